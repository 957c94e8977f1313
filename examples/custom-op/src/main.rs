//! Trains an MLP whose activation is the custom op (squared ReLU) on the UCI
//! handwritten digits, with Kiln's optimizer and data loader:
//!
//! ```sh
//! cargo xtask run --release -p kiln-example-custom-op
//! ```

use std::path::PathBuf;

use anyhow::{Context, Result};
use kiln_core::{
    load_digits, train_test_split, AdamConfig, Backend, DataLoader, Device, InMemoryDataset, Loss,
    Module, Optimizer, OptimizerConfig, SequentialLoader,
};
use kiln_example_custom_op::squared_relu;
use kiln_torch::{compute_loss, to_tch, TchModule, TorchBackend, TorchOptimizer};
use tch::nn;

fn main() -> Result<()> {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.kiln/data/digits.csv.gz");
    let (pixels, labels) = load_digits(&data)
        .context("the digits come with the project virtualenv: run `cargo xtask setup`")?;
    let pixels = pixels.to_dtype(kiln_core::DType::F32);
    let scaled: Vec<f32> = pixels.as_slice::<f32>()?.iter().map(|v| v / 16.0).collect();
    let pixels = kiln_core::HostTensor::new(scaled, pixels.shape().clone())?;
    let ((train_x, train_y), (test_x, test_y)) = train_test_split(&pixels, &labels, 0.2, 0)?;

    TorchBackend::manual_seed(0);
    // A model written in tch, with the custom op as its activation.
    let model = TchModule::new(Device::Cpu, |p| {
        let hidden = nn::linear(p / "0", 64, 128, Default::default());
        let out = nn::linear(p / "2", 128, 10, Default::default());
        move |x: &tch::Tensor, _train: bool| {
            let h =
                squared_relu(&x.apply(&hidden)).map_err(|e| tch::TchError::Kind(e.to_string()))?;
            Ok(h.apply(&out))
        }
    })?;
    let mut optimizer = TorchOptimizer::new(
        OptimizerConfig::Adam(AdamConfig::new(1e-3)),
        model.named_parameters(),
        &[],
    )?;
    let loader = SequentialLoader::new(InMemoryDataset::new(train_x, train_y)?, 64)?.shuffle(0);
    let loss_fn = Loss::cross_entropy();
    for epoch in 0..30 {
        let (mut total, mut seen) = (0.0, 0usize);
        for batch in loader.batches(epoch) {
            let batch = batch?;
            let x = to_tch(&batch.inputs, Device::Cpu)?;
            let y = to_tch(&batch.targets, Device::Cpu)?;
            optimizer.zero_grad()?;
            let loss = compute_loss(&loss_fn, &model.forward(&x)?, &y)?;
            TorchBackend::backward(&loss)?;
            optimizer.step()?;
            total += loss.double_value(&[]) * batch.targets.dims()[0] as f64;
            seen += batch.targets.dims()[0];
        }
        if epoch % 10 == 9 {
            println!("epoch {epoch}: training loss {:.4}", total / seen as f64);
        }
    }
    let logits = tch::no_grad(|| model.forward(&to_tch(&test_x, Device::Cpu)?))?;
    let predicted = logits.argmax(-1, false);
    let correct = predicted
        .eq_tensor(&to_tch(&test_y, Device::Cpu)?)
        .sum(tch::Kind::Int64)
        .int64_value(&[]);
    let accuracy = correct as f64 / test_y.dims()[0] as f64;
    println!(
        "held-out accuracy with the squared-ReLU op: {:.2}%",
        100.0 * accuracy
    );
    Ok(())
}
