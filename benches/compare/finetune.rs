//! Workload (l): fine-tuning the LLaMA-style model of (k) with LoRA, against
//! full fine-tuning and against PEFT on the same model, step time and peak
//! memory; and the text pipeline (read JSON Lines, tokenize, pack into blocks
//! of 256, batch 8 with 2 workers) against `datasets.map` + a PyTorch
//! `DataLoader` on the same file with the same `tokenizer.json`.

use std::path::Path;

use anyhow::Result;
use kiln::core::lora::LoraConfig;
use kiln::data::PrefetchLoader;
use kiln::hf::TextTokenizer;
use kiln::prelude::*;
use kiln::text::{PackedText, PadCollate, TextDataset, TextOptions, TextTask};
use serde_json::{json, Value};

use crate::llm::{BATCH, SEQ};
use crate::tasks::TaskArgs;
use crate::worker::{median, timed};

pub const DESCRIBE: &str = "(l) fine-tuning (k)'s 101M LLaMA: LoRA (r 16, alpha 32, on q, k, \
     v, o, gate, up and down projections) against full fine-tuning and against PEFT, AdamW steps \
     on 2 x 256 tokens; and text to batches: JSON Lines tokenized (byte-level BPE), packed into \
     blocks of 256, shuffled, batch 8, 2 workers";

pub const VARIANTS: [&str; 6] = [
    "kiln-full",
    "pytorch-full",
    "kiln-lora",
    "peft-lora",
    "kiln-text",
    "python-text",
];

/// The text pipeline's block and batch.
pub const BLOCK: usize = 256;
pub const TEXT_BATCH: usize = 8;

/// The adapters both LoRA variants train.
pub fn lora() -> LoraConfig {
    LoraConfig::new(16, 32.0).with_target_modules([
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ])
}

/// Runs a Kiln variant.
pub fn worker(variant: &str, a: &TaskArgs) -> Result<Value> {
    match variant {
        "kiln-text" => text(a),
        "kiln-full" => crate::llm::train(a, false, None),
        "kiln-lora" => crate::llm::train(a, false, Some(&lora())),
        other => anyhow::bail!("{other} is not a Kiln variant of (l)"),
    }
}

fn text(a: &TaskArgs) -> Result<Value> {
    let tokenizer = std::sync::Arc::new(TextTokenizer::open(a.dir.join("text"))?);
    let mut tokens = 0usize;
    let mut batches = 0usize;
    let times = timed(0, a.repeats.min(3), || {
        let data = TextDataset::open(
            a.dir.join("text/corpus.jsonl"),
            TextTask::LanguageModel {
                text: "text".into(),
            },
            TextOptions {
                max_length: None,
                truncation: false,
                eos_token: Some(2),
            },
            tokenizer.clone(),
        )?;
        let packed = PackedText::new(data, BLOCK, 2)?;
        let loader = PrefetchLoader::with_collate(packed, TEXT_BATCH, PadCollate::new(0))?
            .num_workers(2)
            .shuffle(0);
        (tokens, batches) = (0, 0);
        for batch in loader.batches(0) {
            tokens += batch?.inputs.numel();
            batches += 1;
        }
        Ok(())
    })?;
    let m = median(times.clone());
    Ok(json!({
        "repeats_s": times,
        "tokens_per_s": tokens as f64 / m,
        "tokens": tokens,
        "batches": batches,
    }))
}

/// The table of (l).
pub fn table<'a>(ok: impl Fn(&str) -> Option<&'a Value>) -> String {
    let num = |r: &Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let mut t = format!(
        "Training: one AdamW step (lr 1e-4) per repeat on {BATCH} x {SEQ} tokens in float32; \
         peak RSS is the whole process (the model's 101M float32 parameters are 386 MiB). \
         `vs` compares with the same method in Python (PyTorch + transformers, PEFT 0.21).\n\n\
         | variant | trainable parameters | tokens/s | peak RSS (MiB) | vs Python |\n\
         | --- | ---: | ---: | ---: | ---: |\n"
    );
    for (v, base) in [
        ("kiln-full", "pytorch-full"),
        ("pytorch-full", "pytorch-full"),
        ("kiln-lora", "peft-lora"),
        ("peft-lora", "peft-lora"),
    ] {
        if let Some(r) = ok(v) {
            let tps = num(r, "tokens_per_s");
            t += &format!(
                "| {v} | {:.0} | {tps:.0} | {:.0} | {} |\n",
                num(r, "trainable"),
                num(r, "peak_rss_mb"),
                ok(base).map_or("-".to_owned(), |b| format!(
                    "{:.2}x",
                    tps / num(b, "tokens_per_s")
                )),
            );
        }
    }
    t += "\nText to batches: one pass over the file per repeat (read, tokenize, pack, shuffle, \
          batch), `datasets` with its cache off.\n\n\
          | variant | tokens | batches | tokens/s | peak RSS (MiB) | vs datasets + DataLoader |\n\
          | --- | ---: | ---: | ---: | ---: | ---: |\n";
    let base = ok("python-text").map(|b| num(b, "tokens_per_s"));
    for v in ["kiln-text", "python-text"] {
        if let Some(r) = ok(v) {
            let tps = num(r, "tokens_per_s");
            t += &format!(
                "| {v} | {:.0} | {:.0} | {tps:.0} | {:.0} | {} |\n",
                num(r, "tokens"),
                num(r, "batches"),
                num(r, "peak_rss_mb"),
                base.map_or("-".to_owned(), |b| format!("{:.2}x", tps / b)),
            );
        }
    }
    t
}

/// The model directory, tokens, corpus and tokenizer, made by the Python side.
pub fn prepare(dir: &Path, mut python: std::process::Command) -> Result<()> {
    python
        .args(["--task", "finetune", "--variant", "prepare", "--dir"])
        .arg(dir);
    crate::run_json(
        python,
        "making the LLaMA model directory and the text corpus",
    )
    .map(drop)
}
