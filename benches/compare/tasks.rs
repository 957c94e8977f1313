//! Workloads (d)-(j): data loading, TorchScript inference, the fused ops,
//! checkpoint I/O, data-parallel training (`ddp.rs`) and serving exported
//! models (`serve.rs`), decoding and augmenting image files, and the resize
//! those augmentations rest on, alone (`resize.rs`). Each has its own variants
//! and table; like the training workloads, every variant runs in its own process
//! (two, for (h)) and prints one JSON line.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use kiln::core::{
    backend::TrainBackend,
    model::{Layer, LinearConfig},
    state_tensors::StateTensors,
};
use kiln::data::{Compose, DataLoader, InMemoryDataset, PrefetchLoader, TransformedDataset};
use kiln::prelude::*;
use kiln::torch::{ScriptModule, TorchBackend};
use kiln::train::Checkpoint;
use kiln::vision::{Normalize, ToFloat};
use serde_json::{json, Value};
use tch::{Kind, Tensor};

use crate::worker::{device_flag, median, peak_rss_mb, rss_mb, timed};
use crate::{ddp, finetune, llm, num, ops, resize, run_json, serve, xorshift, zero, Settings};

/// A non-training workload.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Task {
    /// (d) IDX images, shuffle, normalise, batch 256, 2 workers.
    Data,
    /// (e) TorchScript inference latency at batch 1.
    Script,
    /// (f) each fused op against the composition of built-in ops.
    Ops,
    /// (g) checkpoint save and load of a 100M-parameter model.
    Checkpoint,
    /// (h) data-parallel training on two ranks, and the all-reduce alone.
    Ddp,
    /// (i) inference of exported models: latency at batch 1, throughput at batch 64.
    Serve,
    /// (j) JPEG/PNG files decoded and augmented, from class folders and from shards;
    /// the 224 set also as all-PNG and all-WebP folders.
    Images,
    /// (j) the uint8 antialiased bilinear resize alone, one thread, against torchvision's.
    Resize,
    /// (k) a 100M LLaMA-style model: training and generation against transformers.
    Llm,
    /// (k, MoE) a small Qwen3-MoE shape: the same work as (k).
    Moe,
    /// (k, Qwen3-0.6B) the real Qwen3-0.6B shape, at sequence 512.
    Qwen3,
    Finetune,
    /// (m) sharded strategies and activation checkpointing on two ranks.
    Zero,
}

/// (j): batch size and workers, the images per class of the 224 set (of
/// 256x256 images; the 64 set is the shapes set's default 500 per class of 64x64),
/// and ImageNet's normalisation.
const IMAGES_BATCH: usize = 64;
const IMAGES_WORKERS: usize = 2;
const IMAGES_224_PER_CLASS: usize = 200;
/// The other encodings of the 224 set (`images-224-FORMAT`), each image of
/// `images-224` re-encoded: lossless PNG, and lossy WebP at quality 90.
const IMAGES_224_FORMATS: [&str; 2] = ["png", "webp"];
const IMAGE_MEAN: [f64; 3] = [0.485, 0.456, 0.406];
const IMAGE_STD: [f64; 3] = [0.229, 0.224, 0.225];

/// Images in the data-loading workload (MNIST's training set size).
const DATA_IMAGES: usize = 60_000;
const DATA_BATCH: usize = 256;
const DATA_WORKERS: usize = 2;
/// Calls per timed repeat of the batch-1 inference workload.
const SCRIPT_CALLS: usize = 2000;
/// Ten 3162x3162 linear layers with bias: 100,014,060 parameters.
const CKPT_LAYERS: usize = 10;
const CKPT_WIDTH: usize = 3162;

