//! `TorchScript`: a TorchScript file (`torch.jit.script` / `torch.jit.trace`
//! output) as one layer of a model, for transfer learning from a pretrained
//! backbone. Its parameters and buffers come from the file, under the layer's
//! path; the torch backend builds it (TensorFlow cannot run TorchScript).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{FieldCheck, LayerSpec, ShapeCheck};
use crate::error::{Error, Result};

fn yes() -> bool {
    true
}

/// A TorchScript model as a layer: `{ type = "torchscript", path = "backbone.pt" }`.
///
/// Its output shape is found by running it once: the torch backend fills
/// `output_shape` in from the data's input shape
/// (`kiln_torch::resolve_torchscript_shapes`), and a checkpoint records it.
/// Until then, shape inference through this layer is
/// [`Error::Unsupported`](crate::Error::Unsupported) saying so.
///
/// ```
/// use kiln_core::model::{Layer, LinearConfig, TorchScriptConfig};
///
/// let toml = r#"
///     type = "sequential"
///     layers = [
///       { type = "torchscript", path = "backbone.pt", trainable = false },
///       { type = "linear", in_features = 64, out_features = 10 },
///     ]
/// "#;
/// let net: Layer = toml::from_str(toml).expect("valid");
/// let backbone = TorchScriptConfig::new("backbone.pt").frozen().with_output_shape([64]);
/// assert!(net.output_shape(&[8, 1, 8, 8]).is_err()); // not run yet
/// let resolved = Layer::sequential([backbone.into(), LinearConfig::new(64, 10).into()]);
/// assert_eq!(resolved.output_shape(&[8, 1, 8, 8])?, vec![8, 10]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TorchScriptConfig {
    /// The `.pt` file, as `torch.jit.save` wrote it (relative paths are
    /// relative to the working directory).
    pub path: PathBuf,
    /// Whether its parameters train (default); `false` freezes them all: no
    /// gradient, and not in the optimizer.
    #[serde(default = "yes")]
    pub trainable: bool,
    /// The shape of one example's output (without the batch dimension), found
    /// by running the file once; filled in by the torch backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_shape: Option<Vec<usize>>,
}

impl TorchScriptConfig {
    /// The TorchScript file at `path`, trainable, its output shape unknown.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            trainable: true,
            output_shape: None,
        }
    }

    /// Freezes every parameter of the file (`trainable = false`).
    pub fn frozen(mut self) -> Self {
        self.trainable = false;
        self
    }

    /// Records the shape of one example's output (batch dimension excluded).
    pub fn with_output_shape(mut self, shape: impl Into<Vec<usize>>) -> Self {
        self.output_shape = Some(shape.into());
        self
    }
}

impl LayerSpec for TorchScriptConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        if self.path.as_os_str().is_empty() {
            return Err(check.invalid("path", "must name a TorchScript (.pt) file"));
        }
        if let Some(shape) = &self.output_shape {
            check.positive_all("output_shape", shape)?;
        }
        Ok(())
    }

    fn output_shape(&self, _input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        at.recorded(self.output_shape.as_deref(), |path| {
            Error::unsupported(format!(
                "shape inference through the torchscript layer `{}` ({}) before it has run: \
                 its output shape is found by running the file once on the torch backend \
                 (kiln train/eval/predict/inspect do), or give it as `output_shape`",
                path,
                self.path.display()
            ))
        })
    }
}
