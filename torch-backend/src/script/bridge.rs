//! The bridge to `torch::jit::Module` for what tch's [`CModule`] does not expose:
//! a TorchScript model's buffers (include/script.h, src/script/bridge.cc).

use std::marker::{PhantomData, PhantomPinned};

use kiln_core::{Error, Result};
use tch::{CModule, Tensor};

use crate::cxx_tensor::from_at;

/// libtorch's `torch::jit::Module`, opaque to Rust: only ever behind a reference
/// ([`jit_module`]).
#[repr(C)]
pub(crate) struct JitModule {
    _opaque: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

// SAFETY: `JitModule` is exactly C++'s `torch::jit::Module` (the type id), and
// it is opaque (zero-sized, `!Unpin`, never built or moved in Rust): Rust only
// holds it behind a shared reference.
#[allow(unsafe_code)]
unsafe impl cxx::ExternType for JitModule {
    type Id = cxx::type_id!("torch::jit::Module");
    type Kind = cxx::kind::Opaque;
}

#[allow(unsafe_code)]
#[cxx::bridge(namespace = "kiln::script")]
mod ffi {
    // SAFETY: the declarations match include/script.h exactly (cxx checks the
    // signatures at compile time), and every function returns `Result`, so a C++
    // exception comes back as an error instead of unwinding into Rust.
    unsafe extern "C++" {
        include!("kiln-torch/include/script.h");

        #[namespace = "at"]
        type Tensor = crate::cxx_tensor::AtTensor;
        #[namespace = "torch::jit"]
        type Module = super::JitModule;

        fn buffer_names(module: &Module) -> Result<Vec<String>>;
        fn buffer(module: &Module, name: &str) -> Result<UniquePtr<Tensor>>;
        fn parameter_names(module: &Module) -> Result<Vec<String>>;
        fn parameter(module: &Module, name: &str) -> Result<UniquePtr<Tensor>>;
        fn submodule_names(module: &Module, types: &mut Vec<String>) -> Result<Vec<String>>;
        fn set_submodule_training(module: &Module, name: &str, training: bool) -> Result<()>;
    }
}

// tch's `CModule` is one private field, the `torch::jit::Module*` that torch-sys
// allocates (`typedef torch::jit::script::Module *module`); a size check keeps
// a future tch that adds a field from compiling against this.
const _: () = assert!(
    std::mem::size_of::<CModule>() == std::mem::size_of::<*mut std::ffi::c_void>()
        && std::mem::align_of::<CModule>() == std::mem::align_of::<*mut std::ffi::c_void>()
);

/// The `torch::jit::Module` that `module` owns, borrowed as long as `module`.
pub(super) fn jit_module(module: &CModule) -> &JitModule {
    // SAFETY: `CModule` (tch 0.24) is `struct CModule { c_module: *mut CModule_ }`:
    // a single pointer-sized, pointer-aligned field (checked above), so its bytes
    // are that pointer, which `transmute_copy` reads without moving the module.
    // The pointer is the non-null `torch::jit::Module*` that `atm_load*` returned
    // with `new`, alive until the `CModule` drops, so for the returned borrow.
    // `JitModule` is zero-sized: Rust reads nothing through the reference, and C++
    // only reads the module (`const torch::jit::Module&`). The caller checks the
    // result against tch's own API once per module (`check_bridge`).
    #[allow(unsafe_code)]
    unsafe {
        let raw: *mut std::ffi::c_void = std::mem::transmute_copy(module);
        &*raw.cast::<JitModule>()
    }
}

fn bridge_error(what: &str, error: cxx::Exception) -> Error {
    Error::backend_with_source("torch", what, error)
}

/// The module's buffers with PyTorch's names, as handles sharing storage with it.
pub(crate) fn named_buffers(module: &CModule) -> Result<Vec<(String, Tensor)>> {
    let jit = jit_module(module);
    let names =
        ffi::buffer_names(jit).map_err(|e| bridge_error("listing TorchScript buffers", e))?;
    names
        .into_iter()
        .map(|name| {
            let tensor = ffi::buffer(jit, &name)
                .map_err(|e| bridge_error(&format!("reading TorchScript buffer {name}"), e))?;
            Ok((name, from_at(tensor)?))
        })
        .collect()
}

/// Checks that the bridge sees the module tch loaded: the same parameters, in
/// the same order, sharing storage with tch's handles.
pub(crate) fn check_bridge(module: &CModule, params: &[(String, Tensor)]) -> Result<()> {
    let jit = jit_module(module);
    let names =
        ffi::parameter_names(jit).map_err(|e| bridge_error("listing TorchScript parameters", e))?;
    let same = names.len() == params.len()
        && names
            .iter()
            .zip(params)
            .all(|(name, (tch_name, tch_tensor))| {
                name == tch_name
                    && ffi::parameter(jit, name)
                        .ok()
                        .and_then(|t| from_at(t).ok())
                        .is_some_and(|t| t.data_ptr() == tch_tensor.data_ptr())
            });
    if same {
        Ok(())
    } else {
        Err(Error::backend(
            "torch",
            "reaching a TorchScript module's buffers",
            "the C++ bridge does not see the module tch loaded (another tch version?)",
        ))
    }
}

/// Every submodule's dotted name with its TorchScript class name.
pub(crate) fn submodules(module: &CModule) -> Result<Vec<(String, String)>> {
    let mut types = Vec::new();
    let names = ffi::submodule_names(jit_module(module), &mut types)
        .map_err(|e| bridge_error("listing TorchScript submodules", e))?;
    Ok(names.into_iter().zip(types).collect())
}

/// Sets the training flag of the submodule `name` (and its own submodules).
pub(crate) fn set_submodule_training(module: &CModule, name: &str, training: bool) -> Result<()> {
    ffi::set_submodule_training(jit_module(module), name, training)
        .map_err(|e| bridge_error(&format!("switching TorchScript submodule {name}"), e))
}