impl Task {
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "data" => Task::Data,
            "script" => Task::Script,
            "ops" => Task::Ops,
            "checkpoint" => Task::Checkpoint,
            "ddp" => Task::Ddp,
            "serve" => Task::Serve,
            "images" => Task::Images,
            "resize" => Task::Resize,
            "llm" => Task::Llm,
            "moe" => Task::Moe,
            "qwen3" => Task::Qwen3,
            "finetune" => Task::Finetune,
            "zero" => Task::Zero,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Task::Data => "data",
            Task::Script => "script",
            Task::Ops => "ops",
            Task::Checkpoint => "checkpoint",
            Task::Ddp => "ddp",
            Task::Serve => "serve",
            Task::Images => "images",
            Task::Resize => "resize",
            Task::Llm => "llm",
            Task::Moe => "moe",
            Task::Qwen3 => "qwen3",
            Task::Finetune => "finetune",
            Task::Zero => "zero",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Task::Data => {
                "(d) data loading: 60000 IDX images 28x28, shuffle, normalise, batch 256, 2 workers"
            }
            Task::Script => {
                "(e) TorchScript inference, batch 1 (the CNN of (b), eval mode, no grad)"
            }
            Task::Ops => {
                "(f) fused ops against the composition of built-in ops, forward + backward"
            }
            Task::Checkpoint => "(g) checkpoint save and load, 100M parameters (float32, 400 MB)",
            Task::Ddp => ddp::DESCRIBE,
            Task::Serve => serve::DESCRIBE,
            Task::Llm => llm::DESCRIBE,
            Task::Moe => llm::MOE_DESCRIBE,
            Task::Qwen3 => llm::QWEN3_DESCRIBE,
            Task::Finetune => finetune::DESCRIBE,
            Task::Zero => zero::DESCRIBE,
            Task::Resize => resize::DESCRIBE,
            Task::Images => {
                "(j) image files: decode (JPEG/PNG/WebP), RandomResizedCrop to 64 or 224, flip, \
                 normalise, batch 64, 2 workers; from class folders and from tar shards"
            }
        }
    }

    pub fn variants(self) -> &'static [&'static str] {
        match self {
            Task::Data => &["kiln-loader", "pytorch-dataloader"],
            Task::Script => &[
                "kiln-script",
                "raw-tch-script",
                "pytorch-script",
                "pytorch-eager",
            ],
            Task::Ops => &ops::VARIANTS,
            Task::Checkpoint => &["kiln-checkpoint", "pytorch-save"],
            Task::Ddp => &ddp::VARIANTS,
            Task::Serve => &serve::VARIANTS,
            Task::Llm | Task::Moe | Task::Qwen3 => &llm::VARIANTS,
            Task::Finetune => &finetune::VARIANTS,
            Task::Zero => &zero::VARIANTS,
            Task::Images => &[
                "kiln-folder-64",
                "kiln-shards-64",
                "pytorch-folder-64",
                "kiln-folder-224",
                "kiln-shards-224",
                "pytorch-folder-224",
                "kiln-folder-224-png",
                "pytorch-folder-224-png",
                "kiln-folder-224-webp",
                "pytorch-folder-224-webp",
            ],
            Task::Resize => &resize::VARIANTS,
        }
    }

    /// Writes the task's inputs into `dir`.
    pub fn prepare(self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        match self {
            Task::Data => write_idx(dir),
            Task::Script => {
                let mut c = python();
                c.args(["--task", "script", "--variant", "export", "--dir"])
                    .arg(dir);
                run_json(c, "exporting the TorchScript model").map(drop)
            }
            Task::Ops | Task::Checkpoint | Task::Zero => Ok(()),
            Task::Ddp => ddp::prepare(dir),
            Task::Serve => serve::prepare(dir),
            Task::Images => write_images(dir),
            Task::Resize => resize::prepare(dir, python()),
            Task::Llm | Task::Moe | Task::Qwen3 => llm::prepare(dir, python(), self.name()),
            Task::Finetune => finetune::prepare(dir, python()),
        }
    }

    /// Runs `variant` in its own process.
    pub fn run(self, variant: &str, dir: &Path, s: &Settings) -> Result<Value> {
        if self == Task::Ddp {
            return ddp::run(variant, dir, s);
        }
        if self == Task::Zero {
            return zero::run(variant, dir, s);
        }
        let mut c = if variant.starts_with("kiln-") || variant.starts_with("raw-tch") {
            let mut c = Command::new(std::env::current_exe()?);
            c.args(["--worker", variant]);
            c
        } else {
            // The ops' library for Python: where the build put it, unless the
            // environment names another copy (a binary carried to another machine).
            let library = std::env::var_os("KILN_FUSED_OPS_LIBRARY")
                .unwrap_or_else(|| kiln::fused_ops::TORCH_LIBRARY.into());
            let mut c = python();
            c.args(["--variant", variant])
                .env("KILN_FUSED_OPS_LIBRARY", library);
            c
        };
        // The resize is timed on one thread, whatever the other tasks get.
        let threads = if self == Task::Resize { 1 } else { s.threads };
        c.args(["--task", self.name(), "--dir"])
            .arg(dir)
            .args(["--warmup", &s.warmup.to_string()])
            .args(["--repeats", &s.repeats.to_string()])
            .args(["--threads", &threads.to_string()])
            .args(["--device", &s.device.to_string()]);
        run_json(c, variant)
    }

    /// The number a round is ranked by (see `run_rounds`).
    pub fn score(self, r: &Value) -> f64 {
        match self {
            Task::Data => num(r, "samples_per_s"),
            Task::Script => num(r, "latency_us"),
            Task::Ops => ["bias_gelu", "softmax_xent", "swish"]
                .iter()
                .map(|op| num(&r["ops_us"], op))
                .sum(),
            Task::Checkpoint => num(r, "save_s") + num(r, "load_s"),
            Task::Ddp => ddp::score(r),
            Task::Serve => num(&r["cnn"], "latency_us") + num(&r["transformer"], "latency_us"),
            Task::Images => num(r, "samples_per_s"),
            Task::Resize => num(r, "images_per_s"),
            Task::Llm | Task::Moe | Task::Qwen3 => {
                num(r, "tokens_per_s") + num(&r["b1"], "tokens_per_s")
            }
            Task::Finetune => num(r, "tokens_per_s"),
            Task::Zero => num(r, "steps_per_s"),
        }
    }

    /// One line of progress for a result.
    pub fn summary(self, r: &Value) -> String {
        match self {
            Task::Data | Task::Images => format!("{:>9.0} samples/s", num(r, "samples_per_s")),
            Task::Llm | Task::Moe | Task::Qwen3 if r.get("b1").is_some() => format!(
                "{:.1} tokens/s at batch 1, {:.1} at batch 8",
                num(&r["b1"], "tokens_per_s"),
                num(&r["b8"], "tokens_per_s")
            ),
            Task::Llm | Task::Moe | Task::Qwen3 | Task::Finetune => {
                format!("{:.0} tokens/s", num(r, "tokens_per_s"))
            }
            Task::Script => format!("{:>9.1} us/call", num(r, "latency_us")),
            Task::Ops => ["bias_gelu", "softmax_xent", "swish"]
                .iter()
                .map(|op| format!("{op} {:.0} us", num(&r["ops_us"], op)))
                .collect::<Vec<_>>()
                .join(", "),
            Task::Checkpoint => format!(
                "save {:.2} s, load {:.2} s",
                num(r, "save_s"),
                num(r, "load_s")
            ),
            Task::Ddp => ddp::summary(r),
            Task::Resize => resize::summary(r),
            Task::Zero => format!(
                "{:.3} steps/s, state {:.0} MiB, peak RSS {:.0} MiB",
                num(r, "steps_per_s"),
                num(r, "state_mb"),
                num(r, "peak_rss_mb")
            ),
            Task::Serve => serve::MODELS
                .iter()
                .map(|(m, _)| {
                    format!(
                        "{m} {:.0} us at 1, {:.0}/s at {}",
                        num(&r[*m], "latency_us"),
                        num(&r[*m], "samples_per_s"),
                        serve::BATCH
                    )
                })
                .collect::<Vec<_>>()
                .join(", "),
        }
    }

    /// The task's table.
    pub fn table(
        self,
        s: &Settings,
        rows: &[(String, std::result::Result<Value, String>)],
    ) -> String {
        let ok = |name: &str| {
            rows.iter()
                .find(|(v, _)| v == name)
                .and_then(|(_, r)| r.as_ref().ok())
        };
        // (k)'s steps take seconds: at most 3 repeats after 1 warm-up.
        let (repeats, warmup) = match self {
            Task::Llm | Task::Moe | Task::Qwen3 | Task::Finetune => {
                (s.repeats.min(3), s.warmup.min(1))
            }
            _ => (s.repeats, s.warmup),
        };
        let threads = if self == Task::Resize { 1 } else { s.threads };
        let mut t = format!(
            "### {}\n\nMedian of {} repeats after {} warm-up, {} threads; the median of {} rounds.\n\n",
            self.describe(),
            repeats,
            warmup,
            threads,
            s.rounds
        );
        let failed = |t: &mut String| {
            for (v, r) in rows {
                if let Err(e) = r {
                    *t += &format!("\n{v} failed: {}\n", e.replace('|', "/"));
                }
            }
        };
        match self {
            Task::Data => {
                let base = ok("pytorch-dataloader").map(|r| num(r, "samples_per_s"));
                t += "One repeat is one epoch (235 batches).\n\n\
                      | variant | samples/s | epoch (s) | peak RSS (MiB) | vs PyTorch DataLoader |\n\
                      | --- | ---: | ---: | ---: | ---: |\n";
                for (v, r) in rows {
                    if let Ok(r) = r {
                        let sps = num(r, "samples_per_s");
                        t += &format!(
                            "| {v} | {sps:.0} | {:.3} | {:.0} | {} |\n",
                            num(r, "median_s"),
                            num(r, "peak_rss_mb"),
                            ratio(sps, base)
                        );
                    }
                }
            }
            Task::Images => {
                t += "One repeat is one epoch: 3,000 images of 64x64 for the 64 crops, 1,200 of \
                      256x256 for the 224 crops, as JPEG (every 7th progressive, every 11th \
                      grayscale) and PNG (every 13th). The `-png` and `-webp` rows read the same \
                      1,200 images re-encoded, every one as PNG (lossless, Pillow's default \
                      compression) or as lossy WebP (quality 90); each Kiln row is compared \
                      with PyTorch on the same files. Memory: Kiln's peak RSS (one process); \
                      PyTorch's peak summed PSS of the main process and its two workers, \
                      sampled every 20 ms. \"Loading\" is the peak less the memory before the \
                      loader was made (libraries and interpreter loaded): what reading, decoding \
                      and augmenting took. Kiln's bench binary maps libtorch and TensorFlow.\n\n\
                      | variant | samples/s | epoch (s) | peak memory (MiB) | loading (MiB) | vs PyTorch on those files |\n\
                      | --- | ---: | ---: | ---: | ---: | ---: |\n";
                for (v, r) in rows {
                    if let Ok(r) = r {
                        // `kiln-shards-224-png` against `pytorch-folder-224-png`.
                        let set = v.splitn(3, '-').nth(2).unwrap_or_default();
                        let base =
                            ok(&format!("pytorch-folder-{set}")).map(|r| num(r, "samples_per_s"));
                        let sps = num(r, "samples_per_s");
                        t += &format!(
                            "| {v} | {sps:.0} | {:.3} | {:.0} | {:.0} | {} |\n",
                            num(r, "median_s"),
                            num(r, "peak_memory_mb"),
                            num(r, "peak_memory_mb") - num(r, "start_memory_mb"),
                            ratio(sps, base)
                        );
                    }
                }
            }
            Task::Script => {
                let base = ok("pytorch-script").map(|r| num(r, "latency_us"));
                t += &format!(
                    "{SCRIPT_CALLS} calls per repeat; latency is the mean per call within a repeat.\n\n\
                     | variant | latency (us) | calls/s | peak RSS (MiB) | vs Python TorchScript |\n\
                     | --- | ---: | ---: | ---: | ---: |\n"
                );
                for (v, r) in rows {
                    if let Ok(r) = r {
                        let us = num(r, "latency_us");
                        t += &format!(
                            "| {v} | {us:.1} | {:.0} | {:.0} | {} |\n",
                            1e6 / us,
                            num(r, "peak_rss_mb"),
                            // Lower latency is better: the ratio is a speed-up.
                            base.map_or("-".to_owned(), |b| format!("{:.2}x", b / us))
                        );
                    }
                }
            }
            Task::Ops => t += &ops::table(ok),
            Task::Resize => t += &resize::table(ok),
            Task::Llm | Task::Moe | Task::Qwen3 => t += &llm::table(ok),
            Task::Finetune => t += &finetune::table(ok),
            // Three tables of its own (`ddp.rs`).
            Task::Ddp => return ddp::table(s, rows),
            Task::Zero => return zero::table(s, rows),
            Task::Serve => {
                t += &format!(
                    "Latency: mean per call at batch 1 ({} calls per repeat for the CNN, {} for \
                     the transformer); throughput: samples/s at batch {} ({} and {} calls per \
                     repeat). The same weights and inputs everywhere; no autograd. The digits \
                     CNN is `examples/configs/digits-cnn.toml`'s ([1, 8, 8] in), the \
                     transformer block is width 256, 8 heads, feed-forward 1024, sequence 64. \
                     Ratios are against PyTorch eager (higher is better for both); `outputs` is \
                     the largest relative difference of the batch-64 outputs' sum from PyTorch's \
                     (every variant computes the same function).\n\n\
                     | variant | CNN latency (us) | CNN samples/s | transformer latency (us) | transformer samples/s | peak RSS (MiB) | CNN latency vs PyTorch | CNN throughput vs PyTorch | transformer latency vs PyTorch | transformer throughput vs PyTorch | outputs |\n\
                     | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
                    serve::calls("cnn").0,
                    serve::calls("transformer").0,
                    serve::BATCH,
                    serve::calls("cnn").1,
                    serve::calls("transformer").1,
                );
                let base = ok("pytorch-eager");
                for (v, r) in rows {
                    if let Ok(r) = r {
                        let (cnn, tr) = (&r["cnn"], &r["transformer"]);
                        let faster = |model: &str, key: &str, lower_is_better: bool| {
                            base.map_or("-".to_owned(), |b| {
                                let (x, y) = (num(&r[model], key), num(&b[model], key));
                                format!("{:.2}x", if lower_is_better { y / x } else { x / y })
                            })
                        };
                        let outputs = base.map_or("-".to_owned(), |b| {
                            let worst = serve::MODELS
                                .iter()
                                .map(|(m, _)| {
                                    let (x, y) = (num(&r[*m], "checksum"), num(&b[*m], "checksum"));
                                    (x - y).abs() / y.abs().max(1.0)
                                })
                                .fold(0.0, f64::max);
                            format!("{worst:.1e}")
                        });
                        t += &format!(
                            "| {v} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {} | {outputs} |\n",
                            num(cnn, "latency_us"),
                            num(cnn, "samples_per_s"),
                            num(tr, "latency_us"),
                            num(tr, "samples_per_s"),
                            num(r, "peak_rss_mb"),
                            faster("cnn", "latency_us", true),
                            faster("cnn", "samples_per_s", false),
                            faster("transformer", "latency_us", true),
                            faster("transformer", "samples_per_s", false),
                        );
                    }
                }
            }
            Task::Checkpoint => {
                let base = ok("pytorch-save");
                t += "Save: the model's state to a file, made durable (fsync); load: the file back \
                      into the model. Kiln writes a safetensors checkpoint atomically (temporary \
                      file, fsync, rename); PyTorch is `torch.save(state_dict)` then fsync, and \
                      `torch.load` + `load_state_dict`.\n\n\
                      | variant | save (s) | save GB/s | load (s) | load GB/s | file (MB) | peak RSS (MiB) | save vs PyTorch | load vs PyTorch |\n\
                      | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
                for (v, r) in rows {
                    if let Ok(r) = r {
                        let gb = num(r, "bytes") / 1e9;
                        let (save, load) = (num(r, "save_s"), num(r, "load_s"));
                        let speedup = |key: &str, x: f64| {
                            base.map_or("-".to_owned(), |b| format!("{:.2}x", num(b, key) / x))
                        };
                        t += &format!(
                            "| {v} | {save:.2} | {:.2} | {load:.2} | {:.2} | {:.0} | {:.0} | {} | {} |\n",
                            gb / save,
                            gb / load,
                            num(r, "file_bytes") / 1e6,
                            num(r, "peak_rss_mb"),
                            speedup("save_s", save),
                            speedup("load_s", load),
                        );
                    }
                }
                if let Some(k) = ok("kiln-checkpoint") {
                    t += &format!(
                        "\nKiln saves as its trainer does, reading the parameters where libtorch \
                         keeps them (`state_tensors`), with no host copy first; of its load, \
                         {:.2} s is reading the file into host tensors, the rest \
                         `load_state_dict`.\n",
                        num(k, "read_s")
                    );
                }
            }
        }
        failed(&mut t);
        t
    }
}

