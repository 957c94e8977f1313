//! The boxed kernels libtorch calls: one CPU kernel and one Meta kernel per op
//! type, generic functions instantiated by [`register`](crate::register).
//!
//! libtorch calls a boxed kernel with a stack of `StableIValue`s: the inputs
//! (tensors as owned `at::Tensor*`, which the kernel must free; `int`, `float`
//! and `bool` as raw bits), and the kernel writes its outputs (new owned
//! tensors, which libtorch frees) to the start of the same stack.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::c_void;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use kiln_custom_op::{
    AttrValue, Attrs, Context, CustomOp, Float, OpSchema, Parallel, TensorMut, TensorRef,
};

use crate::sys::{self, AtenTensorHandle, StableIValue};
use crate::tensor::{device_name, dtype_name, OwnedTensor};

/// What Rust kernels say about a tensor on a GPU.
pub(crate) const CPU_ONLY: &str =
    "kiln ops written in Rust run on CPU; write a CUDA kernel in C++ (see kiln-fused-ops)";

/// The type of a boxed kernel, as this crate defines it: `C-unwind`, because
/// it raises errors as C++ exceptions that unwind through it.
pub(crate) type BoxedKernel = unsafe extern "C-unwind" fn(*mut StableIValue, u64, u64);

/// The CPU kernel of `O` (also registered for CUDA, where it refuses the tensors
/// with [`CPU_ONLY`]).
///
/// # Safety
///
/// Called by libtorch's dispatcher only, with the stack of `O`'s schema.
pub(crate) unsafe extern "C-unwind" fn boxed<O: CustomOp>(
    stack: *mut StableIValue,
    num_args: u64,
    num_outputs: u64,
) {
    // SAFETY: libtorch's contract for a boxed kernel, which this function's
    // own contract passes on.
    let result = catch_unwind(AssertUnwindSafe(|| unsafe {
        run_boxed::<O>(stack, num_args, num_outputs, Mode::Compute)
    }));
    raise_if_failed::<O>(result);
}

/// The Meta kernel of `O`: outputs of the shapes `O`'s shape function gives,
/// on the meta device, nothing computed (fake tensors, `torch.compile`).
///
/// # Safety
///
/// As [`boxed`].
pub(crate) unsafe extern "C-unwind" fn boxed_meta<O: CustomOp>(
    stack: *mut StableIValue,
    num_args: u64,
    num_outputs: u64,
) {
    // SAFETY: as in `boxed`.
    let result = catch_unwind(AssertUnwindSafe(|| unsafe {
        run_boxed::<O>(stack, num_args, num_outputs, Mode::Meta)
    }));
    raise_if_failed::<O>(result);
}

/// Returns on success; else raises the error as a `c10::Error`.
fn raise_if_failed<O: CustomOp>(result: Result<Result<(), String>, Box<dyn Any + Send>>) {
    let message = match result {
        Ok(Ok(())) => return,
        Ok(Err(message)) => message,
        Err(payload) => {
            // The schema is user code too: a panic there must not escape either.
            let op = catch_unwind(|| O::schema().qualified_name())
                .unwrap_or_else(|_| std::any::type_name::<O>().to_owned());
            format!(
                "{op}: kiln-torch-op panicked: {}",
                panic_message(payload.as_ref())
            )
        }
    };
    throw(message);
}

/// The text of a panic payload.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic payload".to_owned())
}

thread_local! {
    /// The message of the error being raised: the exception unwinds through
    /// Rust frames, so the message lives where no `Drop` is pending.
    static RAISING: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Throws `message` as a `c10::Error` into libtorch, through the calling
/// kernel's frame (an `extern "C-unwind"` function: defined behaviour).
fn throw(message: String) {
    let (ptr, len) = RAISING.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) => {
            *slot = message;
            (slot.as_ptr(), slot.len())
        }
        // Not reentrant; a static message if it ever were.
        Err(_) => {
            const FALLBACK: &str = "kiln-torch-op: an error while raising another";
            (FALLBACK.as_ptr(), FALLBACK.len())
        }
    });
    // SAFETY: `ptr` points at `len` bytes that stay alive (the thread-local, or
    // a static) while the glue copies them into the exception it throws. The
    // exception unwinds through this frame and the kernel's, both `C-unwind`
    // or Rust ABI, holding nothing to drop.
    unsafe { sys::kiln_torch_op_throw(ptr.cast(), len) };
    // kiln_torch_op_throw never returns.
    std::process::abort();
}

/// What a boxed kernel does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Run the kernel on CPU tensors.
    Compute,
    /// Only allocate outputs of the right shapes on the meta device.
    Meta,
}

