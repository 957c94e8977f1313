//! Kiln's main job at this stage: train a small network on the UCI handwritten digits
//! (1797 8x8 images, shipped inside scikit-learn's wheel) through Kiln's torch
//! backend, and print the held-out accuracy.
//!
//! ```text
//! cargo xtask run --release --example digits -- [--model cnn|transformer|mlp]
//!     [--epochs N] [--seed S] [--device cpu|cuda:0] [--data PATH] [--save PATH]
//! ```
//!
//! The model is a Kiln [`Layer`] definition built on libtorch; the optimizer (AdamW),
//! the schedule (cosine annealing) and the loss are Kiln's.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use kiln::core::{
    loss::Loss,
    model::{BatchNormConfig, Conv2dConfig, Layer, LayerNormConfig, LinearConfig, Pool2dConfig},
    optim::{AdamWConfig, OptimizerConfig},
    schedule::{CosineAnnealingLrConfig, SchedulerConfig},
};
use kiln::data::{load_digits, train_test_split, DataLoader, InMemoryDataset, SequentialLoader};
use kiln::prelude::*;
use kiln::torch::{compute_loss, cuda_is_available, to_tch, TorchModel, TorchOptimizer};

#[derive(Clone, Copy, PartialEq)]
enum Model {
    Mlp,
    Cnn,
    Transformer,
}

struct Args {
    data: PathBuf,
    model: Model,
    epochs: u64,
    seed: u64,
    device: Device,
    save: Option<PathBuf>,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        data: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".kiln/data/digits.csv.gz"),
        model: Model::Cnn,
        epochs: 30,
        seed: 0,
        device: Device::Cpu,
        save: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--data" => args.data = PathBuf::from(value()?),
            "--model" => {
                args.model = match value()?.as_str() {
                    "mlp" => Model::Mlp,
                    "cnn" => Model::Cnn,
                    "transformer" => Model::Transformer,
                    other => bail!("--model {other}: expected mlp, cnn or transformer"),
                }
            }
            "--epochs" => {
                args.epochs = value()?.parse().context("--epochs takes a whole number")?
            }
            "--seed" => args.seed = value()?.parse().context("--seed takes a whole number")?,
            "--device" => args.device = value()?.parse()?,
            "--save" => args.save = Some(PathBuf::from(value()?)),
            other => bail!(
                "unknown flag {other}; flags: --model cnn|transformer|mlp --epochs N --seed S \
                 --device cpu|cuda:N --data PATH --save PATH"
            ),
        }
    }
    Ok(args)
}

/// The network, in Kiln's declarative terms (PyTorch's state-dict names).
fn definition(model: Model) -> Layer {
    match model {
        Model::Mlp => Layer::sequential([
            LinearConfig::new(64, 128).into(),
            Layer::Relu,
            LinearConfig::new(128, 10).into(),
        ]),
        // [N, 1, 8, 8] -> two conv blocks -> [N, 10]
        Model::Cnn => Layer::sequential([
            Conv2dConfig::new(1, 32, [3, 3]).with_padding([1, 1]).into(),
            Layer::BatchNorm2d(BatchNormConfig::new(32)),
            Layer::Relu,
            Conv2dConfig::new(32, 64, [3, 3])
                .with_padding([1, 1])
                .into(),
            Layer::BatchNorm2d(BatchNormConfig::new(64)),
            Layer::Relu,
            Layer::MaxPool2d(Pool2dConfig::new([2, 2])),
            Layer::Flatten {
                start_dim: 1,
                end_dim: -1,
            },
            Layer::Dropout { p: 0.25 },
            LinearConfig::new(64 * 4 * 4, 10).into(),
        ]),
        // Each image is a sequence of its 8 rows; a token is the row's 8 pixels plus
        // a one-hot row index (the position). Two pre-norm encoder blocks, then a
        // linear read-out of the flattened sequence.
        Model::Transformer => Layer::sequential([
            LinearConfig::new(16, 64).into(),
            Layer::transformer_encoder_block(64, 4, 128, false, 0.1),
            Layer::transformer_encoder_block(64, 4, 128, false, 0.1),
            LayerNormConfig::new([64]).into(),
            Layer::Flatten {
                start_dim: 1,
                end_dim: -1,
            },
            LinearConfig::new(8 * 64, 10).into(),
        ]),
    }
}