/// Waits for the GPU's queued work, so that a timed run ends when its work does.
pub(crate) fn synchronize(device: Device) {
    if let Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
    }
}

fn ratio(x: f64, base: Option<f64>) -> String {
    base.map_or("-".to_owned(), |b| format!("{:.2}x", x / b))
}

fn python() -> Command {
    let mut c = crate::python_interpreter();
    c.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/python/bench_tasks.py"));
    c
}

/// MNIST-shaped IDX files with deterministic pixels and labels.
fn write_idx(dir: &Path) -> Result<()> {
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
    let mut images = Vec::with_capacity(16 + DATA_IMAGES * 784);
    images.extend_from_slice(&[0, 0, 0x08, 3]);
    for d in [DATA_IMAGES, 28, 28] {
        images.extend_from_slice(&(d as u32).to_be_bytes());
    }
    images.extend((0..DATA_IMAGES * 784).map(|_| (next() >> 56) as u8));
    let mut labels = Vec::with_capacity(8 + DATA_IMAGES);
    labels.extend_from_slice(&[0, 0, 0x08, 1]);
    labels.extend_from_slice(&(DATA_IMAGES as u32).to_be_bytes());
    labels.extend((0..DATA_IMAGES).map(|_| (next() % 10) as u8));
    std::fs::write(dir.join("train-images-idx3-ubyte"), images)?;
    std::fs::write(dir.join("train-labels-idx1-ubyte"), labels)?;
    Ok(())
}

