//! (h) Data-parallel training on two ranks of this machine, one intra-op thread
//! each: Kiln's DDP (`kiln::c10d::data_parallel`, c10d's `Reducer` over a Gloo
//! `ProcessGroup`) against PyTorch's `DistributedDataParallel` under `torchrun`,
//! on the models, data and batch of (a)-(c); and the all-reduce alone (the latency
//! of one float, the bandwidth of 100 MB), Kiln's `ProcessGroup::all_reduce`
//! against `torch.distributed.all_reduce`, both on Gloo.
//!
//! The harness starts Kiln's two ranks itself (this binary, `--worker VARIANT
//! --task ddp`, with `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and a free `MASTER_PORT`
//! per run), and PyTorch's with `torchrun --standalone --nproc-per-node=2
//! benches/python/bench_ddp.py`. Rank 0 of either prints the JSON result.
//!
//! The overlap of communication with the backward pass is measured the same way
//! on both sides, in the rank processes: per repeat, after a barrier each, the
//! DDP step, the same step of a copy of the model without DDP (the compute alone,
//! both ranks computing at once as they do under DDP), and an all-reduce of a flat
//! float32 tensor of all the gradients' bytes (the communication alone); on Kiln's
//! side also its DDP step without the per-step all-reduce of the loss, to show what
//! that costs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use kiln::c10d::{data_parallel, DistributedDataParallel, ProcessGroup};
use kiln::core::{
    backend::{EagerBackend, StepPlan, TrainBackend, Trainable},
    distributed::{CommBackend, DistributedOptions, ReduceOp, Rendezvous},
    loss::Loss,
    optim::{AdamConfig, Optimizer, OptimizerConfig},
};
use kiln::torch::TorchBackend;
use kiln::{Backend, Device, Module};
use serde_json::{json, Value};
use tch::{Kind, Tensor};

use crate::worker::{median, peak_rss_mb, read_batches, to_device};
use crate::{num, output_json, python_interpreter, write_data, Settings, Workload};

/// The ranks of every run.
const WORLD: usize = 2;
/// Batches written per model; rank r takes batches r, r + 2, ...
const NUM_BATCHES: usize = 16;
/// The models of (a)-(c), trained data-parallel.
const MODELS: [Workload; 3] = [Workload::Mlp, Workload::Cnn, Workload::Transformer];
/// What (h) asks of Kiln's steps per second against PyTorch DDP's, per model.
const TARGETS: [f64; 3] = [1.2, 1.0, 1.0];
/// One-float all-reduces: untimed, then each timed on its own.
const LATENCY_WARMUP: usize = 100;
const LATENCY_CALLS: usize = 1000;
/// The 100 MB collectives (float32, 25M values): untimed, then timed calls.
const BANDWIDTH_BYTES: usize = 100_000_000;
const BANDWIDTH_WARMUP: usize = 3;
const BANDWIDTH_CALLS: usize = 20;
/// How long a rank waits for the other at the rendezvous and in a collective.
const RANK_TIMEOUT: Duration = Duration::from_secs(180);

/// The variants, in table order: per model Kiln then PyTorch, then the collectives.
pub const VARIANTS: [&str; 8] = [
    "kiln-ddp-mlp",
    "pytorch-ddp-mlp",
    "kiln-ddp-cnn",
    "pytorch-ddp-cnn",
    "kiln-ddp-transformer",
    "pytorch-ddp-transformer",
    "kiln-gloo",
    "pytorch-gloo",
];

pub const DESCRIBE: &str =
    "(h) data-parallel training, two ranks on this machine (one thread each), \
     Kiln against PyTorch DDP under torchrun; all-reduce, reduce-scatter and all-gather on Gloo";

/// Which side a variant runs, and its model (`None`: the collectives).
fn parse_variant(variant: &str) -> Result<(bool, Option<Workload>)> {
    let (kiln, rest) = if let Some(rest) = variant.strip_prefix("kiln-") {
        (true, rest)
    } else if let Some(rest) = variant.strip_prefix("pytorch-") {
        (false, rest)
    } else {
        bail!("{variant} is not a variant of (h)")
    };
    let model = match rest {
        "gloo" => None,
        other => match other.strip_prefix("ddp-").map(Workload::parse) {
            Some(Ok(w)) if MODELS.contains(&w) => Some(w),
            _ => bail!("{variant} is not a variant of (h)"),
        },
    };
    Ok((kiln, model))
}

