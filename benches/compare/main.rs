//! Kiln against Python, side by side in one run: the same model, data, batch size,
//! dtype and thread count for every variant, each in its own process (so each has
//! its own peak RSS), warm-up first, then the median of several timed repeats.
//!
//! ```sh
//! cargo xtask cargo bench --bench compare                       # every workload, every variant
//! cargo xtask cargo bench --bench compare -- --workloads mlp,ops --repeats 7
//! cargo xtask cargo bench --bench compare --features cuda -- --device cuda   # (a)-(c), (e), (f) on a GPU
//! ```
//!
//! Training workloads (`mlp`, `cnn`, `transformer`) have the variants `kiln-torch`
//! and `kiln-tf` (Kiln's training step on each backend), `raw-tch` (the same model
//! written directly in `tch`, no Kiln layers), `pytorch-eager`, `tf-function` and
//! `keras-fit` (the Python scripts in `benches/python/`, run with the project
//! virtualenv's interpreter). `transformer-bf16`, the transformer at width 1024 in
//! bfloat16 reported with model FLOPs utilisation, has only the torch variants;
//! `transformer-bf16-mixed`, the same model in float32 trained with bfloat16
//! autocast (`bf16-mixed` against `torch.autocast`), only the eager ones. The
//! other workloads (`data`, `script`, `ops`, `checkpoint`, in `tasks.rs`,
//! `serve`, exported models at inference, in `serve.rs`, `images`, image files
//! decoded and augmented, `resize`, the uint8 resize alone, in `resize.rs`, and `ddp`, two data-parallel ranks against PyTorch DDP under `torchrun`, in
//! `ddp.rs`) have their own. The tables are printed and, with `--write`, written
//! to `BENCHMARKS.md` (`BENCHMARKS-cuda.md` with `--device cuda`).
//!
//! On a machine without a Rust toolchain, run the built binary (`target/release/deps/
//! compare-*`) with libtorch's `lib/` on `LD_LIBRARY_PATH`, and `KILN_BENCH_PYTHON` naming
//! the interpreter that has torch and TensorFlow if it is not the project virtualenv's.
//! Built with `--no-default-features --features torch,cuda` it needs no TensorFlow
//! library (the TensorFlow variants are left out), as on a GPU machine without one.
//! `benches/gpu/pack.sh` and `benches/gpu/run.sh` do all of that for a GPU machine.

mod ddp;
mod finetune;
mod llm;
mod ops;
mod report;
mod resize;
mod serve;
mod tasks;
mod worker;
mod zero;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use kiln::core::{
    backend::{StepPlan, TrainBackend},
    loss::Loss,
    model::{Conv2dConfig, Layer, LinearConfig, Pool2dConfig},
    optim::{AdamConfig, Optimizer, OptimizerConfig},
    precision::FloatPrecision,
    DType, HostTensor,
};
use kiln::prelude::*;
#[cfg(feature = "tf")]
use kiln::tf::TfBackend;
use kiln::torch::TorchBackend;
use serde_json::{json, Value};

use crate::report::{report, table};
use crate::tasks::{Task, TaskArgs};
use crate::worker::worker;

/// Every variant of the training workloads, in table order.
const VARIANTS: [&str; 12] = [
    "kiln-torch",
    "kiln-torch-ema",
    "kiln-torch-views",
    "kiln-torch-profile",
    "kiln-torch-graph",
    "raw-tch",
    "pytorch-eager",
    "pytorch-graph",
    "kiln-tf",
    "kiln-tf-profile",
    "tf-function",
    "keras-fit",
];

/// One training workload: the model, its per-sample input and batch size.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Workload {
    /// MLP 784-256-10, batch 64 (overhead-bound).
    Mlp,
    /// A two-convolution CNN on 28x28 images, batch 128.
    Cnn,
    /// A pre-norm transformer encoder block, sequence 128, width 256, batch 32.
    Transformer,
    /// (c) larger and in bfloat16, for model FLOPs utilisation: sequence 256,
    /// width 1024, 16 heads, ff 4096, batch 32 (torch variants only).
    TransformerBf16,
    /// The same model in float32 trained with bfloat16 autocast (`bf16-mixed`,
    /// `torch.autocast`); eager torch variants only.
    TransformerBf16Mixed,
}