/// Arguments of a task worker.
pub struct TaskArgs {
    pub(crate) dir: PathBuf,
    pub(crate) warmup: usize,
    pub(crate) repeats: usize,
    pub(crate) threads: usize,
    pub(crate) device: Device,
    /// (i) only: the models to run (`--models transformer`, for a profile of
    /// one model); every model when not given.
    pub(crate) models: Option<Vec<String>>,
}

impl TaskArgs {
    pub fn parse(flags: &std::collections::BTreeMap<String, String>) -> Result<Self> {
        let get = |k: &str| flags.get(k).with_context(|| format!("--{k} is required"));
        Ok(TaskArgs {
            dir: PathBuf::from(get("dir")?),
            warmup: get("warmup")?.parse()?,
            repeats: get("repeats")?.parse()?,
            threads: get("threads")?.parse()?,
            device: device_flag(flags)?,
            models: flags
                .get("models")
                .map(|m| m.split(',').map(str::to_owned).collect()),
        })
    }
}

/// Runs a Kiln variant of `task` in this process and returns its result.
pub fn worker(task: Task, variant: &str, a: &TaskArgs) -> Result<Value> {
    tch::set_num_threads(a.threads as i32);
    let mut result = match (task, variant) {
        (Task::Data, "kiln-loader") => data(a)?,
        (Task::Images, "kiln-folder-64") => images(a, "64", false)?,
        (Task::Images, "kiln-shards-64") => images(a, "64", true)?,
        (Task::Images, "kiln-folder-224") => images(a, "224", false)?,
        (Task::Images, "kiln-shards-224") => images(a, "224", true)?,
        (Task::Images, "kiln-folder-224-png") => images(a, "224-png", false)?,
        (Task::Images, "kiln-folder-224-webp") => images(a, "224-webp", false)?,
        (Task::Resize, variant) if variant.starts_with("kiln-") => resize::worker(variant, a)?,
        (Task::Script, "kiln-script") => script(a)?,
        (Task::Script, "raw-tch-script") => raw_tch_script(a)?,
        (Task::Ops, "kiln-fused") => ops::run(a, ops::Kernels::Cpp)?,
        (Task::Ops, "kiln-rust") => ops::run(a, ops::Kernels::Rust)?,
        (Task::Ops, "kiln-composed") => ops::run(a, ops::Kernels::Composed)?,
        (Task::Checkpoint, "kiln-checkpoint") => checkpoint(a)?,
        (Task::Serve, variant) if variant.starts_with("kiln-") => serve::worker(variant, a)?,
        (Task::Llm | Task::Moe | Task::Qwen3, variant) if variant.starts_with("kiln-") => {
            llm::worker(variant, a)?
        }
        (Task::Finetune, variant) if variant.starts_with("kiln-") => finetune::worker(variant, a)?,
        _ => bail!(
            "{variant} is not a Rust variant of the {} workload",
            task.name()
        ),
    };
    result["variant"] = json!(variant);
    result["task"] = json!(task.name());
    result["threads"] = json!(a.threads);
    result["device"] = json!(a.device.to_string());
    result["peak_rss_mb"] = json!(peak_rss_mb());
    Ok(result)
}