/// Writes each model's batches into `dir/<model>`, as (a)-(c) do.
pub fn prepare(dir: &Path) -> Result<()> {
    for w in MODELS {
        write_data(&dir.join(w.name()), w, NUM_BATCHES)?;
    }
    Ok(())
}

/// Runs one variant: two ranks, and returns rank 0's result.
pub fn run(variant: &str, dir: &Path, s: &Settings) -> Result<Value> {
    let (kiln, model) = parse_variant(variant)?;
    let steps = model.map_or(0, |w| s.steps.unwrap_or(w.default_steps(Device::Cpu)));
    let data = model.map_or_else(|| dir.to_owned(), |w| dir.join(w.name()));
    let mut args: Vec<String> = vec![
        "--dir".into(),
        data.display().to_string(),
        "--steps".into(),
        steps.to_string(),
        "--warmup".into(),
        s.warmup.to_string(),
        "--repeats".into(),
        s.repeats.to_string(),
    ];
    if kiln {
        args.splice(0..0, ["--task".to_owned(), "ddp".to_owned()]);
        return run_kiln_ranks(variant, &args);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/python/bench_ddp.py");
    let task = if model.is_some() {
        "train"
    } else {
        "collectives"
    };
    let mut c = torchrun();
    c.args(["--standalone", "--nproc-per-node", &WORLD.to_string()])
        .arg(script)
        .args(["--task", task])
        .args(["--workload", model.map_or("collectives", Workload::name)])
        .args(&args)
        .env("TF_CPP_MIN_LOG_LEVEL", "2");
    let out = c
        .output()
        .with_context(|| format!("starting torchrun for {variant}"))?;
    if !out.status.success() {
        // torchrun's summary comes last; the rank's own error is above it.
        let log = dir.join(format!("{variant}.stderr.log"));
        std::fs::write(&log, &out.stderr)?;
        let label = format!("{variant} (its whole stderr in {})", log.display());
        return output_json(&out, &label);
    }
    output_json(&out, variant)
}

/// `torchrun` beside the baselines' interpreter (the project virtualenv's), else
/// the same program as `python -m torch.distributed.run`.
pub(crate) fn torchrun() -> Command {
    let python = python_interpreter();
    let beside = Path::new(python.get_program()).with_file_name("torchrun");
    if beside.is_file() {
        Command::new(beside)
    } else {
        let mut c = python;
        c.args(["-m", "torch.distributed.run"]);
        c
    }
}

/// Starts Kiln's ranks (this binary as `--worker VARIANT ARGS`) on a free port,
/// waits for both, and returns rank 0's JSON result.
pub(crate) fn run_kiln_ranks(variant: &str, args: &[String]) -> Result<Value> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("finding a free port")?
        .port();
    let exe = std::env::current_exe()?;
    let mut children = Vec::with_capacity(WORLD);
    for rank in 0..WORLD {
        let mut command = Command::new(&exe);
        new_session(&mut command);
        let child = command
            .args(["--worker", variant])
            .args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", WORLD.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", WORLD.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("OMP_NUM_THREADS", "1")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                for mut started in children {
                    let _ = started.kill();
                    let _ = started.wait();
                }
                return Err(e).with_context(|| format!("starting rank {rank} of {variant}"));
            }
        }
    }
    // Each rank's pipes drained on its own thread: a rank blocked on a full
    // pipe would stall the other in its next collective.
    let outputs: Vec<std::io::Result<Output>> = std::thread::scope(|scope| {
        let waits: Vec<_> = children
            .into_iter()
            .map(|c| scope.spawn(move || c.wait_with_output()))
            .collect();
        waits
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("waiting thread panicked")))
            })
            .collect()
    });
    let mut outputs = outputs.into_iter().enumerate().map(|(rank, out)| {
        let out = out.with_context(|| format!("waiting for rank {rank} of {variant}"))?;
        ensure!(
            out.status.success(),
            "{variant} rank {rank} exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join(" | ")
        );
        Ok(out)
    });
    let first = outputs.next().context("no rank ran")??;
    for other in outputs {
        other?;
    }
    output_json(&first, variant)
}

