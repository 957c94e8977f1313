//! What every exporter shares: [`ExportOptions`], the one [`ExportError`], and
//! the checked, atomic placement of an exported file ([`FileTarget`]).
//!
//! kiln-onnx (`OnnxExport`), kiln-torch (`export_torchscript`) and kiln-tf
//! (`SavedModelExport`) take the same options and fail with the same error,
//! so code that exports in several formats (the `kiln export` command, a
//! serving pipeline) handles one type:
//!
//! ```
//! use kiln_core::export::{ExportError, ExportFormat, ExportOptions};
//!
//! let options = ExportOptions::new(&[1, 4]).with_input_name("features").with_overwrite(true);
//! assert!(options.check(ExportFormat::Onnx).is_ok());
//! // A TorchScript module's forward takes positional tensors: no names.
//! let err = options.check(ExportFormat::TorchScript).unwrap_err();
//! assert!(matches!(err, ExportError::Invalid { .. }), "{err}");
//! ```
//!
//! A custom op ([`Layer::Custom`](crate::model::Layer::Custom)) is exported
//! through the lowering its crate registers with each exporter
//! (`kiln_onnx::register_onnx_lowering`, `kiln_torch::register_torchscript_lowering`,
//! `kiln_tf::register_portable_custom_layer`): an exporter never names another
//! crate's ops.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::DType;

/// The formats Kiln exports to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ExportFormat {
    /// An ONNX model of standard operators (kiln-onnx).
    Onnx,
    /// A TorchScript file for `torch.jit.load` (kiln-torch).
    TorchScript,
    /// A TensorFlow SavedModel directory (kiln-tf).
    SavedModel,
}

impl ExportFormat {
    /// The function that registers a custom op's lowering for this format,
    /// named in the error for an op that has none.
    pub fn lowering_registrar(self) -> &'static str {
        match self {
            ExportFormat::Onnx => "kiln_onnx::register_onnx_lowering",
            ExportFormat::TorchScript => "kiln_torch::register_torchscript_lowering",
            ExportFormat::SavedModel => "kiln_tf::register_portable_custom_layer",
        }
    }

    /// Whose standard ops the format holds: `ONNX`, `aten`, `TensorFlow`.
    fn op_set(self) -> &'static str {
        match self {
            ExportFormat::Onnx => "ONNX",
            ExportFormat::TorchScript => "aten",
            ExportFormat::SavedModel => "TensorFlow",
        }
    }

    /// What loads the format without Kiln.
    fn runtimes(self) -> &'static str {
        match self {
            ExportFormat::Onnx => "ONNX Runtime",
            ExportFormat::TorchScript => "Python's torch.jit.load",
            ExportFormat::SavedModel => "Python's TensorFlow and TF Serving",
        }
    }

    /// `to ONNX`, `as TorchScript`, `as a SavedModel`: how messages say it.
    fn phrase(self) -> &'static str {
        match self {
            ExportFormat::Onnx => "to ONNX",
            ExportFormat::TorchScript => "as TorchScript",
            ExportFormat::SavedModel => "as a SavedModel",
        }
    }
}

impl fmt::Display for ExportFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ExportFormat::Onnx => "ONNX",
            ExportFormat::TorchScript => "TorchScript",
            ExportFormat::SavedModel => "SavedModel",
        })
    }
}

/// The settings of an export, the same for every format.
///
/// `input_shape` is one batch's shape, batch dimension first (`[1, 1, 8, 8]`):
/// ONNX and SavedModel exports build their graph for it, a TorchScript export
/// checks that the model takes it (and needs none: [`default`](Self::default)
/// leaves it empty). The other settings default to what
/// PyTorch's and TensorFlow's exporters write: an input `input`, an output
/// `output`, an open batch dimension, the weights' float dtype as the input's
/// (int64 before an `Embedding`), and never replacing an existing file.
/// [`check`](Self::check) refuses a setting the format cannot honour rather
/// than ignoring it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ExportOptions {
    /// One batch's shape, batch dimension first.
    pub input_shape: Vec<usize>,
    /// The graph input's (or signature input's) name; ONNX and SavedModel only.
    pub input_name: String,
    /// The graph output's (or signature output's) name; ONNX and SavedModel only.
    pub output_name: String,
    /// Whether dimension 0 is symbolic (`batch`); only ONNX can fix it.
    pub dynamic_batch: bool,
    /// The input's element type; ONNX only (default: from the model).
    pub input_dtype: Option<DType>,
    /// Whether an existing export at the target may be replaced (an existing
    /// file, or for a SavedModel an existing SavedModel directory).
    pub overwrite: bool,
}

