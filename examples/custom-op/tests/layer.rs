//! Step 6: the example op as a layer of a Kiln model definition. On the same
//! weights, libtorch and TensorFlow give the same outputs and parameter gradients
//! (1e-5), and `Trainer` trains the model on both with the same epoch losses (1e-4),
//! reducing the loss.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln_core::backend::Trainable;
use kiln_core::{
    backend::{Backend, EagerBackend, TrainBackend},
    loss::Loss,
    model::{Layer, LinearConfig},
    module::Module,
    optim::{OptimizerConfig, SgdConfig},
    state_dict::StateDict,
    Device, HostTensor,
};
use kiln_data::{InMemoryDataset, SequentialLoader};
use kiln_tf::{TfBackend, TfTensor};
use kiln_torch::{from_tch, TorchBackend};
use kiln_train::{Trainer, TrainerConfig, TrainingState};

fn spec() -> Layer {
    Layer::sequential([
        LinearConfig::new(5, 12).into(),
        kiln_example_custom_op::layer(),
        LinearConfig::new(12, 3).into(),
    ])
}

/// 96 rows of features in [-1, 1) and the class of the largest of the first three.
fn data() -> (HostTensor, HostTensor) {
    let x: Vec<f32> = (0..96 * 5)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let y: Vec<i64> = x
        .chunks(5)
        .map(|r| (0..3).fold(0, |b, i| if r[i] > r[b] { i } else { b }) as i64)
        .collect();
    (
        HostTensor::new(x, [96, 5]).unwrap(),
        HostTensor::new(y, [96]).unwrap(),
    )
}

fn max_diff(a: &HostTensor, b: &HostTensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    a.to_f64_vec()
        .iter()
        .zip(b.to_f64_vec())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// libtorch's generator is global: the tests in this binary run one at a time so
/// that the seeded initial weights are the same in every run.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn initial() -> StateDict {
    kiln_example_custom_op::register_layer().unwrap();
    TorchBackend::manual_seed(4);
    TorchBackend::build_model(&spec(), Device::Cpu)
        .unwrap()
        .state_dict()
        .unwrap()
}

#[test]
fn both_backends_agree_on_outputs_and_gradients() {
    let _serial = serial();
    let weights = initial();
    let mut torch = TorchBackend::build_model(&spec(), Device::Cpu).unwrap();
    torch.load_state_dict(&weights).unwrap();
    let mut tf = TfBackend::build_model(&spec(), Device::Cpu).unwrap();
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

fn fit<B: TrainBackend>(weights: &StateDict) -> Vec<f64> {
    let mut model = B::build_model(&spec(), Device::Cpu).unwrap();
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

#[test]
fn the_trainer_trains_it_on_both_backends_alike() {
    let _serial = serial();
    let weights = initial();
    let torch = fit::<TorchBackend>(&weights);
    let tf = fit::<TfBackend>(&weights);
    eprintln!("torch {torch:.4?}\ntensorflow {tf:.4?}");
    assert!(
        torch[11] < 0.5 * torch[0],
        "training reduces the loss: {torch:?}"
    );
    let worst = torch
        .iter()
        .zip(&tf)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-4, "epoch losses differ by {worst}");
}
