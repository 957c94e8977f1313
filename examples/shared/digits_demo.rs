//! The digits demo both op examples end with (examples/custom-op and
//! examples/rust-op include this file with `#[path]`): the command line, the UCI
//! handwritten digits, and training a model definition with Kiln's `Trainer` and
//! Adam on libtorch or TensorFlow. Each example's `main.rs` only says which ops
//! the model uses.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use kiln_core::{
    backend::{TrainBackend, Trainable},
    loss::Loss,
    model::Layer,
    optim::{AdamConfig, OptimizerConfig},
    Device, HostTensor,
};
use kiln_data::{load_digits, train_test_split, InMemoryDataset, SequentialLoader};
use kiln_tf::TfBackend;
use kiln_torch::TorchBackend;
use kiln_train::{Accuracy, Trainer, TrainerConfig, TrainingState};

const EPOCHS: u64 = 30;
const BATCH_SIZE: usize = 64;
const LEARNING_RATE: f64 = 1e-3;

/// Features `[N, 64]` (float32 in `[0, 1]`) and labels `[N]` (int64).
type Split = (HostTensor, HostTensor);

/// Installs the logger and reads `[--backend torch|tensorflow]`: the backend's
/// name (`torch` by default).
pub fn start(program: &str) -> Result<&'static str> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_target(false)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    Ok(
        match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
            [] | ["--backend", "torch"] => "torch",
            ["--backend", "tensorflow"] => "tensorflow",
            _ => bail!("usage: {program} [--backend torch|tensorflow]"),
        },
    )
}

/// Trains `spec` (inputs `[N, 64]`, 10 classes) on 80% of the digits on
/// `backend` and returns its accuracy on the other 20%.
pub fn train(backend: &str, spec: &Layer) -> Result<f64> {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.kiln/data/digits.csv.gz");
    let (pixels, labels) = load_digits(&data)
        .context("the digits come with the project virtualenv: run `cargo xtask setup`")?;
    let pixels = pixels.to_dtype(kiln_core::DType::F32);
    let scaled: Vec<f32> = pixels.as_slice::<f32>()?.iter().map(|v| v / 16.0).collect();
    let pixels = HostTensor::new(scaled, pixels.shape().clone())?;
    let split = train_test_split(&pixels, &labels, 0.2, 0)?;
    match backend {
        "torch" => fit::<TorchBackend>(spec, split),
        _ => fit::<TfBackend>(spec, split),
    }
}

/// Trains `spec` with Adam and returns the held-out accuracy.
fn fit<B: TrainBackend>(
    spec: &Layer,
    ((train_x, train_y), (test_x, test_y)): (Split, Split),
) -> Result<f64> {
    B::manual_seed(0);
    let model = B::build_model(spec, Device::Cpu)?;
    let optimizer =
        model.build_optimizer(&OptimizerConfig::Adam(AdamConfig::new(LEARNING_RATE)), &[])?;
    let mut state = TrainingState::new(model, optimizer, None);
    let train =
        SequentialLoader::new(InMemoryDataset::new(train_x, train_y)?, BATCH_SIZE)?.shuffle(0);
    let test = SequentialLoader::new(InMemoryDataset::new(test_x, test_y)?, 256)?;
    let config = TrainerConfig {
        epochs: EPOCHS,
        ..TrainerConfig::default()
    };
    let mut trainer =
        Trainer::<B>::new(config, Loss::cross_entropy())?.with_metric(|| Box::new(Accuracy::new()));
    trainer.fit(&mut state, &train, Some(&test))?;
    let metrics = trainer.evaluate(&mut state.model, &test)?;
    metrics
        .iter()
        .find_map(|(name, value)| (name == "accuracy").then_some(*value))
        .context("the trainer reports accuracy")
}
