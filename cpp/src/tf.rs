//! The fused ops in TensorFlow graphs, with gradients.
//!
//! The same kernels as the libtorch ops ([`crate::bias_gelu`],
//! [`crate::softmax_cross_entropy`], [`crate::swish`]; one C++ definition in
//! `include/kernels.h`) are registered with TensorFlow as the op types below, for
//! float32 and float64 on the CPU. Their gradients are in TensorFlow's C++ gradient
//! registry, so `Graph::add_gradients` differentiates them (through the `*_GRAD`
//! ops); the C API alone cannot register a gradient.
//!
//! The ops are registered by the first call of [`register`], which reports a
//! registration failure; the builders here and [`crate::register_layers`] call it
//! (call it yourself before importing a graph that uses the ops). There is no
//! static initialiser, so a binary that links kiln-fused-ops but never reaches these
//! ops (one calling [`crate::register_torch_layers`] only) does not load
//! TensorFlow. Registering again, or alongside another copy of these ops, never
//! aborts.
//!
//! Errors at run time (a bias of the wrong size, a target outside `[0, C)`) fail the
//! session run with a [`tensorflow::Status`] carrying the op's message
//! (`kiln::bias_gelu: bias must have shape [4] ...`), as the libtorch ops word it.
//!
//! To differentiate `sum(y * w)`, multiply in the graph and call `add_gradients`
//! with `dx: None`: tensorflow 0.21 passes a `Some(dx)` to TensorFlow through a
//! pointer into a vector it has already dropped (a crash or garbage).
//!
//! ```no_run
//! use tensorflow::{DataType, Graph, Operation, Status};
//!
//! fn placeholder(graph: &mut Graph, name: &str, dtype: DataType) -> Result<Operation, Status> {
//!     let mut nd = graph.new_operation("Placeholder", name)?;
//!     nd.set_attr_type("dtype", dtype)?;
//!     nd.finish()
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut graph = Graph::new();
//! let x = placeholder(&mut graph, "x", DataType::Float)?;
//! let bias = placeholder(&mut graph, "bias", DataType::Float)?;
//! let y = kiln_fused_ops::tf::bias_gelu(&mut graph, "y", x.into(), bias.clone().into())?;
//! let grads = graph.add_gradients(None, &[y.into()], &[bias.into()], None)?;
//! # let _ = grads;
//! # Ok(())
//! # }
//! ```

use kiln_core::{Error, Result};
use tensorflow::{DataType, Graph, Operation, Output, Status, Tensor};

/// `KilnBiasGelu(x: T [..., C], bias: T [C]) -> y: T`: `gelu(x + bias)`, exact GELU.
pub const BIAS_GELU: &str = "KilnBiasGelu";
/// `KilnBiasGeluGrad(grad, x, bias) -> (dx, dbias)`: the backward op of [`BIAS_GELU`].
pub const BIAS_GELU_GRAD: &str = "KilnBiasGeluGrad";
/// `KilnSoftmaxXent(logits: T [N, C], target: int64 [N]) -> loss: T [N]`, attribute
/// [`LABEL_SMOOTHING`]: per-row cross-entropy with label smoothing.
pub const SOFTMAX_XENT: &str = "KilnSoftmaxXent";
/// `KilnSoftmaxXentGrad(grad [N], logits, target) -> dlogits`: the backward op of
/// [`SOFTMAX_XENT`] (same attributes).
pub const SOFTMAX_XENT_GRAD: &str = "KilnSoftmaxXentGrad";
/// `KilnSwish(x: T, beta: T [1]) -> y: T`: `x * sigmoid(beta * x)`.
pub const SWISH: &str = "KilnSwish";
/// `KilnSwishGrad(grad, x, beta) -> (dx, dbeta)`: the backward op of [`SWISH`].
pub const SWISH_GRAD: &str = "KilnSwishGrad";
/// The `float` attribute of [`SOFTMAX_XENT`] and [`SOFTMAX_XENT_GRAD`], in `[0, 1]`
/// (default 0). TensorFlow float attributes are 32-bit, also for float64 kernels.
pub const LABEL_SMOOTHING: &str = "label_smoothing";
/// Every op type registered by [`register`].
pub const OP_TYPES: [&str; 6] = [
    BIAS_GELU,
    BIAS_GELU_GRAD,
    SOFTMAX_XENT,
    SOFTMAX_XENT_GRAD,
    SWISH,
    SWISH_GRAD,
];