/// Starts the child in a session of its own, as `torchrun` starts its workers
/// (`start_new_session`). With the kernel's autogroup scheduling a session is
/// one scheduling group: on a machine loaded by other sessions, two ranks left
/// in the harness's session would share one group's CPU while torchrun's two
/// get a group each.
fn new_session(command: &mut Command) {
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure runs in the child between fork and exec and calls
        // only setsid(2), which is async-signal-safe, and builds an io::Error from
        // errno, which does not allocate.
        unsafe {
            command.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        };
    }
}

/// CPU seconds this process has used so far, all its threads (`utime + stime`
/// of `/proc/self/stat`, in ticks of 1/100 s; the Python script reads the same).
fn cpu_seconds() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            // The fields after the command name, which may hold spaces: state is
            // field 3, utime 14, stime 15.
            let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            let ticks = |i: usize| fields.get(i - 3)?.parse::<f64>().ok();
            Some((ticks(14)? + ticks(15)?) / 100.0)
        })
        .unwrap_or(f64::NAN)
}

/// A rank's arguments, from its flags.
struct RankArgs {
    dir: PathBuf,
    steps: usize,
    warmup: usize,
    repeats: usize,
}

/// Runs this process as one rank of a Kiln variant (started by [`run`]);
/// returns rank 0's result, `None` on the other ranks.
pub fn rank(variant: &str, flags: &BTreeMap<String, String>) -> Result<Option<Value>> {
    let get = |k: &str| flags.get(k).with_context(|| format!("--{k} is required"));
    let a = RankArgs {
        dir: PathBuf::from(get("dir")?),
        steps: get("steps")?.parse()?,
        warmup: get("warmup")?.parse()?,
        repeats: get("repeats")?.parse()?,
    };
    let (kiln, model) = parse_variant(variant)?;
    ensure!(
        kiln,
        "{variant} is PyTorch's: the harness runs it under torchrun"
    );
    // Two ranks share this machine's cores: one intra-op thread each.
    tch::set_num_threads(1);
    let rendezvous = Rendezvous::from_env()?.context(
        "a rank of (h) needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (the harness sets them)",
    )?;
    let options = DistributedOptions {
        backend: CommBackend::Gloo,
        timeout: RANK_TIMEOUT,
        ..DistributedOptions::default()
    };
    let group = Arc::new(ProcessGroup::join(&rendezvous, &options)?);
    let mut result = match model {
        Some(w) => train(w, &group, &options, &a)?,
        None => collectives(&group)?,
    };
    group.barrier()?;
    if group.rank() != 0 {
        return Ok(None);
    }
    result["variant"] = json!(variant);
    result["world_size"] = json!(group.world_size());
    result["threads"] = json!(1);
    result["peak_rss_mb"] = json!(peak_rss_mb());
    Ok(Some(result))
}

/// Wall-clock and CPU seconds of `f`, started on every rank at once (after a barrier).
fn aligned(group: &ProcessGroup, f: impl FnOnce() -> Result<()>) -> Result<(f64, f64)> {
    group.barrier()?;
    let (start, cpu) = (Instant::now(), cpu_seconds());
    f()?;
    Ok((start.elapsed().as_secs_f64(), cpu_seconds() - cpu))
}

