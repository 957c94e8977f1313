//! Workload (k): a LLaMA-style model of about 100M parameters in the Hugging
//! Face format, loaded by `kiln-hf` and by `transformers` from the same
//! directory. Training: AdamW steps on batches of 2 sequences of 256 tokens
//! (next-token cross-entropy over every position) in float32 and in bfloat16
//! (parameters and activations, `model.to(torch.bfloat16)` on the Python side),
//! against the `transformers` model class in PyTorch eager. Generation: 128 new
//! tokens after 16-token prompts, greedy, with a key/value cache, at batch 1
//! and 8, against `transformers`' `generate`.

use std::path::Path;

use anyhow::Result;
use kiln::core::backend::StepPlan;
use kiln::core::generation::GenerationConfig;
use kiln::core::lora::LoraConfig;
use kiln::core::loss::Loss;
use kiln::core::optim::{AdamWConfig, Optimizer, OptimizerConfig};
use kiln::hf::Pretrained;
use kiln::prelude::*;
use kiln::torch::{generate, TorchBackend, TorchModel};
use serde_json::{json, Value};

use crate::tasks::TaskArgs;
use crate::worker::{median, timed};

pub const DESCRIBE: &str = "(k) a LLaMA-style model, 101M parameters (hidden 768, 12 layers, 12 \
     heads, 4 key/value heads, SwiGLU 2048, vocabulary 32000, tied), from a Hugging Face \
     directory: training at sequence 256 and generation of 128 tokens";

pub const MOE_DESCRIBE: &str = "(k, MoE) a Qwen3-MoE-shaped mixture of experts, 139M parameters, \
     51M active (hidden 512, 8 layers, 8 heads over 2 key/value heads, 32 experts of 256 with 4 \
     per token, renormalised, vocabulary 32000), from a Hugging Face directory: the work of (k)";

pub const QWEN3_DESCRIBE: &str = "(k, Qwen3-0.6B) the Qwen3-0.6B shape with random weights, \
     596M parameters (28 layers, hidden 1024, 16 heads over 8 key/value heads of 128, SwiGLU \
     3072, vocabulary 151936, tied), from a Hugging Face directory: training at sequence 512 and \
     generation of 128 tokens";

pub const VARIANTS: [&str; 6] = [
    "kiln-train-f32",
    "pytorch-train-f32",
    "kiln-train-bf16",
    "pytorch-train-bf16",
    "kiln-generate",
    "transformers-generate",
];

/// Sequences per training batch, tokens per sequence (the Python side's
/// token file decides; these are (k)'s).
pub const BATCH: usize = 2;
pub const SEQ: usize = 256;
/// New tokens per generation, and the batch sizes generated at.
pub const NEW_TOKENS: usize = 128;
pub const GENERATE_BATCHES: [usize; 2] = [1, 8];

/// Runs a Kiln variant: training steps or generations, timed.
pub fn worker(variant: &str, a: &TaskArgs) -> Result<Value> {
    let pretrained = Pretrained::open(a.dir.join("model"))?;
    let (io, _) = StateDict::load_safetensors(a.dir.join("tokens.safetensors"))?;
    let get = |name: &str| {
        io.get(name)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("tokens.safetensors has no `{name}`"))
    };
    match variant {
        "kiln-generate" => {
            let mut model = TorchModel::new(pretrained.layer(), a.device)?;
            model.load_state_dict(&pretrained.load_weights()?)?;
            model.set_mode(Mode::Eval);
            let prompts = get("prompts")?;
            let width = prompts.dims()[1];
            let rows: Vec<Vec<i64>> = prompts
                .as_slice::<i64>()?
                .chunks(width)
                .map(<[i64]>::to_vec)
                .collect();
            let config = GenerationConfig::greedy(NEW_TOKENS);
            let mut out = json!({});
            for batch in GENERATE_BATCHES {
                let mut tokens = Vec::new();
                let times = timed(a.warmup.min(1), a.repeats.min(3), || {
                    tokens = generate(&model, &rows[..batch], &config)?;
                    Ok(())
                })?;
                let m = median(times.clone());
                out[format!("b{batch}")] = json!({
                    "repeats_s": times,
                    "tokens_per_s": (batch * NEW_TOKENS) as f64 / m,
                    "first_row": tokens[0],
                });
            }
            Ok(out)
        }
        "kiln-train-f32" | "kiln-train-bf16" => train(a, variant.ends_with("bf16"), None),
        other => anyhow::bail!("{other} is not a Kiln variant of (k)"),
    }
}

