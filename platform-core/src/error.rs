//! The single error type shared by every Kiln crate.

use std::fmt;
use std::path::PathBuf;

use crate::device::Device;
use crate::dtype::DType;
use crate::shape::Shape;

/// `Result` with Kiln's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Boxed error from a native library or another crate, kept as the source.
pub type BoxedSource = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in Kiln.
///
/// Every message names what was wrong and what was expected.
///
/// ```
/// use kiln_core::{DType, Error};
///
/// let err = Error::DTypeMismatch {
///     context: "matmul".into(),
///     expected: DType::F32,
///     actual: DType::I64,
/// };
/// assert_eq!(err.to_string(), "matmul: expected dtype float32, got int64");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor had a different shape than an operation requires.
    #[error("{context}: expected shape {expected}, got {actual}")]
    ShapeMismatch {
        /// Where the mismatch was detected.
        context: String,
        /// The shape (or shape description) that was required.
        expected: String,
        /// The shape that was found.
        actual: String,
    },

    /// A buffer's length does not match the number of elements of a shape.
    #[error("shape {shape} holds {expected} elements, but {actual} were given")]
    ElementCount {
        /// The requested shape.
        shape: Shape,
        /// Its element count.
        expected: usize,
        /// The number of elements supplied.
        actual: usize,
    },

    /// A tensor had a different element type than an operation requires.
    #[error("{context}: expected dtype {expected}, got {actual}")]
    DTypeMismatch {
        /// Where the mismatch was detected.
        context: String,
        /// The required dtype.
        expected: DType,
        /// The dtype that was found.
        actual: DType,
    },

    /// Two tensors live on different devices; Kiln never copies silently.
    #[error(
        "{context}: tensors on different devices, {expected} and {actual}; \
         move one with `to(device)` first"
    )]
    DeviceMismatch {
        /// Where the mismatch was detected.
        context: String,
        /// The device of the first tensor.
        expected: Device,
        /// The device of the second tensor.
        actual: Device,
    },

    /// A device was requested that the backend cannot use.
    #[error("device {device} is unavailable: {reason}")]
    DeviceUnavailable {
        /// The requested device.
        device: Device,
        /// Why it cannot be used.
        reason: String,
    },

    /// An I/O operation on a file failed.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },

    /// A checkpoint could not be written or read back.
    #[error("checkpoint {}: {reason}", .path.display())]
    Checkpoint {
        /// The checkpoint file or directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A run's output directory cannot be used (not empty for a new run,
    /// held by another run, not a directory).
    #[error("output directory {}: {reason}", .path.display())]
    RunDirectory {
        /// The directory.
        path: PathBuf,
        /// What is in the way, and what to do instead.
        reason: String,
    },

    /// A data file is malformed.
    #[error("malformed data file {}{}: {reason}", .path.display(), AtOffset(*.offset))]
    Data {
        /// The data file.
        path: PathBuf,
        /// Byte offset of the problem (in the decompressed stream for compressed files), when known.
        offset: Option<u64>,
        /// What is wrong, including the 1-based line for text formats.
        reason: String,
    },

    /// A native library (libtorch, TensorFlow, ...) reported an error.
    #[error("{backend} failed in {context}: {message}")]
    Backend {
        /// Name of the backend, see [`Backend::NAME`](crate::Backend::NAME).
        backend: &'static str,
        /// The operation that failed.
        context: String,
        /// The native library's message.
        message: String,
        /// The native error value, when there is one.
        #[source]
        source: Option<BoxedSource>,
    },

    /// The operation is not supported (by this backend, dtype, device, ...).
    #[error("unsupported: {what}")]
    Unsupported {
        /// What was attempted.
        what: String,
    },

    /// An argument is out of its valid range or otherwise unusable.
    #[error("invalid argument `{name}`: {reason}")]
    InvalidArgument {
        /// Name of the argument.
        name: String,
        /// Why it is invalid and what is accepted.
        reason: String,
    },

    /// A state dict lacks an entry a module or optimizer needs.
    #[error("state dict has no entry `{key}` ({available} entries present)")]
    MissingKey {
        /// The missing key.
        key: String,
        /// How many entries the state dict holds.
        available: usize,
    },

    /// A configuration file that cannot be used.
    #[error("config {path}: {reason}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the key and the allowed values.
        reason: String,
    },

    /// Training produced a NaN or infinite loss; training stopped there.
    #[error(
        "the loss at step {step} is {value}: training stopped (lower the learning rate, clip \
         gradients, or check the data); checkpoints written before it are intact"
    )]
    NonFiniteLoss {
        /// The optimizer step whose loss was not finite (1-based).
        step: u64,
        /// The loss value.
        value: f64,
    },
}

