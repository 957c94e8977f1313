//! Fine-tuning a Hugging Face checkpoint as a language model, then generating
//! text with it.
//!
//! ```text
//! .kiln/venv/bin/python examples/pretrained/make_tiny_llama.py models/tiny-llama
//! cargo xtask run --release --example pretrained_lm -- models/tiny-llama runs/tiny-llama
//! ```
//!
//! The model directory is what `save_pretrained` writes (`config.json`,
//! `model.safetensors`, `tokenizer.json`); the script makes a tiny LLaMA with
//! random weights and a text to learn (`train.txt`). The example tokenizes the
//! text with the directory's tokenizer, trains next-token prediction on windows
//! of it (the logits `[N, T, V]` flattened to `[N·T, V]` for the loss, as
//! nanoGPT does), writes the fine-tuned weights back in the Hugging Face
//! format (`OUT_DIR/model`, which `from_pretrained` reads), and ends with text
//! generated greedily and by sampling, with a key/value cache.

use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use kiln::core::generation::{Decoding, GenerationConfig};
use kiln::core::optim::AdamWConfig;
use kiln::core::rng::epoch_order;
use kiln::hf::{Pretrained, TextTokenizer};
use kiln::prelude::*;
use kiln::torch::{generate, TorchBackend, TorchModel};
use kiln::train::{CsvSink, LogSink, RunDirectory, RunStart};

/// Tokens per training window.
const BLOCK: usize = 32;

/// Windows of a token sequence with their next tokens as targets.
struct Windows {
    tokens: Vec<i64>,
    batch: usize,
    seed: Option<u64>,
}

impl Windows {
    fn count(&self) -> usize {
        self.tokens.len() - BLOCK
    }
}

impl DataLoader for Windows {
    fn num_batches(&self) -> usize {
        self.count().div_ceil(self.batch)
    }

    fn batches(&self, epoch: u64) -> Box<dyn Iterator<Item = kiln::Result<Batch>> + Send + '_> {
        let order = epoch_order(self.count(), self.seed, epoch);
        let batches: Vec<Vec<usize>> = order.chunks(self.batch).map(<[_]>::to_vec).collect();
        Box::new(batches.into_iter().map(move |starts| {
            let inputs: Vec<i64> = starts
                .iter()
                .flat_map(|&s| self.tokens[s..s + BLOCK].to_vec())
                .collect();
            let targets: Vec<i64> = starts
                .iter()
                .flat_map(|&s| self.tokens[s + 1..s + 1 + BLOCK].to_vec())
                .collect();
            let n = starts.len();
            Ok(Batch {
                inputs: HostTensor::new(inputs, [n, BLOCK])?,
                targets: HostTensor::new(targets, [n * BLOCK])?,
            })
        }))
    }
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (model_dir, out, epochs) = match args.as_slice() {
        [m, o] => (PathBuf::from(m), PathBuf::from(o), 2),
        [m, o, flag, n] if flag == "--epochs" => (PathBuf::from(m), PathBuf::from(o), n.parse()?),
        _ => bail!("usage: pretrained_lm MODEL_DIR OUT_DIR [--epochs N]"),
    };
    let done = run(&model_dir, &out, epochs)?;
    println!(
        "validation loss: {:.3} before, {:.3} after fine-tuning",
        done.loss_before, done.loss_after
    );
    for (what, text) in &done.texts {
        println!("{what}: {text}");
    }
    Ok(())
}

