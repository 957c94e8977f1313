//! Registering an op in libtorch: schema, CPU, CUDA (a refusal) and Meta
//! kernels through the stable C ABI, the autograd kernel through the glue.

use std::any::TypeId;
use std::collections::BTreeMap;
use std::ffi::{c_char, CString};
use std::sync::{Mutex, PoisonError};

use kiln_core::{Error, Result};
use kiln_custom_op::{CustomOp, OpSchema, Saved};

use crate::kernel::{boxed, boxed_meta, BoxedKernel};
use crate::sys::{self, TorchLibraryHandle};

/// An op this process registered.
struct Registered {
    type_id: TypeId,
    schema: OpSchema,
}

/// Every op registered by this copy of the crate, by `namespace::name`.
static REGISTRY: Mutex<BTreeMap<String, Registered>> = Mutex::new(BTreeMap::new());

/// Registers the op `O` in libtorch: its schema (in a fragment of its
/// namespace), its CPU kernel, a CUDA kernel that refuses the tensors (Rust
/// kernels run on the CPU), a Meta kernel (output shapes from the shape
/// function, for fake tensors and `torch.compile`) and an Autograd kernel.
/// With a [`Gradient`](kiln_custom_op::Gradient) in the schema, backward calls the
/// gradient op through the dispatcher, looked up by name when backward runs
/// (so registration order does not matter); without one, backward fails with
/// an error naming the op.
///
/// The op is then callable as `torch.ops.<namespace>.<name>` from Python in
/// this process, from TorchScript, and from Rust with [`call`](crate::call).
/// libtorch keeps the registration for the life of the process.
///
/// # Errors
///
/// - an invalid schema ([`OpSchema::validate`]), or a gradient op registered
///   before whose arguments do not fit (`OpSchema::check_gradient_op`);
/// - the op registered already by this process (`Error::InvalidArgument`
///   naming it): register each op once;
/// - libtorch refusing it ([`Error::Backend`]), for instance because a library
///   loaded before already defines an op of that name.
///
/// ```no_run
/// # struct MyOp;
/// # impl kiln_custom_op::CustomOp for MyOp {
/// #     fn schema() -> kiln_custom_op::OpSchema { kiln_custom_op::OpSchema::new("demo", "my_op").input("x").output("y") }
/// #     fn output_shapes(i: &[&[i64]], _: &kiln_custom_op::Attrs) -> Result<Vec<kiln_custom_op::Shape>, kiln_custom_op::OpError> { Ok(vec![i[0].to_vec()]) }
/// #     fn compute<T: kiln_custom_op::Float>(_: &[kiln_custom_op::TensorRef<'_, T>], _: &mut [kiln_custom_op::TensorMut<'_, T>], _: &kiln_custom_op::Attrs, _: &kiln_custom_op::Context<'_>) -> Result<(), kiln_custom_op::OpError> { Ok(()) }
/// # }
/// kiln_torch_op::register::<MyOp>()?;
/// assert!(kiln_torch_op::register::<MyOp>().is_err()); // once per process
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn register<O: CustomOp>() -> Result<()> {
    let schema = O::schema();
    let name = schema.qualified_name();
    schema
        .validate()
        .map_err(|e| Error::invalid_argument(&name, e.to_string()))?;
    let mut registry = REGISTRY.lock().unwrap_or_else(PoisonError::into_inner);
    if registry.contains_key(&name) {
        return Err(Error::invalid_argument(
            &name,
            "registered twice: kiln_torch_op::register already registered this op in libtorch \
             in this process; register each op once",
        ));
    }
    check_gradients(&schema, &registry)?;
    define::<O>(&schema)?;
    registry.insert(
        name,
        Registered {
            type_id: TypeId::of::<O>(),
            schema,
        },
    );
    Ok(())
}

/// Registers `O` unless this process registered that same type already.
#[cfg_attr(not(feature = "tch"), allow(dead_code))]
pub(crate) fn ensure_registered<O: CustomOp>() -> Result<()> {
    let name = O::schema().qualified_name();
    let same = REGISTRY
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&name)
        .map(|r| r.type_id == TypeId::of::<O>());
    match same {
        Some(true) => Ok(()),
        _ => register::<O>(),
    }
}

/// Checks `schema` against its gradient op and the ops whose gradient it is,
/// among those registered already (the others are checked when they come).
fn check_gradients(schema: &OpSchema, registry: &BTreeMap<String, Registered>) -> Result<()> {
    let fail = |e: kiln_custom_op::OpError| {
        Error::invalid_argument(schema.qualified_name(), e.to_string())
    };
    if let Some(grad) = schema
        .gradient_qualified_name()
        .and_then(|g| registry.get(&g))
    {
        schema.check_gradient_op(&grad.schema).map_err(fail)?;
    }
    let name = schema.qualified_name();
    for forward in registry.values() {
        if forward.schema.gradient_qualified_name().as_deref() == Some(&name) {
            forward.schema.check_gradient_op(schema).map_err(fail)?;
        }
    }
    Ok(())
}

/// A C string of `text`, which comes from a validated schema (identifiers,
/// so no NUL).
fn c_string(text: &str) -> Result<CString> {
    CString::new(text).map_err(|_| Error::invalid_argument(text, "contains a NUL byte"))
}

