//! Trains an MLP whose activation is the custom op (squared ReLU) on the UCI
//! handwritten digits with Kiln's `Trainer`, on libtorch (the default) or on
//! TensorFlow: the model is one definition, and the op is a layer of it. Loading
//! the digits and the training loop are examples/shared/digits_demo.rs.
//!
//! ```sh
//! cargo xtask run --release -p kiln-example-custom-op
//! cargo xtask run --release -p kiln-example-custom-op -- --backend tensorflow
//! ```

#[path = "../../shared/digits_demo.rs"]
mod digits_demo;

use anyhow::Result;
use kiln_core::model::{Layer, LinearConfig};

fn main() -> Result<()> {
    let backend = digits_demo::start("kiln-example-custom-op")?;

    // Step 6 of the op's path: the backends learn the op, and the model uses it.
    kiln_example_custom_op::register_layer()?;
    let spec = Layer::sequential([
        LinearConfig::new(64, 128).into(),
        kiln_example_custom_op::layer(),
        LinearConfig::new(128, 10).into(),
    ]);
    let accuracy = digits_demo::train(backend, &spec)?;
    println!(
        "held-out accuracy with the squared-ReLU op ({backend}): {:.2}%",
        100.0 * accuracy
    );
    Ok(())
}
