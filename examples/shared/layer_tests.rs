//! What both op examples check of their ops as layers of a Kiln model definition
//! (examples/custom-op/tests/layer.rs and examples/rust-op/tests/layer.rs include
//! this file with `#[path]` and pass their model): on the same weights, libtorch
//! and TensorFlow give the same outputs and parameter gradients (1e-5), and
//! `Trainer` trains the model on both with the same epoch losses (1e-4), reducing
//! the loss. The model maps 5 features to 3 classes; its ops must be registered.

#![allow(dead_code)] // each test binary uses part of it

use kiln_core::{
    backend::{Backend, EagerBackend, TrainBackend, Trainable},
    loss::Loss,
    model::Layer,
    module::Module,
    optim::{OptimizerConfig, SgdConfig},
    state_dict::StateDict,
    Device, HostTensor,
};
use kiln_data::{InMemoryDataset, SequentialLoader};
use kiln_tf::{TfBackend, TfTensor};
use kiln_torch::{from_tch, TorchBackend};
use kiln_train::{Trainer, TrainerConfig, TrainingState};

/// 96 rows of features in [-1, 1) and the class of the largest of the first three.
pub fn data() -> (HostTensor, HostTensor) {
    let x: Vec<f32> = (0..96 * 5)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let y = kiln_testkit::argmax_labels(&x, 5, 3);
    (
        HostTensor::new(x, [96, 5]).unwrap(),
        HostTensor::new(y, [96]).unwrap(),
    )
}

fn max_diff(a: &HostTensor, b: &HostTensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    kiln_testkit::max_abs_diff(&a.to_f64_vec(), &b.to_f64_vec())
}

/// libtorch's generator is global: the tests in a binary run one at a time so
/// that the seeded initial weights are the same in every run.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// `spec`'s seeded initial weights, which both backends load.
fn initial(spec: &Layer) -> StateDict {
    TorchBackend::manual_seed(4);
    TorchBackend::build_model(spec, Device::Cpu)
        .unwrap()
        .state_dict()
        .unwrap()
}

/// Outputs and parameter gradients of `spec` on libtorch and on TensorFlow agree.
pub fn both_backends_agree_on_outputs_and_gradients(spec: &Layer) {
    let weights = initial(spec);
    let mut torch = TorchBackend::build_model(spec, Device::Cpu).unwrap();
    torch.load_state_dict(&weights).unwrap();
    let mut tf = TfBackend::build_model(spec, Device::Cpu).unwrap();
    tf.load_state_dict(&weights).unwrap();
    let (x, y) = data();

    let out = torch
        .forward(&TorchBackend::from_host(&x, Device::Cpu).unwrap())
        .unwrap();
    let target = TorchBackend::from_host(&y, Device::Cpu).unwrap();
    TorchBackend::backward(&TorchBackend::loss(&Loss::cross_entropy(), &out, &target).unwrap())
        .unwrap();
    let tf_out = tf.forward(&TfTensor::from_host(&x).unwrap()).unwrap();
    let d = max_diff(
        &from_tch(&out.detach()).unwrap(),
        &tf_out.to_host().unwrap(),
    );
    assert!(d < 1e-5, "outputs differ by {d}");

    let (_, tf_grads) = tf
        .gradients(
            &Loss::cross_entropy(),
            &TfTensor::from_host(&x).unwrap(),
            &TfTensor::from_host(&y).unwrap(),
        )
        .unwrap();
    for (name, p) in Module::<TorchBackend>::named_parameters(&torch).unwrap() {
        let d = max_diff(&from_tch(&p.grad()).unwrap(), tf_grads.get(&name).unwrap());
        assert!(d < 1e-5, "gradient of {name} differs by {d}");
    }
}

fn fit<B: TrainBackend>(spec: &Layer, weights: &StateDict) -> Vec<f64> {
    let mut model = B::build_model(spec, Device::Cpu).unwrap();
    model.load_state_dict(weights).unwrap();
    let sgd = OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.5));
    let optimizer = model.build_optimizer(&sgd, &[]).unwrap();
    let mut state = TrainingState::new(model, optimizer, None);
    let (x, y) = data();
    let loader = SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), 16).unwrap();
    let config = TrainerConfig {
        epochs: 12,
        ..TrainerConfig::default()
    };
    Trainer::<B>::new(config, Loss::cross_entropy())
        .unwrap()
        .fit(&mut state, &loader, None)
        .unwrap()
        .series("loss")
        .into_iter()
        .map(|(_, v)| v)
        .collect()
}

/// `Trainer` reduces `spec`'s loss on both backends, with the same epoch losses.
pub fn the_trainer_trains_it_on_both_backends_alike(spec: &Layer) {
    let weights = initial(spec);
    let torch = fit::<TorchBackend>(spec, &weights);
    let tf = fit::<TfBackend>(spec, &weights);
    eprintln!("torch {torch:.4?}\ntensorflow {tf:.4?}");
    assert!(
        torch[11] < 0.5 * torch[0],
        "training reduces the loss: {torch:?}"
    );
    let worst = kiln_testkit::max_abs_diff(&torch, &tf);
    assert!(worst < 1e-4, "epoch losses differ by {worst}");
}
