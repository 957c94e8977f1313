//! Registering a [`CustomOp`] with TensorFlow: the op definition, the CPU
//! kernels for float and double, and the gradient.

use std::any::TypeId;
use std::collections::BTreeMap;
use std::ffi::c_char;
use std::sync::{Mutex, MutexGuard};

use kiln_core::{Error, Result};
use kiln_custom_op::{AttrValue, CustomOp, OpSchema, Saved};

use crate::kernel;
use crate::sys::{self, Status};

/// An op registered through this crate.
struct Registered {
    type_id: TypeId,
    schema: OpSchema,
}

/// TensorFlow op type -> the op registered under it by this crate. Held while
/// registering, so that checking and registering are one step.
static REGISTERED: Mutex<BTreeMap<String, Registered>> = Mutex::new(BTreeMap::new());

fn registered() -> MutexGuard<'static, BTreeMap<String, Registered>> {
    // The map stays consistent even if a holder panicked: entries are only inserted.
    REGISTERED.lock().unwrap_or_else(|p| p.into_inner())
}

/// Registers `O` with TensorFlow in this process: its op definition (type
/// [`OpSchema::tf_op_name`], inputs `x: T`, outputs `y: T`, attribute
/// `T: {float, double}` and each of the schema's attributes with its default),
/// its shape function, its CPU kernels for float32 and float64, and, when the
/// schema names a gradient op, a gradient in TensorFlow's C++ gradient registry,
/// so that `Graph::add_gradients` differentiates it. The gradient op is looked up
/// by type when a gradient is built: register it too, before or after.
///
/// TensorFlow keeps float attributes as 32-bit floats: the kernel sees an
/// `eps` of `1e-6` as `1e-6_f32 as f64`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] naming the op when its schema is invalid, when it
/// is already registered in this process (TensorFlow would abort the process
/// on a second registration, so Kiln refuses it), when TensorFlow already knows
/// an op of that type from elsewhere, or when it and its gradient op (both
/// registered through this crate) do not fit each other
/// ([`OpSchema::check_gradient_op`]); [`Error::Backend`] when TensorFlow refuses
/// a registration.
///
/// Register at start-up, before building graphs on other threads: TensorFlow's
/// gradient registry is not synchronised.
pub fn register<O: CustomOp>() -> Result<()> {
    register_inner::<O>(false)
}

/// Whether `O` is registered with TensorFlow through [`register`] in this process.
pub fn is_registered<O: CustomOp>() -> bool {
    registered()
        .get(&O::schema().tf_op_name())
        .is_some_and(|r| r.type_id == TypeId::of::<O>())
}

/// [`register`], or nothing when `O` itself is registered already and `allow_same`.
pub(crate) fn register_inner<O: CustomOp>(allow_same: bool) -> Result<()> {
    let schema = O::schema();
    let op = schema.qualified_name();
    schema
        .validate()
        .map_err(|e| Error::invalid_argument(op.clone(), e.to_string()))?;
    for a in &schema.attrs {
        if matches!(a.default, AttrValue::Float(v) if !(v as f32).is_finite()) {
            // TensorFlow would fail to parse the default, and abort.
            return Err(Error::invalid_argument(
                op,
                format!(
                    "the default of `{}` is outside float32's range; TensorFlow keeps float \
                     attributes as float32",
                    a.name
                ),
            ));
        }
    }
    let op_type = schema.tf_op_name();
    let mut table = registered();
    if let Some(existing) = table.get(&op_type) {
        if allow_same && existing.type_id == TypeId::of::<O>() {
            return Ok(());
        }
        return Err(Error::invalid_argument(
            op.clone(),
            format!(
                "the op is already registered with TensorFlow in this process (as op type \
                 {op_type}, by `{}`); register each op once",
                existing.schema.qualified_name()
            ),
        ));
    }
    if op_known_to_tensorflow(&op_type) {
        return Err(Error::invalid_argument(
            op,
            format!(
                "TensorFlow already has an op type {op_type} (built in or from another \
                 library); choose another namespace or name"
            ),
        ));
    }
    check_gradient_pairs(&schema, &table)?;

    register_definition::<O>(&schema, &op_type)?;
    // From here on TensorFlow knows the op: record it even if a later step fails,
    // so that a retry is refused instead of aborting the process.
    table.insert(
        op_type.clone(),
        Registered {
            type_id: TypeId::of::<O>(),
            schema: schema.clone(),
        },
    );
    register_kernels::<O>(&schema, &op_type)?;
    if let Some(gradient) = &schema.gradient {
        let grad_type = schema.tf_gradient_op_name().unwrap_or_default();
        register_gradient(&schema, &op_type, &grad_type, gradient.saves)?;
    }
    log::debug!("registered {op} with TensorFlow as {op_type}");
    Ok(())
}

/// Checks `schema` against its gradient op and the ops it is the gradient of,
/// where those are registered through this crate.
fn check_gradient_pairs(schema: &OpSchema, table: &BTreeMap<String, Registered>) -> Result<()> {
    let invalid = |e: kiln_custom_op::OpError| {
        Error::invalid_argument(schema.qualified_name(), e.to_string())
    };
    if let Some(grad) = schema.tf_gradient_op_name().and_then(|g| table.get(&g)) {
        schema.check_gradient_op(&grad.schema).map_err(invalid)?;
    }
    let op_type = schema.tf_op_name();
    for forward in table.values() {
        if forward.schema.tf_gradient_op_name().as_deref() == Some(op_type.as_str()) {
            forward.schema.check_gradient_op(schema).map_err(invalid)?;
        }
    }
    Ok(())
}

fn op_known_to_tensorflow(op_type: &str) -> bool {
    let name = sys::c_string(op_type);
    // SAFETY: name is NUL-terminated; the glue only reads it and catches everything.
    unsafe { sys::kiln_tf_op_is_registered(name.as_ptr()) != 0 }
}

