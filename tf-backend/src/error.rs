//! TensorFlow statuses as Kiln errors.

use kiln_core::Error;

/// Wraps a [`tensorflow::Status`] as [`Error::Backend`], keeping it as the source
/// (its code and message) and naming the operation that failed.
pub fn tf_error(context: &str, status: tensorflow::Status) -> Error {
    Error::backend_with_source("tensorflow", context, status)
}
