//! Calling registered ops from Rust on `tch` tensors, and ops as
//! `Layer::Custom` layers (feature `tch`).

use std::ffi::{c_char, CString};

use kiln_core::model::CustomConfig;
use kiln_core::{Error, Result};
use kiln_custom_op::{AttrValue, Attrs, CustomOp, OpSchema};
use tch::Tensor;

use crate::registry::{c_message, ensure_registered};
use crate::sys::{self, AtenTensorHandle};

/// The most outputs [`call`] takes back from one op.
const MAX_OUTPUTS: usize = 64;

/// Calls the registered op `op` (`namespace::name`, as `torch.ops` names it)
/// through libtorch's dispatcher, so autograd applies: with inputs that
/// require grad, the outputs have a `grad_fn` whose backward runs the op's
/// gradient op. `attrs` are passed after the tensors in their order (an
/// [`Attrs`] made from the op's schema has them in schema order); attributes
/// left out take the schema's defaults.
///
/// ```no_run
/// # struct RmsNorm;
/// # impl kiln_custom_op::CustomOp for RmsNorm {
/// #     fn schema() -> kiln_custom_op::OpSchema { kiln_custom_op::OpSchema::new("demo", "rms_norm").input("x").input("weight").output("y").attr("eps", kiln_custom_op::AttrValue::Float(1e-6)) }
/// #     fn output_shapes(i: &[&[i64]], _: &kiln_custom_op::Attrs) -> Result<Vec<kiln_custom_op::Shape>, kiln_custom_op::OpError> { Ok(vec![i[0].to_vec()]) }
/// #     fn compute<T: kiln_custom_op::Float>(_: &[kiln_custom_op::TensorRef<'_, T>], _: &mut [kiln_custom_op::TensorMut<'_, T>], _: &kiln_custom_op::Attrs, _: &kiln_custom_op::Context<'_>) -> Result<(), kiln_custom_op::OpError> { Ok(()) }
/// # }
/// use kiln_custom_op::{AttrValue, Attrs, CustomOp};
///
/// kiln_torch_op::register::<RmsNorm>()?;
/// let x = tch::Tensor::randn([4, 8], (tch::Kind::Float, tch::Device::Cpu));
/// let w = tch::Tensor::ones([8], (tch::Kind::Float, tch::Device::Cpu));
/// let mut attrs = Attrs::defaults(&RmsNorm::schema());
/// attrs.set("eps", AttrValue::Float(1e-5)).map_err(|e| kiln_core::Error::invalid_argument("eps", e.to_string()))?;
/// let y = kiln_torch_op::call("demo::rms_norm", &[&x, &w], &attrs)?.remove(0);
/// # Ok::<(), kiln_core::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::Backend`] with libtorch's message as its source: no such op, a
/// wrong number of arguments, or the kernel's own error (a bad shape or dtype,
/// a panic in a Rust kernel), which names the op and the input.
pub fn call(op: &str, inputs: &[&Tensor], attrs: &Attrs) -> Result<Vec<Tensor>> {
    let name = CString::new(op).map_err(|_| Error::invalid_argument(op, "contains a NUL byte"))?;
    let handles: Vec<AtenTensorHandle> = inputs
        .iter()
        .map(|t| t.as_ptr().cast_mut().cast())
        .collect();
    let (kinds, bits): (Vec<u8>, Vec<u64>) = attrs
        .iter()
        .map(|(_, value)| match value {
            AttrValue::Float(v) => (sys::KILN_TORCH_OP_ATTR_FLOAT as u8, v.to_bits()),
            AttrValue::Int(v) => (sys::KILN_TORCH_OP_ATTR_INT as u8, v as u64),
            AttrValue::Bool(v) => (sys::KILN_TORCH_OP_ATTR_BOOL as u8, u64::from(v)),
        })
        .unzip();
    let mut outputs: Vec<AtenTensorHandle> = vec![std::ptr::null_mut(); MAX_OUTPUTS];
    let mut n_outputs = 0usize;
    let mut err = vec![0 as c_char; 4096];
    // SAFETY: every pointer comes with its length; the input handles are
    // `at::Tensor*` (tch's C_tensor), borrowed for the call; the glue catches
    // every C++ exception and writes at most MAX_OUTPUTS new handles.
    let rc = unsafe {
        sys::kiln_torch_op_call(
            name.as_ptr(),
            handles.as_ptr(),
            handles.len(),
            kinds.as_ptr(),
            bits.as_ptr(),
            kinds.len(),
            outputs.as_mut_ptr(),
            outputs.len(),
            &mut n_outputs,
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if rc != 0 {
        return Err(Error::backend("torch", format!("`{op}`"), c_message(&err)));
    }
    Ok(outputs[..n_outputs]
        .iter()
        // SAFETY: each is a new `at::Tensor*` the glue allocated for the
        // caller; tch's Tensor takes ownership and frees it.
        .map(|&handle| unsafe { Tensor::from_ptr(handle.cast()) })
        .collect())
}

/// Registers `O` (with [`register`](crate::register), unless this process
/// registered that same type already) and makes it a
/// [`Layer::Custom`](kiln_core::model::Layer::Custom) layer named
/// `namespace::name` on libtorch (`kiln_torch::register_custom_layer`).
///
/// The layer passes its input `x` and then its params, in order, as the op's
/// inputs, so it declares one param per op input after the first; its
/// `attrs` set the op's attributes by name (the others keep their defaults);
/// its output is the op's first output. Gradients reach the params through
/// the op's gradient op.
///
/// ```toml
/// { type = "custom", op = "example_rs::rms_norm", params = [{ name = "weight", shape = [64], init = { type = "ones" } }], attrs = { eps = 1e-5 } }
/// ```
///
/// # Errors
///
/// Those of [`register`](crate::register). Building a model fails later when a
/// layer declares the wrong number of params, or an attribute the op does
/// not have or a value its kind cannot hold.
pub fn register_layer<O: CustomOp>() -> Result<()> {
    ensure_registered::<O>()?;
    let schema = O::schema();
    let name = schema.qualified_name();
    kiln_torch::register_custom_layer(&name.clone(), move |x, params, config| {
        check_params(&schema, params.len(), config)?;
        let attrs = layer_attrs(&schema, config)?;
        let mut inputs = Vec::with_capacity(1 + params.len());
        inputs.push(x);
        inputs.extend_from_slice(params);
        call(&name, &inputs, &attrs)?
            .into_iter()
            .next()
            .ok_or_else(|| {
                Error::backend("torch", format!("`{name}`"), "the op returned no tensor")
            })
    });
    Ok(())
}

/// Checks that the layer declares one param per op input after `x`.
fn check_params(schema: &OpSchema, given: usize, config: &CustomConfig) -> Result<()> {
    let expected = &schema.inputs[1..];
    if given == expected.len() {
        return Ok(());
    }
    let declared: Vec<&str> = config.params.iter().map(|p| p.name.as_str()).collect();
    Err(Error::invalid_argument(
        format!("{}.params", config.op),
        format!(
            "`{}` takes {} then {expected:?}: the layer passes x then its params, so it needs \
             {} params, got {given} ({declared:?})",
            schema.qualified_name(),
            schema.inputs[0],
            expected.len()
        ),
    ))
}

/// The op's attributes with the layer's values set by name.
fn layer_attrs(schema: &OpSchema, config: &CustomConfig) -> Result<Attrs> {
    Attrs::from_numbers(schema, config.attrs.iter().map(|(k, &v)| (k.as_str(), v))).map_err(
        |(key, e)| Error::invalid_argument(format!("{}.attrs.{key}", config.op), e.to_string()),
    )
}
