//! The Rust ops as layers of a Kiln model definition (RMSNorm with a learned
//! weight, squared ReLU), also written in a config file. On the same weights,
//! libtorch and TensorFlow give the same outputs and parameter gradients (1e-5),
//! and `Trainer` trains the model on both with the same epoch losses (1e-4),
//! reducing the loss (the checks are examples/shared/layer_tests.rs, which
//! examples/custom-op runs on its op too).

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

#[path = "../../shared/layer_tests.rs"]
mod layer_tests;

use kiln_core::{
    backend::{Backend, TrainBackend},
    model::{Layer, LinearConfig},
    module::Module,
    Device,
};
use kiln_tf::{TfBackend, TfTensor};
use kiln_torch::TorchBackend;
use layer_tests::{data, serial};

fn spec() -> Layer {
    Layer::sequential([
        LinearConfig::new(5, 12).into(),
        kiln_example_rust_op::rms_norm(12, 1e-5),
        kiln_example_rust_op::squared_relu(),
        LinearConfig::new(12, 3).into(),
    ])
}

#[test]
fn both_backends_agree_on_outputs_and_gradients() {
    let _serial = serial();
    kiln_example_rust_op::register().unwrap();
    layer_tests::both_backends_agree_on_outputs_and_gradients(&spec());
}

#[test]
fn the_trainer_trains_it_on_both_backends_alike() {
    let _serial = serial();
    kiln_example_rust_op::register().unwrap();
    layer_tests::the_trainer_trains_it_on_both_backends_alike(&spec());
}

#[test]
fn a_config_file_names_the_ops_and_their_attributes() {
    let _serial = serial();
    kiln_example_rust_op::register().unwrap();
    let text = r#"
        type = "sequential"
        layers = [
            { type = "linear", in_features = 5, out_features = 12 },
            { type = "custom", op = "example_rs::rms_norm", params = [{ name = "weight", shape = [12], init = { type = "ones" } }], attrs = { eps = 1e-5 } },
            { type = "custom", op = "example_rs::squared_relu" },
            { type = "linear", in_features = 12, out_features = 3 },
        ]
    "#;
    let from_file: Layer = toml::from_str(text).unwrap();
    assert_eq!(from_file, spec());
    TorchBackend::build_model(&from_file, Device::Cpu).unwrap();

    // An attribute the op does not have, and a missing parameter, are errors
    // that name them.
    let unknown = text.replace("eps = 1e-5", "epsilon = 1e-5");
    let layer: Layer = toml::from_str(&unknown).unwrap();
    let x = TorchBackend::from_host(&data().0, Device::Cpu).unwrap();
    let err = TorchBackend::build_model(&layer, Device::Cpu)
        .and_then(|m| m.forward(&x).map(|_| ()))
        .unwrap_err()
        .display_chain()
        .to_string();
    assert!(err.contains("epsilon"), "{err}");
    let tf_err = TfBackend::build_model(&layer, Device::Cpu)
        .and_then(|m| {
            m.forward(&TfTensor::from_host(&data().0).unwrap())
                .map(|_| ())
        })
        .unwrap_err()
        .display_chain()
        .to_string();
    assert!(tf_err.contains("epsilon"), "{tf_err}");
}