/// (d): Kiln's prefetching loader with two workers over the IDX images.
fn data(a: &TaskArgs) -> Result<Value> {
    let images = kiln::data::load_mnist_images(&a.dir.join("train-images-idx3-ubyte"))?;
    let labels = kiln::data::load_mnist_labels(&a.dir.join("train-labels-idx1-ubyte"))?;
    let n = images.dims()[0];
    let images = images.reshape([n, 1, 28, 28])?;
    let transform = Compose::new().then(ToFloat).then(Normalize {
        mean: vec![0.1307],
        std: vec![0.3081],
    });
    let dataset = TransformedDataset::new(InMemoryDataset::new(images, labels)?, transform, 0);
    let loader = PrefetchLoader::new(dataset, DATA_BATCH)?
        .shuffle(0)
        .num_workers(DATA_WORKERS);
    let (times, checksum) = time_epochs(a, &loader, n, |_| Ok(()))?;
    let m = median(times.clone());
    Ok(json!({
        "repeats_s": times, "median_s": m, "samples_per_s": n as f64 / m, "checksum": checksum,
    }))
}

/// Times whole epochs of `loader`, each of which must give `n` samples, every
/// batch passing `check`: the times, and a checksum that keeps the work observable.
fn time_epochs(
    a: &TaskArgs,
    loader: &dyn DataLoader,
    n: usize,
    check: impl Fn(&kiln::data::Batch) -> Result<()>,
) -> Result<(Vec<f64>, f64)> {
    let mut epoch = 0;
    let mut checksum = 0.0f64;
    let times = timed(a.warmup, a.repeats, || {
        let mut seen = 0;
        for batch in loader.batches(epoch) {
            let batch = batch?;
            check(&batch)?;
            seen += batch.inputs.dims()[0];
            checksum += f64::from(batch.inputs.as_slice::<f32>()?[0]);
        }
        ensure!(seen == n, "an epoch gave {seen} samples, not {n}");
        epoch += 1;
        Ok(())
    })?;
    Ok((times, checksum))
}

