//! Kiln's main job at this stage: train a small MLP on the UCI handwritten digits
//! (1797 8x8 images, shipped inside scikit-learn's wheel) with libtorch, and
//! print the held-out accuracy.
//!
//! ```text
//! cargo xtask run --release --example digits [-- --epochs N --seed S --data PATH]
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use kiln::core::{load_digits, train_test_split};
use kiln::prelude::*;
use kiln::torch::{cuda_is_available, to_tch};
use tch::nn::{self, Module as _, OptimizerConfig};

struct Args {
    data: PathBuf,
    epochs: usize,
    seed: u64,
    device: Device,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        data: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".kiln/data/digits.csv.gz"),
        epochs: 60,
        seed: 0,
        device: Device::Cpu,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--data" => args.data = PathBuf::from(value()?),
            "--epochs" => {
                args.epochs = value()?.parse().context("--epochs takes a whole number")?
            }
            "--seed" => args.seed = value()?.parse().context("--seed takes a whole number")?,
            "--device" => args.device = value()?.parse()?,
            other => bail!(
                "unknown flag {other}; flags: --data PATH --epochs N --seed S --device cpu|cuda:N"
            ),
        }
    }
    Ok(args)
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = parse_args()?;
    TorchBackend::manual_seed(args.seed);
    log::info!("CUDA available to libtorch: {}", cuda_is_available());

    let (features, labels) = load_digits(&args.data).with_context(|| {
        "the digits data set comes with the project virtualenv: run `cargo xtask setup`"
    })?;
    let ((train_x, train_y), (test_x, test_y)) =
        train_test_split(&features, &labels, 0.2, args.seed)?;
    println!(
        "digits: {} training and {} held-out images of 8x8 pixels, 10 classes",
        train_x.dims()[0],
        test_x.dims()[0]
    );

    // Pixels are 0..16; scale to 0..1 on the device.
    let device = args.device;
    let train_x = to_tch(&train_x, device)? / 16.0;
    let train_y = to_tch(&train_y, device)?;
    let test_x = to_tch(&test_x, device)? / 16.0;
    let test_y = to_tch(&test_y, device)?;

    let vs = nn::VarStore::new(kiln::torch::device_to_tch(device)?);
    let root = vs.root();
    let model = nn::seq()
        .add(nn::linear(&root / "fc1", 64, 128, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&root / "fc2", 128, 10, Default::default()));
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;

    let batch_size = 64;
    let n = train_x.size()[0];
    let start = Instant::now();
    for epoch in 1..=args.epochs {
        let perm = tch::Tensor::randperm(n, (tch::Kind::Int64, vs.device()));
        let mut total = 0.0;
        for begin in (0..n).step_by(batch_size) {
            let idx = perm.narrow(0, begin, batch_size.min((n - begin) as usize) as i64);
            let logits = model.forward(&train_x.index_select(0, &idx));
            let loss = logits.cross_entropy_for_logits(&train_y.index_select(0, &idx));
            opt.backward_step(&loss);
            total += loss.double_value(&[]) * idx.size()[0] as f64;
        }
        if epoch % 10 == 0 || epoch == args.epochs {
            let acc = tch::no_grad(|| model.forward(&test_x).accuracy_for_logits(&test_y));
            println!(
                "epoch {epoch:3}  train loss {:.4}  held-out accuracy {:.2}%",
                total / n as f64,
                100.0 * acc.double_value(&[])
            );
        }
    }
    let accuracy =
        tch::no_grad(|| model.forward(&test_x).accuracy_for_logits(&test_y)).double_value(&[]);
    println!(
        "held-out accuracy: {:.2}% ({} epochs in {:.2}s on {device})",
        100.0 * accuracy,
        args.epochs,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