impl Workload {
    fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "mlp" => Workload::Mlp,
            "cnn" => Workload::Cnn,
            "transformer" => Workload::Transformer,
            "transformer-bf16" => Workload::TransformerBf16,
            "transformer-bf16-mixed" => Workload::TransformerBf16Mixed,
            other => {
                bail!(
                    "unknown workload {other}; expected mlp, cnn, transformer, transformer-bf16 \
                     or transformer-bf16-mixed"
                )
            }
        })
    }

    fn name(self) -> &'static str {
        match self {
            Workload::Mlp => "mlp",
            Workload::Cnn => "cnn",
            Workload::Transformer => "transformer",
            Workload::TransformerBf16 => "transformer-bf16",
            Workload::TransformerBf16Mixed => "transformer-bf16-mixed",
        }
    }

    /// The dtype of the model and its inputs.
    fn dtype(self) -> DType {
        match self {
            Workload::TransformerBf16 => DType::BF16,
            _ => DType::F32,
        }
    }

    /// Whether the matrix work runs in bfloat16 (MFU is reported for these).
    fn is_bf16(self) -> bool {
        matches!(
            self,
            Workload::TransformerBf16 | Workload::TransformerBf16Mixed
        )
    }

    /// Whether `variant` can run this workload: the bf16 ones have no TensorFlow
    /// variants (Kiln's TensorFlow backend has no bf16) and no raw-tch twin, and
    /// the mixed one no CUDA-graph variants (autocast's weight-cast cache and
    /// graph capture do not mix without more work).
    fn runs(self, variant: &str) -> bool {
        match self {
            Workload::TransformerBf16 => {
                !(is_tensorflow(variant)
                    || matches!(
                        variant,
                        "raw-tch" | "kiln-torch-ema" | "kiln-torch-views" | "kiln-torch-profile"
                    ))
            }
            Workload::TransformerBf16Mixed => matches!(variant, "kiln-torch" | "pytorch-eager"),
            _ => true,
        }
    }

    /// The precision the Kiln model trains in.
    fn precision(self) -> FloatPrecision {
        match self {
            Workload::TransformerBf16Mixed => FloatPrecision::Bf16Mixed,
            _ => FloatPrecision::F32,
        }
    }

    /// `(sequence, width, heads, feed-forward width)` of the transformer workloads.
    fn transformer_dims(self) -> Option<(usize, usize, usize, usize)> {
        match self {
            Workload::Transformer => Some((128, 256, 8, 1024)),
            Workload::TransformerBf16 | Workload::TransformerBf16Mixed => {
                Some((256, 1024, 16, 4096))
            }
            Workload::Mlp | Workload::Cnn => None,
        }
    }

    /// Model FLOPs of one training step (forward and backward, 3x the forward's
    /// matrix products; elementwise work not counted), for the transformers.
    fn flops_per_step(self) -> Option<f64> {
        let (s, d, _, f) = self.transformer_dims()?;
        let [b, s, d, f] = [self.batch(), s, d, f].map(|v| v as f64);
        let tokens = b * s;
        // QKV and output projections, attention scores and values, feed-forward, classifier.
        let forward = 2.0 * tokens * d * 4.0 * d
            + 4.0 * b * s * s * d
            + 2.0 * tokens * d * f * 2.0
            + 2.0 * tokens * d * CLASSES as f64;
        Some(3.0 * forward)
    }

    fn describe(self) -> &'static str {
        match self {
            Workload::Mlp => "(a) MLP 784-256-10, batch 64, Adam",
            Workload::Cnn => "(b) CNN 28x28 (conv32-pool-conv64-pool-fc128-fc10), batch 128, Adam",
            Workload::Transformer => {
                "(c) transformer encoder block, seq 128, width 256, 8 heads, ff 1024, batch 32, Adam"
            }
            Workload::TransformerBf16 => {
                "(c, larger, bf16) transformer encoder block, seq 256, width 1024, 16 heads, ff 4096, \
                 batch 32, Adam, parameters and inputs in bfloat16"
            }
            Workload::TransformerBf16Mixed => {
                "(c, larger, bf16-mixed) the same block and batch, float32 parameters and Adam, \
                 the forward pass under bfloat16 autocast"
            }
        }
    }

    fn input_shape(self) -> Vec<usize> {
        match self {
            Workload::Mlp => vec![784],
            Workload::Cnn => vec![1, 28, 28],
            Workload::Transformer | Workload::TransformerBf16 | Workload::TransformerBf16Mixed => {
                let (seq, width, ..) = self.transformer_dims().unwrap_or_default();
                vec![seq, width]
            }
        }
    }

    fn batch(self) -> usize {
        match self {
            Workload::Mlp => 64,
            Workload::Cnn => 128,
            Workload::Transformer | Workload::TransformerBf16 | Workload::TransformerBf16Mixed => {
                32
            }
        }
    }

    /// Timed steps per repeat: about a second of work for Python PyTorch here
    /// (the bf16 transformer: 2 s a step on this CPU, ~2 ms on an H100).
    fn default_steps(self, device: Device) -> usize {
        match self {
            Workload::Mlp => 400,
            Workload::Cnn => 20,
            Workload::Transformer => 5,
            Workload::TransformerBf16 | Workload::TransformerBf16Mixed if device.is_cuda() => 100,
            Workload::TransformerBf16 | Workload::TransformerBf16Mixed => 1,
        }
    }

    /// The model as a Kiln definition (the Python scripts build the same).
    fn spec(self) -> Layer {
        match self {
            Workload::Mlp => Layer::sequential([
                LinearConfig::new(784, 256).into(),
                Layer::Relu,
                LinearConfig::new(256, 10).into(),
            ]),
            Workload::Cnn => Layer::sequential([
                Conv2dConfig::new(1, 32, [3, 3]).with_padding([1, 1]).into(),
                Layer::Relu,
                Layer::MaxPool2d(Pool2dConfig::new([2, 2])),
                Conv2dConfig::new(32, 64, [3, 3])
                    .with_padding([1, 1])
                    .into(),
                Layer::Relu,
                Layer::MaxPool2d(Pool2dConfig::new([2, 2])),
                Layer::Flatten {
                    start_dim: 1,
                    end_dim: -1,
                },
                LinearConfig::new(64 * 7 * 7, 128).into(),
                Layer::Relu,
                LinearConfig::new(128, 10).into(),
            ]),
            Workload::Transformer | Workload::TransformerBf16 | Workload::TransformerBf16Mixed => {
                let (seq, width, heads, ff) = self.transformer_dims().unwrap_or_default();
                Layer::sequential([
                    Layer::transformer_encoder_block(width, heads, ff, false, 0.0),
                    Layer::Flatten {
                        start_dim: 1,
                        end_dim: -1,
                    },
                    LinearConfig::new(seq * width, 10).into(),
                ])
            }
        }
    }
}