/// The default input name of every format.
pub const DEFAULT_INPUT_NAME: &str = "input";
/// The default output name of every format.
pub const DEFAULT_OUTPUT_NAME: &str = "output";
/// The name of the second input of a model that
/// [takes an attention mask](crate::model::Layer::takes_attention_mask)
/// (ONNX and SavedModel; TorchScript's `forward` argument), as
/// `transformers` names it: `[batch, seq]` int64, nonzero on the tokens.
pub const ATTENTION_MASK_INPUT: &str = "attention_mask";

impl Default for ExportOptions {
    /// The default settings without an input shape, which only a TorchScript
    /// export takes.
    fn default() -> Self {
        ExportOptions::new(&[])
    }
}

impl ExportOptions {
    /// The default settings for batches shaped like `input_shape` (batch first).
    pub fn new(input_shape: &[usize]) -> Self {
        ExportOptions {
            input_shape: input_shape.to_vec(),
            input_name: DEFAULT_INPUT_NAME.to_owned(),
            output_name: DEFAULT_OUTPUT_NAME.to_owned(),
            dynamic_batch: true,
            input_dtype: None,
            overwrite: false,
        }
    }

    /// With the input named `name` (default `input`).
    pub fn with_input_name(mut self, name: impl Into<String>) -> Self {
        self.input_name = name.into();
        self
    }

    /// With the output named `name` (default `output`).
    pub fn with_output_name(mut self, name: impl Into<String>) -> Self {
        self.output_name = name.into();
        self
    }

    /// With a symbolic (`true`, the default) or fixed batch dimension.
    pub fn with_dynamic_batch(mut self, dynamic: bool) -> Self {
        self.dynamic_batch = dynamic;
        self
    }

    /// With the input's element type `dtype`.
    pub fn with_input_dtype(mut self, dtype: DType) -> Self {
        self.input_dtype = Some(dtype);
        self
    }

    /// Whether an existing export at the target may be replaced (default: no).
    pub fn with_overwrite(mut self, overwrite: bool) -> Self {
        self.overwrite = overwrite;
        self
    }

    /// Checks the settings for `format`: a batch dimension and no zero-sized
    /// dimension, two different non-empty names, and no setting the format
    /// cannot honour (names for TorchScript, a fixed batch or an input dtype
    /// outside ONNX), each an [`ExportError::Invalid`] naming the setting.
    pub fn check(&self, format: ExportFormat) -> Result<(), ExportError> {
        let invalid = |what: &str, reason: String| {
            Err(ExportError::Invalid {
                what: what.to_owned(),
                reason,
            })
        };
        if self.input_shape.is_empty() && format != ExportFormat::TorchScript {
            return invalid(
                "input shape",
                format!(
                    "is empty; a {format} export builds its graph for one input shape: give \
                     the batch dimension and the sample's, like [1, 1, 8, 8]"
                ),
            );
        }
        if self.input_shape.contains(&0) {
            return invalid(
                "input shape",
                format!(
                    "{:?} has a dimension of size 0; every dimension must be at least 1",
                    self.input_shape
                ),
            );
        }
        let named = matches!(format, ExportFormat::Onnx | ExportFormat::SavedModel);
        for (what, name, default) in [
            ("input name", &self.input_name, DEFAULT_INPUT_NAME),
            ("output name", &self.output_name, DEFAULT_OUTPUT_NAME),
        ] {
            if !named && name != default {
                return invalid(
                    what,
                    format!(
                        "`{name}` cannot be given to a {format} export: a TorchScript \
                         module's forward takes and returns positional tensors"
                    ),
                );
            }
            if name.is_empty() {
                return invalid(what, "must not be empty".to_owned());
            }
        }
        if self.input_name == self.output_name {
            return invalid(
                "output name",
                format!("`{}` is also the input's name", self.output_name),
            );
        }
        if !self.dynamic_batch && format != ExportFormat::Onnx {
            return invalid(
                "dynamic batch",
                format!(
                    "a fixed batch size applies to ONNX only: a {format} export takes any \
                     batch size"
                ),
            );
        }
        if let (Some(dtype), false) = (self.input_dtype, format == ExportFormat::Onnx) {
            return invalid(
                "input dtype",
                format!(
                    "{dtype} cannot be set for a {format} export, whose input takes the \
                     model's own dtype; only ONNX takes an input dtype"
                ),
            );
        }
        Ok(())
    }
}