/// What [`run`] gives back.
pub struct Finetuned {
    /// Validation loss (nats per token) of the checkpoint as loaded.
    pub loss_before: f64,
    /// The same after fine-tuning.
    pub loss_after: f64,
    /// `("greedy", text)` and `("sampled", text)`, each the prompt and its continuation.
    pub texts: Vec<(&'static str, String)>,
    /// The fine-tuned weights, under Kiln's names.
    pub weights: StateDict,
}

/// Fine-tunes the model in `model_dir` on its `train.txt` for `epochs` into the
/// new directory `out` (`steps.csv`, `epochs.csv`, the model in the Hugging
/// Face format under `model/`, `greedy.txt` and `sampled.txt`).
pub fn run(model_dir: &Path, out: &Path, epochs: u64) -> Result<Finetuned> {
    if out.exists() && std::fs::read_dir(out)?.next().is_some() {
        bail!(
            "{} is not empty: choose a new or empty directory (the example never writes over files)",
            out.display()
        );
    }
    let pretrained = Pretrained::open(model_dir)?;
    let tokenizer = TextTokenizer::open(model_dir)?;
    let text = std::fs::read_to_string(model_dir.join("train.txt")).with_context(|| {
        format!(
            "{}: the text to learn (make_tiny_llama.py writes it)",
            model_dir.display()
        )
    })?;
    let tokens = tokenizer.encode(&text)?;
    ensure!(
        tokens.len() > 4 * BLOCK,
        "train.txt holds {} tokens: too few",
        tokens.len()
    );
    let split = tokens.len() * 9 / 10;
    let train = Windows {
        tokens: tokens[..split].to_vec(),
        batch: 16,
        seed: Some(0),
    };
    let val = Windows {
        tokens: tokens[split..].to_vec(),
        batch: 64,
        seed: None,
    };
    println!(
        "{} model from {}: {} tokens of text, {} training windows of {BLOCK}",
        pretrained.family(),
        model_dir.display(),
        tokens.len(),
        train.count()
    );

    // The checkpoint's model, its logits flattened for the loss.
    let Layer::Sequential { layers } = pretrained.layer().clone() else {
        bail!("a pretrained model is a sequential of layers");
    };
    let mut training = layers;
    training.push(Layer::Flatten {
        start_dim: 0,
        end_dim: 1,
    });
    let mut model = TorchModel::new(&Layer::sequential(training), Device::Cpu)?;
    model.load_state_dict(&pretrained.load_weights()?)?;
    println!("model: {} parameters", model.num_parameters()?);

    let run_dir = RunDirectory::acquire(out, RunStart::New)?;
    let optimizer = model.build_optimizer(&OptimizerConfig::AdamW(AdamWConfig::new(2e-3)), &[])?;
    let mut state = TrainingState::<TorchBackend>::new(model, optimizer, None);
    let config = TrainerConfig {
        epochs,
        seed: 0,
        ..TrainerConfig::default()
    };
    let mut trainer = Trainer::<TorchBackend>::new(config, Loss::cross_entropy())?
        .with_sink(CsvSink::new(run_dir.path())?)
        .with_sink(LogSink::every(20)?);
    let before = trainer.evaluate(&mut state.model, &val)?;
    trainer.fit(&mut state, &train, Some(&val))?;
    let after = trainer.evaluate(&mut state.model, &val)?;
    let loss = |m: &[(String, f64)]| {
        m.iter()
            .find(|(n, _)| n == "loss")
            .map_or(f64::NAN, |(_, v)| *v)
    };

    let weights = state.model.state_dict()?;
    let saved = out.join("model");
    pretrained.save(&weights, &saved)?;
    println!(
        "wrote the fine-tuned model to {} (transformers' from_pretrained reads it)",
        saved.display()
    );

    // Generation runs the checkpoint's own definition with the new weights.
    let mut lm = TorchModel::new(pretrained.layer(), Device::Cpu)?;
    lm.load_state_dict(&weights)?;
    lm.set_mode(Mode::Eval);
    let prompt = "The little fox";
    let ids = tokenizer.encode(prompt)?;
    let eos = pretrained.eos_token_ids()?;
    let mut texts = Vec::new();
    for (what, decoding) in [
        ("greedy", Decoding::Greedy),
        (
            "sampled",
            Decoding::Sample {
                temperature: 0.8,
                top_k: Some(40),
                top_p: Some(0.95),
            },
        ),
    ] {
        let config = GenerationConfig::greedy(24)
            .with_decoding(decoding)
            .with_stop_tokens(eos.clone())
            .with_seed(1);
        let new = generate(&lm, std::slice::from_ref(&ids), &config)?;
        let text = format!("{prompt}{}", tokenizer.decode(&new[0])?);
        std::fs::write(out.join(format!("{what}.txt")), &text)?;
        texts.push((what, text));
    }
    Ok(Finetuned {
        loss_before: loss(&before),
        loss_after: loss(&after),
        texts,
        weights,
    })
}