/// What `--help` prints.
const USAGE: &str = "\
Kiln against Python PyTorch, TensorFlow and Keras on the same work (BENCHMARKS.md).

usage: cargo xtask cargo bench --bench compare [--features cuda] -- [FLAGS]

  --workloads W,W   mlp, cnn, transformer, transformer-bf16, transformer-bf16-mixed,
                    data, script, ops, checkpoint, ddp, serve, images, resize, llm, moe, qwen3, finetune, zero (default: all of
                    them; on a GPU all but data, checkpoint and ddp)
  --variants V,V    only these variants (kiln-torch, raw-tch, pytorch-eager, kiln-tf,
                    tf-function, keras-fit, kiln-torch-graph, pytorch-graph, ...)
  --steps N         timed steps per repeat (default: per workload)
  --warmup N        untimed warm-up steps or calls (default 5)
  --repeats N       timed repeats; the median is kept (default 5)
  --threads N       intra-op (and TensorFlow inter-op) threads of every variant (default 2)
  --rounds N        run every variant N times in turn, keep each one's median round (default 1)
  --device D        cpu or cuda[:N] (default cpu)
  --write           write the tables to BENCHMARKS.md (BENCHMARKS-cuda.md on a GPU)";

/// What every variant runs with.
#[derive(Clone, Debug)]
struct Settings {
    steps: Option<usize>,
    warmup: usize,
    repeats: usize,
    threads: usize,
    num_batches: usize,
    /// Times each variant runs, alternating with the others (see `run_rounds`).
    rounds: usize,
    /// Where the torch variants and the fused ops run (TensorFlow's wheel is CPU-only).
    device: Device,
}

