//! A character-level GPT, after Karpathy's nanoGPT: a small decoder-only
//! transformer learns to continue a text one character at a time, then writes
//! some of its own.
//!
//! ```text
//! cargo xtask run --release --example char_lm -- OUT_DIR [--text FILE] [--epochs N]
//!     [--seed S] [--device cpu|cuda:0] [--prompt TEXT] [--length N] [--temperature T]
//! ```
//!
//! OUT_DIR must be new or empty. The example writes its training text there
//! (`input.txt`: about 12 KB of short sentences from a small grammar, made from
//! the seed; `--text FILE` trains on your own UTF-8 file instead, copied there),
//! trains, and writes `model.safetensors` (PyTorch's state-dict names),
//! `epochs.csv`, `steps.csv` and `sample.txt`. It prints the validation loss,
//! its perplexity, and two losses to compare it with: a uniform guess (ln V)
//! and the best guess that ignores the context (the entropy of the validation
//! characters).
//!
//! The pieces, as in nanoGPT:
//!
//! * a vocabulary of the text's characters; every `block` consecutive
//!   characters of the first 90% of the text are a training window, whose
//!   targets are the same characters shifted by one (the last 10% validates);
//! * token and learned position embeddings: Kiln has no position-embedding
//!   layer, so each character goes in as `[one-hot char ‖ one-hot position]`
//!   and a `Linear(V + block, E)` maps it to `wte[char] + wpe[position] + bias`,
//!   nanoGPT's sum as one matrix product;
//! * pre-norm transformer blocks with causal self-attention
//!   ([`Layer::transformer_encoder_block`] with `causal = true`), a final layer
//!   norm and a linear head to `V` logits per position;
//! * the loss at every position, nanoGPT's
//!   `cross_entropy(logits.view(-1, V), targets.view(-1))`: the model's last
//!   layer flattens `[N, T, V]` to `[N·T, V]`, and the loader gives the targets
//!   as `[N·T]`;
//! * sampling: the logits of the last position for the last `block`
//!   characters, divided by the temperature, softmax, one draw from a seeded
//!   generator, appended; repeated.
//!
//! The model is trained by the [`Trainer`] and the code is generic over the
//! backend: `main` trains on libtorch ([`TorchBackend`]); `train::<TfBackend>`
//! runs the same code on TensorFlow (its test does).

use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use kiln::core::{
    model::{LayerNormConfig, LinearConfig},
    optim::AdamWConfig,
    rng::{epoch_order, SplitMix64},
    schedule::CosineAnnealingLrConfig,
};
use kiln::prelude::*;
use kiln::train::{CsvSink, LogSink, RunDirectory, RunStart, ScheduleInterval};

/// The model's and the run's sizes.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Context length: characters the model sees at once.
    pub block: usize,
    /// Width of the residual stream.
    pub embed: usize,
    /// Attention heads per block (must divide `embed`).
    pub heads: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Dropout in the blocks while training.
    pub dropout: f64,
    /// Training windows per optimizer step.
    pub batch: usize,
    /// Passes over the training windows.
    pub epochs: u64,
    /// Peak learning rate (AdamW; cosine decay to a tenth of it, per step).
    pub lr: f64,
    /// Seed of the generated text, the initial weights, the window order and dropout.
    pub seed: u64,
    /// Where the model trains.
    pub device: Device,
}

impl Default for Settings {
    /// The sizes of a release run: about 100k parameters, about a minute on
    /// two CPU cores.
    fn default() -> Self {
        Settings {
            block: 32,
            embed: 64,
            heads: 4,
            layers: 2,
            dropout: 0.0,
            batch: 32,
            epochs: 2,
            lr: 3e-3,
            seed: 0,
            device: Device::Cpu,
        }
    }
}