/// Kiln's data-parallel step on `w`, with the profile's two references.
fn train(
    w: Workload,
    group: &Arc<ProcessGroup>,
    options: &DistributedOptions,
    a: &RankArgs,
) -> Result<Value> {
    let (rank, world) = (group.rank(), group.world_size());
    let host = read_batches(&a.dir, w)?;
    ensure!(
        host.len() % world == 0,
        "{} batches do not split over {world} ranks",
        host.len()
    );
    // At step k, rank r trains on batch (k * world + r) mod n.
    let mine: Vec<_> = host.into_iter().skip(rank).step_by(world).collect();
    let batches = to_device::<TorchBackend>(&mine, Device::Cpu)?;
    let adam = OptimizerConfig::Adam(AdamConfig::new(1e-3));

    TorchBackend::manual_seed(0);
    let model = TorchBackend::build_model(&w.spec(), Device::Cpu)?;
    let mut model = data_parallel(model, group.clone(), options)?;
    let mut optimizer = model.build_optimizer(&adam, &[])?;
    // The same model without DDP: its step is the compute alone.
    TorchBackend::manual_seed(0);
    let mut local = TorchBackend::build_model(&w.spec(), Device::Cpu)?;
    let mut local_optimizer = local.build_optimizer(&adam, &[])?;
    // Kiln's data-parallel step without its one-float all-reduce of the loss:
    // the step of `train_step` rebuilt from DDP's hooks, the loss read locally.
    TorchBackend::manual_seed(0);
    let bare = TorchBackend::build_model(&w.spec(), Device::Cpu)?;
    let mut bare_optimizer = bare.build_optimizer(&adam, &[])?;
    let bare_ddp = DistributedDataParallel::new(
        group.clone(),
        &bare.named_parameters()?,
        &bare.named_buffers()?,
        options,
    )?;
    // All the gradients' bytes in one tensor: the communication alone.
    let values: i64 = model
        .named_parameters()?
        .iter()
        .map(|(_, t)| t.numel() as i64)
        .sum();
    let gradients = Tensor::f_zeros([values], (Kind::Float, tch::Device::Cpu))?;

    let loss = Loss::cross_entropy();
    let plan = StepPlan {
        loss: &loss,
        scale: 1.0,
        apply: true,
        clip: None,
    };
    let (mut next, mut next_local, mut next_bare, mut last_loss) = (0, 0, 0, f64::NAN);
    let mut ddp_steps = |n: usize| -> Result<()> {
        for _ in 0..n {
            let (x, y) = &batches[next % batches.len()];
            optimizer.zero_grad()?;
            last_loss = model.train_step(&mut optimizer, x, y, &plan)?;
            next += 1;
        }
        Ok(())
    };
    let mut local_steps = |n: usize| -> Result<()> {
        for _ in 0..n {
            let (x, y) = &batches[next_local % batches.len()];
            local_optimizer.zero_grad()?;
            local.train_step(&mut local_optimizer, x, y, &plan)?;
            next_local += 1;
        }
        Ok(())
    };
    let mut bare_steps = |n: usize| -> Result<()> {
        for _ in 0..n {
            let (x, y) = &batches[next_bare % batches.len()];
            bare_optimizer.zero_grad()?;
            bare_ddp.before_forward(true)?;
            let loss = TorchBackend::loss(plan.loss, &bare.forward(x)?, y)?;
            TorchBackend::item(&loss)?;
            bare_ddp.after_forward(&loss, true)?;
            TorchBackend::backward(&loss)?;
            bare_optimizer.step()?;
            next_bare += 1;
        }
        Ok(())
    };
    let reduce = |n: usize| -> Result<()> {
        for _ in 0..n {
            group.all_reduce(&gradients, ReduceOp::Sum)?;
        }
        Ok(())
    };
    ddp_steps(a.warmup)?;
    local_steps(a.warmup)?;
    bare_steps(a.warmup)?;
    reduce(a.warmup)?;
    let (mut ddp_s, mut local_s, mut reduce_s) = (Vec::new(), Vec::new(), Vec::new());
    let mut bare_s = Vec::new();
    let (mut ddp_cpu, mut local_cpu) = (Vec::new(), Vec::new());
    for _ in 0..a.repeats {
        let (wall, cpu) = aligned(group, || ddp_steps(a.steps))?;
        ddp_s.push(wall);
        ddp_cpu.push(cpu);
        let (wall, cpu) = aligned(group, || local_steps(a.steps))?;
        local_s.push(wall);
        local_cpu.push(cpu);
        reduce_s.push(aligned(group, || reduce(a.steps))?.0);
        bare_s.push(aligned(group, || bare_steps(a.steps))?.0);
    }
    let m = median(ddp_s.clone());
    let per_step_ms = |s: Vec<f64>| median(s) / a.steps as f64 * 1e3;
    Ok(json!({
        "workload": w.name(),
        "batch": w.batch(),
        "steps": a.steps,
        "repeats_s": ddp_s,
        "median_s": m,
        "steps_per_s": a.steps as f64 / m,
        "samples_per_s": (a.steps * w.batch() * world) as f64 / m,
        "ddp_step_ms": m / a.steps as f64 * 1e3,
        "local_step_ms": per_step_ms(local_s),
        "allreduce_ms": per_step_ms(reduce_s),
        "ddp_no_loss_mean_ms": per_step_ms(bare_s),
        "ddp_cpu_ms": per_step_ms(ddp_cpu),
        "local_cpu_ms": per_step_ms(local_cpu),
        "gradient_bytes": values * 4,
        "final_loss": last_loss,
    }))
}

