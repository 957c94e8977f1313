//! Adding a custom op to Kiln from scratch: squared ReLU (`max(x, 0)^2`), a C++
//! kernel with its gradient, bridged with cxx and usable from Rust (autograd
//! included), TorchScript and Python, and in TensorFlow graphs.
//!
//! The four steps, each in its own file: `build.rs` (compile with kiln-build),
//! `cpp/squared_relu.cc` (kernel, gradient, `TORCH_LIBRARY`), `cpp/bridge.{h,cc}`
//! and `src/ffi.rs` (the bridge), and this file (the safe Rust API).
//!
//! Step 5 makes it a TensorFlow op too: `cpp/squared_relu_tf.cc` (kernels, shape
//! functions, the gradient, the registration), `src/tf_ffi.rs` (its bridge) and the
//! [`tf`] module here.

//!
//! Step 6 makes it a layer of Kiln model definitions on both backends:
//! [`register_layer`] hands the two functions above to the backends under the
//! name [`LAYER_OP`], and [`layer`] declares it, so `Trainer<TorchBackend>` and
//! `Trainer<TfBackend>` train models that use it (see `src/main.rs`).

mod ffi;
mod tf_ffi;

use kiln_core::{
    model::{CustomConfig, Layer},
    Error, Result,
};
use tch::Tensor;

/// The layer op name for [`Layer::Custom`]: `namespace::name`, as in `torch.ops`.
pub const LAYER_OP: &str = "example::squared_relu";

/// Step 6: registers squared ReLU as a custom layer op with both backends (and
/// the TensorFlow op itself). Idempotent; call it once before building models.
///
/// ```no_run
/// use kiln_core::{backend::TrainBackend, model::{Layer, LinearConfig}, Device};
///
/// kiln_example_custom_op::register_layer()?;
/// let net = Layer::sequential([
///     LinearConfig::new(64, 128).into(),
///     kiln_example_custom_op::layer(),
///     LinearConfig::new(128, 10).into(),
/// ]);
/// let on_torch = kiln_torch::TorchBackend::build_model(&net, Device::Cpu)?;
/// let on_tf = kiln_tf::TfBackend::build_model(&net, Device::Cpu)?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn register_layer() -> Result<()> {
    tf::register()?;
    kiln_torch::register_custom_layer(LAYER_OP, |x, _params, _config| squared_relu(x));
    kiln_tf::register_custom_layer(LAYER_OP, |graph, name, x, _params, _config| {
        tf::add_node(graph, name, x)
    });
    Ok(())
}

/// The squared-ReLU activation as a layer (no parameters).
pub fn layer() -> Layer {
    CustomConfig::new(LAYER_OP).into()
}

/// The shared library for Python: `torch.ops.load_library(LIBRARY)` gives
/// `torch.ops.example.squared_relu`.
pub const LIBRARY: &str = env!("SQUARED_RELU_LIBRARY");

/// Step 4: the safe API. `max(x, 0)^2` for float32 or float64 `x`, differentiable.
pub fn squared_relu(x: &Tensor) -> Result<Tensor> {
    use kiln_torch::cxx_tensor::{as_at, from_at};
    // The C++ exception (its message) is the Kiln error's source.
    let result = ffi::bridge::squared_relu(as_at(x))
        .map_err(|e| Error::backend_with_source("example", "squared_relu", e))?;
    from_at(result)
}

/// Step 5: the op in TensorFlow graphs, with its gradient, so
/// `Graph::add_gradients` differentiates through it.
///
/// ```no_run
/// use tensorflow::{ops, DataType, Scope};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let mut scope = Scope::new_root_scope();
/// let x = ops::Placeholder::new().dtype(DataType::Float).build(&mut scope)?;
/// let mut graph = scope.graph_mut();
/// let y = kiln_example_custom_op::tf::squared_relu(&mut graph, x.clone().into())?;
/// // Only `None` as the last argument: tensorflow 0.21 frees a `Some(dx)` too early.
/// let dy_dx = graph.add_gradients(None, &[y], &[x.into()], None)?;
/// # let _ = dy_dx;
/// # Ok(())
/// # }
/// ```
pub mod tf {
    use kiln_core::{Error, Result};
    use tensorflow::{Graph, Output};

    /// The op type: `ExampleSquaredRelu(x: T) -> y: T`, `T` float or double.
    pub const OP: &str = "ExampleSquaredRelu";
    /// Its backward op, which the gradient adds:
    /// `ExampleSquaredReluGrad(grad: T, x: T) -> dx: T`.
    pub const GRAD_OP: &str = "ExampleSquaredReluGrad";

    /// Registers [`OP`], [`GRAD_OP`], their CPU kernels and the gradient with
    /// TensorFlow, leaving alone whatever is already registered (by an earlier
    /// call or another copy of the ops), so calling it again is harmless. Call it
    /// before importing a graph that uses the op; [`squared_relu`] calls it.
    pub fn register() -> Result<()> {
        crate::tf_ffi::bridge::register_tf_ops()
            .map_err(|e| Error::backend_with_source("example", "registering the TensorFlow ops", e))
    }

    /// Adds an [`OP`] node, `max(x, 0)^2`, to `graph` and returns its output. `x`
    /// must be float or double (TensorFlow refuses other types here); other
    /// errors fail the session run with the op's message.
    pub fn squared_relu(graph: &mut Graph, x: Output) -> Result<Output> {
        let mut name = "SquaredRelu".to_owned();
        for i in 1.. {
            let taken = graph
                .operation_by_name(&name)
                .map_err(|e| Error::invalid_argument("name", e.to_string()))?
                .is_some();
            if !taken {
                break;
            }
            name = format!("SquaredRelu_{i}");
        }
        add_node(graph, &name, x)
    }

    /// Adds an [`OP`] node named `name` (unique in `graph`).
    pub fn add_node(graph: &mut Graph, name: &str, x: Output) -> Result<Output> {
        register()?;
        let add = |graph: &mut Graph| -> std::result::Result<Output, tensorflow::Status> {
            let mut node = graph.new_operation(OP, name)?;
            node.add_input(x);
            Ok(node.finish()?.into())
        };
        add(graph).map_err(|s| kiln_tf::tf_error(&format!("adding an {OP} node"), s))
    }
}