/// The kernel's work, with errors as messages that name the op.
///
/// # Safety
///
/// `stack` holds `max(num_args, num_outputs)` values, the first `num_args`
/// being `O`'s arguments as libtorch encodes them.
unsafe fn run_boxed<O: CustomOp>(
    stack: *mut StableIValue,
    num_args: u64,
    num_outputs: u64,
    mode: Mode,
) -> Result<(), String> {
    let schema = O::schema();
    let op = schema.qualified_name();
    let (n_in, n_out) = (schema.inputs.len(), schema.outputs.len());
    if num_args != (n_in + schema.attrs.len()) as u64 || num_outputs != n_out as u64 {
        return Err(format!(
            "{op}: libtorch passed {num_args} arguments for {num_outputs} outputs, expected {} and {n_out}",
            n_in + schema.attrs.len()
        ));
    }
    // SAFETY: the caller's contract: `num_args` initialised values.
    let args: Vec<StableIValue> =
        unsafe { std::slice::from_raw_parts(stack, num_args as usize) }.to_vec();
    // Owned at once, so every input is freed on every path.
    let mut inputs: Vec<OwnedTensor> = args[..n_in]
        .iter()
        // SAFETY: the dispatcher hands the kernel one owned reference per tensor argument.
        .map(|&v| unsafe { OwnedTensor::from_raw(v as usize as AtenTensorHandle) })
        .collect();
    let attrs = read_attrs(&schema, &args[n_in..])?;

    let (dtype, device_type, device_index) = check_inputs(&schema, &inputs, mode)?;
    let mut shapes = Vec::with_capacity(n_in);
    for input in &mut inputs {
        if mode == Mode::Compute && !input.is_contiguous()? {
            *input = input.contiguous()?;
        }
        shapes.push(input.sizes()?);
    }
    let shape_refs: Vec<&[i64]> = shapes.iter().map(Vec::as_slice).collect();
    let out_shapes =
        kiln_custom_op::infer_shapes::<O>(&shape_refs, &attrs).map_err(|e| e.to_string())?;
    let mut outputs = Vec::with_capacity(n_out);
    for (shape, name) in out_shapes.iter().zip(&schema.outputs) {
        if shape.iter().any(|&d| d < 0) {
            return Err(format!(
                "{op}: the shape function gave output `{name}` the shape {shape:?}, expected known sizes"
            ));
        }
        outputs.push(OwnedTensor::empty(shape, dtype, device_type, device_index)?);
    }
    if mode == Mode::Compute {
        // SAFETY: plain constant getters.
        let (f32_code, f64_code) = unsafe {
            (
                sys::aoti_torch_dtype_float32(),
                sys::aoti_torch_dtype_float64(),
            )
        };
        let result = if dtype == f32_code {
            compute::<O, f32>(&inputs, &shapes, &outputs, &out_shapes, &attrs)
        } else if dtype == f64_code {
            compute::<O, f64>(&inputs, &shapes, &outputs, &out_shapes, &attrs)
        } else {
            Err(format!("{op}: unexpected dtype {}", dtype_name(dtype)))
        };
        result?;
    }
    for (i, output) in outputs.into_iter().enumerate() {
        // SAFETY: `i < num_outputs`, within the stack; libtorch now owns the reference.
        unsafe { *stack.add(i) = output.into_raw() as usize as StableIValue };
    }
    drop(inputs);
    Ok(())
}

/// The attributes from their stack values (`float` as f64 bits, `int` as i64
/// bits, `bool` in the low byte).
fn read_attrs(schema: &OpSchema, values: &[StableIValue]) -> Result<Attrs, String> {
    let mut attrs = Attrs::defaults(schema);
    for (def, &bits) in schema.attrs.iter().zip(values) {
        let value = match def.default {
            AttrValue::Float(_) => AttrValue::Float(f64::from_bits(bits)),
            AttrValue::Int(_) => AttrValue::Int(bits as i64),
            AttrValue::Bool(_) => AttrValue::Bool(bits & 0xff != 0),
        };
        attrs
            .set(&def.name, value)
            .map_err(|e| format!("{}: {e}", schema.qualified_name()))?;
    }
    Ok(attrs)
}

/// Checks that every input is float32 or float64, all of one dtype, on the
/// CPU (meta for the Meta kernel); returns that dtype and the device.
fn check_inputs(
    schema: &OpSchema,
    inputs: &[OwnedTensor],
    mode: Mode,
) -> Result<(i32, i32, i32), String> {
    let op = schema.qualified_name();
    // SAFETY: plain constant getters.
    let (cpu, cuda, meta, f32_code, f64_code) = unsafe {
        (
            sys::aoti_torch_device_type_cpu(),
            sys::aoti_torch_device_type_cuda(),
            sys::aoti_torch_device_type_meta(),
            sys::aoti_torch_dtype_float32(),
            sys::aoti_torch_dtype_float64(),
        )
    };
    let expected_device = if mode == Mode::Meta { meta } else { cpu };
    let mut first: Option<(i32, &str)> = None;
    for (input, name) in inputs.iter().zip(&schema.inputs) {
        let device = input.device_type()?;
        if device == cuda {
            return Err(format!("{op}: input `{name}` is on CUDA: {CPU_ONLY}"));
        }
        if device != expected_device {
            return Err(format!(
                "{op}: input `{name}` is on {}, expected {} (every input on one device)",
                device_name(device),
                device_name(expected_device)
            ));
        }
        let dtype = input.dtype()?;
        if dtype != f32_code && dtype != f64_code {
            return Err(format!(
                "{op}: input `{name}` is {}, expected float32 or float64",
                dtype_name(dtype)
            ));
        }
        match first {
            None => first = Some((dtype, name)),
            Some((d, first_name)) if d != dtype => {
                return Err(format!(
                    "{op}: input `{name}` is {}, expected {} like `{first_name}` (every input has one dtype)",
                    dtype_name(dtype),
                    dtype_name(d)
                ));
            }
            Some(_) => {}
        }
    }
    let device_index = match inputs.first() {
        Some(input) => input.device_index()?,
        None => -1,
    };
    match first {
        Some((dtype, _)) => Ok((dtype, expected_device, device_index)),
        None => Err(format!("{op}: an op needs at least one tensor input")),
    }
}