/// AdamW steps of the model (in bfloat16 when `bf16`, with `lora`'s adapters
/// and the rest frozen when given) on the task's 2 x 256 tokens, timed; (l)
/// runs it too.
pub fn train(a: &TaskArgs, bf16: bool, lora: Option<&LoraConfig>) -> Result<Value> {
    let pretrained = Pretrained::open(a.dir.join("model"))?;
    let (io, _) = StateDict::load_safetensors(a.dir.join("tokens.safetensors"))?;
    let ids = io
        .get("train")
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("tokens.safetensors has no `train`"))?;
    let Layer::Sequential { mut layers } = pretrained.layer().clone() else {
        anyhow::bail!("the model is a sequential");
    };
    layers.push(Layer::Flatten {
        start_dim: 0,
        end_dim: 1,
    });
    TorchBackend::manual_seed(0);
    let mut model = TorchModel::new(&Layer::sequential(layers), a.device)?;
    model.load_state_dict(&pretrained.load_weights()?)?;
    if let Some(lora) = lora {
        model.add_lora(lora)?;
    }
    if bf16 {
        model.to_dtype(DType::BF16)?;
    }
    let mut optimizer =
        model.build_optimizer(&OptimizerConfig::AdamW(AdamWConfig::new(1e-4)), &[])?;
    // [batch, seq + 1] tokens: (k)'s 2 x 257, the Qwen3-0.6B row's 2 x 513.
    let (batch, seq) = match *ids.dims() {
        [batch, width] if width > 1 => (batch, width - 1),
        _ => anyhow::bail!("train tokens {:?}: expected [batch, seq + 1]", ids.dims()),
    };
    let all = ids.as_slice::<i64>()?;
    let inputs: Vec<i64> = all
        .chunks(seq + 1)
        .flat_map(|r| r[..seq].to_vec())
        .collect();
    let targets: Vec<i64> = all.chunks(seq + 1).flat_map(|r| r[1..].to_vec()).collect();
    let x = TorchBackend::from_host(&HostTensor::new(inputs, [batch, seq])?, a.device)?;
    let y = TorchBackend::from_host(&HostTensor::new(targets, [batch * seq])?, a.device)?;
    let loss_fn = Loss::cross_entropy();
    let plan = StepPlan {
        loss: &loss_fn,
        scale: 1.0,
        apply: true,
        clip: None,
    };
    let mut losses = Vec::new();
    let times = timed(a.warmup.min(1), a.repeats.min(3), || {
        optimizer.zero_grad()?;
        losses.push(model.train_step(&mut optimizer, &x, &y, &plan)?);
        Ok(())
    })?;
    let m = median(times.clone());
    Ok(json!({
        "repeats_s": times,
        "steps_per_s": 1.0 / m,
        "tokens_per_s": (batch * seq) as f64 / m,
        "batch": batch,
        "seq": seq,
        "losses": losses,
        "parameters": pretrained.layer().num_parameters()?,
        "trainable": model.num_trainable_parameters()?,
    }))
}

/// The table of (k).
pub fn table<'a>(ok: impl Fn(&str) -> Option<&'a Value>) -> String {
    let num = |r: &Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    // The batch the rows trained on (every task's default is (k)'s).
    let (batch, seq) = ok("kiln-train-bf16")
        .or_else(|| ok("pytorch-train-bf16"))
        .map_or((BATCH as f64, SEQ as f64), |r| {
            (num(r, "batch"), num(r, "seq"))
        });
    let mut t = format!(
        "Training: one AdamW step (lr 1e-4) per repeat on {batch} x {seq} tokens, loss over every \
         position; bf16 is parameters, gradients and optimizer state in bfloat16 on both sides. \
         Generation: {NEW_TOKENS} new tokens after 16-token prompts, greedy, cached keys and \
         values; tokens/s counts new tokens over all rows. `same tokens` compares the first \
         row's generated ids with transformers'.\n\n\
         | variant | tokens/s | steps/s | peak RSS (MiB) | vs PyTorch eager | loss after the steps |\n\
         | --- | ---: | ---: | ---: | ---: | ---: |\n"
    );
    for dtype in ["f32", "bf16"] {
        let base = ok(&format!("pytorch-train-{dtype}")).map(|r| num(r, "tokens_per_s"));
        for v in [
            format!("kiln-train-{dtype}"),
            format!("pytorch-train-{dtype}"),
        ] {
            if let Some(r) = ok(&v) {
                let tps = num(r, "tokens_per_s");
                let last = r["losses"]
                    .as_array()
                    .and_then(|l| l.last())
                    .and_then(Value::as_f64)
                    .unwrap_or(f64::NAN);
                t += &format!(
                    "| {v} | {tps:.0} | {:.3} | {:.0} | {} | {last:.4} |\n",
                    num(r, "steps_per_s"),
                    num(r, "peak_rss_mb"),
                    base.map_or("-".to_owned(), |b| format!("{:.2}x", tps / b)),
                );
            }
        }
    }
    t += "\n| variant | batch | new tokens/s | peak RSS (MiB) | vs transformers.generate | same tokens |\n\
          | --- | ---: | ---: | ---: | ---: | --- |\n";
    let base = ok("transformers-generate");
    for v in ["kiln-generate", "transformers-generate"] {
        let Some(r) = ok(v) else { continue };
        for batch in GENERATE_BATCHES {
            let key = format!("b{batch}");
            let tps = num(&r[&key], "tokens_per_s");
            let (ratio, same) = match base {
                Some(b) => (
                    format!("{:.2}x", tps / num(&b[&key], "tokens_per_s")),
                    if r[&key]["first_row"] == b[&key]["first_row"] {
                        "yes"
                    } else {
                        "no"
                    },
                ),
                None => ("-".to_owned(), "-"),
            };
            t += &format!(
                "| {v} | {batch} | {tps:.1} | {:.0} | {ratio} | {same} |\n",
                num(r, "peak_rss_mb")
            );
        }
    }
    t
}

/// The model directory and token file of `task` (`llm`, `moe`), made by the
/// Python side.
pub fn prepare(dir: &Path, mut python: std::process::Command, task: &str) -> Result<()> {
    python
        .args(["--task", task, "--variant", "prepare", "--dir"])
        .arg(dir);
    crate::run_json(python, "making the model directory").map(drop)
}
