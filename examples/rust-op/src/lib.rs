//! Ops written in Rust, registered in libtorch and TensorFlow from one definition.
//!
//! [`ops`] defines three ops, each a type implementing `kiln_custom_op::CustomOp`
//! (schema, shape function, kernel generic over f32/f64) with its gradient as
//! another such op: squared ReLU, a fused RMSNorm and Swish-β. There is no C++ and
//! no `unsafe` here:
//!
//! 1. `kiln_torch_op::register::<Op>()` registers an op in libtorch through its
//!    stable C ABI (schema, CPU and Meta kernels, autograd through the gradient op);
//!    `kiln_tf_op::register::<Op>()` registers it in TensorFlow through its C op and
//!    kernel API (op, shape function, CPU kernel, gradient for `Graph::add_gradients`).
//! 2. The `register_layer` functions of the same crates also make it a
//!    `Layer::Custom` op of model definitions ([`register`] does both for every op),
//!    so [`squared_relu`] and [`rms_norm`] build layers that `Trainer<TorchBackend>` and
//!    `Trainer<TfBackend>` train (`src/main.rs`).
//! 3. `torch-library/` builds the same ops as a shared library for Python:
//!    `torch.ops.load_library(path)` gives `torch.ops.example_rs.*`.

pub mod ops;

use std::sync::OnceLock;

use kiln_core::{
    model::{CustomConfig, Init, Layer},
    Error, Result,
};

/// Registers every op of [`ops`] in libtorch and TensorFlow, as ops and as
/// `Layer::Custom` layers. Registering an op twice is an error in both engines;
/// this function does it once per process and returns the first outcome to
/// later calls.
///
/// ```no_run
/// kiln_example_rust_op::register()?;
/// let x = tch::Tensor::randn([4, 8], (tch::Kind::Float, tch::Device::Cpu));
/// let y = kiln_torch_op::call("example_rs::squared_relu", &[&x], &Default::default())?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn register() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| register_all().map_err(|e| e.display_chain().to_string()))
        .clone()
        .map_err(|message| Error::backend("kiln-example-rust-op", "registering the ops", message))
}

fn register_all() -> Result<()> {
    use ops::*;
    // Forward ops as layers (which registers the op itself), gradient ops as ops.
    kiln_torch_op::register_layer::<SquaredRelu>()?;
    kiln_torch_op::register_layer::<RmsNorm>()?;
    kiln_torch_op::register_layer::<Swish>()?;
    kiln_torch_op::register::<SquaredReluBackward>()?;
    kiln_torch_op::register::<RmsNormBackward>()?;
    kiln_torch_op::register::<SwishBackward>()?;
    kiln_tf_op::register_layer::<SquaredRelu>()?;
    kiln_tf_op::register_layer::<RmsNorm>()?;
    kiln_tf_op::register_layer::<Swish>()?;
    kiln_tf_op::register::<SquaredReluBackward>()?;
    kiln_tf_op::register::<RmsNormBackward>()?;
    kiln_tf_op::register::<SwishBackward>()?;
    Ok(())
}

/// Squared ReLU as a layer (no parameters).
pub fn squared_relu() -> Layer {
    CustomConfig::new("example_rs::squared_relu").into()
}

/// RMSNorm over the last dimension of `features` elements, with a learned
/// `weight` starting at ones and `eps` (default [`ops::RMS_NORM_EPS`]).
pub fn rms_norm(features: usize, eps: f64) -> Layer {
    CustomConfig::new("example_rs::rms_norm")
        .with_param("weight", [features], Init::Ones)
        .with_attr("eps", eps)
        .into()
}
