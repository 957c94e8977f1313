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
//! other workloads (`data`, `script`, `ops`, `checkpoint`, in `tasks.rs`) have their own. The tables are printed and, with
//! `--write`, written to `BENCHMARKS.md` (`BENCHMARKS-cuda.md` with `--device cuda`).
//!
//! On a machine without a Rust toolchain, run the built binary (`target/release/deps/
//! compare-*`) with libtorch's `lib/` on `LD_LIBRARY_PATH`, and `KILN_BENCH_PYTHON` naming
//! the interpreter that has torch and TensorFlow if it is not the project virtualenv's.
//! Built with `--no-default-features --features torch,cuda` it needs no TensorFlow
//! library (the TensorFlow variants are left out), as on a GPU machine without one.
//! `benches/gpu/pack.sh` and `benches/gpu/run.sh` do all of that for a GPU machine.

mod tasks;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use kiln::core::{
    AdamConfig, Conv2dConfig, DType, FloatPrecision, HostTensor, Layer, LinearConfig, Loss,
    Optimizer, OptimizerConfig, Pool2dConfig, StepPlan, TrainBackend,
};
use kiln::prelude::*;
#[cfg(feature = "tf")]
use kiln::tf::TfBackend;
use kiln::torch::TorchBackend;
use serde_json::{json, Value};

use crate::tasks::{Task, TaskArgs};