/// Where libtorch's messages say a registration came from.
const FILE: &std::ffi::CStr = c"kiln-torch-op/src/registry.rs";

/// Defines the schema and registers every kernel.
fn define<O: CustomOp>(schema: &OpSchema) -> Result<()> {
    let name = schema.qualified_name();
    let refused = |what: String| {
        Error::backend(
            "torch",
            format!("registering `{name}`"),
            format!("libtorch refused to {what} (it printed its reason on stderr)"),
        )
    };
    let ns = c_string(&schema.namespace)?;
    let op = c_string(&schema.name)?;
    let text = schema.torch_schema();
    let schema_c = c_string(&text)?;

    if op_exists(&name)? {
        return Err(Error::backend(
            "torch",
            format!("registering `{name}`"),
            format!(
                "libtorch already has an op `{name}` (from a library loaded before, or Python); \
                 an op name can be defined once per process"
            ),
        ));
    }
    let mut fragment: TorchLibraryHandle = std::ptr::null_mut();
    // SAFETY: NUL-terminated strings and a valid out-pointer. The library
    // object is never deleted: deleting it would remove the definition.
    let rc = unsafe {
        sys::aoti_torch_library_init_fragment(ns.as_ptr(), FILE.as_ptr(), line!(), &mut fragment)
    };
    if rc != 0 {
        return Err(refused(format!(
            "open a library fragment for `{}`",
            schema.namespace
        )));
    }
    // SAFETY: a live library handle and a NUL-terminated schema.
    if unsafe { sys::aoti_torch_library_def(fragment, schema_c.as_ptr()) } != 0 {
        return Err(refused(format!("define `{text}`")));
    }
    let kernels: [(&std::ffi::CStr, BoxedKernel); 3] = [
        (c"CPU", boxed::<O>),
        // A CUDA tensor reaches the CPU kernel, which refuses it by name
        // (rather than libtorch's "could not run with the CUDA backend").
        (c"CUDA", boxed::<O>),
        (c"Meta", boxed_meta::<O>),
    ];
    for (key, kernel) in kernels {
        let mut library: TorchLibraryHandle = std::ptr::null_mut();
        // SAFETY: NUL-terminated strings and a valid out-pointer; the library
        // object is never deleted (that would remove the kernel).
        let rc = unsafe {
            sys::aoti_torch_library_init_impl(
                ns.as_ptr(),
                key.as_ptr(),
                FILE.as_ptr(),
                line!(),
                &mut library,
            )
        };
        let key_name = key.to_string_lossy();
        if rc != 0 {
            return Err(refused(format!(
                "open a {key_name} library for `{}`",
                schema.namespace
            )));
        }
        // SAFETY: libtorch's boxed-kernel pointer type is `extern "C"`; ours is
        // `extern "C-unwind"`, which has the same calling convention on every
        // target and differs only in allowing unwinding out of the function.
        // libtorch calls it from C++ (compiled with exceptions, through a
        // function-pointer type that is not noexcept), so the c10::Error the
        // kernel throws propagates to the dispatcher's caller as one thrown by
        // a C++ kernel. Rust panics never leave the kernel (caught inside).
        let kernel = unsafe {
            std::mem::transmute::<BoxedKernel, unsafe extern "C" fn(*mut u64, u64, u64)>(kernel)
        };
        // SAFETY: a live library handle, a NUL-terminated op name, and a
        // boxed kernel for this op's schema.
        let rc = unsafe {
            sys::torch_library_impl(library, op.as_ptr(), Some(kernel), sys::TORCH_ABI_VERSION)
        };
        if rc != 0 {
            return Err(refused(format!(
                "register the {key_name} kernel of `{name}`"
            )));
        }
    }
    register_autograd(schema, &ns, &op)
}

/// Registers the glue's Autograd kernel for the op.
fn register_autograd(schema: &OpSchema, ns: &CString, op: &CString) -> Result<()> {
    let grad_op = c_string(schema.gradient.as_ref().map_or("", |g| g.op.as_str()))?;
    let save_outputs = schema
        .gradient
        .as_ref()
        .is_some_and(|g| g.saves == Saved::InputsAndOutputs);
    let mut err = [0 as c_char; 1024];
    // SAFETY: NUL-terminated strings and an error buffer of the length given;
    // the glue catches every C++ exception.
    let rc = unsafe {
        sys::kiln_torch_op_register_autograd(
            ns.as_ptr(),
            op.as_ptr(),
            grad_op.as_ptr(),
            schema.inputs.len(),
            schema.outputs.len(),
            i32::from(save_outputs),
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::backend(
            "torch",
            format!(
                "registering the autograd kernel of `{}`",
                schema.qualified_name()
            ),
            c_message(&err),
        ))
    }
}

/// The NUL-terminated message the glue wrote into `buf`.
pub(crate) fn c_message(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Whether libtorch's dispatcher has a schema named `name` (default overload).
fn op_exists(name: &str) -> Result<bool> {
    let name_c = c_string(name)?;
    let mut exists = 0;
    // SAFETY: a NUL-terminated name and a valid out-pointer; cannot throw.
    unsafe { sys::kiln_torch_op_exists(name_c.as_ptr(), &mut exists) };
    Ok(exists != 0)
}
