//! The raw bindings: libtorch's stable C ABI and the glue's functions, generated
//! by bindgen at build time from the linked libtorch's headers (see build.rs),
//! allow-listed to what this crate calls.
#![allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code,
    missing_docs,
    unreachable_pub,
    clippy::all,
    clippy::undocumented_unsafe_blocks
)]

include!(concat!(env!("OUT_DIR"), "/torch_stable_abi.rs"));

/// `TORCH_ABI_VERSION` of the headers the bindings come from: the
/// `extension_build_version` the version-aware shim functions take.
pub(crate) const TORCH_ABI_VERSION: u64 = ((TORCH_VERSION_MAJOR as u64) << 56)
    | ((TORCH_VERSION_MINOR as u64) << 48)
    | ((TORCH_VERSION_PATCH as u64) << 40)
    | (TORCH_VERSION_ABI_TAG as u64);
