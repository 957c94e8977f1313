//! The error of reading and running ONNX models (exports fail with
//! [`kiln_core::export::ExportError`]).

use std::path::PathBuf;

/// Result alias for kiln-onnx.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong reading or running an ONNX model. Every message names
/// what was wrong and what was expected. Exporting fails with the exporters'
/// one error, [`ExportError`](kiln_core::export::ExportError).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file is not a readable ONNX model (truncated, not protobuf, not ONNX).
    #[error("{path} is not a valid ONNX model: {reason}")]
    InvalidModel {
        /// The file.
        path: PathBuf,
        /// What was found.
        reason: String,
    },
    /// An input given to [`OnnxModel`](crate::OnnxModel) does not match the model.
    #[error("input '{name}': {reason}")]
    Input {
        /// The input's name in the model.
        name: String,
        /// What was expected and what was given.
        reason: String,
    },
    /// An output of an [`OnnxModel`](crate::OnnxModel) cannot be returned as a
    /// `HostTensor` (not a tensor, or an element type Kiln lacks).
    #[error("output '{name}': {reason}")]
    Output {
        /// The output's name in the model.
        name: String,
        /// What it is, and what Kiln can return.
        reason: String,
    },
    /// ONNX Runtime could not be loaded or failed.
    #[error("ONNX Runtime: {0}")]
    Runtime(String),
    /// Reading or writing a file failed. The I/O error is the
    /// [`source`](std::error::Error::source), left out of this message: show the
    /// whole chain (`anyhow`'s `{:#}`, or [`kiln_core::error::ErrorChain`]) for
    /// `writing model.onnx: Permission denied (os error 13)`.
    #[error("{action} {path}")]
    Io {
        /// `reading`, `writing`, ...
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// An error of Kiln's model definitions or tensors.
    #[error(transparent)]
    Core(#[from] kiln_core::Error),
}

impl Error {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        Error::Io {
            action,
            path: path.into(),
            source,
        }
    }
}

/// Into Kiln's one error type, so that `?` takes an ONNX error in a function
/// returning [`kiln_core::Result`]. Each kind keeps its meaning and message: an
/// file that is not ONNX is `Data`, a bad input or output `InvalidArgument`,
/// ONNX Runtime's own failure `Backend` (`onnxruntime`), a failed read `Io`.
impl From<Error> for kiln_core::Error {
    fn from(error: Error) -> Self {
        use kiln_core::Error as Kiln;
        use std::io::Error as IoError;
        match error {
            Error::InvalidModel { path, reason } => {
                Kiln::data(path, None, format!("not a valid ONNX model: {reason}"))
            }
            Error::Input { name, reason } => {
                Kiln::invalid_argument(format!("input '{name}'"), reason)
            }
            Error::Output { name, reason } => {
                Kiln::invalid_argument(format!("output '{name}'"), reason)
            }
            Error::Runtime(message) => {
                Kiln::backend("onnxruntime", "running an ONNX model", message)
            }
            Error::Io {
                action,
                path,
                source,
            } => Kiln::Io {
                path,
                source: IoError::new(source.kind(), format!("{action}: {source}")),
            },
            Error::Core(error) => error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn onnx_errors_become_kiln_errors_of_the_same_kind() {
        use kiln_core::Error as Kiln;
        let input: Kiln = Error::Input {
            name: "pixels".into(),
            reason: "dimension 1 is 7, the model expects 8".into(),
        }
        .into();
        assert!(
            matches!(&input, Kiln::InvalidArgument { name, reason }
                if name == "input 'pixels'" && reason.contains("expects 8")),
            "{input:?}"
        );

        let invalid: Kiln = Error::InvalidModel {
            path: "truncated.onnx".into(),
            reason: "the protobuf ends early".into(),
        }
        .into();
        assert!(matches!(&invalid, Kiln::Data { .. }), "{invalid:?}");
        assert!(
            invalid.to_string().contains("not a valid ONNX model"),
            "{invalid}"
        );

        let runtime: Kiln = Error::Runtime("out of memory".into()).into();
        assert!(matches!(
            &runtime,
            Kiln::Backend {
                backend: "onnxruntime",
                ..
            }
        ));
        assert!(runtime
            .display_chain()
            .to_string()
            .ends_with("out of memory"));

        let core: Kiln = Error::Core(Kiln::unsupported("a complex input")).into();
        assert_eq!(core.to_string(), "unsupported: a complex input");
    }

    /// The whole chain, as `anyhow`'s `{:#}` prints it.
    fn chain(error: &(dyn std::error::Error + 'static)) -> String {
        kiln_core::error::ErrorChain::new(error).to_string()
    }

    #[test]
    fn an_io_error_prints_its_cause_once() {
        let cause = "disk on fire";
        let error = Error::io("reading", "out/model.onnx", std::io::Error::other(cause));
        let walked = chain(&error);
        assert_eq!(walked, "reading out/model.onnx: disk on fire");
        assert_eq!(walked.matches(cause).count(), 1, "{walked}");

        // The same once converted into Kiln's error, as `kiln predict` reports it.
        let kiln: kiln_core::Error = error.into();
        let walked = chain(&kiln);
        assert_eq!(walked, "out/model.onnx: reading: disk on fire");
        assert_eq!(walked.matches(cause).count(), 1, "{walked}");
    }
}
