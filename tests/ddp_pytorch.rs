//! Kiln's data-parallel training against PyTorch's DistributedDataParallel
//! under torchrun, both on Gloo with two ranks: the same MLP, initial weights,
//! data, `DistributedSampler` order, Adam and clipping give the same per-step
//! losses (1e-5). The reference is tests/reference/ddp_reference.py.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use kiln::c10d::{data_parallel, ProcessGroup};
use kiln::core::backend::{Backend, StepPlan, Trainable};
use kiln::core::distributed::{DistributedOptions, Rendezvous};
use kiln::core::loss::Loss;
use kiln::core::model::{Layer, LinearConfig};
use kiln::core::module::Module;
use kiln::core::optim::{AdamConfig, GradClip, Optimizer, OptimizerConfig};
use kiln::core::state_dict::StateDict;
use kiln::core::{Device, HostTensor, Result};
use kiln::data::{DataLoader, DistributedSampler, InMemoryDataset, PrefetchLoader};
use kiln::torch::{TorchBackend, TorchModel};

const ROLE: &str = "KILN_DDP_TEST_DIR";
const N: usize = 100;
const BATCH: usize = 8;
const EPOCHS: u64 = 2;
const SEED: u64 = 11;

fn mlp() -> Layer {
    Layer::sequential([
        LinearConfig::new(12, 32).into(),
        Layer::Relu,
        LinearConfig::new(32, 5).into(),
    ])
}

fn data() -> Result<(HostTensor, HostTensor)> {
    // A fixed, irregular pattern: no generator needed on either side.
    let x: Vec<f32> = (0..N * 12)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let y: Vec<i64> = (0..N).map(|i| ((i * 7 + i / 3) % 5) as i64).collect();
    Ok((HostTensor::new(x, [N, 12])?, HostTensor::new(y, [N])?))
}

/// One rank: trains as the reference does, rank 0 writing its losses.
fn rank(dir: &Path) -> Result<()> {
    let rendezvous = Rendezvous::from_env()?.expect("a rank's environment");
    let options = DistributedOptions {
        timeout: Duration::from_secs(60),
        ..DistributedOptions::default()
    };
    let group = Arc::new(ProcessGroup::join(&rendezvous, &options)?);
    let mut model = TorchModel::new(&mlp(), Device::Cpu)?;
    let (init, _) = StateDict::load_safetensors(dir.join("init.safetensors"))?;
    model.load_state_dict(&init)?;
    let mut model = data_parallel(model, group.clone(), &options)?;
    let mut opt = model.build_optimizer(&OptimizerConfig::Adam(AdamConfig::new(1e-2)), &[])?;
    let (x, y) = data()?;
    let sampler = DistributedSampler::new(rendezvous.world_size, rendezvous.rank)?.shuffle(SEED);
    let loader = PrefetchLoader::new(InMemoryDataset::new(x, y)?, BATCH)?.sampler(sampler);
    let loss = Loss::cross_entropy();
    let clip = GradClip::Norm {
        max_norm: 0.5,
        norm_type: 2.0,
    };
    let plan = StepPlan {
        loss: &loss,
        scale: 1.0,
        apply: true,
        clip: Some(&clip),
    };
    let mut losses = Vec::new();
    for epoch in 0..EPOCHS {
        for batch in loader.batches(epoch) {
            let batch = batch?;
            opt.zero_grad()?;
            let inputs = TorchBackend::from_host(&batch.inputs, Device::Cpu)?;
            let targets = TorchBackend::from_host(&batch.targets, Device::Cpu)?;
            losses.push(model.train_step(&mut opt, &inputs, &targets, &plan)?);
        }
    }
    if rendezvous.rank == 0 {
        std::fs::write(
            dir.join("kiln.json"),
            serde_json::to_string(&losses).unwrap(),
        )
        .unwrap();
    }
    Ok(())
}

fn spawn_ranks(dir: &Path) -> Vec<std::process::Output> {
    let exe = std::env::current_exe().unwrap();
    let port = kiln_testkit::ranks::free_port().to_string();
    let children: Vec<_> = (0..2)
        .map(|r| {
            Command::new(&exe)
                .args(["kiln_ddp_matches_pytorch_ddp", "--exact", "--nocapture"])
                .env(ROLE, dir)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("KILN_LAUNCH", "1")
                .env("OMP_NUM_THREADS", "1")
                .output_spawn()
        })
        .collect();
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

trait SpawnPiped {
    fn output_spawn(&mut self) -> std::process::Child;
}

impl SpawnPiped for Command {
    fn output_spawn(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    }
}

fn read_losses(path: PathBuf) -> Vec<f64> {
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

#[test]
fn kiln_ddp_matches_pytorch_ddp() -> Result<()> {
    if let Some(dir) = std::env::var_os(ROLE) {
        return rank(Path::new(&dir));
    }
    let Some(_python) = kiln_testkit::python("kiln_ddp_matches_pytorch_ddp") else {
        return Ok(());
    };
    let torchrun = kiln_testkit::workspace_root().join(".kiln/venv/bin/torchrun");
    if !torchrun.exists() {
        kiln_testkit::skip("kiln_ddp_matches_pytorch_ddp", "no torchrun in .kiln/venv");
        return Ok(());
    }
    let tmp = kiln_testkit::TempDir::new("ddp-pytorch");
    let dir = tmp.path();
    TorchBackend::manual_seed(21);
    let init = TorchModel::new(&mlp(), Device::Cpu)?.state_dict()?;
    init.save_safetensors(dir.join("init.safetensors"), &BTreeMap::new())?;
    let (x, y) = data()?;
    let mut both = StateDict::new();
    both.insert("x", x);
    both.insert("y", y);
    both.save_safetensors(dir.join("data.safetensors"), &BTreeMap::new())?;

    let reference = Command::new(&torchrun)
        .args(["--standalone", "--nproc-per-node=2"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/ddp_reference.py"))
        .arg(dir)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(
        reference.status.success(),
        "the PyTorch DDP reference failed:\n{}",
        String::from_utf8_lossy(&reference.stderr)
    );
    for (r, out) in spawn_ranks(dir).iter().enumerate() {
        assert!(
            out.status.success(),
            "Kiln rank {r} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (ours, theirs) = (
        read_losses(dir.join("kiln.json")),
        read_losses(dir.join("losses.json")),
    );
    assert_eq!(ours.len(), theirs.len(), "number of steps");
    assert_eq!(ours.len(), 2 * N.div_ceil(2).div_ceil(BATCH));
    let diff = ours
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    eprintln!(
        "Kiln DDP vs PyTorch DDP: {} steps, largest loss difference {diff:e}",
        ours.len()
    );
    assert!(
        diff < 1e-5,
        "losses differ by {diff}:\n{ours:?}\n{theirs:?}"
    );
    Ok(())
}
