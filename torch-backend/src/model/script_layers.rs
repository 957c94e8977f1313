//! The TorchScript layers inside a [`TorchModel`], saved back for Python.

use std::path::Path;

use kiln_core::{model::Layer, Error, Result};

use super::{lock_script, TorchModel};

impl TorchModel {
    /// Saves the [`Layer::TorchScript`] layer at `layer` (its path in the
    /// model, `"0"`) with its current weights and buffers as a TorchScript
    /// file that Python's `torch.jit.load` reads (see [`ScriptModule::save`](crate::ScriptModule::save)):
    /// a fine-tuned backbone goes back to Python as it came. An unknown path,
    /// or one that is not a torchscript layer, is [`Error::InvalidArgument`].
    pub fn save_torchscript_layer(&self, layer: &str, path: impl AsRef<Path>) -> Result<()> {
        let module = self.script_layer(layer).ok_or_else(|| {
            let layers: Vec<String> = self
                .spec
                .torchscript_layers()
                .into_iter()
                .map(|(p, _)| format!("`{p}`"))
                .collect();
            Error::invalid_argument(
                "layer",
                format!(
                    "`{layer}` is not a torchscript layer of this model (its torchscript \
                     layers: {})",
                    if layers.is_empty() {
                        "none".to_owned()
                    } else {
                        layers.join(", ")
                    }
                ),
            )
        })?;
        lock_script(module)?.save(path)
    }

    /// Whether the model has a [`Layer::TorchScript`] layer.
    pub(super) fn has_scripts(&self) -> bool {
        self.spec
            .layers()
            .iter()
            .any(|(_, l)| matches!(l, Layer::TorchScript(_)))
    }
}
