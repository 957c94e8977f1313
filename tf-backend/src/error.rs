//! TensorFlow statuses as Kiln errors.

use kiln_core::Error;

/// Wraps a [`tensorflow::Status`] as [`Error::Backend`], keeping it as the source
/// (its code and message) and naming the operation that failed.
pub fn tf_error(context: &str, status: tensorflow::Status) -> Error {
    Error::backend_with_source("tensorflow", context, status)
}

/// Why a [`TfModel`](crate::TfModel) could not be exported as a SavedModel
/// ([`SavedModelExport`](crate::SavedModelExport)). Every message names what was
/// wrong and what would work; nothing was written when one is returned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// Something exists at the target path and overwriting was not asked for.
    #[error("{} already exists; pass `overwrite(true)` to replace it", .path.display())]
    Exists {
        /// The target path.
        path: std::path::PathBuf,
    },
    /// Overwriting was asked for, but the path holds something other than a
    /// SavedModel directory, which an export never replaces.
    #[error(
        "{} exists and is not a SavedModel directory (no saved_model.pb): an export \
         replaces only a SavedModel; remove it yourself or choose another path",
        .path.display()
    )]
    NotASavedModel {
        /// The target path.
        path: std::path::PathBuf,
    },
    /// A layer builds a TensorFlow op that only Kiln's process knows (a custom
    /// op library), so Python's TensorFlow and TF Serving could not load the graph:
    /// a custom layer with no portable builder
    /// ([`register_portable_custom_layer`](crate::register_portable_custom_layer)).
    #[error(
        "{path} ({layer}) cannot be exported as a SavedModel: its TensorFlow op `{op_type}` \
         (node `{node}`) is not a standard TensorFlow op, so Python's TensorFlow and TF \
         Serving cannot load it; to export it, register a builder of the same computation \
         from standard ops (tf.raw_ops) with `kiln_tf::register_portable_custom_layer`"
    )]
    NonStandardOp {
        /// The layer's path in the model (`2.block.0`), or `<root>`.
        path: String,
        /// The layer's kind (`Custom kiln::bias_gelu`).
        layer: String,
        /// The op type (`KilnBiasGelu`).
        op_type: String,
        /// The graph node.
        node: String,
    },
    /// A layer cannot be exported at all.
    #[error("{path} ({layer}) cannot be exported as a SavedModel: {reason}")]
    Unsupported {
        /// The layer's path in the model, or `<root>`.
        path: String,
        /// The layer's kind.
        layer: String,
        /// Why, and what would work.
        reason: String,
    },
    /// An export setting is invalid (an empty name, an empty input shape).
    #[error("invalid export setting `{name}`: {reason}")]
    InvalidArgument {
        /// The setting.
        name: &'static str,
        /// What was expected and what was given.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("{action} {}", .path.display())]
    Io {
        /// `writing`, `renaming`, ...
        action: &'static str,
        /// The file or directory.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The model could not be built for the input (a shape or dtype that does
    /// not fit the definition), or TensorFlow failed.
    #[error(transparent)]
    Core(#[from] kiln_core::Error),
}

impl ExportError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<std::path::PathBuf>,
        source: std::io::Error,
    ) -> Self {
        ExportError::Io {
            action,
            path: path.into(),
            source,
        }
    }
}

/// Into Kiln's one error type, so that `?` takes an export error in a function
/// returning [`kiln_core::Result`]. Each kind keeps its meaning and message: an
/// existing path is [`Error::Io`] with [`AlreadyExists`](std::io::ErrorKind::AlreadyExists),
/// a layer that cannot be exported [`Error::Unsupported`], a bad setting
/// [`Error::InvalidArgument`].
impl From<ExportError> for Error {
    fn from(error: ExportError) -> Self {
        use std::io::{Error as IoError, ErrorKind};
        match error {
            ExportError::Exists { path } => Error::Io {
                path,
                source: IoError::new(
                    ErrorKind::AlreadyExists,
                    "already exists; pass `overwrite(true)` to replace it",
                ),
            },
            ExportError::NotASavedModel { path } => Error::Io {
                path,
                source: IoError::new(
                    ErrorKind::AlreadyExists,
                    "exists and is not a SavedModel directory (no saved_model.pb): an export \
                     replaces only a SavedModel; remove it yourself or choose another path",
                ),
            },
            unsupported @ (ExportError::NonStandardOp { .. } | ExportError::Unsupported { .. }) => {
                Error::unsupported(unsupported.to_string())
            }
            ExportError::InvalidArgument { name, reason } => Error::invalid_argument(name, reason),
            ExportError::Io {
                action,
                path,
                source,
            } => Error::Io {
                path,
                source: IoError::new(source.kind(), format!("{action}: {source}")),
            },
            ExportError::Core(error) => error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::ErrorKind;

    fn io_kind(error: &Error) -> Option<ErrorKind> {
        match error {
            Error::Io { source, .. } => Some(source.kind()),
            _ => None,
        }
    }

    #[test]
    fn export_errors_become_kiln_errors_of_the_same_kind() {
        let exists: Error = ExportError::Exists {
            path: "out/model".into(),
        }
        .into();
        assert_eq!(io_kind(&exists), Some(ErrorKind::AlreadyExists));
        let chain = exists.display_chain().to_string();
        assert!(
            chain.starts_with("out/model: already exists") && chain.contains("overwrite(true)"),
            "{chain}"
        );

        let not_saved_model: Error = ExportError::NotASavedModel {
            path: "notes".into(),
        }
        .into();
        assert_eq!(io_kind(&not_saved_model), Some(ErrorKind::AlreadyExists));

        let unsupported = ExportError::Unsupported {
            path: "2".into(),
            layer: "SavedModel".into(),
            reason: "a saved_model layer exports to no format".into(),
        };
        let message = unsupported.to_string();
        let unsupported: Error = unsupported.into();
        assert!(
            matches!(&unsupported, Error::Unsupported { what } if *what == message),
            "{unsupported:?}"
        );

        let invalid: Error = ExportError::InvalidArgument {
            name: "input_name",
            reason: "is empty".into(),
        }
        .into();
        assert!(
            matches!(&invalid, Error::InvalidArgument { name, reason } if name == "input_name" && reason == "is empty")
        );

        let io: Error = ExportError::Io {
            action: "writing",
            path: "out/model/saved_model.pb".into(),
            source: std::io::Error::from(ErrorKind::PermissionDenied),
        }
        .into();
        assert_eq!(io_kind(&io), Some(ErrorKind::PermissionDenied));
        let chain = io.display_chain().to_string();
        assert!(
            chain.starts_with("out/model/saved_model.pb: writing: permission denied"),
            "{chain}"
        );

        let core: Error = ExportError::Core(Error::unsupported("a bf16 input")).into();
        assert_eq!(core.to_string(), "unsupported: a bf16 input");
    }
}