const CLASSES: usize = 10;

fn main() -> Result<()> {
    let mut args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if args.first().map(String::as_str) == Some("--worker") {
        args.remove(0);
        return worker(&args);
    }
    let mut workloads = vec![
        Workload::Mlp,
        Workload::Cnn,
        Workload::Transformer,
        Workload::TransformerBf16,
        Workload::TransformerBf16Mixed,
    ];
    let mut tasks = vec![
        Task::Data,
        Task::Script,
        Task::Ops,
        Task::Checkpoint,
        Task::Ddp,
        Task::Serve,
        Task::Images,
        Task::Resize,
        Task::Llm,
        Task::Moe,
        Task::Qwen3,
        Task::Finetune,
        Task::Zero,
    ];
    let mut variants: Option<Vec<String>> = None;
    let mut settings = Settings {
        steps: None,
        warmup: 5,
        repeats: 5,
        threads: 2,
        num_batches: 16,
        rounds: 1,
        device: Device::Cpu,
    };
    let mut workloads_given = false;
    let mut write = false;
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--workloads" => {
                workloads_given = true;
                (workloads, tasks) = (Vec::new(), Vec::new());
                for name in value()?.split(',') {
                    match Task::parse(name) {
                        Some(task) => tasks.push(task),
                        None => workloads.push(Workload::parse(name)?),
                    }
                }
            }
            "--variants" => variants = Some(value()?.split(',').map(str::to_owned).collect()),
            "--steps" => settings.steps = Some(value()?.parse()?),
            "--warmup" => settings.warmup = value()?.parse()?,
            "--repeats" => settings.repeats = value()?.parse()?,
            "--threads" => settings.threads = value()?.parse()?,
            "--rounds" => settings.rounds = value()?.parse()?,
            "--device" => settings.device = value()?.parse()?,
            "--write" => write = true,
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown flag {other}\n\n{USAGE}"),
        }
    }
    let all_variants: Vec<&str> = VARIANTS
        .iter()
        .copied()
        .chain(tasks.iter().flat_map(|t| t.variants().iter().copied()))
        .collect();
    for v in variants.iter().flatten() {
        ensure!(
            all_variants.contains(&v.as_str()),
            "unknown variant {v}; expected one of {all_variants:?}"
        );
    }
    // The variants asked for (all by default) that can run on the device.
    let selected = |all: &[&'static str]| -> Vec<&'static str> {
        all.iter()
            .copied()
            .filter(|v| {
                variants
                    .as_ref()
                    .is_none_or(|list| list.iter().any(|c| c == v))
                    && !(is_tensorflow(v) && (settings.device.is_cuda() || !cfg!(feature = "tf")))
                    && (settings.device.is_cuda() || !is_cuda_graph(v))
            })
            .collect()
    };
    ensure!(settings.repeats >= 1, "--repeats must be at least 1");
    ensure!(settings.rounds >= 1, "--rounds must be at least 1");
    if !cfg!(feature = "tf") {
        eprintln!("== built without the `tf` feature: the TensorFlow variants are left out");
    }
    if settings.device.is_cuda() {
        ensure!(
            kiln::torch::cuda_is_available(),
            "--device {}: libtorch sees no CUDA device on this machine",
            settings.device
        );
        // Data loading, checkpoints and (h) (Gloo) do not depend on the device: they stay
        // CPU tables.
        if !workloads_given {
            tasks.retain(|t| matches!(t, Task::Script | Task::Ops));
        }
        eprintln!(
            "== on {}: the TensorFlow variants are left out (the pinned tensorflow-cpu wheel has no GPU)",
            settings.device
        );
    }

    let scratch = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-compare");
    let mut sections = Vec::new();
    for workload in workloads {
        let data = scratch.join(workload.name());
        write_data(&data, workload, settings.num_batches)?;
        let steps = settings
            .steps
            .unwrap_or(workload.default_steps(settings.device));
        eprintln!(
            "== {} ({steps} steps x {} repeats)",
            workload.describe(),
            settings.repeats
        );
        let mut names = selected(&VARIANTS);
        names.retain(|v| workload.runs(v));
        let rows = run_rounds(
            &names,
            settings.rounds,
            |variant| run_variant(variant, workload, &data, steps, &settings),
            |r| num(r, "steps_per_s"),
            |r| {
                format!(
                    "{:>9.1} steps/s  {:>7.0} MiB",
                    num(r, "steps_per_s"),
                    num(r, "peak_rss_mb")
                )
            },
        );
        sections.push(table(workload, steps, &settings, &rows));
    }
    for task in tasks {
        let dir = scratch.join(task.name());
        eprintln!("== {} ({} repeats)", task.describe(), settings.repeats);
        task.prepare(&dir)?;
        let names = selected(task.variants());
        let rows = run_rounds(
            &names,
            settings.rounds,
            |variant| task.run(variant, &dir, &settings),
            |r| task.score(r),
            |r| task.summary(r),
        );
        sections.push(task.table(&settings, &rows));
    }
    let report = report(&sections, &settings);
    println!("{report}");
    if write {
        let file = if settings.device.is_cuda() {
            "BENCHMARKS-cuda.md"
        } else {
            "BENCHMARKS.md"
        };
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
        // Hand-written analysis below the marker (profiles, before/after) is kept.
        let kept = std::fs::read_to_string(&path)
            .ok()
            .and_then(|old| old.find(KEPT_MARKER).map(|at| old[at..].to_owned()))
            .unwrap_or_default();
        let text = if kept.is_empty() {
            report.clone()
        } else {
            format!("{report}\n{kept}")
        };
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("written to {}", path.display());
    }
    Ok(())
}

