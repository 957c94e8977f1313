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
    /// The layers `layer_types` names, by default all but every
    /// `sliding_window_pattern`-th (Gemma 3: five local layers, one global).
    Pattern,
}

/// The sliding window of each of `layers` layers (`None`: full causal attention).
pub(crate) fn sliding_windows(
    config: &HfConfig,
    layers: usize,
    rule: Windows,
) -> Result<Vec<Option<usize>>> {
    let window = match rule {
        Windows::Never => None,
        Windows::EveryLayer | Windows::Pattern => config.opt_usize("sliding_window")?,
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
    // Without a window (use_sliding_window false), transformers' sliding
    // layers see the whole causal context.
    Ok(sliding_layers(config, layers, rule)?
        .into_iter()
        .map(|sliding| window.filter(|_| sliding))
        .collect())
}

/// Whether each of `layers` layers is a sliding-window layer
/// (`"sliding_attention"`), by `layer_types` or the family's rule.
pub(crate) fn sliding_layers(config: &HfConfig, layers: usize, rule: Windows) -> Result<Vec<bool>> {
    if let (Windows::LayerTypes | Windows::Pattern, Some(types)) = (rule, config.get("layer_types"))
    {
        return layer_types(config, types, layers);
    }
    Ok(match rule {
        Windows::Never => vec![false; layers],
        Windows::EveryLayer => vec![config.get("sliding_window").is_some(); layers],
        Windows::LayerTypes => {
            let first = config.opt_usize("max_window_layers")?.unwrap_or(28);
            (0..layers).map(|i| i >= first).collect()
        }
        Windows::Pattern => {
            let pattern = config
                .opt_usize("sliding_window_pattern")?
                .unwrap_or(6)
                .max(1);
            (0..layers).map(|i| (i + 1) % pattern != 0).collect()
        }
    })
}

/// `layer_types`: one entry per layer, full or sliding attention.
fn layer_types(config: &HfConfig, types: &Value, layers: usize) -> Result<Vec<bool>> {
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
            Some("full_attention") => Ok(false),
            Some("sliding_attention") => Ok(true),
            _ => Err(config.unsupported(
                "layer_types",
                format!("layer type {t}: Kiln builds full_attention and sliding_attention layers"),
            )),
        })
        .collect()
}
