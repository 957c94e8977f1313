//! A training loop written by hand, without the `Trainer`, generic over the
//! backend: the same function trains on libtorch and on TensorFlow.
//!
//! ```text
//! cargo run --release --example manual_loop -- [--backend torch|tensorflow]
//!     [--epochs N] [--seed S] [--device cpu|cuda:0] [--data PATH] [--save PATH]
//! ```
//!
//! It is the loop a PyTorch user writes:
//!
//! ```text
//! for epoch in range(epochs):
//!     model.train()
//!     for x, y in loader:
//!         optimizer.zero_grad(); loss = loss_fn(model(x), y); loss.backward(); optimizer.step()
//!     scheduler.step()
//!     model.eval(); evaluate...
//! ```
//!
//! written against [`TrainBackend`]: the model is built from a [`Layer`]
//! definition by the backend, `Trainable::train_step` runs forward, loss,
//! backward and the optimizer step (on TensorFlow as one compiled program),
//! `Trainable::eval_step` gives the loss and the logits without gradients,
//! and the learning-rate schedule is stepped by hand after each epoch. The
//! accuracy is counted by hand from the logits. `--save` writes the trained
//! weights as safetensors with PyTorch's state-dict names (Python:
//! `model.load_state_dict(safetensors.torch.load_file(path))`), and refuses a
//! path that exists.

use std::fs::OpenOptions;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use kiln::core::{
    backend::StepPlan, model::LinearConfig, optim::AdamWConfig, schedule::CosineAnnealingLrConfig,
};
use kiln::data::load_digits;
use kiln::prelude::*;

/// What to train, from the command line.
#[derive(Clone, Debug)]
pub struct Options {
    /// The digits file (`.kiln/data/digits.csv.gz`, from `cargo xtask setup`).
    pub data: PathBuf,
    /// Passes over the training rows.
    pub epochs: u64,
    /// Seeds the initial weights, dropout, the split and the shuffling.
    pub seed: u64,
    /// Where the model trains (TensorFlow: CPU only).
    pub device: Device,
    /// Where to write the trained weights (safetensors); must not exist.
    pub save: Option<PathBuf>,
}

/// What one run reports after its last epoch.
#[derive(Clone, Debug)]
pub struct Report {
    /// The mean training loss of each epoch.
    pub train_losses: Vec<f64>,
    /// The loss on the held-out rows after the last epoch.
    pub val_loss: f64,
    /// The share of held-out rows classified correctly after the last epoch.
    pub val_accuracy: f64,
}

const USAGE: &str = "flags: --backend torch|tensorflow --epochs N --seed S \
                     --device cpu|cuda:N --data PATH --save PATH";

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let mut backend = String::from("torch");
    let mut options = Options {
        data: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".kiln/data/digits.csv.gz"),
        epochs: 10,
        seed: 0,
        device: Device::Cpu,
        save: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--backend" => backend = value()?,
            "--epochs" => options.epochs = value()?.parse().context("--epochs: a whole number")?,
            "--seed" => options.seed = value()?.parse().context("--seed: a whole number")?,
            "--device" => options.device = value()?.parse()?,
            "--data" => options.data = PathBuf::from(value()?),
            "--save" => options.save = Some(PathBuf::from(value()?)),
            other => bail!("unknown flag {other}; {USAGE}"),
        }
    }
    // One function, monomorphised for the backend the flag names.
    let report = match backend.as_str() {
        "torch" => train::<kiln::torch::TorchBackend>(&options)?,
        "tensorflow" | "tf" => train::<kiln::tf::TfBackend>(&options)?,
        other => bail!("--backend {other}: expected torch or tensorflow"),
    };
    println!(
        "done: validation loss {:.4}, accuracy {:.2}%",
        report.val_loss,
        100.0 * report.val_accuracy
    );
    Ok(())
}

/// The network: a multilayer perceptron over the 64 pixels, with dropout
/// (active in training mode only). Its state-dict names are PyTorch's for
/// `nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))`:
/// `0.weight`, `0.bias`, `3.weight`, `3.bias`.
pub fn definition() -> Layer {
    Layer::sequential([
        LinearConfig::new(64, 128).into(),
        Layer::Relu,
        Layer::Dropout { p: 0.2 },
        LinearConfig::new(128, 10).into(),
    ])
}

/// The digits as `[N, 64]` pixels scaled to 0..1 and `[N]` labels, split into
/// training and held-out rows (a fifth) by `seed`.
pub fn digits(
    path: &Path,
    seed: u64,
) -> Result<((HostTensor, HostTensor), (HostTensor, HostTensor))> {
    let (pixels, labels) = load_digits(path).with_context(|| {
        format!(
            "loading the digits from {} (run `cargo xtask setup` to provision them)",
            path.display()
        )
    })?;
    let scaled: Vec<f32> = pixels.as_slice::<f32>()?.iter().map(|p| p / 16.0).collect();
    let pixels = HostTensor::new(scaled, pixels.dims().to_vec())?;
    Ok(train_test_split(&pixels, &labels, 0.2, seed)?)
}