/// (j): Kiln's `ImageFolder` or `WebDataset` with torchvision's transforms,
/// decoded and augmented by the loader's two workers, on the set `images-{set}`
/// (`64`, `224`, or `224-FORMAT`: the crop size first). Memory is this
/// process's peak RSS (one process; PyTorch's is its processes' summed PSS).
fn images(a: &TaskArgs, set: &str, shards: bool) -> Result<Value> {
    use kiln::vision::transforms::RandomResizedCrop;
    use kiln::vision::{ImageFolder, RandomHorizontalFlip, WebDataset};

    let size: usize = set
        .split('-')
        .next()
        .unwrap_or_default()
        .parse()
        .with_context(|| format!("the image set {set} names no crop size"))?;
    let start_mb = rss_mb();
    let root = a.dir.join(format!("images-{set}"));
    let transform = || {
        Compose::new()
            .then(RandomResizedCrop::new(size, size))
            .then(RandomHorizontalFlip::default())
            .then(ToFloat)
            .then(Normalize {
                mean: IMAGE_MEAN.to_vec(),
                std: IMAGE_STD.to_vec(),
            })
    };
    let (loader, n): (Box<dyn DataLoader>, usize) = if shards {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(root.join("shards"))?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<_>>()?;
        paths.retain(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("train-") && n.ends_with(".tar"))
        });
        paths.sort();
        let shards = WebDataset::open(&paths)?;
        let order = shards.epoch_order(0, 1000, 0, 1)?;
        let n = shards.len();
        let loader = PrefetchLoader::new(
            TransformedDataset::new(shards, transform(), 0),
            IMAGES_BATCH,
        )?
        .order(order)
        .num_workers(IMAGES_WORKERS);
        (Box::new(loader), n)
    } else {
        let folder = ImageFolder::new(root.join("train"))?;
        let n = folder.len();
        let loader = PrefetchLoader::new(
            TransformedDataset::new(folder, transform(), 0),
            IMAGES_BATCH,
        )?
        .shuffle(0)
        .num_workers(IMAGES_WORKERS);
        (Box::new(loader), n)
    };
    let (times, checksum) = time_epochs(a, loader.as_ref(), n, |batch| {
        ensure!(
            batch.inputs.dims()[1..] == [3, size, size],
            "a batch of shape {:?}",
            batch.inputs.dims()
        );
        Ok(())
    })?;
    let m = median(times.clone());
    Ok(json!({
        "repeats_s": times, "median_s": m, "samples_per_s": n as f64 / m, "images": n,
        "peak_memory_mb": peak_rss_mb(), "start_memory_mb": start_mb, "checksum": checksum,
    }))
}

