//! Which layers of a decoder attend within a sliding window: `layer_types`
//! (`"full_attention"`, `"sliding_attention"`) where the config has it, else
//! the family's own rule, with the window `sliding_window` (gated by
//! `use_sliding_window` in the families that have that key).

use serde_json::Value;

use crate::config::HfConfig;
use crate::error::{HfError, Result};

/// How a family decides which of its layers slide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Windows {
    /// Never (LLaMA's attention reads no `sliding_window`).
    Never,
    /// Every layer, when `sliding_window` is set (Mistral, Phi-3).
    EveryLayer,
    /// The layers `layer_types` names, by default those from
    /// `max_window_layers` on (Qwen2, Qwen3), when `use_sliding_window`.
    LayerTypes,
}

/// The sliding window of each of `layers` layers (`None`: full causal attention).
pub(crate) fn sliding_windows(
    config: &HfConfig,
    layers: usize,
    rule: Windows,
) -> Result<Vec<Option<usize>>> {
    let window = match rule {
        Windows::Never => None,
        Windows::EveryLayer => config.opt_usize("sliding_window")?,
        Windows::LayerTypes => {
            if config.bool_or("use_sliding_window", false)? {
                config.opt_usize("sliding_window")?
            } else {
                None
            }
        }
    };
    if window == Some(0) {
        return Err(HfError::Config {
            path: config.path().to_owned(),
            key: "sliding_window".to_owned(),
            reason: "is 0; a window holds at least the token itself".to_owned(),
        });
    }
    match rule {
        Windows::Never => Ok(vec![None; layers]),
        Windows::EveryLayer => Ok(vec![window; layers]),
        Windows::LayerTypes => match config.get("layer_types") {
            None => {
                let first = config.opt_usize("max_window_layers")?.unwrap_or(28);
                Ok((0..layers).map(|i| window.filter(|_| i >= first)).collect())
            }
            Some(types) => layer_types(config, types, layers, window),
        },
    }
}

/// `layer_types`: one entry per layer, full or sliding attention.
fn layer_types(
    config: &HfConfig,
    types: &Value,
    layers: usize,
    window: Option<usize>,
) -> Result<Vec<Option<usize>>> {
    let wrong = |reason: String| HfError::Config {
        path: config.path().to_owned(),
        key: "layer_types".to_owned(),
        reason,
    };
    let Some(types) = types.as_array() else {
        return Err(wrong(format!(
            "expected a list of layer types, got {types}"
        )));
    };
    if types.len() != layers {
        return Err(wrong(format!(
            "has {} entries for num_hidden_layers = {layers}; one per layer",
            types.len()
        )));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            Some("full_attention") => Ok(None),
            // Without a window (use_sliding_window false), transformers'
            // sliding layers see the whole causal context.
            Some("sliding_attention") => Ok(window),
            _ => Err(config.unsupported(
                "layer_types",
                format!("layer type {t}: Kiln builds full_attention and sliding_attention layers"),
            )),
        })
        .collect()
}