/// The attribute lines of the op definition: `T` and the schema's, with defaults.
fn attr_specs(schema: &OpSchema) -> Vec<String> {
    let mut specs = vec!["T: {float, double}".to_owned()];
    specs.extend(schema.attrs.iter().map(|a| match a.default {
        // TensorFlow parses the default as an f32.
        AttrValue::Float(v) => format!("{}: float = {:?}", a.name, v as f32),
        AttrValue::Int(v) => format!("{}: int = {v}", a.name),
        AttrValue::Bool(v) => format!("{}: bool = {v}", a.name),
    }));
    specs
}

fn register_definition<O: CustomOp>(schema: &OpSchema, op_type: &str) -> Result<()> {
    let name = sys::c_string(op_type);
    // SAFETY: name is NUL-terminated; the builder is consumed by
    // TF_RegisterOpDefinition below.
    let builder = unsafe { sys::TF_NewOpDefinitionBuilder(name.as_ptr()) };
    for spec in attr_specs(schema) {
        let spec = sys::c_string(&spec);
        // SAFETY: builder is live; TensorFlow copies the string.
        unsafe { sys::TF_OpDefinitionBuilderAddAttr(builder, spec.as_ptr()) };
    }
    for input in &schema.inputs {
        let spec = sys::c_string(&format!("{input}: T"));
        // SAFETY: as above.
        unsafe { sys::TF_OpDefinitionBuilderAddInput(builder, spec.as_ptr()) };
    }
    for output in &schema.outputs {
        let spec = sys::c_string(&format!("{output}: T"));
        // SAFETY: as above.
        unsafe { sys::TF_OpDefinitionBuilderAddOutput(builder, spec.as_ptr()) };
    }
    let status = Status::new();
    // SAFETY: builder is live; shape_fn::<O> is an extern "C" fn of the
    // signature TensorFlow expects, alive for the whole process. Registering
    // takes ownership of the builder.
    unsafe {
        sys::TF_OpDefinitionBuilderSetShapeInferenceFunction(builder, Some(kernel::shape_fn::<O>));
        sys::TF_RegisterOpDefinition(builder, status.as_ptr());
    }
    status.check().map_err(|m| {
        Error::backend(
            "tensorflow",
            format!("registering op {op_type} ({})", schema.qualified_name()),
            m,
        )
    })
}

fn register_kernels<O: CustomOp>(schema: &OpSchema, op_type: &str) -> Result<()> {
    type Compute = unsafe extern "C" fn(*mut std::ffi::c_void, *mut sys::TF_OpKernelContext);
    let kernels: [(sys::TF_DataType, Compute); 2] = [
        (sys::TF_FLOAT, kernel::compute::<O, f32>),
        (sys::TF_DOUBLE, kernel::compute::<O, f64>),
    ];
    let name = sys::c_string(op_type);
    let device = sys::c_string("CPU");
    let attr = sys::c_string("T");
    let kernel_name = sys::c_string(&format!("{op_type}Op"));
    for (dtype, compute) in kernels {
        let fail = |m: String| {
            Error::backend(
                "tensorflow",
                format!(
                    "registering the CPU kernel of {op_type} ({}) for data type {dtype}",
                    schema.qualified_name()
                ),
                m,
            )
        };
        // SAFETY: the strings are NUL-terminated and copied; the callbacks are
        // extern "C" fns of the expected signatures, alive for the process.
        let builder = unsafe {
            sys::TF_NewKernelBuilder(
                name.as_ptr(),
                device.as_ptr(),
                Some(kernel::create::<O>),
                Some(compute),
                Some(kernel::delete),
            )
        };
        let status = Status::new();
        // SAFETY: builder is live; attr is NUL-terminated.
        unsafe {
            sys::TF_KernelBuilder_TypeConstraint(builder, attr.as_ptr(), dtype, status.as_ptr())
        };
        if let Err(m) = status.check() {
            // SAFETY: the builder was not registered, so it is still ours to free.
            unsafe { sys::TF_DeleteKernelBuilder(builder) };
            return Err(fail(m));
        }
        // SAFETY: builder is live and handed over to TensorFlow here.
        unsafe { sys::TF_RegisterKernelBuilder(kernel_name.as_ptr(), builder, status.as_ptr()) };
        status.check().map_err(fail)?;
    }
    Ok(())
}

fn register_gradient(
    schema: &OpSchema,
    op_type: &str,
    grad_type: &str,
    saves: Saved,
) -> Result<()> {
    let op = sys::c_string(op_type);
    let grad = sys::c_string(grad_type);
    let mut err = [0 as c_char; 1024];
    // SAFETY: the strings are NUL-terminated and copied by the glue; err is a
    // writable buffer of the length passed; the glue catches every exception.
    let rc = unsafe {
        sys::kiln_tf_op_register_gradient(
            op.as_ptr(),
            grad.as_ptr(),
            schema.inputs.len() as i32,
            schema.outputs.len() as i32,
            i32::from(saves == Saved::InputsAndOutputs),
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::backend(
            "tensorflow",
            format!(
                "registering the gradient of {op_type} ({})",
                schema.qualified_name()
            ),
            sys::glue_message(&err),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attribute_lines_parse_back() {
        let schema = OpSchema::new("t", "op")
            .input("x")
            .output("y")
            .attr("eps", AttrValue::Float(1e-6))
            .attr("k", AttrValue::Int(-3))
            .attr("flag", AttrValue::Bool(true));
        assert_eq!(
            attr_specs(&schema),
            [
                "T: {float, double}",
                "eps: float = 1e-6",
                "k: int = -3",
                "flag: bool = true"
            ]
        );
    }
}