/// Runs each variant `rounds` times, all variants in turn per round, so that a
/// slow spell of a shared machine hits every variant rather than one; keeps, per
/// variant, the round whose `score` is the median (the round results are in its
/// `round_scores`). A variant that fails in any round is reported as failed.
fn run_rounds(
    variants: &[&str],
    rounds: usize,
    mut run: impl FnMut(&str) -> Result<Value>,
    score: impl Fn(&Value) -> f64,
    summary: impl Fn(&Value) -> String,
) -> Vec<(String, std::result::Result<Value, String>)> {
    let mut results: Vec<std::result::Result<Vec<Value>, String>> =
        vec![Ok(Vec::new()); variants.len()];
    for round in 0..rounds {
        for (variant, result) in variants.iter().zip(&mut results) {
            let Ok(done) = result else { continue };
            eprint!("   {variant:<24} ");
            if rounds > 1 {
                eprint!("round {} ", round + 1);
            }
            match run(variant) {
                Ok(r) => {
                    eprintln!("{}", summary(&r));
                    done.push(r);
                }
                Err(e) => {
                    eprintln!("failed: {e:#}");
                    *result = Err(format!("{e:#}"));
                }
            }
        }
    }
    variants
        .iter()
        .zip(results)
        .map(|(variant, result)| {
            let kept = result.map(|mut all| {
                all.sort_by(|a, b| score(a).total_cmp(&score(b)));
                let scores: Vec<f64> = all.iter().map(&score).collect();
                let mut kept = all.swap_remove(all.len() / 2);
                kept["round_scores"] = json!(scores);
                kept
            });
            (variant.to_string(), kept)
        })
        .collect()
}

/// Where the generated part of `BENCHMARKS.md` ends: `--write` keeps what follows.
const KEPT_MARKER: &str = "<!-- written by hand: --write keeps everything below -->";

