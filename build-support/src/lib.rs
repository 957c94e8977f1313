//! Finds, provisions and links Kiln's native libraries.
//!
//! Kiln links libtorch (through `tch`) and the TensorFlow C API (through
//! `tensorflow`). Both come from PyPI wheels installed into a virtualenv shared
//! by the user's Kiln checkouts (linked from `.kiln/venv`; see [`ensure_venv`]),
//! or from directories the user names with
//! `LIBTORCH` / `LIBTENSORFLOW`. This crate is used in two places:
//!
//! - by `cargo xtask` (the `kiln-xtask` binary), which provisions the virtualenv
//!   on first use with [`setup`], then runs cargo;
//! - by each Kiln build script, through [`build_script`], which puts the
//!   libraries' real directories on the binaries' rpath so nothing needs
//!   `LD_LIBRARY_PATH`, and keeps `libtorch_cuda` linked.
//!
//! It has no native dependency and no `unsafe` code.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "bindgen")]
mod bindings;
pub mod book;
mod cxx;
mod error;
mod layout;
mod libtorch;
mod link;
mod onnx;
mod ops;
mod provision;
mod setup;
mod tensorflow;
pub mod versions;

#[cfg(feature = "bindgen")]
pub use bindings::{bindgen_builder, libclang_dir};
pub use cxx::configure_cxx;
pub use error::{BuildError, ErrorChain, Result};
pub use layout::Layout;
pub use libtorch::Libtorch;
pub use link::{build_script, Native};
pub use onnx::Onnx;
pub use ops::{OpsArtifacts, TfOps, TfOpsArtifacts, TorchOps};
pub use provision::{
    ensure_venv, existing_venv, find_python, pip_install, shared_cache_dir, shared_venv_dir,
    venv_is_provisioned, Venv,
};
pub use setup::{pkg_config_path, setup, Setup};
pub use tensorflow::Tensorflow;