/// Formats an optional byte offset as `" at byte N"` or nothing.
struct AtOffset(Option<u64>);

impl fmt::Display for AtOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(offset) => write!(f, " at byte {offset}"),
            None => Ok(()),
        }
    }
}

impl Error {
    /// An error reported by a native backend, without a source error value.
    pub fn backend(
        backend: &'static str,
        context: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Error::Backend {
            backend,
            context: context.into(),
            message: message.into(),
            source: None,
        }
    }

    /// An error reported by a native backend; the message is `source.to_string()`.
    pub fn backend_with_source<E>(
        backend: &'static str,
        context: impl Into<String>,
        source: E,
    ) -> Self
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        Error::Backend {
            backend,
            context: context.into(),
            message: source.to_string(),
            source: Some(Box::new(source)),
        }
    }

    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// An unsupported operation.
    pub fn unsupported(what: impl Into<String>) -> Self {
        Error::Unsupported { what: what.into() }
    }

    /// An invalid argument `name`, with the reason it was rejected.
    pub fn invalid_argument(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            name: name.into(),
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn messages_name_expected_and_actual() {
        let e = Error::ShapeMismatch {
            context: "linear".into(),
            expected: "[4, 3]".into(),
            actual: "[4, 2]".into(),
        };
        assert_eq!(e.to_string(), "linear: expected shape [4, 3], got [4, 2]");

        let e = Error::ElementCount {
            shape: Shape::new(vec![2, 3]),
            expected: 6,
            actual: 5,
        };
        assert_eq!(
            e.to_string(),
            "shape [2, 3] holds 6 elements, but 5 were given"
        );

        let e = Error::DeviceMismatch {
            context: "add".into(),
            expected: Device::Cpu,
            actual: Device::Cuda(1),
        };
        assert_eq!(
            e.to_string(),
            "add: tensors on different devices, cpu and cuda:1; move one with `to(device)` first"
        );

        let e = Error::DeviceUnavailable {
            device: Device::Cuda(0),
            reason: "no CUDA driver".into(),
        };
        assert_eq!(
            e.to_string(),
            "device cuda:0 is unavailable: no CUDA driver"
        );

        let e = Error::Checkpoint {
            path: PathBuf::from("run/ckpt-3"),
            reason: "missing metadata".into(),
        };
        assert_eq!(e.to_string(), "checkpoint run/ckpt-3: missing metadata");

        assert_eq!(
            Error::unsupported("float16 on cpu").to_string(),
            "unsupported: float16 on cpu"
        );
        assert_eq!(
            Error::invalid_argument("lr", "must be positive, got -1").to_string(),
            "invalid argument `lr`: must be positive, got -1"
        );
        assert_eq!(
            Error::MissingKey {
                key: "fc.weight".into(),
                available: 3
            }
            .to_string(),
            "state dict has no entry `fc.weight` (3 entries present)"
        );
    }

    #[test]
    fn data_error_names_offset_when_known() {
        let e = Error::Data {
            path: PathBuf::from("d.csv.gz"),
            offset: Some(130),
            reason: "line 3: bad".into(),
        };
        assert_eq!(
            e.to_string(),
            "malformed data file d.csv.gz at byte 130: line 3: bad"
        );
        let e = Error::Data {
            path: PathBuf::from("d.csv.gz"),
            offset: None,
            reason: "empty".into(),
        };
        assert_eq!(e.to_string(), "malformed data file d.csv.gz: empty");
    }

    #[test]
    fn io_error_displays_path_and_keeps_source() {
        let e = Error::io(
            "/nope/x.bin",
            std::io::Error::new(std::io::ErrorKind::NotFound, "not found"),
        );
        assert_eq!(e.to_string(), "/nope/x.bin: not found");
        assert!(e.source().is_some());
    }

    #[test]
    fn backend_constructors() {
        let e = Error::backend("torch", "matmul", "size mismatch");
        assert_eq!(e.to_string(), "torch failed in matmul: size mismatch");
        assert!(e.source().is_none());

        let io = std::io::Error::other("CUDA out of memory");
        let e = Error::backend_with_source("tensorflow", "session run", io);
        assert_eq!(
            e.to_string(),
            "tensorflow failed in session run: CUDA out of memory"
        );
        assert_eq!(
            e.source().map(ToString::to_string).as_deref(),
            Some("CUDA out of memory")
        );
    }

    #[test]
    fn error_is_send_and_sync() {
        fn check<T: Send + Sync + 'static>() {}
        check::<Error>();
    }
}
