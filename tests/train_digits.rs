//! End to end through the facade: a Kiln-defined CNN trained on the real UCI digits
//! (from the project virtualenv's scikit-learn) with Kiln's loader, loss, AdamW and
//! schedule, reaching a held-out accuracy no chance could.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln::core::{
    loss::Loss,
    model::{BatchNormConfig, Conv2dConfig, Layer, LinearConfig, Pool2dConfig},
    optim::{AdamWConfig, OptimizerConfig},
    schedule::{SchedulerConfig, StepLrConfig},
};
use kiln::data::{load_digits, train_test_split, DataLoader, InMemoryDataset, SequentialLoader};
use kiln::prelude::*;
use kiln::torch::{compute_loss, from_tch, to_tch, TorchModel, TorchOptimizer};

#[test]
fn a_small_cnn_learns_the_digits() {
    let Some(data) = kiln_testkit::digits("a_small_cnn_learns_the_digits") else {
        return;
    };
    TorchBackend::manual_seed(0);
    let (x, y) = load_digits(&data).unwrap();
    assert_eq!((x.dims(), y.dims()), (&[1797, 64][..], &[1797][..]));
    let ((train_x, train_y), (test_x, test_y)) = train_test_split(&x, &y, 0.2, 0).unwrap();
    let images = |x: &HostTensor| {
        let scaled: Vec<f32> = x
            .as_slice::<f32>()
            .unwrap()
            .iter()
            .map(|p| p / 16.0)
            .collect();
        HostTensor::new(scaled, [x.dims()[0], 1, 8, 8]).unwrap()
    };
    let spec = Layer::sequential([
        Conv2dConfig::new(1, 16, [3, 3]).with_padding([1, 1]).into(),
        Layer::BatchNorm2d(BatchNormConfig::new(16)),
        Layer::Relu,
        Layer::MaxPool2d(Pool2dConfig::new([2, 2])),
        Layer::Flatten {
            start_dim: 1,
            end_dim: -1,
        },
        LinearConfig::new(16 * 4 * 4, 10).into(),
    ]);
    let mut model = TorchModel::new(&spec, Device::Cpu).unwrap();
    let mut opt = TorchOptimizer::new(
        OptimizerConfig::AdamW(AdamWConfig::new(3e-3)),
        model.named_parameters().unwrap(),
        &[],
    )
    .unwrap();
    let mut schedule = SchedulerConfig::StepLr(StepLrConfig {
        step_size: 4,
        gamma: 0.5,
    })
    .build(&opt.learning_rates())
    .unwrap();
    let loader =
        SequentialLoader::new(InMemoryDataset::new(images(&train_x), train_y).unwrap(), 32)
            .unwrap()
            .shuffle(0);
    for epoch in 0..8 {
        for batch in loader.batches(epoch) {
            let batch = batch.unwrap();
            opt.zero_grad().unwrap();
            let logits = model
                .forward(&to_tch(&batch.inputs, Device::Cpu).unwrap())
                .unwrap();
            let loss = compute_loss(
                &Loss::cross_entropy(),
                &logits,
                &to_tch(&batch.targets, Device::Cpu).unwrap(),
            )
            .unwrap();
            TorchBackend::backward(&loss).unwrap();
            opt.step().unwrap();
        }
        opt.set_learning_rates(&schedule.step().unwrap()).unwrap();
    }
    model.set_mode(Mode::Eval);
    let logits = model
        .forward(&to_tch(&images(&test_x), Device::Cpu).unwrap())
        .unwrap();
    let predicted = from_tch(&logits.argmax(-1, false)).unwrap();
    let (p, t) = (
        predicted.as_slice::<i64>().unwrap(),
        test_y.as_slice::<i64>().unwrap(),
    );
    let accuracy = p.iter().zip(t).filter(|(a, b)| a == b).count() as f64 / t.len() as f64;
    assert!(accuracy > 0.95, "held-out accuracy {accuracy}");
}
