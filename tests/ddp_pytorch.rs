//! Kiln's data-parallel training against PyTorch's DistributedDataParallel
//! under torchrun, both on Gloo with two ranks: the same MLP, initial weights,
//! data, `DistributedSampler` order, Adam and clipping give the same per-step
//! losses (1e-5), under DDP and under post-local SGD (PyTorch's
//! `post_localSGD_hook` with `PostLocalSGDOptimizer` and
//! `PeriodicModelAverager`, where each rank's final weights match too). The
//! reference is tests/reference/ddp_reference.py.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use kiln::c10d::{data_parallel, post_local_sgd, PostLocalSgdOptions, ProcessGroup};
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
/// Post-local SGD's warm-up and period: averaged after steps 3, 6, 9 and 12
/// (0-based) of the 14, so that the last step leaves the ranks apart.
const LOCAL_SGD: PostLocalSgdOptions = PostLocalSgdOptions {
    warmup_steps: 3,
    period: 3,
};
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

/// One rank: trains as the reference does, rank 0 writing its losses, each
/// rank its weights' sum of squares.
fn rank(dir: &Path, local_sgd: bool) -> Result<()> {
    let rendezvous = Rendezvous::from_env()?.expect("a rank's environment");
    let options = DistributedOptions {
        timeout: Duration::from_secs(60),
        ..DistributedOptions::default()
    };
    let group = Arc::new(ProcessGroup::join(&rendezvous, &options)?);
    let mut model = TorchModel::new(&mlp(), Device::Cpu)?;
    let (init, _) = StateDict::load_safetensors(dir.join("init.safetensors"))?;
    model.load_state_dict(&init)?;
    let losses = if local_sgd {
        let model = post_local_sgd(model, group.clone(), &LOCAL_SGD, &options)?;
        train(model, &rendezvous)?
    } else {
        train(data_parallel(model, group.clone(), &options)?, &rendezvous)?
    };
    if rendezvous.rank == 0 {
        std::fs::write(
            dir.join("kiln.json"),
            serde_json::to_string(&losses.0).unwrap(),
        )
        .unwrap();
    }
    std::fs::write(
        dir.join(format!("kiln-squares-{}.json", rendezvous.rank)),
        serde_json::to_string(&losses.1).unwrap(),
    )
    .unwrap();
    Ok(())
}

/// Trains `model` as the reference does: the losses, and the final weights'
/// sum of squares.
fn train<M: Trainable<TorchBackend>>(
    mut model: M,
    rendezvous: &Rendezvous,
) -> Result<(Vec<f64>, f64)> {
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
    let squares = model
        .state_dict()?
        .into_inner()
        .values()
        .map(|t| t.to_f64_vec().iter().map(|v| v * v).sum::<f64>())
        .sum();
    Ok((losses, squares))
}

fn spawn_ranks(dir: &Path, test: &str) -> Vec<std::process::Output> {
    let exe = std::env::current_exe().unwrap();
    let port = kiln_testkit::ranks::free_port().to_string();
    let children: Vec<_> = (0..2)
        .map(|r| {
            Command::new(&exe)
                .args([test, "--exact", "--nocapture"])
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
    let test = "kiln_ddp_matches_pytorch_ddp";
    if let Some(dir) = std::env::var_os(ROLE) {
        return rank(Path::new(&dir), false);
    }
    let Some(run) = against_pytorch(test, "ddp", &[])? else {
        return Ok(());
    };
    run.losses_match("DDP");
    let squares = run.squares();
    assert!(
        (squares[0] - squares[1]).abs() < 1e-12 * squares[0],
        "DDP's ranks hold different weights: {squares:?}"
    );
    Ok(())
}

#[test]
fn kiln_post_local_sgd_matches_pytorch_post_local_sgd() -> Result<()> {
    let test = "kiln_post_local_sgd_matches_pytorch_post_local_sgd";
    if let Some(dir) = std::env::var_os(ROLE) {
        return rank(Path::new(&dir), true);
    }
    let (warmup, period) = (
        LOCAL_SGD.warmup_steps.to_string(),
        LOCAL_SGD.period.to_string(),
    );
    let Some(run) = against_pytorch(
        test,
        "post_local_sgd",
        &["post_local_sgd", &warmup, &period],
    )?
    else {
        return Ok(());
    };
    run.losses_match("post-local SGD");
    // The last step was each rank's own: their weights are apart, each as
    // PyTorch's rank of the same number has them.
    let (ours, theirs) = (
        run.squares(),
        read_losses(run.dir.path().join("squares.json")),
    );
    eprintln!("weights' sums of squares by rank: Kiln {ours:?}, PyTorch {theirs:?}");
    assert!(
        (ours[0] - ours[1]).abs() > 1e-6 * ours[0],
        "the ranks hold the same weights after a local step: {ours:?}"
    );
    for (a, b) in ours.iter().zip(&theirs) {
        assert!((a - b).abs() < 1e-5 * b, "{ours:?} vs {theirs:?}");
    }
    Ok(())
}

/// A run of the reference and of Kiln's ranks on the same data.
struct Compared {
    dir: kiln_testkit::TempDir,
}

impl Compared {
    /// Asserts that the per-step losses are PyTorch's (1e-5).
    fn losses_match(&self, what: &str) {
        let dir = self.dir.path();
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
            "Kiln {what} vs PyTorch {what}: {} steps, largest loss difference {diff:e}",
            ours.len()
        );
        assert!(
            diff < 1e-5,
            "losses differ by {diff}:\n{ours:?}\n{theirs:?}"
        );
    }

    /// Each Kiln rank's final weights' sum of squares.
    fn squares(&self) -> Vec<f64> {
        (0..2)
            .map(|r| {
                serde_json::from_str(
                    &std::fs::read_to_string(
                        self.dir.path().join(format!("kiln-squares-{r}.json")),
                    )
                    .unwrap(),
                )
                .unwrap()
            })
            .collect()
    }
}

/// Runs the reference under torchrun with `args` after the directory, then
/// Kiln's two ranks under `mode`; `None` (skipped) without Python.
fn against_pytorch(test: &str, mode: &str, args: &[&str]) -> Result<Option<Compared>> {
    let Some(_python) = kiln_testkit::python(test) else {
        return Ok(None);
    };
    let torchrun = kiln_testkit::workspace_root().join(".kiln/venv/bin/torchrun");
    if !torchrun.exists() {
        kiln_testkit::skip(test, "no torchrun in .kiln/venv");
        return Ok(None);
    }
    let tmp = kiln_testkit::TempDir::new(mode);
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
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(
        reference.status.success(),
        "the PyTorch {mode} reference failed:\n{}",
        String::from_utf8_lossy(&reference.stderr)
    );
    for (r, out) in spawn_ranks(dir, test).iter().enumerate() {
        assert!(
            out.status.success(),
            "Kiln rank {r} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(Some(Compared { dir: tmp }))
}
