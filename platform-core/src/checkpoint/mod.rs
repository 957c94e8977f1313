//! Training checkpoints: one safetensors file with everything a run needs to
//! continue exactly, readable by Python's `safetensors` package.
//!
//! Layout of a checkpoint file:
//!
//! | key / metadata | holds |
//! | --- | --- |
//! | `model.<name>` | parameters and buffers, PyTorch state-dict names |
//! | `optimizer.<key>` | the optimizer's state ([`crate::Optimizer::state_dict`]) |
//! | metadata `kiln.format` | `kiln-checkpoint-1` |
//! | metadata `kiln.version`, `kiln.backend` | who wrote it |
//! | metadata `kiln.step`, `kiln.epoch`, `kiln.batch_in_epoch` | where training stood |
//! | metadata `kiln.seed` | the run's seed (randomness is re-derived from seed and step) |
//! | metadata `kiln.model` | the model definition ([`crate::Layer`], JSON) |
//! | metadata `kiln.scheduler` | the learning-rate schedule's state (JSON) |
//! | metadata `kiln.metrics` | the metrics of the last evaluation (JSON) |
//!
//! Files are written atomically (temporary file, fsync, rename), so a crash
//! mid-write never leaves a broken checkpoint under the final name.

mod manager;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::model::Layer;
use crate::state_dict::StateDict;
use crate::state_tensors::{WritableState, WritableTensor};

pub use manager::{CheckpointPolicy, Checkpointer, MonitorMode};

/// The format tag written into every checkpoint.
pub const CHECKPOINT_FORMAT: &str = "kiln-checkpoint-1";

/// Everything in a checkpoint.
///
/// A checkpoint read back ([`Checkpoint::load`]) holds host copies of its
/// tensors (`S` = [`StateDict`], the default). One about to be written can hold
/// the backend's own tensors instead (`S` = [`StateTensors`](crate::StateTensors),
/// from [`Module::state_tensors`](crate::Module::state_tensors) and
/// [`Optimizer::state_tensors`](crate::Optimizer::state_tensors)), which
/// [`save`](Checkpoint::save) reads in place: that is how the trainer saves.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint<S = StateDict> {
    /// Model parameters and buffers.
    pub model: S,
    /// Optimizer state.
    pub optimizer: S,
    /// Optimizer steps taken.
    pub step: u64,
    /// The epoch in progress (0-based).
    pub epoch: u64,
    /// Batches of `epoch` already consumed.
    pub batch_in_epoch: u64,
    /// The run's seed.
    pub seed: u64,
    /// Which backend wrote it (`"torch"`, `"tensorflow"`).
    pub backend: String,
    /// The model definition, when the model was built from one.
    pub model_definition: Option<Layer>,
    /// The learning-rate schedule's state, if any.
    pub scheduler: Option<serde_json::Value>,
    /// Metrics at the time of saving (e.g. validation loss and accuracy).
    pub metrics: BTreeMap<String, f64>,
}

impl<S: WritableState> Checkpoint<S> {
    /// Writes the checkpoint to `path` atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        let names: Vec<(String, &dyn WritableTensor)> = prefixed("model.", &self.model)
            .chain(prefixed("optimizer.", &self.optimizer))
            .collect();
        let mut meta = BTreeMap::new();
        meta.insert("kiln.format".to_owned(), CHECKPOINT_FORMAT.to_owned());
        meta.insert(
            "kiln.version".to_owned(),
            env!("CARGO_PKG_VERSION").to_owned(),
        );
        meta.insert("kiln.backend".to_owned(), self.backend.clone());
        meta.insert("kiln.step".to_owned(), self.step.to_string());
        meta.insert("kiln.epoch".to_owned(), self.epoch.to_string());
        meta.insert(
            "kiln.batch_in_epoch".to_owned(),
            self.batch_in_epoch.to_string(),
        );
        meta.insert("kiln.seed".to_owned(), self.seed.to_string());
        if let Some(def) = &self.model_definition {
            meta.insert("kiln.model".to_owned(), to_json(def, path)?);
        }
        if let Some(s) = &self.scheduler {
            meta.insert("kiln.scheduler".to_owned(), to_json(s, path)?);
        }
        meta.insert("kiln.metrics".to_owned(), to_json(&self.metrics, path)?);
        crate::safetensors::save_entries(
            path,
            names.iter().map(|(k, v)| (k.as_str(), *v)).collect(),
            &meta,
        )
    }
}