/// Every variant of the training workloads, in table order.
const VARIANTS: [&str; 8] = [
    "kiln-torch",
    "kiln-torch-graph",
    "raw-tch",
    "pytorch-eager",
    "pytorch-graph",
    "kiln-tf",
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
            Workload::TransformerBf16 => !(is_tensorflow(variant) || variant == "raw-tch"),
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
                    data, script, ops, checkpoint (default: all of them; on a GPU all but
                    data and checkpoint)
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
    let mut tasks = vec![Task::Data, Task::Script, Task::Ops, Task::Checkpoint];
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
        // Data loading and checkpoints do not depend on the device: they stay CPU tables.
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
            eprint!("   {variant:<18} ");
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
    matches!(variant, "kiln-tf" | "tf-function" | "keras-fit")
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

/// One workload's table: steps/s, samples/s, peak RSS and the ratio against
/// Python PyTorch eager.
fn table(
    workload: Workload,
    steps: usize,
    s: &Settings,
    rows: &[(String, std::result::Result<Value, String>)],
) -> String {
    let baseline = rows
        .iter()
        .find(|(v, _)| v == "pytorch-eager")
        .and_then(|(_, r)| r.as_ref().ok())
        .map(|r| num(r, "steps_per_s"));
    let raw = rows
        .iter()
        .find(|(v, _)| v == "raw-tch")
        .and_then(|(_, r)| r.as_ref().ok())
        .map(|r| num(r, "steps_per_s"));
    // Model FLOPs utilisation, for the bf16 workload: against the GPU's
    // published peak when known, else the best bf16 matrix product that the
    // PyTorch process measured on the same device.
    let mfu = workload
        .is_bf16()
        .then(|| workload.flops_per_step().zip(peak_tflops(rows)))
        .flatten();
    let mut t = format!(
        "### {}\n\n{steps} timed steps per repeat, median of {} repeats after {} warm-up steps, {} threads, \
         on {}; the median of {} rounds.\n\n",
        workload.describe(),
        s.repeats,
        s.warmup,
        s.threads,
        s.device,
        s.rounds
    );
    if let Some((flops, (peak, source))) = &mfu {
        t += &format!(
            "Model FLOPs per step: {:.3} TFLOP (3x the forward's matrix products); \
             MFU against {} TFLOP/s, {source}.\n\n",
            flops / 1e12,
            if *peak < 10.0 {
                format!("{peak:.2}")
            } else {
                format!("{peak:.1}")
            }
        );
    }
    let (extra_head, extra_rule) = if mfu.is_some() {
        (" TFLOP/s | MFU |", " ---: | ---: |")
    } else {
        ("", "")
    };
    t += &format!(
        "| variant | steps/s | samples/s |{extra_head} peak RSS (MiB) | vs PyTorch eager | final loss |\n\
         | --- | ---: | ---: |{extra_rule} ---: | ---: | ---: |\n"
    );
    for (variant, result) in rows {
        match result {
            Ok(r) => {
                let sps = num(r, "steps_per_s");
                let ratio = baseline.map_or("-".to_owned(), |b| format!("{:.2}x", sps / b));
                // Two significant digits at least (the bf16 transformer runs < 1 step/s on a CPU).
                let sps_text = if sps < 10.0 {
                    format!("{sps:.2}")
                } else {
                    format!("{sps:.1}")
                };
                let extra = mfu.as_ref().map_or(String::new(), |(flops, (peak, _))| {
                    let tflops = flops * sps / 1e12;
                    format!(" {tflops:.2} | {:.1}% |", 100.0 * tflops / peak)
                });
                t += &format!(
                    "| {variant} | {sps_text} | {:.0} |{extra} {:.0} | {ratio} | {:.4} |\n",
                    num(r, "samples_per_s"),
                    num(r, "peak_rss_mb"),
                    num(r, "final_loss"),
                );
            }
            Err(e) => t += &format!("| {variant} | failed: {} | | | | |\n", e.replace('|', "/")),
        }
    }
    if let (Some(raw), Some(kiln)) = (
        raw,
        rows.iter()
            .find(|(v, _)| v == "kiln-torch")
            .and_then(|(_, r)| r.as_ref().ok())
            .map(|r| num(r, "steps_per_s")),
    ) {
        t += &format!(
            "\nKiln's overhead over raw `tch`: {:+.1}% time per step.\n",
            100.0 * (raw / kiln - 1.0)
        );
    }
    t
}

/// The bf16 peak that MFU is measured against, with where it comes from: the
/// published dense bf16 rate of a known GPU (named by the PyTorch process),
/// else the best bf16 matrix product that process measured.
fn peak_tflops(rows: &[(String, std::result::Result<Value, String>)]) -> Option<(f64, String)> {
    let r = rows
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok())
        .find(|r| r.get("matmul_tflops").is_some())?;
    let name = r["device_name"].as_str().unwrap_or("unknown device");
    // NVIDIA's data sheets, dense (no sparsity) bf16 tensor-core rates.
    let published = [
        ("H100 PCIe", 756.0),
        ("H100", 989.4),
        ("H200", 989.4),
        ("A100", 312.0),
    ];
    Some(
        match published.iter().find(|(model, _)| name.contains(model)) {
            Some((_, peak)) => (*peak, format!("the published dense bf16 peak of the {name}")),
            None => (
                num(r, "matmul_tflops"),
                format!(
                    "the best rate of a bf16 square matrix product (n = 4096 on a CPU, 8192 on a GPU) \
                     that PyTorch measured on this {name}, for want of a published peak"
                ),
            ),
        },
    )
}

