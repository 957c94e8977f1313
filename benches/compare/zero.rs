//! (m) Sharded strategies on two ranks of this machine (one intra-op thread
//! each, Gloo): a transformer of about 100M parameters (14 pre-norm encoder
//! blocks of width 768, 12 heads, feed-forward 3072, sequence 64, batch 4 per
//! rank, Adam) trained under Kiln's DDP, ZeRO-1, ZeRO-2 and full sharding
//! (FSDP, every block a unit), each with and without activation checkpointing
//! of every block, against PyTorch's DDP, `ZeroRedundancyOptimizer` (ZeRO-1)
//! and `fully_shard` (FSDP2, on every block and the root) under `torchrun`,
//! with and without `torch.utils.checkpoint` on every block. PyTorch has no
//! ZeRO-2 of its own outside FSDP, so Kiln's runs alone.
//!
//! Each variant runs in its own two processes, so that rank 0's peak resident
//! set is that strategy's. Rank 0 reports steps per second (median over the
//! repeats), its peak resident set, and the state it holds after a step:
//! parameters, gradients (those still held) and optimizer state.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use kiln::c10d::{
    data_parallel, fully_shard, zero_data_parallel, FullShardOptions, ProcessGroup, ZeroStage,
};
use kiln::core::{
    backend::{StepPlan, TrainBackend, Trainable},
    distributed::{CommBackend, DistributedOptions, Rendezvous},
    loss::Loss,
    model::{Layer, LinearConfig},
    optim::{AdamConfig, Optimizer, OptimizerConfig},
    state_tensors::{StateTensor, StateTensors},
};
use kiln::torch::{TorchBackend, TorchModel};
use kiln::{Backend, Device, Module};
use serde_json::{json, Value};
use tch::{Kind, Tensor};

use crate::worker::{median, peak_rss_mb};
use crate::{num, output_json, Settings};

/// The model: blocks, width, heads, feed-forward width, sequence, batch per rank.
const BLOCKS: usize = 14;
const WIDTH: usize = 768;
const HEADS: usize = 12;
const FF: usize = 3072;
const SEQ: usize = 64;
const BATCH: usize = 4;
const CLASSES: usize = 10;
/// Distinct batches each rank cycles through.
const BATCHES: usize = 4;
/// Timed steps per repeat, unless `--steps` says otherwise.
const DEFAULT_STEPS: usize = 3;
const RANK_TIMEOUT: Duration = Duration::from_secs(600);

pub const VARIANTS: [&str; 15] = [
    "kiln-ddp",
    "pytorch-ddp",
    "kiln-zero1",
    "pytorch-zero1",
    "kiln-zero2",
    "kiln-fsdp",
    "kiln-fsdp-noprefetch",
    "pytorch-fsdp",
    "kiln-ddp-ckpt",
    "pytorch-ddp-ckpt",
    "kiln-zero1-ckpt",
    "pytorch-zero1-ckpt",
    "kiln-zero2-ckpt",
    "kiln-fsdp-ckpt",
    "pytorch-fsdp-ckpt",
];

pub const DESCRIBE: &str = "(m) sharded strategies, two ranks on this machine (one thread each): \
     a 100M-parameter transformer under DDP, ZeRO-1, ZeRO-2 and FSDP, with and without \
     activation checkpointing, Kiln against PyTorch's DDP, ZeroRedundancyOptimizer and \
     fully_shard under torchrun";

/// Whether a variant is Kiln's, its strategy, and whether it checkpoints
/// (`-ckpt`); `kiln-fsdp-noprefetch` gathers each unit only when it runs.
fn parse_variant(variant: &str) -> Result<(bool, &str, bool)> {
    let (kiln, rest) = match variant.split_once('-') {
        Some(("kiln", rest)) => (true, rest),
        Some(("pytorch", rest)) => (false, rest),
        _ => bail!("{variant} is not a variant of (m)"),
    };
    let rest = match rest {
        "fsdp-noprefetch" if kiln => "fsdp",
        other => other,
    };
    let (strategy, checkpointed) = match rest.strip_suffix("-ckpt") {
        Some(s) => (s, true),
        None => (rest, false),
    };
    ensure!(
        matches!(strategy, "ddp" | "zero1" | "zero2" | "fsdp"),
        "{variant} is not a variant of (m)"
    );
    Ok((kiln, strategy, checkpointed))
}

/// Kiln's model: the blocks, then the sequence flattened into a classifier.
fn spec() -> Layer {
    let mut layers: Vec<Layer> = (0..BLOCKS)
        .map(|_| Layer::transformer_encoder_block(WIDTH, HEADS, FF, false, 0.0))
        .collect();
    layers.push(Layer::Flatten {
        start_dim: 1,
        end_dim: -1,
    });
    layers.push(LinearConfig::new(SEQ * WIDTH, CLASSES).into());
    Layer::sequential(layers)
}