/// The tensors of `state` with their names after `prefix`.
fn prefixed<'a>(
    prefix: &'a str,
    state: &'a impl WritableState,
) -> impl Iterator<Item = (String, &'a dyn WritableTensor)> + 'a {
    state
        .writable_tensors()
        .into_iter()
        .map(move |(name, t)| (format!("{prefix}{name}"), t))
}

impl Checkpoint {
    /// Reads a checkpoint written by [`save`](Self::save).
    ///
    /// A file that is not a Kiln checkpoint (a plain safetensors state dict, another
    /// format version), or whose metadata is damaged, is [`Error::Checkpoint`]
    /// naming the file and what is wrong; a truncated file too.
    pub fn load(path: &Path) -> Result<Self> {
        let (tensors, meta) = StateDict::load_safetensors(path)?;
        let bad = |reason: String| Error::Checkpoint {
            path: path.to_path_buf(),
            reason,
        };
        match meta.get("kiln.format").map(String::as_str) {
            Some(CHECKPOINT_FORMAT) => {}
            Some(other) => {
                return Err(bad(format!(
                    "format `{other}`, this Kiln reads `{CHECKPOINT_FORMAT}`"
                )))
            }
            None => {
                return Err(bad(
                    "no `kiln.format` metadata: a safetensors file, but not a Kiln checkpoint \
                     (load a plain state dict with the model's `load` instead)"
                        .to_owned(),
                ))
            }
        }
        let number = |key: &str| -> Result<u64> {
            let text = meta
                .get(key)
                .ok_or_else(|| bad(format!("metadata `{key}` is missing")))?;
            text.parse()
                .map_err(|_| bad(format!("metadata `{key}` is `{text}`, not a whole number")))
        };
        let parse_json = |key: &str| -> Result<Option<serde_json::Value>> {
            meta.get(key)
                .map(|text| {
                    serde_json::from_str(text)
                        .map_err(|e| bad(format!("metadata `{key}` is not valid JSON: {e}")))
                })
                .transpose()
        };
        let model_definition = match parse_json("kiln.model")? {
            Some(v) => Some(serde_json::from_value(v).map_err(|e| {
                bad(format!(
                    "metadata `kiln.model` is not a model definition: {e}"
                ))
            })?),
            None => None,
        };
        let metrics = match parse_json("kiln.metrics")? {
            Some(v) => serde_json::from_value(v).map_err(|e| {
                bad(format!(
                    "metadata `kiln.metrics` is not a map of numbers: {e}"
                ))
            })?,
            None => BTreeMap::new(),
        };
        let mut model = StateDict::new();
        let mut optimizer = StateDict::new();
        for (key, value) in tensors.into_inner() {
            if let Some(k) = key.strip_prefix("model.") {
                model.insert(k.to_owned(), value);
            } else if let Some(k) = key.strip_prefix("optimizer.") {
                optimizer.insert(k.to_owned(), value);
            } else {
                return Err(bad(format!(
                    "unexpected tensor `{key}` (expected `model.*` or `optimizer.*`)"
                )));
            }
        }
        Ok(Self {
            model,
            optimizer,
            step: number("kiln.step")?,
            epoch: number("kiln.epoch")?,
            batch_in_epoch: number("kiln.batch_in_epoch")?,
            seed: number("kiln.seed")?,
            backend: meta.get("kiln.backend").cloned().unwrap_or_default(),
            model_definition,
            scheduler: parse_json("kiln.scheduler")?,
            metrics,
        })
    }
}

/// Serialises a metadata value to JSON, naming the file on failure.
fn to_json<T: serde::Serialize>(value: &T, path: &Path) -> Result<String> {
    serde_json::to_string(value).map_err(|e| Error::Checkpoint {
        path: path.to_path_buf(),
        reason: format!("cannot serialise metadata: {e}"),
    })
}

/// `<dir>/step-<step>.safetensors`.
pub fn checkpoint_path(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step:08}.safetensors"))
}