/// The whole report: machine, versions, command, then one table per workload.
fn report(sections: &[String], s: &Settings) -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let accelerator = if s.device.is_cuda() {
        let gpu = Command::new("nvidia-smi")
            .args(["--query-gpu=name", "--format=csv,noheader"])
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|names| names.lines().next().map(|l| l.trim().to_owned()))
            .filter(|name| !name.is_empty())
            .unwrap_or_else(|| "a CUDA GPU".to_owned());
        format!(
            "{gpu} ({}; TensorFlow variants are CPU-only and left out)",
            s.device
        )
    } else {
        "CPU only".to_owned()
    };
    let rustc = Command::new("rustc")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "built on another machine (no rustc here)".to_owned());
    #[cfg(feature = "tf")]
    let tensorflow = format!(
        "TensorFlow {} (C API and Python)",
        kiln::tf::TENSORFLOW_VERSION
    );
    #[cfg(not(feature = "tf"))]
    let tensorflow = "built without TensorFlow (feature `tf` off)";
    format!(
        "# Benchmarks\n\n\
         Kiln against Python on the same work, in one run (`benches/compare/`, Python side in\n\
         `benches/python/`). Every variant runs in its own process with the same model, data,\n\
         batch size, dtype (float32; bfloat16 where the title says so) and {} threads; peak RSS\n\
         is the process's high-water mark. Each\n\
         variant ran {} times, taking turns with the others, and the table keeps its median\n\
         round: the machine is a shared VM whose speed drifts by up to 2x for minutes at a time,\n\
         so compare ratios within one table, not across runs.\n\n\
         - Machine: {cpu}, {cores} cores, {accelerator}.\n\
         - Versions: libtorch {} (tch 0.24) and Python torch {}; {tensorflow}; {rustc}.\n\
         - Reproduce: `cargo xtask cargo bench --bench compare{} -- --rounds {}{} --write`\n\n{}",
        s.threads,
        s.rounds,
        kiln::torch::LIBTORCH_VERSION,
        kiln::torch::LIBTORCH_VERSION,
        if s.device.is_cuda() {
            " --features cuda"
        } else {
            ""
        },
        s.rounds,
        if s.device.is_cuda() {
            format!(" --device {}", s.device)
        } else {
            String::new()
        },
        sections.join("\n")
    )
}

// ----- workers: one variant, one workload, in this process -----

struct WorkerArgs {
    variant: String,
    workload: Workload,
    data: PathBuf,
    steps: usize,
    warmup: usize,
    repeats: usize,
    threads: usize,
    device: Device,
}

/// `VARIANT --key value ...` as the variant and a map of keys to values.
fn parse_flags(args: &[String]) -> Result<(String, BTreeMap<String, String>)> {
    let variant = args.first().context("--worker needs a variant")?.clone();
    let mut flags = BTreeMap::new();
    for pair in args[1..].chunks(2) {
        let [k, v] = pair else {
            bail!("flag {} needs a value", pair[0])
        };
        flags.insert(k.trim_start_matches("--").to_owned(), v.clone());
    }
    Ok((variant, flags))
}

fn parse_worker(args: &[String]) -> Result<WorkerArgs> {
    let (variant, flags) = parse_flags(args)?;
    let get = |k: &str| flags.get(k).with_context(|| format!("--{k} is required"));
    Ok(WorkerArgs {
        variant,
        workload: Workload::parse(get("workload")?)?,
        data: PathBuf::from(get("data")?),
        steps: get("steps")?.parse()?,
        warmup: get("warmup")?.parse()?,
        repeats: get("repeats")?.parse()?,
        threads: get("threads")?.parse()?,
        device: device_flag(&flags)?,
    })
}

/// Kiln's variants keep freed host memory for reuse, as `Trainer::fit` does
/// (`--host-memory retain`, the default), or leave glibc's default
/// (`--host-memory release`, for the before/after in BENCHMARKS.md).
fn apply_host_memory(args: &[String]) -> Result<()> {
    let (variant, flags) = parse_flags(args)?;
    let retain = match flags.get("host-memory").map(String::as_str) {
        None | Some("retain") => true,
        Some("release") => false,
        Some(other) => bail!("--host-memory {other}: expected retain or release"),
    };
    if retain && variant.starts_with("kiln-") {
        kiln::core::host_memory::retain_freed_memory();
    }
    Ok(())
}

/// The `--device` of a worker's flags; the CPU when absent.
fn device_flag(flags: &BTreeMap<String, String>) -> Result<Device> {
    Ok(flags.get("device").map_or(Ok(Device::Cpu), |d| d.parse())?)
}

