//! What a `config.json` may ask for, bounded by what the weight files hold.
//!
//! A config is a few hundred bytes that decide how large a model Kiln builds:
//! `num_hidden_layers: 1000000` over a two-layer file would build a million
//! layer definitions before a tensor is compared. The safetensors headers are
//! cheap (no tensor data is read) and already validated, so the sizes that
//! decide the model's memory (the layer count, the vocabulary, the hidden and
//! intermediate sizes, the positions) are compared with the tensors' shapes
//! first, and a difference names the config key, the tensor and both values.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::config::HfConfig;
use crate::error::{HfError, Result};

/// One tensor's header entry: the file it is in and its shape.
pub(crate) struct HeaderTensor {
    pub(crate) file: PathBuf,
    pub(crate) shape: Vec<usize>,
}

/// Every tensor's header entry across `files`, by name. A tensor stored in
/// two files is refused, naming both: which copy is meant is ambiguous.
pub(crate) fn read_headers(files: &[PathBuf]) -> Result<BTreeMap<String, HeaderTensor>> {
    let mut tensors: BTreeMap<String, HeaderTensor> = BTreeMap::new();
    for file in files {
        for (name, _, shape) in kiln_core::safetensors::load_safetensors_shapes(file)? {
            if let Some(first) = tensors.get(&name) {
                return Err(HfError::Config {
                    path: file.clone(),
                    key: name.clone(),
                    reason: format!(
                        "the tensor is stored twice, in {} and in {}; a checkpoint stores \
                         each tensor once",
                        first.file.display(),
                        file.display()
                    ),
                });
            }
            tensors.insert(
                name,
                HeaderTensor {
                    file: file.clone(),
                    shape,
                },
            );
        }
    }
    Ok(tensors)
}

/// The number of layers the tensor names hold: one more than the largest
/// index after a `layers.`, `h.` or `layer.` component
/// (`model.layers.3.mlp...`, `transformer.h.3...`, `encoder.layer.3...`).
fn layers_held(tensors: &BTreeMap<String, HeaderTensor>) -> usize {
    let mut held = 0;
    for name in tensors.keys() {
        let parts: Vec<&str> = name.split('.').collect();
        for pair in parts.windows(2) {
            if matches!(pair[0], "layers" | "h" | "layer") {
                if let Ok(i) = pair[1].parse::<usize>() {
                    held = held.max(i + 1);
                }
            }
        }
    }
    held
}

/// The shape of the first tensor whose name ends with one of `suffixes`.
fn shape_of<'t>(
    tensors: &'t BTreeMap<String, HeaderTensor>,
    suffixes: &[&str],
) -> Option<(&'t str, &'t HeaderTensor)> {
    tensors
        .iter()
        .find(|(name, _)| suffixes.iter().any(|s| name.ends_with(s)))
        .map(|(name, t)| (name.as_str(), t))
}

/// Compares `config`'s sizes with the tensors in `files` before anything is
/// built: no size key present may ask for more than the weights hold (a
/// smaller one is found, as every other difference, by the shape checks of
/// the load, which cost nothing).
pub(crate) fn check_config_against_weights(config: &HfConfig, files: &[PathBuf]) -> Result<()> {
    let tensors = read_headers(files)?;
    let config_path = config.path();
    let mismatch = |key: &str, value: usize, held: String| HfError::Config {
        path: config_path.to_owned(),
        key: key.to_owned(),
        reason: format!(
            "is {value}, but {held}; the config must describe the weights it comes with"
        ),
    };

    let held = layers_held(&tensors);
    for key in ["num_hidden_layers", "n_layer"] {
        if let Some(layers) = config.opt_usize(key)? {
            if layers > held {
                return Err(mismatch(
                    key,
                    layers,
                    format!("the weights ({}) hold {held} layers", describe(files)),
                ));
            }
        }
    }

    // [vocabulary, hidden] of the token embedding.
    let embedding = shape_of(
        &tensors,
        &[
            "embed_tokens.weight",
            "wte.weight",
            "word_embeddings.weight",
        ],
    );
    if let Some((name, t)) = embedding.filter(|(_, t)| t.shape.len() == 2) {
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let held =
            |what: &str, n: usize| format!("`{name}` in {} has {n} {what}", t.file.display());
        for key in ["vocab_size", "n_vocab"] {
            if let Some(v) = config.opt_usize(key)? {
                if v > rows {
                    return Err(mismatch(key, v, held("rows (tokens)", rows)));
                }
            }
        }
        for key in ["hidden_size", "n_embd"] {
            if let Some(v) = config.opt_usize(key)? {
                if v > cols {
                    return Err(mismatch(key, v, held("columns (hidden features)", cols)));
                }
            }
        }
    }

    // [positions, hidden] of a learned position embedding (GPT-2, BERT).
    let positions = shape_of(
        &tensors,
        &["wpe.weight", "embeddings.position_embeddings.weight"],
    );
    if let Some((name, t)) = positions.filter(|(_, t)| t.shape.len() == 2) {
        for key in ["n_positions", "max_position_embeddings"] {
            if let Some(v) = config.opt_usize(key)? {
                if v > t.shape[0] {
                    return Err(mismatch(
                        key,
                        v,
                        format!(
                            "`{name}` in {} has {} rows (positions)",
                            t.file.display(),
                            t.shape[0]
                        ),
                    ));
                }
            }
        }
    }

    // [intermediate, hidden] of the first MLP's up projection.
    let up = shape_of(
        &tensors,
        &["mlp.up_proj.weight", "intermediate.dense.weight"],
    );
    if let Some((name, t)) = up.filter(|(_, t)| t.shape.len() == 2) {
        if let Some(v) = config.opt_usize("intermediate_size")? {
            if v > t.shape[0] {
                return Err(mismatch(
                    "intermediate_size",
                    v,
                    format!("`{name}` in {} has {} rows", t.file.display(), t.shape[0]),
                ));
            }
        }
    }
    Ok(())
}

/// `model.safetensors`, or `3 files (model-00001-of-00003.safetensors, ...)`.
fn describe(files: &[PathBuf]) -> String {
    let name = |p: &Path| {
        p.file_name().map_or_else(
            || p.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    };
    match files {
        [one] => name(one),
        [first, ..] => format!("{} files ({}, ...)", files.len(), name(first)),
        [] => "no file".to_owned(),
    }
}