/// The collectives alone: the all-reduce of one float (latency) and of 100 MB
/// (bandwidth), then the reduce-scatter of 100 MB (each rank keeps its 50 MB)
/// and the all-gather of 50 MB per rank into 100 MB, the sharded strategies'
/// two collectives.
fn collectives(group: &ProcessGroup) -> Result<Value> {
    let cpu = (Kind::Float, tch::Device::Cpu);
    let each_call =
        |call: &dyn Fn() -> Result<()>, warmup: usize, calls: usize| -> Result<Vec<f64>> {
            for _ in 0..warmup {
                call()?;
            }
            group.barrier()?;
            (0..calls)
                .map(|_| {
                    let start = Instant::now();
                    call()?;
                    Ok(start.elapsed().as_secs_f64())
                })
                .collect()
        };
    // Zeros: a sum repeated a thousand times stays finite.
    let one = Tensor::f_zeros([1], cpu)?;
    let latency = each_call(
        &|| Ok(group.all_reduce(&one, ReduceOp::Sum)?),
        LATENCY_WARMUP,
        LATENCY_CALLS,
    )?;
    let values = (BANDWIDTH_BYTES / 4) as i64;
    let whole = Tensor::f_zeros([values], cpu)?;
    let bandwidth = each_call(
        &|| Ok(group.all_reduce(&whole, ReduceOp::Sum)?),
        BANDWIDTH_WARMUP,
        BANDWIDTH_CALLS,
    )?;
    let share = Tensor::f_zeros([values / WORLD as i64], cpu)?;
    let reduce_scatter = each_call(
        &|| Ok(group.reduce_scatter(&share, &whole, ReduceOp::Sum)?),
        BANDWIDTH_WARMUP,
        BANDWIDTH_CALLS,
    )?;
    let all_gather = each_call(
        &|| Ok(group.all_gather_into(&whole, &share)?),
        BANDWIDTH_WARMUP,
        BANDWIDTH_CALLS,
    )?;
    // Kiln only: the reduce-scatter of a buffer given up (ZeRO-2's windows).
    let owned = each_call(
        &|| Ok(group.reduce_scatter_owned(&share, whole.shallow_clone(), ReduceOp::Sum)?),
        BANDWIDTH_WARMUP,
        BANDWIDTH_CALLS,
    )?;
    let mut result = collectives_result(latency, bandwidth, reduce_scatter, all_gather);
    let owned_s = median(owned.clone());
    result["reduce_scatter_owned_ms"] = json!(owned_s * 1e3);
    result["reduce_scatter_owned_calls_s"] = json!(owned);
    Ok(result)
}