/// The data directory's batches as host tensors.
fn read_batches(dir: &Path, workload: Workload) -> Result<Vec<(HostTensor, HostTensor)>> {
    let meta: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json"))?)?;
    let batches = meta["num_batches"]
        .as_u64()
        .context("meta.json: num_batches")? as usize;
    let x_bytes = std::fs::read(dir.join("x.f32"))?;
    let y_bytes = std::fs::read(dir.join("y.i64"))?;
    let x: Vec<f32> = x_bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let y: Vec<i64> = y_bytes
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default()))
        .collect();
    let batch = workload.batch();
    let per_sample: usize = workload.input_shape().iter().product();
    ensure!(
        x.len() == batches * batch * per_sample,
        "x.f32 has {} values",
        x.len()
    );
    let mut dims = vec![batch];
    dims.extend(workload.input_shape());
    (0..batches)
        .map(|i| {
            let xs = x[i * batch * per_sample..(i + 1) * batch * per_sample].to_vec();
            let ys = y[i * batch..(i + 1) * batch].to_vec();
            Ok((
                HostTensor::new(xs, dims.clone())?,
                HostTensor::new(ys, [batch])?,
            ))
        })
        .collect()
}

/// The process's peak resident set, in MiB (`VmHWM`).
fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `warmup` untimed runs of `f`, then the seconds of each of `repeats` timed runs.
fn timed(warmup: usize, repeats: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    for _ in 0..warmup {
        f()?;
    }
    (0..repeats)
        .map(|_| {
            let start = Instant::now();
            f()?;
            Ok(start.elapsed().as_secs_f64())
        })
        .collect()
}

/// `a.warmup` steps, then `a.repeats` timed runs of `a.steps` steps; `step(i)`
/// runs step `i` (counted from the first warm-up step) and returns its loss.
fn time_steps(
    a: &WorkerArgs,
    mut step: impl FnMut(usize) -> Result<f64>,
) -> Result<(Vec<f64>, f64)> {
    let (mut next, mut loss) = (0, f64::NAN);
    let mut run = |n: usize| -> Result<()> {
        for _ in 0..n {
            loss = step(next)?;
            next += 1;
        }
        Ok(())
    };
    run(a.warmup)?;
    let times = timed(0, a.repeats, || run(a.steps))?;
    Ok((times, loss))
}

fn worker(args: &[String]) -> Result<()> {
    apply_host_memory(args)?;
    if let Some(i) = args.iter().position(|a| a == "--task") {
        let task = args
            .get(i + 1)
            .and_then(|name| Task::parse(name))
            .context("--task needs data, script, ops or checkpoint")?;
        let (variant, flags) = parse_flags(args)?;
        let result = tasks::worker(task, &variant, &TaskArgs::parse(&flags)?)?;
        println!("{result}");
        return Ok(());
    }
    let a = parse_worker(args)?;
    ensure!(
        a.workload.runs(&a.variant),
        "{} has no {} variant",
        a.workload.name(),
        a.variant
    );
    let dtype = a.workload.dtype();
    let host: Vec<(HostTensor, HostTensor)> = read_batches(&a.data, a.workload)?
        .into_iter()
        .map(|(x, y)| (x.to_dtype(dtype), y))
        .collect();
    let (times, loss) = match a.variant.as_str() {
        "kiln-torch" => {
            tch::set_num_threads(a.threads as i32);
            let precision = a.workload.precision();
            kiln_step::<TorchBackend>(&a, &host, |m| match precision {
                FloatPrecision::F32 => m.to_dtype(dtype),
                mixed => m.set_precision(mixed),
            })?
        }
        #[cfg(feature = "cuda")]
        "kiln-torch-graph" => graphed_step(&a, &host)?,
        #[cfg(feature = "tf")]
        "kiln-tf" => {
            // As the Python worker's `tf.config.threading`.
            kiln::tf::set_thread_counts(a.threads, a.threads)?;
            kiln_step::<TfBackend>(&a, &host, |_| Ok(()))?
        }
        "raw-tch" => {
            tch::set_num_threads(a.threads as i32);
            raw_tch::run(&a, &host)?
        }
        other => bail!("unknown worker variant {other}"),
    };
    let m = median(times.clone());
    let batch = a.workload.batch();
    let result = json!({
        "variant": a.variant,
        "workload": a.workload.name(),
        "batch": batch,
        "steps": a.steps,
        "repeats_s": times,
        "median_s": m,
        "steps_per_s": a.steps as f64 / m,
        "samples_per_s": (a.steps * batch) as f64 / m,
        "peak_rss_mb": peak_rss_mb(),
        "final_loss": loss,
        "threads": a.threads,
        "device": a.device.to_string(),
    });
    println!("{result}");
    Ok(())
}

