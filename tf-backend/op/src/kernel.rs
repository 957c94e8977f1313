//! The C callbacks TensorFlow calls for a Rust op: the shape function and the
//! CPU kernel's create, compute and delete functions. Each is generic over the
//! op (and the element type), so every op gets its own C function pointers, and
//! each runs its body under `catch_unwind`: an error or a panic becomes the
//! node's failure status, never an unwind into C++.

use std::any::Any;
use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use kiln_custom_op::{
    AttrKind, AttrValue, Attrs, Context, CustomOp, Float, OpError, Shape, TensorMut, TensorRef,
    ThreadPool,
};

use crate::sys::{self, Status, Tensor};

/// Why a callback failed: a TensorFlow status code and the message.
struct Failure {
    code: sys::TF_Code,
    message: String,
}

impl Failure {
    fn invalid(message: impl Into<String>) -> Self {
        Failure {
            code: sys::TSL_INVALID_ARGUMENT,
            message: message.into(),
        }
    }

    fn internal(message: impl Into<String>) -> Self {
        Failure {
            code: sys::TSL_INTERNAL,
            message: message.into(),
        }
    }
}

impl From<OpError> for Failure {
    fn from(e: OpError) -> Self {
        match e {
            OpError::Invalid { .. } => Failure::invalid(e.to_string()),
            OpError::Panic { .. } => Failure::internal(e.to_string()),
        }
    }
}

/// Runs `body`, turning a panic in it (in Kiln's own callback code: the op's
/// kernel and shape function are already guarded by kiln_custom_op) into a failure.
fn guarded<R>(
    op: &str,
    what: &str,
    body: impl FnOnce() -> Result<R, Failure>,
) -> Result<R, Failure> {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|payload| {
        Err(Failure::internal(format!(
            "{op}: kiln-tf-op's {what} panicked: {}",
            panic_message(payload.as_ref())
        )))
    })
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic payload".to_owned())
}

// ----- shape inference -----

/// `O`'s shape function for TensorFlow: input shapes with unknown dimensions as
/// -1; an input of unknown rank makes every output unknown. An error from
/// `O::output_shapes` fails graph construction with its message.
pub(crate) extern "C" fn shape_fn<O: CustomOp>(
    ctx: *mut sys::TF_ShapeInferenceContext,
    status: *mut sys::TF_Status,
) {
    let op = O::schema().qualified_name();
    if let Err(f) = guarded(&op, "shape function", || infer::<O>(ctx, status)) {
        sys::set_status(status, f.code, &f.message);
    }
}