/// The collectives' JSON (the Python script reports the same keys).
fn collectives_result(
    latency: Vec<f64>,
    bandwidth: Vec<f64>,
    reduce_scatter: Vec<f64>,
    all_gather: Vec<f64>,
) -> Value {
    let q = |v: &[f64], q: f64| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * q).round() as usize]
    };
    let gb_s = |seconds: f64| BANDWIDTH_BYTES as f64 / seconds / 1e9;
    let (big, rs, ag) = (
        median(bandwidth.clone()),
        median(reduce_scatter.clone()),
        median(all_gather.clone()),
    );
    json!({
        "latency_us": median(latency.clone()) * 1e6,
        "latency_p10_us": q(&latency, 0.1) * 1e6,
        "latency_p90_us": q(&latency, 0.9) * 1e6,
        "bandwidth_ms": big * 1e3,
        "bandwidth_gb_s": gb_s(big),
        "bandwidth_calls_s": bandwidth,
        "reduce_scatter_ms": rs * 1e3,
        "reduce_scatter_gb_s": gb_s(rs),
        "reduce_scatter_calls_s": reduce_scatter,
        "all_gather_ms": ag * 1e3,
        "all_gather_gb_s": gb_s(ag),
        "all_gather_calls_s": all_gather,
    })
}

/// The number a round is ranked by (see `run_rounds`).
pub fn score(r: &Value) -> f64 {
    // The 100 MB all-reduce varies most from run to run (a 1000-call median of
    // the one-float latency varies little): it picks the collectives' round.
    if r.get("latency_us").is_some() {
        num(r, "bandwidth_ms")
    } else {
        num(r, "steps_per_s")
    }
}

/// One line of progress for a result.
pub fn summary(r: &Value) -> String {
    if r.get("latency_us").is_some() {
        format!(
            "1 float {:>6.0} us, 100 MB {:>5.0} ms ({:.2} GB/s), reduce-scatter {:>5.0} ms{}, all-gather {:>5.0} ms",
            num(r, "latency_us"),
            num(r, "bandwidth_ms"),
            num(r, "bandwidth_gb_s"),
            num(r, "reduce_scatter_ms"),
            r.get("reduce_scatter_owned_ms")
                .and_then(Value::as_f64)
                .map_or(String::new(), |ms| format!(" (given up {ms:.0} ms)")),
            num(r, "all_gather_ms")
        )
    } else {
        format!(
            "{:>9.1} steps/s  (step {:.2} ms: alone {:.2} ms, all-reduce alone {:.2} ms)",
            num(r, "steps_per_s"),
            num(r, "ddp_step_ms"),
            num(r, "local_step_ms"),
            num(r, "allreduce_ms")
        )
    }
}

