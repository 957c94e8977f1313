//! Step 6: the example op as a layer of a Kiln model definition. On the same
//! weights, libtorch and TensorFlow give the same outputs and parameter gradients
//! (1e-5), and `Trainer` trains the model on both with the same epoch losses (1e-4),
//! reducing the loss (the checks are examples/shared/layer_tests.rs, which
//! examples/rust-op runs on its ops too).

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

#[path = "../../shared/layer_tests.rs"]
mod layer_tests;

use kiln_core::model::{Layer, LinearConfig};

fn spec() -> Layer {
    Layer::sequential([
        LinearConfig::new(5, 12).into(),
        kiln_example_custom_op::layer(),
        LinearConfig::new(12, 3).into(),
    ])
}

#[test]
fn both_backends_agree_on_outputs_and_gradients() {
    let _serial = layer_tests::serial();
    kiln_example_custom_op::register_layer().unwrap();
    layer_tests::both_backends_agree_on_outputs_and_gradients(&spec());
}

#[test]
fn the_trainer_trains_it_on_both_backends_alike() {
    let _serial = layer_tests::serial();
    kiln_example_custom_op::register_layer().unwrap();
    layer_tests::the_trainer_trains_it_on_both_backends_alike(&spec());
}