/// Characters of text the example generates for itself.
pub const TEXT_CHARS: usize = 12_000;

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let mut settings = Settings::default();
    let (mut out, mut text_file) = (None::<PathBuf>, None::<PathBuf>);
    let (mut prompt, mut length, mut temperature) = (None::<String>, 400usize, 0.8f64);
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--text" => text_file = Some(PathBuf::from(value()?)),
            "--epochs" => settings.epochs = value()?.parse().context("--epochs: a whole number")?,
            "--seed" => settings.seed = value()?.parse().context("--seed: a whole number")?,
            "--device" => settings.device = value()?.parse()?,
            "--prompt" => prompt = Some(value()?),
            "--length" => length = value()?.parse().context("--length: a whole number")?,
            "--temperature" => temperature = value()?.parse().context("--temperature: a number")?,
            flag if flag.starts_with("--") => bail!(
                "unknown flag {flag}; usage: char_lm OUT_DIR [--text FILE] [--epochs N] \
                 [--seed S] [--device cpu|cuda:N] [--prompt TEXT] [--length N] \
                 [--temperature T]"
            ),
            dir if out.is_none() => out = Some(PathBuf::from(dir)),
            extra => bail!("one OUT_DIR only; unexpected {extra:?}"),
        }
    }
    let out = out.context("usage: char_lm OUT_DIR [flags]: OUT_DIR is a new or empty directory")?;
    let text = match &text_file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading {} (a UTF-8 text file)", path.display()))?,
        None => story(settings.seed, TEXT_CHARS),
    };

    let trained = train::<TorchBackend>(&text, &out, &settings)?;
    let v = trained.vocab.len();
    println!(
        "validation: loss {:.4} nats/char (perplexity {:.2}), next-char accuracy {:.1}%",
        trained.val_loss,
        trained.val_loss.exp(),
        100.0 * trained.val_accuracy
    );
    println!(
        "to compare: a uniform guess over the {v} characters costs ln {v} = {:.4}; the best \
         guess that ignores the context, {:.4}",
        (v as f64).ln(),
        trained.val_unigram_entropy
    );
    let weights = out.join("model.safetensors");
    trained
        .model
        .state_dict()?
        .save_safetensors(&weights, &Default::default())?;

    // A prompt in the text's characters: "The " if it can be, else the text's start.
    let prompt = prompt.unwrap_or_else(|| {
        let the = "The ";
        if trained.vocab.encode(the).is_ok() {
            the.to_owned()
        } else {
            text.chars().take(1).collect()
        }
    });
    let sample = trained.sample(&prompt, length, temperature, settings.seed)?;
    std::fs::write(out.join("sample.txt"), format!("{prompt}{sample}"))?;
    println!(
        "sample (temperature {temperature}, seed {}):\n{prompt}{sample}",
        settings.seed
    );
    println!(
        "wrote {} and sample.txt in {}",
        weights.display(),
        out.display()
    );
    Ok(())
}

