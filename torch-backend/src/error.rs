//! libtorch errors as Kiln errors.

use kiln_core::Error;

/// Wraps a [`tch::TchError`] as [`Error::Backend`], keeping it as the source and
/// naming the operation that failed.
pub fn torch_error(context: &str, error: tch::TchError) -> Error {
    Error::backend_with_source("torch", context, error)
}