#[allow(unsafe_code)]
#[cxx::bridge(namespace = "kiln::ops::tf")]
mod ffi {
    // SAFETY: the declaration matches src/tf/register.h (cxx checks the signature
    // at compile time); the function takes no pointers and reports failure by
    // throwing, which `Result` turns into an error.
    unsafe extern "C++" {
        include!("kiln-fused-ops/src/tf/register.h");

        fn register_tf_ops() -> Result<()>;
        /// For tests: the registration again, past the once-per-process guard.
        // Used by the unit tests only; cxx rejects `#[cfg(test)]` in a bridge.
        #[allow(dead_code)]
        fn register_tf_ops_again() -> Result<()>;
    }
}

/// Makes sure the ops (see [`OP_TYPES`]), their CPU kernels (float32, float64) and
/// the gradients of [`BIAS_GELU`], [`SOFTMAX_XENT`] and [`SWISH`] are registered
/// with TensorFlow in this process. Idempotent and cheap after the first call.
///
/// A failed registration (reported by TensorFlow) is an [`Error::Backend`].
pub fn register() -> Result<()> {
    ffi::register_tf_ops().map_err(|e| {
        Error::backend_with_source("kiln-fused-ops", "registering the TensorFlow ops", e)
    })
}

/// Adds a `KilnBiasGelu` node named `name`: `gelu(x + bias)` with `bias` of `x`'s
/// last dimension; `T` (float or double) comes from the inputs.
pub fn bias_gelu(graph: &mut Graph, name: &str, x: Output, bias: Output) -> Result<Operation> {
    add(graph, BIAS_GELU, name, vec![x, bias], None)
}

/// Adds a `KilnSoftmaxXent` node named `name`: the per-row loss `[N]` of `logits
/// [N, C]` against int64 class indices `target [N]` with `label_smoothing` in
/// `[0, 1]` (checked when the session creates the kernel). Differentiable in `logits`.
pub fn softmax_cross_entropy(
    graph: &mut Graph,
    name: &str,
    logits: Output,
    target: Output,
    label_smoothing: f32,
) -> Result<Operation> {
    add(
        graph,
        SOFTMAX_XENT,
        name,
        vec![logits, target],
        Some(label_smoothing),
    )
}

/// Adds a `KilnSwish` node named `name`: `x * sigmoid(beta * x)` with a
/// one-element `beta`; differentiable in `x` and `beta`.
pub fn swish(graph: &mut Graph, name: &str, x: Output, beta: Output) -> Result<Operation> {
    add(graph, SWISH, name, vec![x, beta], None)
}

/// `gelu(x + bias)` (exact GELU, `z * 0.5 * (1 + erf(z / sqrt(2)))` with
/// `z = x + bias`) from standard TensorFlow ops (`AddV2`, `Mul`, `Erf`, `Const`),
/// as [`bias_gelu`] computes it in one kernel: the portable form a SavedModel
/// export writes, which Python's TensorFlow and TF Serving load without Kiln's op
/// library. The last op is named `name`, the others `name/...`; `T` (float or
/// double) comes from `x`. Differentiable through TensorFlow's own gradients.
pub fn portable_bias_gelu(
    graph: &mut Graph,
    name: &str,
    x: Output,
    bias: Output,
) -> Result<Output> {
    let dtype = x.operation.output_type(x.index as usize);
    let z = standard(graph, "AddV2", &format!("{name}/add_bias"), vec![x, bias])?;
    let rsqrt2 = scalar(
        graph,
        &format!("{name}/rsqrt2"),
        std::f64::consts::FRAC_1_SQRT_2,
        dtype,
    )?;
    let scaled = standard(
        graph,
        "Mul",
        &format!("{name}/scaled"),
        vec![z.clone(), rsqrt2],
    )?;
    let erf = standard(graph, "Erf", &format!("{name}/erf"), vec![scaled])?;
    let one = scalar(graph, &format!("{name}/one"), 1.0, dtype)?;
    let erf1 = standard(
        graph,
        "AddV2",
        &format!("{name}/erf_plus_one"),
        vec![erf, one],
    )?;
    let half = scalar(graph, &format!("{name}/half"), 0.5, dtype)?;
    let half_z = standard(graph, "Mul", &format!("{name}/half_z"), vec![z, half])?;
    standard(graph, "Mul", name, vec![half_z, erf1])
}