/// (j): the shapes set twice, as class folders and shards: 64x64 images for the
/// 64 crops, 256x256 ones for the 224 crops (`examples/images/make_shapes.py`);
/// then the 224 set's folder re-encoded as PNG and as WebP (`bench_tasks.py`).
fn write_images(dir: &Path) -> Result<()> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/images/make_shapes.py");
    for (size, image_size, per_class) in [(64, 64, 500), (224, 256, IMAGES_224_PER_CLASS)] {
        let out = dir.join(format!("images-{size}"));
        if out.join("train").exists() {
            continue;
        }
        let _ = std::fs::remove_dir_all(&out);
        let status = crate::python_interpreter()
            .arg(&script)
            .arg(&out)
            .args(["--size", &image_size.to_string()])
            .args(["--train-per-class", &per_class.to_string()])
            .args(["--val-per-class", "1", "--shard-size", "500"])
            .status()
            .context("running make_shapes.py")?;
        ensure!(
            status.success(),
            "make_shapes.py failed for {}",
            out.display()
        );
    }
    for format in IMAGES_224_FORMATS {
        if dir.join(format!("images-224-{format}/train")).exists() {
            continue;
        }
        let mut c = python();
        c.args(["--task", "images", "--variant", &format!("encode-{format}")])
            .arg("--dir")
            .arg(dir);
        run_json(c, &format!("re-encoding the 224 set as {format}"))?;
    }
    Ok(())
}