/// Why a model could not be exported, in any format. Every message names
/// what was wrong and what would work; nothing was written when one is returned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// A layer (or one of its settings) has no mapping in the format.
    #[error("{path} ({layer}) cannot be exported {}: {reason}", .format.phrase())]
    Unsupported {
        /// The format.
        format: ExportFormat,
        /// The layer's path in the model (`2.block.0`), or `<root>`.
        path: String,
        /// The layer's kind (`Linear`, `Custom(kiln::my_op)`).
        layer: String,
        /// Why, and what would work.
        reason: String,
    },
    /// A layer builds an op that only Kiln's process knows (a custom op
    /// library), so the format's own runtime could not load the export: a
    /// custom op without a lowering to standard ops
    /// ([`ExportFormat::lowering_registrar`]).
    #[error(
        "{path} ({layer}) cannot be exported {}: its op `{op}` (node `{node}`) is not a \
         standard {} op, so {} cannot load it; register a lowering of the same \
         computation from standard ops with `{}`",
        .format.phrase(), .format.op_set(), .format.runtimes(), .format.lowering_registrar()
    )]
    NonStandardOp {
        /// The format.
        format: ExportFormat,
        /// The layer's path in the model (`2.block.0`), or `<root>`.
        path: String,
        /// The layer's kind (`Custom kiln::bias_gelu`).
        layer: String,
        /// The op's type in the format (`KilnBiasGelu`).
        op: String,
        /// The graph node.
        node: String,
    },
    /// A weight a layer needs is missing, or has another shape or dtype than
    /// the layer declares.
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
    /// An export setting does not fit the model or the format (an empty or
    /// repeated name, an input shape the model does not take).
    #[error("{what}: {reason}")]
    Invalid {
        /// The setting or value (`input dtype`, `output name`).
        what: String,
        /// What was given and what was expected.
        reason: String,
    },
    /// The directory the export should go in does not exist.
    #[error("the directory of {} does not exist; create it first", .path.display())]
    MissingParent {
        /// The target path.
        path: PathBuf,
    },
    /// Something exists at the target and overwriting was not asked for.
    #[error(
        "{} already exists; pass --overwrite (or `with_overwrite(true)`) to replace it",
        .path.display()
    )]
    Exists {
        /// The target path.
        path: PathBuf,
    },
    /// Overwriting was asked for, but the target is something an export never
    /// replaces (a directory where a file goes, a directory that is not a
    /// SavedModel).
    #[error("{} {reason}", .path.display())]
    NotReplaceable {
        /// The target path.
        path: PathBuf,
        /// What it is and what would work.
        reason: String,
    },
    /// Reading or writing a file failed. The I/O error is the
    /// [`source`](std::error::Error::source), left out of this message: show
    /// the chain (`anyhow`'s `{:#}`, or [`crate::error::ErrorChain`]) for
    /// `writing model.onnx: Permission denied (os error 13)`.
    #[error("{action} {}", .path.display())]
    Io {
        /// `writing`, `renaming`, ...
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// An error of Kiln's model definitions, tensors or engines.
    #[error(transparent)]
    Core(#[from] crate::Error),
}

impl ExportError {
    /// An [`ExportError::Io`].
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ExportError::Io {
            action,
            path: path.into(),
            source,
        }
    }

    /// An [`ExportError::Invalid`].
    pub fn invalid(what: impl Into<String>, reason: impl Into<String>) -> Self {
        ExportError::Invalid {
            what: what.into(),
            reason: reason.into(),
        }
    }
}

/// `2.block.0`, or `<root>` for the model itself: a layer's path in messages.
pub fn shown_path(path: &str) -> String {
    if path.is_empty() {
        "<root>".to_owned()
    } else {
        path.to_owned()
    }
}

/// The directory `path` goes in (`.` for a bare name), which must exist:
/// [`ExportError::MissingParent`] otherwise, as every exporter reports it.
pub fn existing_parent(path: &Path) -> Result<PathBuf, ExportError> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if parent.is_dir() {
        Ok(parent)
    } else {
        Err(ExportError::MissingParent {
            path: path.to_path_buf(),
        })
    }
}

/// The file an export writes, checked before anything is built: its directory
/// exists, it is not a directory, and it is free unless overwriting was asked
/// for. [`write`](Self::write) then places the file atomically.
#[derive(Debug)]
pub struct FileTarget {
    path: PathBuf,
    file_name: String,
    overwrite: bool,
}

