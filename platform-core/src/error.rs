//! The single error type shared by every Kiln crate.
//!
//! An error's `Display` says what was being done and what was wrong at its own
//! level; a cause (an I/O error, a native library's message, the error that made a
//! checkpoint not fit) is never repeated in it but returned by
//! [`source`](std::error::Error::source). Show the whole chain, `context: cause:
//! cause`, with [`Error::display_chain`] or [`ErrorChain`] (or `anyhow`'s `{:#}`),
//! which prints each cause once.

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
/// Every message names what was wrong and what was expected. Variants with a
/// cause ([`Io`](Error::Io), [`Backend`](Error::Backend), and
/// [`Checkpoint`](Error::Checkpoint) and [`Data`](Error::Data) when they have
/// one) keep it as the [`source`](std::error::Error::source) and leave it out
/// of their own message: show an error to a user with
/// [`display_chain`](Error::display_chain) (or `anyhow`'s `{:#}`).
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

    /// An I/O operation on a file failed. Displays the path; the I/O error is
    /// the source (`{:#}` shows `path: No such file or directory (os error 2)`).
    #[error("{}", .path.display())]
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
        /// What is wrong with it (without the cause's message).
        reason: String,
        /// The error behind `reason`, when there is one (a state dict that does
        /// not fit, metadata that is not JSON).
        #[source]
        source: Option<BoxedSource>,
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
        /// What is wrong, including the 1-based line for text formats (without
        /// the cause's message).
        reason: String,
        /// The error behind `reason`, when there is one (a read or gzip error,
        /// a native library's refusal).
        #[source]
        source: Option<BoxedSource>,
    },

    /// A native library (libtorch, TensorFlow, ...) reported an error.
    ///
    /// Displays the backend and the operation; the native library's message is
    /// the source: a native error value, or a [`BackendMessage`] when the
    /// library gave only text (`{:#}` shows `torch failed in matmul: <message>`).
    #[error("{backend} failed in {context}")]
    Backend {
        /// Name of the backend, see [`Backend::NAME`](crate::backend::Backend::NAME).
        backend: &'static str,
        /// The operation that failed.
        context: String,
        /// The native error, whose `Display` is the native library's message.
        #[source]
        source: BoxedSource,
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

    /// A data-parallel job cannot go on: the rendezvous environment is
    /// incomplete, a rank did not arrive or died, or the ranks disagree.
    #[error("distributed training, {context}: {reason}")]
    Distributed {
        /// What was being done (`rendezvous`, `all_reduce at step 12`, ...).
        context: String,
        /// What went wrong, naming the rank or the variable where known.
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

    /// An export failed (ONNX, TorchScript, SavedModel): the exporters' one
    /// error, kept whole so that `?` in a function returning [`Result`] loses
    /// nothing of it.
    #[error(transparent)]
    Export(Box<crate::export::ExportError>),
}

impl From<crate::export::ExportError> for Error {
    fn from(error: crate::export::ExportError) -> Self {
        match error {
            // An engine's own error comes back as itself, not wrapped twice.
            crate::export::ExportError::Core(error) => error,
            other => Error::Export(Box::new(other)),
        }
    }
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

/// The message of a backend error that has no error value of its own (a C++
/// exception's text, a panic message): the source of such an
/// [`Error::Backend`], displayed as the text itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendMessage(String);

impl BackendMessage {
    /// The message.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for BackendMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BackendMessage {}

/// Displays an error followed by each of its sources, separated by `": "`
/// (`context: cause: cause`), as `anyhow` does for `{:#}`. Made by
/// [`Error::display_chain`], or [`ErrorChain::new`] for any error.
///
/// ```
/// use kiln_core::Error;
///
/// let err = Error::io("data/x.csv", std::io::Error::other("disk on fire"));
/// assert_eq!(err.to_string(), "data/x.csv");
/// assert_eq!(err.display_chain().to_string(), "data/x.csv: disk on fire");
/// ```
#[derive(Clone, Copy)]
pub struct ErrorChain<'a>(&'a (dyn std::error::Error + 'static));

impl<'a> ErrorChain<'a> {
    /// The chain of `error` and its sources.
    pub fn new(error: &'a (dyn std::error::Error + 'static)) -> Self {
        ErrorChain(error)
    }
}

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            write!(f, ": {cause}")?;
            next = cause.source();
        }
        Ok(())
    }
}

