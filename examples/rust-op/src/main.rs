//! Trains an MLP on the UCI handwritten digits with Kiln's `Trainer`, on
//! libtorch (the default) or on TensorFlow, whose normalisation and activation
//! are ops written in Rust: `Linear -> RMSNorm -> squared ReLU -> Linear`. The
//! model is one definition, and the ops are layers of it. Loading the digits and
//! the training loop are examples/shared/digits_demo.rs.
//!
//! ```sh
//! cargo xtask run --release -p kiln-example-rust-op
//! cargo xtask run --release -p kiln-example-rust-op -- --backend tensorflow
//! ```

#[path = "../../shared/digits_demo.rs"]
mod digits_demo;

use anyhow::Result;
use kiln_core::model::{Layer, LinearConfig};

fn main() -> Result<()> {
    let backend = digits_demo::start("kiln-example-rust-op")?;

    // Both engines learn the Rust ops, and the model uses them as layers.
    kiln_example_rust_op::register()?;
    let spec = Layer::sequential([
        LinearConfig::new(64, 128).into(),
        kiln_example_rust_op::rms_norm(128, kiln_example_rust_op::ops::RMS_NORM_EPS),
        kiln_example_rust_op::squared_relu(),
        LinearConfig::new(128, 10).into(),
    ]);
    let accuracy = digits_demo::train(backend, &spec)?;
    println!(
        "held-out accuracy with the Rust ops ({backend}): {:.2}%",
        100.0 * accuracy
    );
    Ok(())
}