/// Runs `O`'s kernel on `T` over the tensors' memory.
fn compute<O: CustomOp, T: Float>(
    inputs: &[OwnedTensor],
    shapes: &[Vec<i64>],
    outputs: &[OwnedTensor],
    out_shapes: &[Vec<i64>],
    attrs: &Attrs,
) -> Result<(), String> {
    let views = |tensor: &OwnedTensor, shape: &[i64]| -> Result<(*mut T, usize), String> {
        let len = shape.iter().product::<i64>() as usize;
        Ok((tensor.data_ptr()?.cast::<T>(), len))
    };
    let mut refs = Vec::with_capacity(inputs.len());
    for (tensor, shape) in inputs.iter().zip(shapes) {
        let (ptr, len) = views(tensor, shape)?;
        let data: &[T] = if len == 0 {
            &[]
        } else {
            // SAFETY: a contiguous CPU tensor of dtype T with `len` elements
            // from `ptr`, kept alive by `inputs` for this borrow; the kernel
            // only reads it.
            unsafe { std::slice::from_raw_parts(ptr, len) }
        };
        refs.push(TensorRef::new(data, shape).map_err(|e| e.to_string())?);
    }
    let mut muts = Vec::with_capacity(outputs.len());
    for (tensor, shape) in outputs.iter().zip(out_shapes) {
        let (ptr, len) = views(tensor, shape)?;
        let data: &mut [T] = if len == 0 {
            &mut []
        } else {
            // SAFETY: a fresh contiguous CPU tensor of dtype T with `len`
            // elements, allocated for this call: no other reference to its
            // memory exists (inputs are other tensors), so the slice is unique.
            unsafe { std::slice::from_raw_parts_mut(ptr, len) }
        };
        muts.push(TensorMut::new(data, shape).map_err(|e| e.to_string())?);
    }
    kiln_custom_op::run::<O, T>(&refs, &mut muts, attrs, &Context::new(&TorchParallel))
        .map_err(|e| e.to_string())
}

/// Loops on libtorch's intra-op thread pool (`at::parallel_for`, through the
/// stable ABI's `torch_parallel_for`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TorchParallel;

/// One `parallel_for`: the body, and the first panic of any worker.
struct Job<'a> {
    body: &'a (dyn Fn(usize, usize) + Sync),
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

/// The C callback `torch_parallel_for` calls on each range. A panic is caught
/// here (it must not unwind into libtorch's workers) and raised again by
/// [`TorchParallel::parallel_for`] on the calling thread.
unsafe extern "C" fn run_range(begin: i64, end: i64, ctx: *mut c_void) {
    // SAFETY: `ctx` is the `Job` that `parallel_for` passed, alive until
    // `torch_parallel_for` returns, which is after every call of this function.
    let job = unsafe { &*ctx.cast::<Job<'_>>() };
    let result = catch_unwind(AssertUnwindSafe(|| {
        (job.body)(begin as usize, end as usize)
    }));
    if let Err(payload) = result {
        let mut slot = job.panic.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(payload);
    }
}

impl Parallel for TorchParallel {
    fn parallel_for(&self, len: usize, grain: usize, body: &(dyn Fn(usize, usize) + Sync)) {
        if len == 0 {
            return;
        }
        let job = Job {
            body,
            panic: Mutex::new(None),
        };
        // SAFETY: `run_range` matches ParallelFunc and reads `job` (alive for
        // the whole call) as a `Job`; it catches every panic.
        let rc = unsafe {
            sys::torch_parallel_for(
                0,
                len as i64,
                grain.max(1) as i64,
                Some(run_range),
                (&job as *const Job<'_>).cast_mut().cast(),
            )
        };
        if let Some(payload) = job.panic.into_inner().unwrap_or_else(|p| p.into_inner()) {
            resume_unwind(payload);
        }
        if rc != 0 {
            // The Parallel trait has no error channel: a panic, which
            // kiln_custom_op::run (the only caller of a kernel) turns into an error.
            std::panic::panic_any(format!("libtorch's parallel_for failed (error code {rc})"));
        }
    }
}
