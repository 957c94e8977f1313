//! The one error type of kiln-onnx.

use std::path::PathBuf;

/// Result alias for kiln-onnx.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong exporting, reading or running an ONNX model. Every
/// message names what was wrong and what was expected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A layer (or one of its settings) has no ONNX mapping.
    #[error("{path} ({layer}) cannot be exported to ONNX: {reason}")]
    Unsupported {
        /// The layer's path in the model (`2.block.0`), or `<root>`.
        path: String,
        /// The layer's kind (`Linear`, `Custom(kiln::my_op)`).
        layer: String,
        /// Why, and what would work.
        reason: String,
    },
    /// A state-dict entry a layer needs is missing, or has another shape or
    /// dtype than the layer declares.
    #[error("{path} ({layer}): state dict entry `{key}` {reason}")]
    Weight {
        /// The layer's path in the model (`2.block.0`), or `<root>`.
        path: String,
        /// The layer's kind (`Linear`).
        layer: String,
        /// The state-dict key (`2.block.0.weight`).
        key: String,
        /// What was found and what was expected.
        reason: String,
    },
    /// An export setting does not fit the model (a name used twice, an input
    /// dtype the first layer cannot take).
    #[error("{what}: {reason}")]
    Invalid {
        /// The setting or value (`input dtype`, `output name`).
        what: String,
        /// What was given and what was expected.
        reason: String,
    },
    /// The directory the output file should go in does not exist.
    #[error("the directory of {path} does not exist; create it first")]
    MissingParent {
        /// The output file.
        path: PathBuf,
    },
    /// The output file exists and overwriting was not asked for.
    #[error("{path} already exists; pass --overwrite (or `overwrite(true)`) to replace it")]
    FileExists {
        /// The file.
        path: PathBuf,
    },
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
    /// Reading or writing a file failed.
    #[error("{action} {path}: {source}")]
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