/// Text from a small grammar: `chars` characters (or a few more: whole lines)
/// of short sentences, the same for the same `seed`.
pub fn story(seed: u64, chars: usize) -> String {
    const NAMES: [&str; 6] = ["anna", "ben", "clara", "david", "emma", "felix"];
    const ANIMALS: [&str; 8] = ["cat", "dog", "fox", "owl", "horse", "duck", "mouse", "bear"];
    const ADJECTIVES: [&str; 8] = [
        "little", "old", "brown", "quiet", "happy", "sleepy", "clever", "big",
    ];
    const PLACES: [&str; 6] = ["garden", "river", "forest", "barn", "hill", "market"];
    const SEES: [&str; 6] = ["sees", "follows", "finds", "watches", "feeds", "calls"];
    const SEE: [&str; 6] = ["see", "follow", "find", "watch", "feed", "call"];
    const RESTS: [&str; 6] = ["sleeps", "sings", "runs", "waits", "dances", "rests"];
    const NEAR: [&str; 4] = ["near", "by", "in", "behind"];
    const WHEN: [&str; 4] = ["morning", "evening", "day", "night"];

    fn pick(rng: &mut SplitMix64, list: &[&'static str]) -> &'static str {
        list[rng.below(list.len() as u64) as usize]
    }
    let mut rng = SplitMix64::new(seed);
    let r = &mut rng;
    let mut text = String::with_capacity(chars + 200);
    let mut line = 0;
    while text.len() < chars {
        for _ in 0..1 + line % 3 {
            let sentence = match r.below(5) {
                0 => format!(
                    "{} {} the {} {}.",
                    title(pick(r, &NAMES)),
                    pick(r, &SEES),
                    pick(r, &ADJECTIVES),
                    pick(r, &ANIMALS)
                ),
                1 => format!(
                    "The {} {} {} {} the {}.",
                    pick(r, &ADJECTIVES),
                    pick(r, &ANIMALS),
                    pick(r, &RESTS),
                    pick(r, &NEAR),
                    pick(r, &PLACES)
                ),
                2 => format!(
                    "Every {}, {} walks to the {}.",
                    pick(r, &WHEN),
                    title(pick(r, &NAMES)),
                    pick(r, &PLACES)
                ),
                3 => format!(
                    "Where is the {}? It {} {} the {}.",
                    pick(r, &ANIMALS),
                    pick(r, &RESTS),
                    pick(r, &NEAR),
                    pick(r, &PLACES)
                ),
                _ => format!(
                    "{} and {} {} the {}.",
                    title(pick(r, &NAMES)),
                    title(pick(r, &NAMES)),
                    pick(r, &SEE),
                    pick(r, &ANIMALS)
                ),
            };
            if !text.is_empty() && !text.ends_with('\n') {
                text.push(' ');
            }
            text.push_str(&sentence);
        }
        text.push('\n');
        line += 1;
    }
    text
}

fn title(word: &str) -> String {
    let mut chars = word.chars();
    chars
        .next()
        .map(|first| first.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

/// The characters of a text, sorted: character `i` is token `i`.
#[derive(Clone, Debug, PartialEq)]
pub struct Vocab {
    chars: Vec<char>,
}

impl Vocab {
    /// The distinct characters of `text`.
    pub fn new(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        Vocab { chars }
    }

    /// Number of characters, `V`.
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The tokens of `text`; an error names a character that is not in the vocabulary.
    pub fn encode(&self, text: &str) -> Result<Vec<usize>> {
        text.chars()
            .map(|c| {
                self.chars.binary_search(&c).map_err(|_| {
                    anyhow::anyhow!("{c:?} is not one of the training text's characters")
                })
            })
            .collect()
    }

    /// The text of `tokens` (each below `len()`).
    pub fn decode(&self, tokens: &[usize]) -> String {
        tokens.iter().map(|&t| self.chars[t]).collect()
    }
}

/// The network on `[N, T, V + block]` inputs (one-hot characters and
/// positions, see [`encode`]), with logits `[N·T, V]` out.
pub fn definition(vocab: usize, s: &Settings) -> Layer {
    let mut layers = vec![LinearConfig::new(vocab + s.block, s.embed).into()];
    for _ in 0..s.layers {
        layers.push(Layer::transformer_encoder_block(
            s.embed,
            s.heads,
            4 * s.embed,
            true,
            s.dropout,
        ));
    }
    layers.extend([
        LayerNormConfig::new([s.embed]).into(),
        LinearConfig::new(s.embed, vocab).into(),
        // [N, T, V] -> [N·T, V], one row per position, as the loss wants.
        Layer::Flatten {
            start_dim: 0,
            end_dim: 1,
        },
    ]);
    Layer::sequential(layers)
}

/// The model's input for `windows` (each of at most `block` tokens, all of
/// one length): `[N, T, V + block]`, row `t` of a window one-hot at its
/// token and at `V + t`.
pub fn encode(windows: &[&[usize]], vocab: usize, block: usize) -> Result<HostTensor> {
    let t = windows.first().map_or(0, |w| w.len());
    ensure!(
        windows.iter().all(|w| w.len() == t) && (1..=block).contains(&t),
        "windows of one length between 1 and {block}"
    );
    let width = vocab + block;
    let mut x = vec![0f32; windows.len() * t * width];
    for (w, window) in windows.iter().enumerate() {
        for (pos, &token) in window.iter().enumerate() {
            let row = (w * t + pos) * width;
            x[row + token] = 1.0;
            x[row + vocab + pos] = 1.0;
        }
    }
    Ok(HostTensor::new(x, [windows.len(), t, width])?)
}

/// Every `block`-character window of `tokens` (stride 1), in batches: inputs
/// `[N, block, V + block]`, targets (the next characters) flattened to
/// `[N·block]`, shuffled every epoch when a seed is given.
pub struct WindowLoader {
    tokens: Vec<usize>,
    vocab: usize,
    block: usize,
    batch: usize,
    seed: Option<u64>,
}

impl WindowLoader {
    /// The windows of `tokens`, which must hold more than `block` tokens.
    pub fn new(
        tokens: Vec<usize>,
        vocab: usize,
        block: usize,
        batch: usize,
        seed: Option<u64>,
    ) -> Result<Self> {
        ensure!(
            tokens.len() > block && batch > 0,
            "{} tokens do not make one window of {block} and its targets",
            tokens.len()
        );
        Ok(WindowLoader {
            tokens,
            vocab,
            block,
            batch,
            seed,
        })
    }

    fn windows(&self) -> usize {
        self.tokens.len() - self.block
    }

    fn batch_at(&self, starts: &[usize]) -> kiln::Result<Batch> {
        let inputs: Vec<&[usize]> = starts
            .iter()
            .map(|&s| &self.tokens[s..s + self.block])
            .collect();
        let targets: Vec<i64> = starts
            .iter()
            .flat_map(|&s| &self.tokens[s + 1..s + 1 + self.block])
            .map(|&t| t as i64)
            .collect();
        let n = targets.len();
        Ok(Batch {
            inputs: encode(&inputs, self.vocab, self.block)
                .map_err(|e| kiln::Error::invalid_argument("windows", e.to_string()))?,
            targets: HostTensor::new(targets, [n])?,
        })
    }
}

impl DataLoader for WindowLoader {
    fn num_batches(&self) -> usize {
        self.windows().div_ceil(self.batch)
    }

    fn batches(&self, epoch: u64) -> Box<dyn Iterator<Item = kiln::Result<Batch>> + Send + '_> {
        let order = epoch_order(self.windows(), self.seed, epoch);
        let batches: Vec<Vec<usize>> = order.chunks(self.batch).map(<[_]>::to_vec).collect();
        Box::new(
            batches
                .into_iter()
                .map(move |starts| self.batch_at(&starts)),
        )
    }
}

/// A trained model with what it needs to predict.
pub struct Trained<B: TrainBackend> {
    /// The model, in eval mode.
    pub model: B::Model,
    /// Its characters.
    pub vocab: Vocab,
    /// Its context length.
    pub block: usize,
    /// Where it lives.
    pub device: Device,
    /// Mean cross-entropy per validation character, in nats.
    pub val_loss: f64,
    /// How often the most likely next character is right on validation.
    pub val_accuracy: f64,
    /// The entropy of the validation targets' character frequencies: the
    /// lowest loss a model that ignores the context can reach there.
    pub val_unigram_entropy: f64,
}

/// Trains a model on `text` into the new run directory `out` (refused unless
/// absent or empty): `input.txt`, `epochs.csv`, `steps.csv`.
pub fn train<B: TrainBackend>(text: &str, out: &Path, s: &Settings) -> Result<Trained<B>> {
    if out.exists() && std::fs::read_dir(out)?.next().is_some() {
        bail!(
            "{} is not empty: choose a new or empty directory (the example never writes \
             over files)",
            out.display()
        );
    }
    let run_dir = RunDirectory::acquire(out, RunStart::New)?;
    std::fs::write(run_dir.path().join("input.txt"), text)?;

    let vocab = Vocab::new(text);
    let tokens = vocab.encode(text)?;
    let split = tokens.len() * 9 / 10;
    let (train_tokens, val_tokens) = (tokens[..split].to_vec(), tokens[split..].to_vec());
    let v = vocab.len();
    let train = WindowLoader::new(train_tokens, v, s.block, s.batch, Some(s.seed))?;
    let val = WindowLoader::new(val_tokens.clone(), v, s.block, 256, None)?;
    println!(
        "text: {} characters, {v} distinct; {} training windows of {} and {} validation windows",
        tokens.len(),
        train.windows(),
        s.block,
        val.windows()
    );

    B::manual_seed(s.seed);
    let model = B::build_model(&definition(v, s), s.device)?;
    println!("model: {} parameters", model.num_parameters()?);
    let optimizer = model.build_optimizer(
        &OptimizerConfig::AdamW(AdamWConfig::new(s.lr).with_weight_decay(0.01)),
        &[],
    )?;
    let steps = s.epochs * train.num_batches() as u64;
    let schedule = SchedulerConfig::CosineAnnealingLr(CosineAnnealingLrConfig {
        t_max: steps,
        eta_min: s.lr / 10.0,
    })
    .build(&optimizer.learning_rates())?;
    let mut state = TrainingState::<B>::new(model, optimizer, Some(schedule));
    let config = TrainerConfig {
        epochs: s.epochs,
        seed: s.seed,
        device: s.device,
        schedule_interval: ScheduleInterval::Step,
        clip: Some(GradClip::Norm {
            max_norm: 1.0,
            norm_type: 2.0,
        }),
        ..TrainerConfig::default()
    };
    let mut trainer = Trainer::<B>::new(config, Loss::cross_entropy())?
        .with_metric(|| Box::new(Accuracy::new()))
        .with_sink(CsvSink::new(run_dir.path())?)
        .with_sink(LogSink::every(50)?);
    trainer.fit(&mut state, &train, Some(&val))?;

    let metric = |metrics: &[(String, f64)], name: &str| {
        metrics
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, value)| *value)
            .with_context(|| format!("the trainer reports {name}"))
    };
    let metrics = trainer.evaluate(&mut state.model, &val)?;
    state.model.set_mode(Mode::Eval);
    Ok(Trained {
        val_loss: metric(&metrics, "loss")?,
        val_accuracy: metric(&metrics, "accuracy")?,
        val_unigram_entropy: unigram_entropy(&val, v),
        model: state.model,
        vocab,
        block: s.block,
        device: s.device,
    })
}

/// The entropy (nats) of the character frequencies of `loader`'s targets.
fn unigram_entropy(loader: &WindowLoader, vocab: usize) -> f64 {
    let mut counts = vec![0usize; vocab];
    for start in 0..loader.windows() {
        for &t in &loader.tokens[start + 1..start + 1 + loader.block] {
            counts[t] += 1;
        }
    }
    let total: usize = counts.iter().sum();
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / total as f64;
            -p * p.ln()
        })
        .sum()
}