/// Runs one variant: two ranks, and returns rank 0's result.
pub fn run(variant: &str, _dir: &Path, s: &Settings) -> Result<Value> {
    let (kiln, _, _) = parse_variant(variant)?;
    let args: Vec<String> = vec![
        "--steps".into(),
        s.steps.unwrap_or(DEFAULT_STEPS).to_string(),
        "--warmup".into(),
        s.warmup.min(2).to_string(),
        "--repeats".into(),
        s.repeats.to_string(),
    ];
    if kiln {
        let mut with_task = vec!["--task".to_owned(), "zero".to_owned()];
        with_task.extend(args);
        return crate::ddp::run_kiln_ranks(variant, &with_task);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/python/bench_zero.py");
    let out = crate::ddp::torchrun()
        .args(["--standalone", "--nproc-per-node", "2"])
        .arg(script)
        .args(["--variant", variant])
        .args(&args)
        .output()
        .with_context(|| format!("starting torchrun for {variant}"))?;
    output_json(&out, variant)
}

/// Bytes of the backend tensors of a state (the optimizer's moments).
fn state_bytes(state: &StateTensors<TorchBackend>) -> i64 {
    state
        .iter()
        .map(|(_, t)| match t {
            StateTensor::Backend(t) => t.numel() as i64 * t.kind().elt_size_in_bytes() as i64,
            StateTensor::Host(_) => 0,
        })
        .sum()
}

/// Bytes of a model's parameters, and of the gradients it holds.
fn parameter_and_gradient_bytes(model: &impl Module<TorchBackend>) -> Result<(i64, i64)> {
    let (mut params, mut grads) = (0, 0);
    for (_, p) in model.named_parameters()? {
        let bytes = p.numel() as i64 * p.kind().elt_size_in_bytes() as i64;
        params += bytes;
        if p.grad().defined() {
            grads += bytes;
        }
    }
    Ok((params, grads))
}

/// Runs this process as one rank of a Kiln variant; returns rank 0's result.
pub fn rank(variant: &str, flags: &BTreeMap<String, String>) -> Result<Option<Value>> {
    let get = |k: &str| -> Result<usize> {
        Ok(flags
            .get(k)
            .with_context(|| format!("--{k} is required"))?
            .parse()?)
    };
    let (steps, warmup, repeats) = (get("steps")?, get("warmup")?, get("repeats")?);
    let (kiln, strategy, checkpointed) = parse_variant(variant)?;
    ensure!(
        kiln,
        "{variant} is PyTorch's: the harness runs it under torchrun"
    );
    tch::set_num_threads(1);
    let rendezvous =
        Rendezvous::from_env()?.context("a rank of (m) needs a launcher's variables")?;
    let options = DistributedOptions {
        backend: CommBackend::Gloo,
        timeout: RANK_TIMEOUT,
        ..DistributedOptions::default()
    };
    let group = Arc::new(ProcessGroup::join(&rendezvous, &options)?);
    TorchBackend::manual_seed(100 + group.rank() as u64);
    let batches: Vec<(Tensor, Tensor)> = (0..BATCHES)
        .map(|_| {
            (
                Tensor::randn(
                    [BATCH as i64, SEQ as i64, WIDTH as i64],
                    (Kind::Float, tch::Device::Cpu),
                ),
                Tensor::randint(
                    CLASSES as i64,
                    [BATCH as i64],
                    (Kind::Int64, tch::Device::Cpu),
                ),
            )
        })
        .collect();
    TorchBackend::manual_seed(0);
    let mut model: TorchModel = TorchBackend::build_model(&spec(), Device::Cpu)?;
    if checkpointed {
        let blocks: Vec<String> = (0..BLOCKS).map(|i| i.to_string()).collect();
        let blocks: Vec<&str> = blocks.iter().map(String::as_str).collect();
        model.checkpoint_activations(&blocks)?;
    }
    let adam = OptimizerConfig::Adam(AdamConfig::new(1e-4));
    let result = match strategy {
        "fsdp" => {
            // Every block a unit (inside which its activations are checkpointed);
            // the root unit holds the head.
            let shard = FullShardOptions {
                units: (0..BLOCKS).map(|i| i.to_string()).collect(),
                prefetch: !variant.ends_with("-noprefetch"),
                ..FullShardOptions::default()
            };
            let mut model = fully_shard(model, group.clone(), &shard, &options)?;
            let mut opt = model.build_optimizer(&adam, &[])?;
            let timing = time_steps(
                &group, &mut model, &mut opt, &batches, steps, warmup, repeats,
            )?;
            let optimizer = state_bytes(&opt.shard().state_tensors()?);
            measured(timing, parameter_and_gradient_bytes(&model)?, optimizer)
        }
        "ddp" => {
            let mut model = data_parallel(model, group.clone(), &options)?;
            let mut opt = model.build_optimizer(&adam, &[])?;
            let timing = time_steps(
                &group, &mut model, &mut opt, &batches, steps, warmup, repeats,
            )?;
            let optimizer = state_bytes(&opt.state_tensors()?);
            measured(timing, parameter_and_gradient_bytes(&model)?, optimizer)
        }
        zero => {
            let stage = if zero == "zero1" {
                ZeroStage::One
            } else {
                ZeroStage::Two
            };
            let mut model = zero_data_parallel(model, group.clone(), stage, &options)?;
            let mut opt = model.build_optimizer(&adam, &[])?;
            let timing = time_steps(
                &group, &mut model, &mut opt, &batches, steps, warmup, repeats,
            )?;
            let optimizer = state_bytes(&opt.shard().state_tensors()?);
            measured(timing, parameter_and_gradient_bytes(&model)?, optimizer)
        }
    };
    group.barrier()?;
    if group.rank() != 0 {
        return Ok(None);
    }
    let mut result = result;
    result["variant"] = json!(variant);
    result["peak_rss_mb"] = json!(peak_rss_mb());
    Ok(Some(result))
}

/// The timing and the state held after the last step, as JSON.
fn measured(timing: (Vec<f64>, usize, f64), (params, grads): (i64, i64), optimizer: i64) -> Value {
    let (repeats_s, steps, loss) = timing;
    let m = median(repeats_s.clone());
    let mb = |b: i64| b as f64 / (1 << 20) as f64;
    json!({
        "steps": steps,
        "repeats_s": repeats_s,
        "steps_per_s": steps as f64 / m,
        "parameters_mb": mb(params),
        "gradients_mb": mb(grads),
        "optimizer_mb": mb(optimizer),
        "state_mb": mb(params + grads + optimizer),
        "final_loss": loss,
    })
}

/// Warm-up steps, then `repeats` timed runs of `steps` steps each (every rank
/// starting together): the seconds of each run, the steps, the last loss.
fn time_steps<M: Trainable<TorchBackend>>(
    group: &ProcessGroup,
    model: &mut M,
    opt: &mut M::Optim,
    batches: &[(Tensor, Tensor)],
    steps: usize,
    warmup: usize,
    repeats: usize,
) -> Result<(Vec<f64>, usize, f64)> {
    let loss = Loss::cross_entropy();
    let plan = StepPlan {
        loss: &loss,
        scale: 1.0,
        apply: true,
        clip: None,
    };
    let mut next = 0;
    let mut last = f64::NAN;
    let mut run = |n: usize| -> Result<()> {
        for _ in 0..n {
            let (x, y) = &batches[next % batches.len()];
            opt.zero_grad()?;
            last = model.train_step(opt, x, y, &plan)?;
            next += 1;
        }
        Ok(())
    };
    run(warmup)?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        group.barrier()?;
        let start = Instant::now();
        run(steps)?;
        times.push(start.elapsed().as_secs_f64());
    }
    Ok((times, steps, last))
}