/// The batches as backend tensors on `device`, made once before timing.
fn to_device<B: TrainBackend>(
    host: &[(HostTensor, HostTensor)],
    device: Device,
) -> Result<Vec<(B::Tensor, B::Tensor)>> {
    host.iter()
        .map(|(x, y)| Ok((B::from_host(x, device)?, B::from_host(y, device)?)))
        .collect()
}

/// Kiln's training step (`TrainBackend::train_step`: forward, loss, backward,
/// optimizer step; one session run on TensorFlow) on batches already on the device.
fn kiln_step<B: TrainBackend>(
    a: &WorkerArgs,
    host: &[(HostTensor, HostTensor)],
    prepare: impl FnOnce(&mut B::Model) -> kiln::core::Result<()>,
) -> Result<(Vec<f64>, f64)> {
    B::manual_seed(0);
    let mut model = B::build_model(&a.workload.spec(), a.device)?;
    prepare(&mut model)?;
    let mut optimizer =
        B::build_optimizer(&OptimizerConfig::Adam(AdamConfig::new(1e-3)), &model, &[])?;
    let batches = to_device::<B>(host, a.device)?;
    let loss = Loss::cross_entropy();
    let plan = StepPlan {
        loss: &loss,
        scale: 1.0,
        apply: true,
        clip: None,
    };
    time_steps(a, |i| {
        let (x, y) = &batches[i % batches.len()];
        optimizer.zero_grad()?;
        Ok(B::train_step(&mut model, &mut optimizer, x, y, &plan)?)
    })
}

/// Kiln's training step captured in a CUDA graph (`kiln::ops::graph::GraphedTrainStep`),
/// replayed on each batch; the loss is read (a synchronisation) only for the last step.
#[cfg(feature = "cuda")]
fn graphed_step(a: &WorkerArgs, host: &[(HostTensor, HostTensor)]) -> Result<(Vec<f64>, f64)> {
    use kiln::ops::graph::GraphedTrainStep;
    use kiln::torch::{TorchModel, TorchOptimizer};

    TorchBackend::manual_seed(0);
    let mut model = TorchModel::new(&a.workload.spec(), a.device)?;
    model.to_dtype(a.workload.dtype())?;
    let optimizer = TorchOptimizer::new(
        OptimizerConfig::Adam(AdamConfig::new(1e-3)),
        model.named_parameters(),
        &[],
    )?;
    let batches = to_device::<TorchBackend>(host, a.device)?;
    let (x0, y0) = &batches[0];
    let mut step = GraphedTrainStep::new(model, optimizer, &Loss::cross_entropy(), None, x0, y0)?;
    let (warmup, steps) = (a.warmup, a.steps);
    time_steps(a, |i| {
        let (x, y) = &batches[i % batches.len()];
        let loss = step.step(x, y)?;
        // Read the loss (and so wait for the device) at the end of the warm-up and
        // of each timed run only, as the Python loops do.
        let done = i + 1;
        Ok(if done >= warmup && (done - warmup) % steps == 0 {
            TorchBackend::item(loss)?
        } else {
            f64::NAN
        })
    })
}

/// The same models written directly against `tch` (its `nn` layers and its
/// libtorch Adam), with no Kiln code in the step.
mod raw_tch {
    use super::*;
    use tch::nn::{self, Module as _, OptimizerConfig as _};
    use tch::{Kind, Tensor};