/// Section (h): steps per second, the overlap profile and the collectives.
pub fn table(s: &Settings, rows: &[(String, std::result::Result<Value, String>)]) -> String {
    let ok = |name: &str| {
        rows.iter()
            .find(|(v, _)| v == name)
            .and_then(|(_, r)| r.as_ref().ok())
    };
    let mut t = format!(
        "### {DESCRIBE}\n\n\
         Two ranks on this machine, one intra-op thread each (`tch::set_num_threads(1)`, \
         `torch.set_num_threads(1)`), on libtorch's c10d with Gloo over localhost, on the CPU \
         whatever `--device` says. Each rank trains the model of (a), (b) or (c) on its own batch of \
         that workload's size (the global batch is twice it), float32, Adam (lr 1e-3); at step k \
         rank r takes batch 2k + r of the {NUM_BATCHES}. Kiln: `kiln::c10d::data_parallel` (DDP on \
         c10d's `Reducer`, default buckets, in `DataParallel`) and `Trainable::train_step`, which averages \
         the loss over the ranks (a one-float all-reduce per step); its ranks are started by the \
         harness with `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and a free `MASTER_PORT`. PyTorch: \
         `DistributedDataParallel` (defaults) over the same model, `init_process_group(\"gloo\")`, \
         the loop of `bench_torch.py`, under `torchrun --standalone --nproc-per-node=2` \
         (`benches/python/bench_ddp.py`). Rank 0 times the steps of each repeat (median of {} \
         repeats after {} warm-up steps); the median of {} rounds, the variants taking turns.\n\n\
         The last column is the same comparison in CPU time (rank 0's process, all its threads, \
         per step): the work done, which a machine loaded by other processes slows less than \
         the wall clock.\n\n\
         | model | steps per repeat | Kiln steps/s | PyTorch DDP steps/s | Kiln vs PyTorch DDP | target | Kiln final loss | PyTorch final loss | CPU per step, Kiln vs PyTorch |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        s.repeats, s.warmup, s.rounds
    );
    let pair = |w: Workload| {
        (
            ok(&format!("kiln-ddp-{}", w.name())),
            ok(&format!("pytorch-ddp-{}", w.name())),
        )
    };
    let cell = |r: Option<&Value>, key: &str, digits: usize| {
        r.map_or("-".to_owned(), |r| format!("{:.*}", digits, num(r, key)))
    };
    for (w, target) in MODELS.iter().zip(TARGETS) {
        let (k, p) = pair(*w);
        let (ratio, verdict, cpu) = match (k, p) {
            (Some(k), Some(p)) => {
                let x = num(k, "steps_per_s") / num(p, "steps_per_s");
                let met = if x >= target { "met" } else { "missed" };
                (
                    format!("{x:.2}x"),
                    format!("{target:.1}x, {met}"),
                    format!("{:.2}x", num(p, "ddp_cpu_ms") / num(k, "ddp_cpu_ms")),
                )
            }
            _ => ("-".to_owned(), format!("{target:.1}x"), "-".to_owned()),
        };
        let steps = k
            .or(p)
            .map_or("-".to_owned(), |r| num(r, "steps").to_string());
        let digits = if w == &Workload::Transformer { 2 } else { 1 };
        t += &format!(
            "| {} | {steps} | {} | {} | {ratio} | {verdict} | {} | {} | {cpu} |\n",
            w.name(),
            cell(k, "steps_per_s", digits),
            cell(p, "steps_per_s", digits),
            cell(k, "final_loss", 4),
            cell(p, "final_loss", 4),
        );
    }

    t += "\nOverlap of communication with the backward pass, from a profile taken in the same \
          rank processes: per repeat, each after a barrier, the data-parallel steps, then as many \
          steps of the same model without DDP (the compute alone, both ranks computing at once), \
          then as many all-reduces (sum) of one flat float32 tensor of all the gradients' bytes \
          (the communication alone); medians per step, in ms. Exposed communication = DDP step - \
          step alone; overlap = (step alone + all-reduce alone - DDP step) / all-reduce alone: 1 \
          when the gradients' all-reduce is hidden entirely behind the backward pass, 0 when it \
          runs after it, below 0 when DDP costs more than the two in sequence. Kiln's DDP step \
          includes its one-float all-reduce of the loss (latency below). The last two columns \
          are CPU time per step (rank 0's process, all threads): what DDP's communication costs \
          in CPU, which on two cores busy with two ranks it cannot take from idle ones.\n\n\
          | model | gradients (MB) | side | step alone | all-reduce alone | DDP step | exposed communication | overlap | CPU, step alone | CPU, DDP step |\n\
          | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
    for w in MODELS {
        let (k, p) = pair(w);
        for (side, r) in [("Kiln", k), ("PyTorch", p)] {
            let Some(r) = r else { continue };
            let (alone, reduce, ddp) = (
                num(r, "local_step_ms"),
                num(r, "allreduce_ms"),
                num(r, "ddp_step_ms"),
            );
            t += &format!(
                "| {} | {:.2} | {side} | {alone:.2} | {reduce:.2} | {ddp:.2} | {:.2} | {:.0}% | {:.2} | {:.2} |\n",
                w.name(),
                num(r, "gradient_bytes") / 1e6,
                ddp - alone,
                100.0 * (alone + reduce - ddp) / reduce,
                num(r, "local_cpu_ms"),
                num(r, "ddp_cpu_ms"),
            );
        }
    }

    let bare: Vec<String> = MODELS
        .iter()
        .filter_map(|w| {
            let k = ok(&format!("kiln-ddp-{}", w.name()))?;
            Some(format!(
                "{} {:.2} ms (with it {:.2})",
                w.name(),
                num(k, "ddp_no_loss_mean_ms"),
                num(k, "ddp_step_ms")
            ))
        })
        .collect();
    if !bare.is_empty() {
        t += &format!(
            "\nKiln's DDP step without its one-float all-reduce of the loss (the same step built \
             in the bench from `DistributedDataParallel`'s hooks, the loss read on each rank, \
             timed last in each repeat): {}.\n",
            bare.join(", ")
        );
    }

    let (k, p) = (ok("kiln-gloo"), ok("pytorch-gloo"));
    t += &format!(
        "\nThe collectives alone, two ranks, Gloo, one thread each: Kiln's `ProcessGroup` \
         against `torch.distributed`, each call timed on rank 0. All-reduce (sum) of one float, \
         {LATENCY_CALLS} calls after {LATENCY_WARMUP}; then, {BANDWIDTH_CALLS} calls after \
         {BANDWIDTH_WARMUP} each, the all-reduce of 100 MB of float32, the reduce-scatter of \
         100 MB (`reduce_scatter` against `reduce_scatter_tensor`: each rank keeps its 50 MB) \
         and the all-gather of 50 MB per rank into 100 MB (`all_gather_into` against \
         `all_gather_into_tensor`), ZeRO's and full sharding's two collectives. Bandwidth is \
         100 MB / time.\n\n\
         | collective | Kiln | PyTorch | Kiln vs PyTorch |\n\
         | --- | ---: | ---: | ---: |\n"
    );
    // Lower is better for times: the ratio is PyTorch's over Kiln's.
    // Kiln's `kiln_key` against PyTorch's `pytorch_key`.
    let against = |kiln_key: &str, pytorch_key: &str, lower_better: bool| match (k, p) {
        (Some(k), Some(p)) => {
            let (a, b) = (num(k, kiln_key), num(p, pytorch_key));
            format!("{:.2}x", if lower_better { b / a } else { a / b })
        }
        _ => "-".to_owned(),
    };
    let speedup = |key: &str, lower_better: bool| against(key, key, lower_better);
    let spread = |r: Option<&Value>| {
        r.map_or("-".to_owned(), |r| {
            format!(
                "{:.0}-{:.0}",
                num(r, "latency_p10_us"),
                num(r, "latency_p90_us")
            )
        })
    };
    t += &format!(
        "| all-reduce 1 float, median latency (us) | {} | {} | {} |\n\
         | all-reduce 1 float, 10th-90th percentile (us) | {} | {} | |\n\
         | all-reduce 100 MB float32, median time (ms) | {} | {} | {} |\n\
         | all-reduce 100 MB float32, bandwidth (GB/s) | {} | {} | {} |\n\
         | reduce-scatter 100 MB, median time (ms) | {} | {} | {} |\n\
         | all-gather into 100 MB, median time (ms) | {} | {} | {} |\n\
         | reduce-scatter 100 MB given up (`reduce_scatter_owned`), median time (ms) | {} | {} | {} |\n",
        cell(k, "latency_us", 0),
        cell(p, "latency_us", 0),
        speedup("latency_us", true),
        spread(k),
        spread(p),
        cell(k, "bandwidth_ms", 1),
        cell(p, "bandwidth_ms", 1),
        speedup("bandwidth_ms", true),
        cell(k, "bandwidth_gb_s", 2),
        cell(p, "bandwidth_gb_s", 2),
        speedup("bandwidth_gb_s", false),
        cell(k, "reduce_scatter_ms", 1),
        cell(p, "reduce_scatter_ms", 1),
        speedup("reduce_scatter_ms", true),
        cell(k, "all_gather_ms", 1),
        cell(p, "all_gather_ms", 1),
        speedup("all_gather_ms", true),
        cell(k, "reduce_scatter_owned_ms", 1),
        cell(p, "reduce_scatter_ms", 1),
        against("reduce_scatter_owned_ms", "reduce_scatter_ms", true)
            + " (against `reduce_scatter_tensor`)",
    );
    for (v, r) in rows {
        if let Err(e) = r {
            t += &format!("\n{v} failed: {}\n", e.replace('|', "/"));
        }
    }
    t
}