/// The table of (m).
pub fn table(s: &Settings, rows: &[(String, std::result::Result<Value, String>)]) -> String {
    let ok = |name: &str| {
        rows.iter()
            .find(|(v, _)| v == name)
            .and_then(|(_, r)| r.as_ref().ok())
    };
    let mut t = format!(
        "Median of {} repeats of {} steps after {} warm-up steps, {} rounds. \
         State = parameters + gradients still held after a step + optimizer state, on rank 0 \
         (MiB); peak RSS is rank 0's whole process (MiB). Steps/s vs PyTorch compares the same \
         strategy with the same checkpointing.\n\n\
         | variant | steps/s | vs PyTorch | state | parameters | gradients | optimizer | peak RSS | final loss |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        s.repeats,
        s.steps.unwrap_or(DEFAULT_STEPS),
        s.warmup.min(2),
        s.rounds
    );
    for v in VARIANTS {
        let Some(r) = ok(v) else { continue };
        let versus = v
            .strip_prefix("kiln-")
            .and_then(|rest| ok(&format!("pytorch-{rest}")))
            .map_or("-".to_owned(), |p| {
                format!("{:.2}x", num(r, "steps_per_s") / num(p, "steps_per_s"))
            });
        t += &format!(
            "| {v} | {:.3} | {versus} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.4} |\n",
            num(r, "steps_per_s"),
            num(r, "state_mb"),
            num(r, "parameters_mb"),
            num(r, "gradients_mb"),
            num(r, "optimizer_mb"),
            num(r, "peak_rss_mb"),
            num(r, "final_loss"),
        );
    }
    for (v, r) in rows {
        if let Err(e) = r {
            t += &format!("\n{v} failed: {}\n", e.replace('|', "/"));
        }
    }
    t
}