    pub(super) fn run(
        a: &WorkerArgs,
        host: &[(HostTensor, HostTensor)],
    ) -> Result<(Vec<f64>, f64)> {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(kiln::torch::device_to_tch(a.device)?);
        let root = vs.root();
        let model: Box<dyn Fn(&Tensor) -> Tensor> = match a.workload {
            Workload::Mlp => {
                let net = nn::seq()
                    .add(nn::linear(&root / "0", 784, 256, Default::default()))
                    .add_fn(|x| x.relu())
                    .add(nn::linear(&root / "2", 256, 10, Default::default()));
                Box::new(move |x| net.forward(x))
            }
            Workload::Cnn => {
                let conv = nn::ConvConfig {
                    padding: 1,
                    ..Default::default()
                };
                let net = nn::seq()
                    .add(nn::conv2d(&root / "0", 1, 32, 3, conv))
                    .add_fn(|x| x.relu().max_pool2d_default(2))
                    .add(nn::conv2d(&root / "3", 32, 64, 3, conv))
                    .add_fn(|x| x.relu().max_pool2d_default(2).flatten(1, -1))
                    .add(nn::linear(&root / "7", 64 * 7 * 7, 128, Default::default()))
                    .add_fn(|x| x.relu())
                    .add(nn::linear(&root / "9", 128, 10, Default::default()));
                Box::new(move |x| net.forward(x))
            }
            Workload::Transformer => Box::new(transformer(&root)),
            Workload::TransformerBf16 | Workload::TransformerBf16Mixed => {
                bail!("raw-tch has no bf16 transformer")
            }
        };
        let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
        let batches: Vec<(Tensor, Tensor)> = host
            .iter()
            .map(|(x, y)| {
                Ok((
                    kiln::torch::to_tch(x, a.device)?,
                    kiln::torch::to_tch(y, a.device)?,
                ))
            })
            .collect::<Result<_>>()?;
        time_steps(a, |i| {
            let (x, y) = &batches[i % batches.len()];
            let loss = model(x).cross_entropy_for_logits(y);
            opt.backward_step(&loss);
            Ok(loss.double_value(&[]))
        })
    }

    /// Pre-norm encoder block (8 heads, ff 1024, exact GELU), flatten, linear.
    fn transformer(root: &nn::Path<'_>) -> impl Fn(&Tensor) -> Tensor {
        let (e, heads, ff, seq) = (256i64, 8i64, 1024i64, 128i64);
        let ln = |p: nn::Path<'_>| nn::layer_norm(p, vec![e], Default::default());
        let ln1 = ln(root / "ln1");
        let in_proj = nn::linear(root / "in_proj", e, 3 * e, Default::default());
        let out_proj = nn::linear(root / "out_proj", e, e, Default::default());
        let ln2 = ln(root / "ln2");
        let fc1 = nn::linear(root / "fc1", e, ff, Default::default());
        let fc2 = nn::linear(root / "fc2", ff, e, Default::default());
        let head = nn::linear(root / "head", seq * e, 10, Default::default());
        move |x: &Tensor| {
            let b = x.size()[0];
            let qkv = in_proj.forward(&ln1.forward(x));
            let split = |t: Tensor| t.reshape([b, seq, heads, e / heads]).transpose(1, 2);
            let parts = qkv.chunk(3, -1);
            let (q, k, v) = (
                split(parts[0].shallow_clone()),
                split(parts[1].shallow_clone()),
                split(parts[2].shallow_clone()),
            );
            let att = Tensor::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                None::<Tensor>,
                0.0,
                false,
                None,
                false,
            );
            let att = att.transpose(1, 2).reshape([b, seq, e]);
            let h = x + out_proj.forward(&att);
            let f = fc2.forward(&fc1.forward(&ln2.forward(&h)).gelu("none"));
            let h = &h + f;
            head.forward(&h.flatten(1, -1)).to_kind(Kind::Float)
        }
    }
}