impl FileTarget {
    /// Checks `path` as the target of an export: a file name (in UTF-8) in an
    /// existing directory ([`ExportError::MissingParent`]), not a directory
    /// ([`ExportError::NotReplaceable`]), free unless `overwrite`
    /// ([`ExportError::Exists`]).
    pub fn check(path: &Path, overwrite: bool) -> Result<Self, ExportError> {
        let file_name = path
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|_| path.to_str().is_some())
            .ok_or_else(|| {
                ExportError::invalid(
                    "output path",
                    format!("{} must name a file, in UTF-8", path.display()),
                )
            })?
            .to_owned();
        existing_parent(path)?;
        let target = FileTarget {
            path: path.to_path_buf(),
            file_name,
            overwrite,
        };
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.is_dir() => Err(ExportError::NotReplaceable {
                path: path.to_path_buf(),
                reason: "is a directory; give the path of a file to create".to_owned(),
            }),
            Ok(_) if !overwrite => Err(ExportError::Exists {
                path: path.to_path_buf(),
            }),
            Ok(_) => Ok(target),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(target),
            Err(e) => Err(ExportError::io("checking", path, e)),
        }
    }

    /// The target path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Calls `save` with a path in a new temporary directory beside the
    /// target, under the target's own file name (a TorchScript archive names
    /// its records after its file), then moves the file into place: with a
    /// rename when replacing is allowed, otherwise with a hard link, which
    /// fails rather than replace a file that appeared since the check. The
    /// temporary directory is removed either way, so a failure leaves the
    /// target as it was.
    pub fn write(
        &self,
        save: impl FnOnce(&Path) -> Result<(), ExportError>,
    ) -> Result<(), ExportError> {
        // Unique per process and call: two exports never share a temporary.
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let tmp_dir = self.path.with_file_name(format!(
            ".{}.export-{}-{}",
            self.file_name,
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&tmp_dir).map_err(|e| ExportError::io("creating", &tmp_dir, e))?;
        let tmp = tmp_dir.join(&self.file_name);
        let result = save(&tmp).and_then(|()| self.place(&tmp));
        if let Err(e) = std::fs::remove_dir_all(&tmp_dir) {
            log::warn!("cannot remove the temporary {}: {e}", tmp_dir.display());
        }
        result
    }

    /// Writes `bytes` as the file, flushed to disk, through [`write`](Self::write).
    pub fn write_bytes(&self, bytes: &[u8]) -> Result<(), ExportError> {
        use std::io::Write as _;
        self.write(|tmp| {
            let mut file =
                std::fs::File::create_new(tmp).map_err(|e| ExportError::io("creating", tmp, e))?;
            file.write_all(bytes)
                .map_err(|e| ExportError::io("writing", tmp, e))?;
            file.sync_all()
                .map_err(|e| ExportError::io("flushing", tmp, e))
        })
    }

    fn place(&self, tmp: &Path) -> Result<(), ExportError> {
        if self.overwrite {
            return std::fs::rename(tmp, &self.path)
                .map_err(|e| ExportError::io("renaming into", &self.path, e));
        }
        match std::fs::hard_link(tmp, &self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(ExportError::Exists {
                path: self.path.clone(),
            }),
            // A file system without hard links: the path was free at the check.
            Err(_) => std::fs::rename(tmp, &self.path)
                .map_err(|e| ExportError::io("renaming into", &self.path, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_a_format_cannot_honour_are_refused_by_name() {
        let options = ExportOptions::new(&[1, 3]);
        for format in [
            ExportFormat::Onnx,
            ExportFormat::TorchScript,
            ExportFormat::SavedModel,
        ] {
            options.check(format).unwrap();
        }
        let fixed = options.clone().with_dynamic_batch(false);
        fixed.check(ExportFormat::Onnx).unwrap();
        let err = fixed.check(ExportFormat::SavedModel).unwrap_err();
        assert!(err.to_string().starts_with("dynamic batch: "), "{err}");
        let err = options
            .clone()
            .with_output_name("y")
            .check(ExportFormat::TorchScript)
            .unwrap_err();
        assert!(err.to_string().contains("`y` cannot be given"), "{err}");
        let err = options
            .clone()
            .with_input_dtype(DType::I64)
            .check(ExportFormat::TorchScript)
            .unwrap_err();
        assert!(err.to_string().starts_with("input dtype: "), "{err}");
        let same = options.clone().with_output_name("input");
        assert!(same.check(ExportFormat::Onnx).is_err());
        assert!(ExportOptions::default().check(ExportFormat::Onnx).is_err());
        ExportOptions::default()
            .check(ExportFormat::TorchScript)
            .unwrap();
        assert!(ExportOptions::new(&[0, 3])
            .check(ExportFormat::Onnx)
            .is_err());
    }

    #[test]
    fn a_file_target_is_checked_and_written_atomically() {
        let dir = std::env::temp_dir().join(format!("kiln-export-target-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.bin");
        let _ = std::fs::remove_file(&path);
        FileTarget::check(&path, false)
            .unwrap()
            .write_bytes(b"one")
            .unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        let err = FileTarget::check(&path, false).unwrap_err();
        assert!(matches!(err, ExportError::Exists { .. }), "{err}");
        // A save that fails leaves the old file and no temporary behind.
        let target = FileTarget::check(&path, true).unwrap();
        let err = target
            .write(|_| Err(ExportError::invalid("model", "refused")))
            .unwrap_err();
        assert_eq!(err.to_string(), "model: refused");
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        target.write_bytes(b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        let err = FileTarget::check(&dir.join("missing/model.bin"), false).unwrap_err();
        assert!(matches!(err, ExportError::MissingParent { .. }), "{err}");
        let err = FileTarget::check(&dir, true).unwrap_err();
        assert!(matches!(err, ExportError::NotReplaceable { .. }), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