impl fmt::Debug for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Error {
    /// This error with all its causes, `context: cause: cause`: the message
    /// to show a user (the same text as `anyhow`'s `{:#}`).
    pub fn display_chain(&self) -> ErrorChain<'_> {
        ErrorChain(self)
    }

    /// An error reported by a native backend that gave only a message; the
    /// message becomes the source, a [`BackendMessage`].
    pub fn backend(
        backend: &'static str,
        context: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Error::Backend {
            backend,
            context: context.into(),
            source: Box::new(BackendMessage(message.into())),
        }
    }

    /// An error reported by a native backend, keeping its error value as the
    /// source (whose `Display` is the native message).
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
            source: Box::new(source),
        }
    }

    /// A checkpoint at `path` that cannot be used, for `reason`.
    pub fn checkpoint(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::Checkpoint {
            path: path.into(),
            reason: reason.into(),
            source: None,
        }
    }

    /// A checkpoint at `path` that cannot be used, for `reason`, because of
    /// `source` (kept as the source, not repeated in `reason`).
    pub fn checkpoint_caused_by<E>(
        path: impl Into<PathBuf>,
        reason: impl Into<String>,
        source: E,
    ) -> Self
    where
        E: Into<BoxedSource>,
    {
        Error::Checkpoint {
            path: path.into(),
            reason: reason.into(),
            source: Some(source.into()),
        }
    }

    /// A malformed data file `path` (at byte `offset` when known), for `reason`.
    pub fn data(path: impl Into<PathBuf>, offset: Option<u64>, reason: impl Into<String>) -> Self {
        Error::Data {
            path: path.into(),
            offset,
            reason: reason.into(),
            source: None,
        }
    }

    /// A malformed data file, for `reason`, because of `source` (kept as the
    /// source, not repeated in `reason`).
    pub fn data_caused_by<E>(
        path: impl Into<PathBuf>,
        offset: Option<u64>,
        reason: impl Into<String>,
        source: E,
    ) -> Self
    where
        E: Into<BoxedSource>,
    {
        Error::Data {
            path: path.into(),
            offset,
            reason: reason.into(),
            source: Some(source.into()),
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

    /// A data-parallel job that cannot go on (see [`Error::Distributed`]).
    pub fn distributed(context: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Distributed {
            context: context.into(),
            reason: reason.into(),
        }
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

        let e = Error::checkpoint("run/ckpt-3", "missing metadata");
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
        let e = Error::data("d.csv.gz", Some(130), "line 3: bad");
        assert_eq!(
            e.to_string(),
            "malformed data file d.csv.gz at byte 130: line 3: bad"
        );
        let e = Error::data("d.csv.gz", None, "empty");
        assert_eq!(e.to_string(), "malformed data file d.csv.gz: empty");
    }

    #[test]
    fn io_error_displays_path_and_keeps_source() {
        let e = Error::io(
            "/nope/x.bin",
            std::io::Error::new(std::io::ErrorKind::NotFound, "not found"),
        );
        assert_eq!(e.to_string(), "/nope/x.bin");
        assert_eq!(e.display_chain().to_string(), "/nope/x.bin: not found");
        assert!(e.source().is_some());
    }

    #[test]
    fn backend_constructors() {
        // A message alone becomes the source, so both constructors chain alike.
        let e = Error::backend("torch", "matmul", "size mismatch");
        assert_eq!(e.to_string(), "torch failed in matmul");
        assert_eq!(
            e.display_chain().to_string(),
            "torch failed in matmul: size mismatch"
        );
        assert!(e
            .source()
            .is_some_and(|s| s.downcast_ref::<BackendMessage>().is_some()));

        let io = std::io::Error::other("CUDA out of memory");
        let e = Error::backend_with_source("tensorflow", "session run", io);
        assert_eq!(e.to_string(), "tensorflow failed in session run");
        assert_eq!(
            e.display_chain().to_string(),
            "tensorflow failed in session run: CUDA out of memory"
        );
        assert_eq!(
            e.source().map(ToString::to_string).as_deref(),
            Some("CUDA out of memory")
        );
    }

    /// `context: cause: cause` written by walking `source()` by hand, as
    /// `anyhow`'s `{:#}` does (independent of [`ErrorChain`]).
    fn walk_chain(error: &(dyn std::error::Error + 'static)) -> String {
        let mut parts = vec![error.to_string()];
        let mut next = error.source();
        while let Some(cause) = next {
            parts.push(cause.to_string());
            next = cause.source();
        }
        parts.join(": ")
    }

    #[test]
    fn a_chained_cause_is_shown_once() {
        let cause = "No such file or directory (os error 2)";
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, cause);
        let cases = [
            (
                Error::backend_with_source("tensorflow", "session run", io()),
                format!("tensorflow failed in session run: {cause}"),
            ),
            (
                Error::io("/runs/a/last.safetensors", io()),
                format!("/runs/a/last.safetensors: {cause}"),
            ),
        ];
        for (error, full) in cases {
            let walked = walk_chain(&error);
            assert_eq!(walked.matches(cause).count(), 1, "{walked}");
            assert_eq!(walked, full);
            assert!(error.source().is_some(), "{error:?}");
        }
    }

    #[test]
    fn checkpoint_and_data_errors_keep_their_cause() {
        let checkpoint = Error::checkpoint_caused_by(
            "/runs/a/last.safetensors",
            "does not fit this model and optimizer",
            Error::backend("torch", "loading fc.weight", "size mismatch"),
        );
        let read = std::io::Error::other("corrupt deflate stream");
        let data = Error::data_caused_by("d.csv.gz", Some(7), "line 2: cannot read", read);
        for (error, cause, full) in [
            (
                &checkpoint,
                "size mismatch",
                "checkpoint /runs/a/last.safetensors: does not fit this model and optimizer: \
                 torch failed in loading fc.weight: size mismatch",
            ),
            (
                &data,
                "corrupt deflate stream",
                "malformed data file d.csv.gz at byte 7: line 2: cannot read: \
                 corrupt deflate stream",
            ),
        ] {
            assert!(!error.to_string().contains(cause), "{error}");
            let walked = walk_chain(error);
            assert_eq!(walked.matches(cause).count(), 1, "{walked}");
            assert_eq!(walked, full);
            assert_eq!(error.display_chain().to_string(), full);
        }
    }

    #[test]
    fn error_is_send_and_sync() {
        fn check<T: Send + Sync + 'static>() {}
        check::<Error>();
    }
}