/// `x * sigmoid(beta * x)` from standard TensorFlow ops (`Mul`, `Sigmoid`), as
/// [`swish`] computes it in one kernel: the portable form a SavedModel export
/// writes. The last op is named `name`, the others `name/...`.
pub fn portable_swish(graph: &mut Graph, name: &str, x: Output, beta: Output) -> Result<Output> {
    let scaled = standard(
        graph,
        "Mul",
        &format!("{name}/beta_x"),
        vec![x.clone(), beta],
    )?;
    let gate = standard(graph, "Sigmoid", &format!("{name}/sigmoid"), vec![scaled])?;
    standard(graph, "Mul", name, vec![x, gate])
}

/// Adds a standard op (its `T` inferred from the inputs) and returns its output.
fn standard(graph: &mut Graph, op_type: &str, name: &str, inputs: Vec<Output>) -> Result<Output> {
    let build = |graph: &mut Graph| -> std::result::Result<Operation, Status> {
        let mut nd = graph.new_operation(op_type, name)?;
        for input in inputs {
            nd.add_input(input);
        }
        nd.finish()
    };
    build(graph)
        .map(Output::from)
        .map_err(|s| kiln_tf::tf_error(&format!("adding TensorFlow op {op_type} ({name})"), s))
}

/// A scalar `Const` of `dtype` (float or double).
fn scalar(graph: &mut Graph, name: &str, value: f64, dtype: DataType) -> Result<Output> {
    let build = |graph: &mut Graph| -> std::result::Result<Operation, Status> {
        let mut nd = graph.new_operation("Const", name)?;
        nd.set_attr_type("dtype", dtype)?;
        match dtype {
            DataType::Double => nd.set_attr_tensor("value", Tensor::<f64>::from(value))?,
            _ => nd.set_attr_tensor("value", Tensor::<f32>::from(value as f32))?,
        }
        nd.finish()
    };
    if !matches!(dtype, DataType::Float | DataType::Double) {
        return Err(Error::invalid_argument(
            name,
            format!("expected a float32 or float64 input, got {dtype:?}"),
        ));
    }
    build(graph)
        .map(Output::from)
        .map_err(|s| kiln_tf::tf_error(&format!("adding TensorFlow op Const ({name})"), s))
}

fn add(
    graph: &mut Graph,
    op_type: &str,
    name: &str,
    inputs: Vec<Output>,
    label_smoothing: Option<f32>,
) -> Result<Operation> {
    register()?;
    let build = |graph: &mut Graph| -> std::result::Result<Operation, Status> {
        let mut nd = graph.new_operation(op_type, name)?;
        for input in inputs {
            nd.add_input(input);
        }
        if let Some(eps) = label_smoothing {
            nd.set_attr_float(LABEL_SMOOTHING, eps)?;
        }
        nd.finish()
    };
    build(graph).map_err(|s| kiln_tf::tf_error(&format!("adding TensorFlow op {op_type}"), s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registering_twice_is_fine() {
        register().unwrap();
        register().unwrap();
        // As a second copy of the ops would: everything is found and left alone
        // (TensorFlow itself aborts on a duplicate op or gradient).
        ffi::register_tf_ops_again().unwrap();
        ffi::register_tf_ops_again().unwrap();
        // One kernel per type still: a duplicate would fail the run with
        // "Multiple OpKernel registrations match NodeDef".
        let mut graph = Graph::new();
        let constant = |graph: &mut Graph, name: &str, values: &[f32], dims: &[u64]| {
            let tensor = tensorflow::Tensor::new(dims).with_values(values).unwrap();
            let mut nd = graph.new_operation("Const", name).unwrap();
            nd.set_attr_type("dtype", tensorflow::DataType::Float)
                .unwrap();
            nd.set_attr_tensor("value", tensor).unwrap();
            nd.finish().unwrap()
        };
        let x = constant(&mut graph, "x", &[1.0, -2.0], &[2]);
        let beta = constant(&mut graph, "beta", &[1.0], &[1]);
        let y = swish(&mut graph, "y", x.into(), beta.into()).unwrap();
        let session = tensorflow::Session::new(&tensorflow::SessionOptions::new(), &graph).unwrap();
        let mut args = tensorflow::SessionRunArgs::new();
        let token = args.request_fetch(&y, 0);
        session.run(&mut args).unwrap();
        let y = args.fetch::<f32>(token).unwrap();
        let expected = [1.0 / (1.0 + (-1f32).exp()), -2.0 / (1.0 + 2f32.exp())];
        assert!((y[0] - expected[0]).abs() < 1e-6 && (y[1] - expected[1]).abs() < 1e-6);
    }
}