/// Scales pixels to 0..1 and shapes the features the model expects.
fn features(x: &HostTensor, model: Model) -> Result<HostTensor> {
    let n = x.dims()[0];
    let pixels: Vec<f32> = x.as_slice::<f32>()?.iter().map(|p| p / 16.0).collect();
    Ok(match model {
        Model::Mlp => HostTensor::new(pixels, [n, 64])?,
        Model::Cnn => HostTensor::new(pixels, [n, 1, 8, 8])?,
        Model::Transformer => {
            let mut tokens = Vec::with_capacity(n * 8 * 16);
            for image in pixels.chunks(64) {
                for (row, values) in image.chunks(8).enumerate() {
                    tokens.extend_from_slice(values);
                    tokens.extend((0..8).map(|i| if i == row { 1.0 } else { 0.0 }));
                }
            }
            HostTensor::new(tokens, [n, 8, 16])?
        }
    })
}

fn accuracy(model: &TorchModel, x: &tch::Tensor, y: &tch::Tensor) -> Result<f64> {
    let logits = tch::no_grad(|| model.forward(x))?;
    let correct = logits
        .f_argmax(-1, false)?
        .f_eq_tensor(y)?
        .f_to_kind(tch::Kind::Float)?
        .f_mean(tch::Kind::Float)?;
    Ok(correct.f_double_value(&[])?)
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = parse_args()?;
    TorchBackend::manual_seed(args.seed);
    log::info!("CUDA available to libtorch: {}", cuda_is_available());

    let (pixels, labels) = load_digits(&args.data).context(
        "the digits data set comes with the project virtualenv: run `cargo xtask setup`",
    )?;
    let ((train_x, train_y), (test_x, test_y)) =
        train_test_split(&pixels, &labels, 0.2, args.seed)?;
    println!(
        "digits: {} training and {} held-out images of 8x8 pixels, 10 classes",
        train_x.dims()[0],
        test_x.dims()[0]
    );

    let spec = definition(args.model);
    let mut model = TorchModel::new(&spec, args.device)?;
    println!("model: {} parameters", model.num_parameters()?);
    let config = OptimizerConfig::AdamW(AdamWConfig::new(2e-3).with_weight_decay(1e-2));
    let mut optimizer = TorchOptimizer::new(config, model.named_parameters()?, &[])?;
    let mut schedule = SchedulerConfig::CosineAnnealingLr(CosineAnnealingLrConfig {
        t_max: args.epochs,
        eta_min: 1e-5,
    })
    .build(&optimizer.learning_rates())?;
    let loss_fn = Loss::cross_entropy();

    let loader = SequentialLoader::new(
        InMemoryDataset::new(features(&train_x, args.model)?, train_y)?,
        64,
    )?
    .shuffle(args.seed);
    let test_x = to_tch(&features(&test_x, args.model)?, args.device)?;
    let test_y = to_tch(&test_y, args.device)?;

    let start = Instant::now();
    for epoch in 0..args.epochs {
        model.set_mode(Mode::Train);
        let (mut total, mut seen) = (0.0, 0usize);
        for batch in loader.batches(epoch) {
            let batch = batch?;
            let x = to_tch(&batch.inputs, args.device)?;
            let y = to_tch(&batch.targets, args.device)?;
            optimizer.zero_grad()?;
            let loss = compute_loss(&loss_fn, &model.forward(&x)?, &y)?;
            TorchBackend::backward(&loss)?;
            optimizer.step()?;
            let n = batch.targets.dims()[0];
            total += loss.f_double_value(&[])? * n as f64;
            seen += n;
        }
        optimizer.set_learning_rates(&schedule.step()?)?;
        if (epoch + 1) % 5 == 0 || epoch + 1 == args.epochs {
            model.set_mode(Mode::Eval);
            println!(
                "epoch {:3}  train loss {:.4}  held-out accuracy {:.2}%",
                epoch + 1,
                total / seen as f64,
                100.0 * accuracy(&model, &test_x, &test_y)?
            );
        }
    }
    model.set_mode(Mode::Eval);
    println!(
        "held-out accuracy: {:.2}% ({} epochs in {:.2}s on {})",
        100.0 * accuracy(&model, &test_x, &test_y)?,
        args.epochs,
        start.elapsed().as_secs_f64(),
        args.device
    );
    if let Some(path) = &args.save {
        model.save(path)?;
        println!(
            "weights saved to {} (safetensors, PyTorch state-dict names)",
            path.display()
        );
    }
    Ok(())
}