impl<B: TrainBackend> Trained<B> {
    /// The logits `[t][V]` for `context` (1 to `block` tokens): row `i`
    /// predicts the token after `context[..=i]`.
    pub fn logits(&self, context: &[usize]) -> Result<Vec<Vec<f32>>> {
        let x = encode(&[context], self.vocab.len(), self.block)?;
        let logits = self.model.predict_step(&B::from_host(&x, self.device)?)?;
        let logits = logits.to_dtype(DType::F32);
        Ok(logits
            .as_slice::<f32>()?
            .chunks(self.vocab.len())
            .map(<[f32]>::to_vec)
            .collect())
    }

    /// `length` characters after `prompt`, drawn one at a time from the
    /// model's distribution at `temperature` (> 0; lower is more conservative)
    /// given the last `block` characters, with a generator seeded by `seed`.
    pub fn sample(
        &self,
        prompt: &str,
        length: usize,
        temperature: f64,
        seed: u64,
    ) -> Result<String> {
        ensure!(
            temperature > 0.0,
            "the temperature must be positive, got {temperature}"
        );
        let mut tokens = self.vocab.encode(prompt)?;
        ensure!(
            !tokens.is_empty(),
            "the prompt must have at least one character"
        );
        let mut rng = SplitMix64::new(seed);
        let mut new = Vec::with_capacity(length);
        for _ in 0..length {
            let context = &tokens[tokens.len().saturating_sub(self.block)..];
            let logits = self.logits(context)?;
            let last = logits.last().context("logits for the last position")?;
            let max = last.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let weights: Vec<f64> = last
                .iter()
                .map(|&l| ((f64::from(l) - f64::from(max)) / temperature).exp())
                .collect();
            let mut u = rng.uniform() * weights.iter().sum::<f64>();
            let mut next = weights.len() - 1;
            for (i, w) in weights.iter().enumerate() {
                if u < *w {
                    next = i;
                    break;
                }
                u -= w;
            }
            tokens.push(next);
            new.push(next);
        }
        Ok(self.vocab.decode(&new))
    }
}