/// Whether a variant runs on TensorFlow, whose pinned wheel (`tensorflow-cpu`) has no GPU.
fn is_tensorflow(variant: &str) -> bool {
    matches!(
        variant,
        "kiln-tf" | "kiln-tf-profile" | "tf-function" | "keras-fit"
    )
}

/// Whether a variant replays a CUDA graph (runs only with `--device cuda`).
fn is_cuda_graph(variant: &str) -> bool {
    variant.ends_with("-graph")
}

/// The Python interpreter of the baselines: `KILN_BENCH_PYTHON` if set (a machine
/// without the project virtualenv), else the virtualenv's.
fn python_interpreter() -> Command {
    Command::new(std::env::var_os("KILN_BENCH_PYTHON").unwrap_or(env!("KILN_VENV_PYTHON").into()))
}

fn num(v: &Value, key: &str) -> f64 {
    v.get(key).and_then(Value::as_f64).unwrap_or(f64::NAN)
}

/// Deterministic features in [-1, 1) and learnable labels (the largest of the
/// first ten features), written as the Python scripts read them.
fn write_data(dir: &Path, workload: Workload, num_batches: usize) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let per_sample: usize = workload.input_shape().iter().product();
    let rows = num_batches * workload.batch();
    let mut next = xorshift(0x2545_f491_4f6c_dd1d);
    let x: Vec<f32> = (0..rows * per_sample)
        .map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        .collect();
    let y: Vec<i64> = x
        .chunks(per_sample)
        .map(|r| (0..CLASSES).fold(0, |b, i| if r[i] > r[b] { i } else { b }) as i64)
        .collect();
    std::fs::write(dir.join("x.f32"), bytemuck_f32(&x))?;
    std::fs::write(
        dir.join("y.i64"),
        y.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
    )?;
    let meta = json!({
        "workload": workload.name(),
        "input_shape": workload.input_shape(),
        "batch": workload.batch(),
        "num_batches": num_batches,
        "classes": CLASSES,
    });
    std::fs::write(dir.join("meta.json"), meta.to_string())?;
    Ok(())
}

/// A xorshift64 stream: the same data every run, without a random-number crate.
fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

fn bytemuck_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

/// Runs one variant in its own process and returns its JSON result.
fn run_variant(
    variant: &str,
    workload: Workload,
    data: &Path,
    steps: usize,
    s: &Settings,
) -> Result<Value> {
    let common = [
        "--workload".to_owned(),
        workload.name().to_owned(),
        "--data".to_owned(),
        data.display().to_string(),
        "--steps".to_owned(),
        steps.to_string(),
        "--warmup".to_owned(),
        s.warmup.to_string(),
        "--repeats".to_owned(),
        s.repeats.to_string(),
        "--threads".to_owned(),
        s.threads.to_string(),
        "--device".to_owned(),
        s.device.to_string(),
    ];
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/python");
    let mut command = match variant {
        "pytorch-eager" | "pytorch-graph" => {
            let mut c = python_interpreter();
            c.arg(scripts.join("bench_torch.py"))
                .args(["--variant", variant]);
            c
        }
        "tf-function" | "keras-fit" => {
            let mut c = python_interpreter();
            c.arg(scripts.join("bench_tf.py"))
                .args(["--variant", variant]);
            c
        }
        _ => {
            let mut c = Command::new(std::env::current_exe()?);
            c.args(["--worker", variant]);
            c
        }
    };
    command.args(&common);
    run_json(command, variant)
}

/// Runs a benchmark process (TensorFlow's banners quiet, Kiln's logs at `warn`)
/// and parses the JSON line it prints last.
fn run_json(mut command: Command, label: &str) -> Result<Value> {
    let out = command
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .env("RUST_LOG", "warn")
        .output()
        .with_context(|| format!("starting {label}"))?;
    output_json(&out, label)
}

/// The JSON line a finished benchmark process printed last, or its error.
fn output_json(out: &Output, label: &str) -> Result<Value> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{label} exited with {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .rev()
            .take(5)
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .with_context(|| format!("{label} printed no JSON result"))?;
    serde_json::from_str(line).with_context(|| format!("{label}'s result {line}"))
}