/// (e): Kiln's `ScriptModule` on one image at a time.
fn script(a: &TaskArgs) -> Result<Value> {
    let mut model = ScriptModule::load(a.dir.join("cnn.pt"), a.device)?;
    model.eval();
    batch_one_latency(a, |x| Ok(model.forward(x)?))
}

/// (e) without Kiln: `tch::CModule` directly.
fn raw_tch_script(a: &TaskArgs) -> Result<Value> {
    let mut model =
        tch::CModule::load_on_device(a.dir.join("cnn.pt"), kiln::torch::device_to_tch(a.device)?)?;
    model.f_set_eval()?;
    batch_one_latency(a, |x| Ok(model.forward_ts(&[x])?))
}

/// Mean latency of `forward` on one 28x28 image, without autograd.
fn batch_one_latency(a: &TaskArgs, forward: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Value> {
    let x = Tensor::f_randn(
        [1, 1, 28, 28],
        (Kind::Float, kiln::torch::device_to_tch(a.device)?),
    )?;
    let times = tch::no_grad(|| {
        timed(a.warmup, a.repeats, || {
            for _ in 0..SCRIPT_CALLS {
                let y = forward(&x)?;
                ensure!(y.size() == [1, 10], "the model returned {:?}", y.size());
            }
            synchronize(a.device);
            Ok(())
        })
    })?;
    let m = median(times.clone());
    Ok(json!({
        "repeats_s": times, "median_s": m, "latency_us": m / SCRIPT_CALLS as f64 * 1e6,
    }))
}

/// (g): a 100M-parameter model's checkpoint written and read back.
fn checkpoint(a: &TaskArgs) -> Result<Value> {
    TorchBackend::manual_seed(0);
    let spec = Layer::sequential(
        (0..CKPT_LAYERS).map(|_| LinearConfig::new(CKPT_WIDTH, CKPT_WIDTH).into()),
    );
    let mut model = TorchBackend::build_model(&spec, Device::Cpu)?;
    let params = model.num_parameters()?;
    let path = a.dir.join("kiln.ckpt");
    // As the trainer saves: the model's own tensors, read in place by the writer.
    let save = timed(a.warmup, a.repeats, || {
        let checkpoint = Checkpoint {
            model: model.state_tensors()?,
            optimizer: StateTensors::new(),
            step: 0,
            epoch: 0,
            batch_in_epoch: 0,
            seed: 0,
            world_size: 1,
            backend: "torch".into(),
            optimizer_kind: None,
            model_definition: Some(spec.clone()),
            lora: None,
            data: None,
            data_order: None,
            scheduler: None,
            metrics: Default::default(),
            epoch_loss: None,
            epoch_metrics: Default::default(),
            averaged: None,
            callbacks: Default::default(),
        };
        Ok(checkpoint.save(&path)?)
    })?;
    let file_bytes = std::fs::metadata(&path)?.len();
    let mut read_s = Vec::new();
    let load = timed(a.warmup, a.repeats, || {
        let start = Instant::now();
        let loaded = Checkpoint::load(&path)?;
        read_s.push(start.elapsed().as_secs_f64());
        model.load_state_dict(&loaded.model)?;
        Ok(())
    })?;
    std::fs::remove_file(&path)?;
    Ok(json!({
        "parameters": params,
        "bytes": params * 4,
        "file_bytes": file_bytes,
        "save_repeats_s": save,
        "load_repeats_s": load,
        "save_s": median(save),
        "read_s": median(read_s),
        "load_s": median(load),
    }))
}