fn infer<O: CustomOp>(
    ctx: *mut sys::TF_ShapeInferenceContext,
    status: *mut sys::TF_Status,
) -> Result<(), Failure> {
    let schema = O::schema();
    let mut shapes: Vec<Shape> = Vec::with_capacity(schema.inputs.len());
    for (i, name) in schema.inputs.iter().enumerate() {
        let handle = sys::ShapeHandle::new();
        // SAFETY: ctx and status are live for this callback; `i` is below the
        // op's declared input count; handle is ours.
        unsafe { sys::TF_ShapeInferenceContextGetInput(ctx, i as i32, handle.as_ptr(), status) };
        sys::status_result(status).map_err(|m| {
            Failure::invalid(format!("{}: input `{name}`: {m}", schema.qualified_name()))
        })?;
        // SAFETY: handle was filled just above.
        if unsafe { sys::TF_ShapeInferenceContextRankKnown(ctx, handle.as_ptr()) } == 0 {
            // Nothing to say about the outputs yet.
            // SAFETY: ctx and status are live for this callback.
            unsafe { sys::TF_ShapeInferenceContextSetUnknownShape(ctx, status) };
            return Ok(());
        }
        // SAFETY: as above, the rank is known.
        let rank = unsafe { sys::TF_ShapeInferenceContextRank(ctx, handle.as_ptr()) };
        let dims = (0..rank)
            .map(|d| {
                let dim = sys::DimensionHandle::new();
                // SAFETY: d is below the rank; dim is ours.
                unsafe { sys::TF_ShapeInferenceContextDim(ctx, handle.as_ptr(), d, dim.as_ptr()) };
                dim.value()
            })
            .collect();
        shapes.push(dims);
    }
    let attrs = shape_attrs(ctx, &schema)?;
    let refs: Vec<&[i64]> = shapes.iter().map(Vec::as_slice).collect();
    let outputs = kiln_custom_op::infer_shapes::<O>(&refs, &attrs)?;
    for (i, shape) in outputs.iter().enumerate() {
        let mut err = [0 as c_char; 512];
        // SAFETY: ctx is live; `shape` holds `len` sizes; err is a writable buffer of its length.
        let rc = unsafe {
            sys::kiln_tf_op_set_output_shape(
                ctx,
                i as i32,
                shape.as_ptr(),
                shape.len() as i32,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if rc != 0 {
            return Err(Failure::internal(format!(
                "{}: output `{}`: {}",
                schema.qualified_name(),
                schema.outputs[i],
                sys::glue_message(&err)
            )));
        }
    }
    Ok(())
}

/// The node's attribute values, as the shape function sees them.
fn shape_attrs(
    ctx: *mut sys::TF_ShapeInferenceContext,
    schema: &kiln_custom_op::OpSchema,
) -> Result<Attrs, Failure> {
    let mut attrs = Attrs::defaults(schema);
    for def in &schema.attrs {
        let name = sys::c_string(&def.name);
        let kind = match def.default.kind() {
            AttrKind::Float => 0,
            AttrKind::Int => 1,
            AttrKind::Bool => 2,
        };
        let (mut f, mut n) = (0.0_f64, 0_i64);
        let mut err = [0 as c_char; 512];
        // SAFETY: ctx is live for this callback; name is NUL-terminated; the
        // out-pointers and the error buffer are ours.
        let rc = unsafe {
            sys::kiln_tf_op_shape_attr(
                ctx,
                name.as_ptr(),
                kind,
                &mut f,
                &mut n,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if rc != 0 {
            return Err(Failure::invalid(format!(
                "{}: reading attribute `{}`: {}",
                schema.qualified_name(),
                def.name,
                sys::glue_message(&err)
            )));
        }
        let value = match def.default.kind() {
            AttrKind::Float => AttrValue::Float(f),
            AttrKind::Int => AttrValue::Int(n),
            AttrKind::Bool => AttrValue::Bool(n != 0),
        };
        attrs.set(&def.name, value)?;
    }
    Ok(attrs)
}

// ----- the CPU kernel -----

/// Reads the node's attributes once, when TensorFlow creates the kernel; the
/// state is a `Box<Attrs>` that [`delete`] frees. A failure fails the kernel's
/// construction (and so the session run) with its message.
pub(crate) extern "C" fn create<O: CustomOp>(
    ctx: *mut sys::TF_OpKernelConstruction,
) -> *mut c_void {
    let schema = O::schema();
    match guarded(&schema.qualified_name(), "kernel construction", || {
        kernel_attrs(ctx, &schema)
    }) {
        Ok(attrs) => Box::into_raw(Box::new(attrs)).cast(),
        Err(f) => {
            let status = Status::new();
            sys::set_status(status.as_ptr(), f.code, &f.message);
            // SAFETY: ctx is live for this callback; status is ours, and
            // TensorFlow copies it.
            unsafe { sys::TF_OpKernelConstruction_Failure(ctx, status.as_ptr()) };
            std::ptr::null_mut()
        }
    }
}

fn kernel_attrs(
    ctx: *mut sys::TF_OpKernelConstruction,
    schema: &kiln_custom_op::OpSchema,
) -> Result<Attrs, Failure> {
    let mut attrs = Attrs::defaults(schema);
    for def in &schema.attrs {
        let name = sys::c_string(&def.name);
        let status = Status::new();
        let value = match def.default.kind() {
            AttrKind::Float => {
                let mut v = 0.0_f32;
                // SAFETY: ctx is live for this callback; name is NUL-terminated;
                // the out-value and status are ours.
                unsafe {
                    sys::TF_OpKernelConstruction_GetAttrFloat(
                        ctx,
                        name.as_ptr(),
                        &mut v,
                        status.as_ptr(),
                    )
                };
                AttrValue::Float(f64::from(v))
            }
            AttrKind::Int => {
                let mut v = 0_i64;
                // SAFETY: as for floats.
                unsafe {
                    sys::TF_OpKernelConstruction_GetAttrInt64(
                        ctx,
                        name.as_ptr(),
                        &mut v,
                        status.as_ptr(),
                    )
                };
                AttrValue::Int(v)
            }
            AttrKind::Bool => {
                let mut v: std::ffi::c_uchar = 0;
                // SAFETY: as for floats.
                unsafe {
                    sys::TF_OpKernelConstruction_GetAttrBool(
                        ctx,
                        name.as_ptr(),
                        &mut v,
                        status.as_ptr(),
                    )
                };
                AttrValue::Bool(v != 0)
            }
        };
        status.check().map_err(|m| {
            Failure::invalid(format!(
                "{}: reading attribute `{}`: {m}",
                schema.qualified_name(),
                def.name
            ))
        })?;
        attrs.set(&def.name, value)?;
    }
    Ok(attrs)
}

/// Frees the state [`create`] made.
pub(crate) extern "C" fn delete(state: *mut c_void) {
    if !state.is_null() {
        // SAFETY: a non-null state is the Box<Attrs> that `create` leaked;
        // TensorFlow calls this once per kernel.
        drop(unsafe { Box::from_raw(state.cast::<Attrs>()) });
    }
}

/// `O`'s CPU kernel on `T`: reads the inputs, allocates the outputs with the
/// shapes `O`'s shape function gives, and runs `kiln_custom_op::run` on a
/// [`ThreadPool`]; an error or panic becomes the node's failure status.
pub(crate) extern "C" fn compute<O: CustomOp, T: Float>(
    state: *mut c_void,
    ctx: *mut sys::TF_OpKernelContext,
) {
    let op = O::schema().qualified_name();
    let outcome = guarded(&op, "kernel", || {
        if state.is_null() {
            return Err(Failure::internal(format!("{op}: the kernel has no state")));
        }
        // SAFETY: a non-null state is the Box<Attrs> `create` made, alive until
        // `delete`; TensorFlow only reads it here (compute may run concurrently).
        let attrs = unsafe { &*state.cast::<Attrs>() };
        run_kernel::<O, T>(ctx, attrs)
    });
    if let Err(f) = outcome {
        let status = Status::new();
        sys::set_status(status.as_ptr(), f.code, &f.message);
        // SAFETY: ctx is live for this callback; TensorFlow copies the status.
        unsafe { sys::TF_OpKernelContext_Failure(ctx, status.as_ptr()) };
    }
}

fn run_kernel<O: CustomOp, T: Float>(
    ctx: *mut sys::TF_OpKernelContext,
    attrs: &Attrs,
) -> Result<(), Failure> {
    let schema = O::schema();
    let op = schema.qualified_name();
    let dtype = sys::tf_dtype(T::TYPE);
    // SAFETY: ctx is live for this callback.
    let n = unsafe { sys::TF_NumInputs(ctx) };
    if usize::try_from(n).ok() != Some(schema.inputs.len()) {
        return Err(Failure::internal(format!(
            "{op}: TensorFlow passed {n} inputs, the op declares {}",
            schema.inputs.len()
        )));
    }
    let mut inputs = Vec::with_capacity(schema.inputs.len());
    for (i, name) in schema.inputs.iter().enumerate() {
        let status = Status::new();
        let mut t: *mut sys::TF_Tensor = std::ptr::null_mut();
        // SAFETY: ctx is live; i < TF_NumInputs; t and status are ours.
        unsafe { sys::TF_GetInput(ctx, i as i32, &mut t, status.as_ptr()) };
        status
            .check()
            .map_err(|m| Failure::internal(format!("{op}: reading input `{name}`: {m}")))?;
        let tensor = Tensor::from_raw(t);
        if tensor.dtype() != dtype {
            return Err(Failure::invalid(format!(
                "{op}: input `{name}` has TensorFlow data type {}, expected {} like the others",
                tensor.dtype(),
                T::TYPE.name()
            )));
        }
        inputs.push(tensor);
    }
    let shapes: Vec<Shape> = inputs.iter().map(Tensor::dims).collect();
    let refs: Vec<&[i64]> = shapes.iter().map(Vec::as_slice).collect();
    let out_shapes = kiln_custom_op::infer_shapes::<O>(&refs, attrs)?;
    let mut outputs = Vec::with_capacity(out_shapes.len());
    for (i, (shape, name)) in out_shapes.iter().zip(&schema.outputs).enumerate() {
        if shape.iter().any(|&d| d < 0) {
            return Err(Failure::invalid(format!(
                "{op}: the shape function gave output `{name}` the shape {shape:?} for the known input shapes {shapes:?}"
            )));
        }
        let numel = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d as usize));
        let bytes = numel
            .and_then(|n| n.checked_mul(std::mem::size_of::<T>()))
            .ok_or_else(|| {
                Failure::invalid(format!(
                    "{op}: output `{name}` of shape {shape:?} is too large"
                ))
            })?;
        let status = Status::new();
        // SAFETY: ctx is live; i is below the op's output count; `shape` holds
        // `len` sizes; status is ours. The returned handle is owned below.
        let t = unsafe {
            sys::TF_AllocateOutput(
                ctx,
                i as i32,
                dtype,
                shape.as_ptr(),
                shape.len() as i32,
                bytes,
                status.as_ptr(),
            )
        };
        status.check().map_err(|m| {
            Failure::internal(format!("{op}: allocating output `{name}` {shape:?}: {m}"))
        })?;
        if t.is_null() {
            return Err(Failure::internal(format!(
                "{op}: TensorFlow allocated no output `{name}`"
            )));
        }
        outputs.push(Tensor::from_raw(t));
    }

    let mut views = Vec::with_capacity(inputs.len());
    for ((tensor, shape), name) in inputs.iter().zip(&shapes).zip(&schema.inputs) {
        // SAFETY: the tensor's type is T (checked above); a kernel's inputs are
        // immutable during its call.
        let data = unsafe { tensor.as_slice::<T>() }
            .map_err(|m| Failure::internal(format!("{op}: input `{name}`: {m}")))?;
        views.push(TensorRef::new(data, shape)?);
    }
    let mut out_views = Vec::with_capacity(outputs.len());
    for ((tensor, shape), name) in outputs.iter_mut().zip(&out_shapes).zip(&schema.outputs) {
        // SAFETY: allocated above with type T for this call alone; each output
        // is a separate buffer.
        let data = unsafe { tensor.as_mut_slice::<T>() }
            .map_err(|m| Failure::internal(format!("{op}: output `{name}`: {m}")))?;
        out_views.push(TensorMut::new(data, shape)?);
    }
    // TensorFlow's C API exposes no CPU thread pool to kernels: Kiln's own.
    let threads = ThreadPool::available();
    kiln_custom_op::run::<O, T>(&views, &mut out_views, attrs, &Context::new(&threads))?;
    Ok(())
}