/// Trains [`definition`] on the digits with backend `B`, printing one line per
/// epoch, and writes the weights to `options.save` if given.
pub fn train<B: TrainBackend>(options: &Options) -> Result<Report> {
    // Refuse an existing output before spending time on training.
    if let Some(path) = &options.save {
        if path.exists() {
            bail!("{} exists; choose a new file for --save", path.display());
        }
    }
    B::manual_seed(options.seed); // initial weights and dropout: torch.manual_seed
    let ((train_x, train_y), (val_x, val_y)) = digits(&options.data, options.seed)?;
    let train_loader =
        SequentialLoader::new(InMemoryDataset::new(train_x, train_y)?, 64)?.shuffle(options.seed);
    let val_loader = SequentialLoader::new(InMemoryDataset::new(val_x, val_y)?, 256)?;

    let mut model = B::build_model(&definition(), options.device)?;
    let mut optimizer = model.build_optimizer(
        &OptimizerConfig::AdamW(AdamWConfig::new(1e-2).with_weight_decay(1e-2)),
        &[],
    )?;
    // torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs, eta_min=1e-5)
    let mut scheduler = SchedulerConfig::CosineAnnealingLr(CosineAnnealingLrConfig {
        t_max: options.epochs,
        eta_min: 1e-5,
    })
    .build(&optimizer.learning_rates())?;
    let loss_fn = Loss::cross_entropy();
    // One micro-batch that applies: no gradient accumulation, no clipping.
    let plan = StepPlan {
        loss: &loss_fn,
        scale: 1.0,
        apply: true,
        clip: None,
    };
    println!(
        "{} backend: {} parameters, {} training batches per epoch",
        B::NAME,
        model.num_parameters()?,
        train_loader.num_batches()
    );

    let mut report = Report {
        train_losses: Vec::new(),
        val_loss: f64::NAN,
        val_accuracy: f64::NAN,
    };
    let start = Instant::now();
    for epoch in 0..options.epochs {
        model.set_mode(Mode::Train); // model.train()
        let (mut total, mut batches) = (0.0, 0usize);
        for batch in train_loader.batches(epoch) {
            let batch = batch?;
            let x = B::from_host(&batch.inputs, options.device)?;
            let y = B::from_host(&batch.targets, options.device)?;
            optimizer.zero_grad()?;
            // forward, loss, backward, optimizer.step(); returns loss.item()
            let loss = model.train_step(&mut optimizer, &x, &y, &plan)?;
            if !loss.is_finite() {
                bail!("epoch {}: the training loss is {loss}", epoch + 1);
            }
            total += loss;
            batches += 1;
        }
        let lr = optimizer.learning_rate();
        optimizer.set_learning_rates(&scheduler.step()?)?; // scheduler.step()

        model.set_mode(Mode::Eval); // model.eval()
        let (mut val_loss, mut correct, mut seen) = (0.0, 0usize, 0usize);
        for batch in val_loader.batches(0) {
            let batch = batch?;
            let x = B::from_host(&batch.inputs, options.device)?;
            let y = B::from_host(&batch.targets, options.device)?;
            let (loss, logits) = model.eval_step(&loss_fn, &x, &y)?; // under no_grad
            let rows = batch.targets.numel();
            val_loss += loss * rows as f64; // the loss is the batch's mean
            correct += count_correct(&logits, &batch.targets)?;
            seen += rows;
        }
        report.train_losses.push(total / batches as f64);
        report.val_loss = val_loss / seen as f64;
        report.val_accuracy = correct as f64 / seen as f64;
        println!(
            "epoch {:>2}: lr {lr:.5}, train loss {:.4}, val loss {:.4}, val accuracy {:.2}% ({:.1}s)",
            epoch + 1,
            total / batches as f64,
            report.val_loss,
            100.0 * report.val_accuracy,
            start.elapsed().as_secs_f64()
        );
    }

    if let Some(path) = &options.save {
        save_new(&model.state_dict()?, path)?;
        println!("saved the weights to {}", path.display());
    }
    Ok(report)
}

/// `(logits.argmax(1) == targets).sum()` for `[N, C]` float logits and `[N]`
/// integer class indices.
pub fn count_correct(logits: &HostTensor, targets: &HostTensor) -> Result<usize> {
    let classes = logits.dims()[1];
    let targets = targets.as_slice::<i64>()?;
    let correct = logits
        .as_slice::<f32>()?
        .chunks(classes)
        .zip(targets)
        .filter(|(row, &target)| {
            let best = row
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(class, _)| class);
            best == usize::try_from(target).ok()
        })
        .count();
    Ok(correct)
}

/// Writes `weights` to `path` as safetensors, refusing a path that exists: the
/// name is claimed first (`create_new`), so a file that appeared since the check
/// at the start is not written over either.
fn save_new(weights: &StateDict, path: &Path) -> Result<()> {
    match OpenOptions::new().write(true).create_new(true).open(path) {
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            bail!("{} exists; choose a new file for --save", path.display())
        }
        Err(e) => return Err(e).with_context(|| format!("creating {}", path.display())),
    }
    let metadata = [("format".to_owned(), "pt".to_owned())].into();
    if let Err(e) = weights.save_safetensors(path, &metadata) {
        let _ = std::fs::remove_file(path); // the empty file this function created
        return Err(e).with_context(|| format!("writing {}", path.display()));
    }
    Ok(())
}
