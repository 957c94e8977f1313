//! Training checkpoints: one safetensors file with everything a run needs to
//! continue exactly, readable by Python's `safetensors` package.
//!
//! Layout of a checkpoint file:
//!
//! | key / metadata | holds |
//! | --- | --- |
//! | `model.<name>` | parameters and buffers, PyTorch state-dict names |
//! | `optimizer.<key>` | the optimizer's state ([`kiln_core::optim::Optimizer::state_dict`]) |
//! | metadata `kiln.format` | `kiln-checkpoint-1` |
//! | metadata `kiln.version`, `kiln.backend` | who wrote it |
//! | metadata `kiln.step`, `kiln.epoch`, `kiln.batch_in_epoch` | where training stood |
//! | metadata `kiln.seed` | the run's seed (randomness is re-derived from seed and step) |
//! | metadata `kiln.world_size` | the number of data-parallel ranks (absent: 1) |
//! | metadata `kiln.optimizer` | the optimizer's algorithm (`adamw`, ...), when known |
//! | metadata `kiln.optimizer_tensors` | how many `optimizer.*` tensors the file holds |
//! | metadata `kiln.optimizer_state` | a record of that state: algorithm, step, entries of each name, checksum (JSON) |
//! | metadata `kiln.model` | the model definition ([`kiln_core::model::Layer`], JSON) |
//! | metadata `kiln.data` | what identifies the training data (JSON, as the trainer was given it) |
//! | metadata `kiln.data_order` | the loaders' shuffle order ([`kiln_core::rng::EPOCH_ORDER`]; absent: written by a Kiln before it) |
//! | metadata `kiln.scheduler` | the learning-rate schedule's state (JSON) |
//! | metadata `kiln.metrics` | the metrics of the last evaluation (JSON) |
//! | metadata `kiln.epoch_loss` | the epoch's training loss so far, `[sum, samples]` (JSON) |
//! | metadata `kiln.epoch_metrics` | the objective's metrics so far, `{name: [sum, samples]}` (JSON; only when it has some) |
//! | metadata `kiln.callbacks` | the callbacks' states by [`state_key`](crate::Callback::state_key) (JSON; absent: none) |
//!
//! Files are written atomically (temporary file, fsync, rename), so a crash
//! mid-write never leaves a broken checkpoint under the final name. A file whose
//! optimizer tensors were removed after it was written (fewer than
//! `kiln.optimizer_tensors`), or that differ from `kiln.optimizer_state`, is
//! refused: a resume from it would not be exact.
//!
//! A run under a sharded strategy writes a sharded checkpoint instead: one
//! such file per rank with its part of the state, and an index that reads as
//! the whole (the `sharded` module's documentation has the layout).

mod data_order;
mod finite;
mod manager;
mod manifest;
mod run_dir;
mod sharded;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_core::error::{Error, Result};
use kiln_core::model::Layer;
use kiln_core::state_dict::StateDict;
use kiln_core::state_tensors::{WritableState, WritableTensor};

pub use data_order::DATA_ORDER_KEY;

pub use finite::{find_non_finite, refuse_non_finite, NonFinite};
pub use manager::{CheckpointPolicy, Checkpointer, MonitorMode};
pub use run_dir::{RunDirectory, RunStart, LOCK_FILE, RUN_OUTPUTS};
pub use sharded::{save_sharded_checkpoint, shard_path};

/// The format tag written into every checkpoint.
pub const CHECKPOINT_FORMAT: &str = "kiln-checkpoint-1";

/// Everything in a checkpoint.
///
/// A checkpoint read back ([`Checkpoint::load`]) holds host copies of its
/// tensors (`S` = [`StateDict`], the default). One about to be written can hold
/// the backend's own tensors instead (`S` = [`StateTensors`](kiln_core::state_tensors::StateTensors),
/// from [`Module::state_tensors`](kiln_core::module::Module::state_tensors) and
/// [`Optimizer::state_tensors`](kiln_core::optim::Optimizer::state_tensors)), which
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
    /// How many data-parallel ranks trained it (1 for one process):
    /// `batch_in_epoch` counts each rank's batches.
    pub world_size: u64,
    /// Which backend wrote it (`"torch"`, `"tensorflow"`).
    pub backend: String,
    /// The optimizer's algorithm ([`OptimizerConfig::kind`](kiln_core::optim::OptimizerConfig::kind)),
    /// when the optimizer reports it ([`Optimizer::kind`](kiln_core::optim::Optimizer::kind)).
    pub optimizer_kind: Option<String>,
    /// The model definition, when the model was built from one.
    pub model_definition: Option<Layer>,
    /// The LoRA adapters the model was trained with, if any: their tensors
    /// are in `model`, and [`LoraConfig::merge`](kiln_core::lora::LoraConfig::merge)
    /// folds them into the base weights.
    pub lora: Option<kiln_core::lora::LoraConfig>,
    /// What identifies the data the run trained on (the CLI records the
    /// dataset's kind, path, sample counts and a fingerprint), when the trainer
    /// was given it ([`Trainer::with_data_identity`](crate::Trainer::with_data_identity)):
    /// a resume on other data can then be refused.
    pub data: Option<serde_json::Value>,
    /// The shuffle order of the data loaders the run trained with
    /// ([`kiln_core::rng::EPOCH_ORDER`], which the [`Trainer`](crate::Trainer)
    /// records), or `None` for a checkpoint written before Kiln recorded it,
    /// whose loaders shuffled in another order: one written mid-epoch cannot
    /// resume on the samples it left off at ([`Checkpoint::check_data_order`]).
    pub data_order: Option<String>,
    /// The learning-rate schedule's state, if any.
    pub scheduler: Option<serde_json::Value>,
    /// Metrics at the time of saving (e.g. validation loss and accuracy).
    pub metrics: BTreeMap<String, f64>,
    /// The training loss of the epoch in progress so far, as the sum of the
    /// per-sample losses and the number of samples: a run resumed mid-epoch
    /// reports the epoch's loss over all its batches, as an uninterrupted one.
    pub epoch_loss: Option<(f64, u64)>,
    /// The epoch's running means of the objective's metrics so far
    /// ([`Objective::metric_names`](kiln_core::objective::Objective::metric_names)),
    /// by name, as `[sum, samples]` each; empty for a supervised loss.
    pub epoch_metrics: BTreeMap<String, (f64, u64)>,
    /// The run's weight average ([`WeightAveraging`](crate::WeightAveraging)),
    /// if it keeps one: the averaged tensors and how many updates made them.
    pub averaged: Option<Averaged<S>>,
    /// The training callbacks' states ([`Callback::state_dict`](crate::Callback::state_dict)),
    /// by their [`state_key`](crate::Callback::state_key).
    pub callbacks: BTreeMap<String, serde_json::Value>,
}

/// A weight average as a checkpoint holds it.
#[derive(Clone, Debug, PartialEq)]
pub struct Averaged<S = StateDict> {
    /// The averaged parameters (and floating-point buffers), by the model's names.
    pub tensors: S,
    /// Updates made (`AveragedModel.n_averaged`).
    pub updates: u64,
    /// How the average is kept.
    pub method: AveragingMethod,
    /// For stochastic weight averaging once it has begun: each parameter
    /// group's learning rate when it began, which its schedule anneals from.
    pub swa_lrs_from: Option<Vec<f64>>,
}

/// How a weight average is kept.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AveragingMethod {
    /// An exponential moving average ([`EmaConfig`](crate::EmaConfig)).
    #[default]
    Ema,
    /// Stochastic weight averaging: an equal-weight average
    /// ([`SwaConfig`](crate::SwaConfig)).
    Swa,
}

impl AveragingMethod {
    /// `"ema"` or `"swa"`, as the config key and the checkpoint name it.
    pub fn name(self) -> &'static str {
        match self {
            AveragingMethod::Ema => "ema",
            AveragingMethod::Swa => "swa",
        }
    }
}

/// The metadata key counting a checkpoint's weight-average updates.
const AVERAGED_UPDATES: &str = "kiln.averaged_updates";
/// The metadata key naming how the average is kept (`ema` when absent).
const AVERAGING_METHOD: &str = "kiln.averaging_method";
/// The metadata key of SWA's starting learning rates (JSON).
const SWA_LRS_FROM: &str = "kiln.swa_lrs_from";

impl<S: WritableState> Checkpoint<S> {
    /// Writes the checkpoint to `path` atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.save_with(path, BTreeMap::new())
    }

    /// Writes the checkpoint to `path` atomically, with `extra` metadata.
    fn save_with(&self, path: &Path, extra: BTreeMap<String, String>) -> Result<()> {
        let mut names: Vec<(String, &dyn WritableTensor)> = prefixed("model.", &self.model)
            .chain(prefixed("optimizer.", &self.optimizer))
            .collect();
        if let Some(averaged) = &self.averaged {
            names.extend(prefixed("averaged.", &averaged.tensors));
        }
        let mut meta = extra;
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
        meta.insert("kiln.world_size".to_owned(), self.world_size.to_string());
        if let Some(kind) = &self.optimizer_kind {
            meta.insert("kiln.optimizer".to_owned(), kind.clone());
        }
        meta.insert(
            OPTIMIZER_TENSORS.to_owned(),
            self.optimizer.writable_tensors().len().to_string(),
        );
        let manifest = manifest::OptimizerManifest::of_writable(
            self.optimizer_kind.as_deref(),
            self.step,
            &self.optimizer,
        )?;
        meta.insert(
            manifest::OPTIMIZER_STATE.to_owned(),
            to_json(&manifest, path)?,
        );
        if let Some(def) = &self.model_definition {
            meta.insert("kiln.model".to_owned(), to_json(def, path)?);
        }
        if let Some(lora) = &self.lora {
            meta.insert("kiln.lora".to_owned(), to_json(lora, path)?);
        }
        if let Some(s) = &self.scheduler {
            meta.insert("kiln.scheduler".to_owned(), to_json(s, path)?);
        }
        if let Some(data) = &self.data {
            meta.insert("kiln.data".to_owned(), to_json(data, path)?);
        }
        if let Some(order) = &self.data_order {
            meta.insert(DATA_ORDER_KEY.to_owned(), order.clone());
        }
        meta.insert("kiln.metrics".to_owned(), to_json(&self.metrics, path)?);
        if let Some(loss) = &self.epoch_loss {
            meta.insert("kiln.epoch_loss".to_owned(), to_json(loss, path)?);
        }
        if !self.epoch_metrics.is_empty() {
            meta.insert(
                "kiln.epoch_metrics".to_owned(),
                to_json(&self.epoch_metrics, path)?,
            );
        }
        if !self.callbacks.is_empty() {
            meta.insert("kiln.callbacks".to_owned(), to_json(&self.callbacks, path)?);
        }
        if let Some(averaged) = &self.averaged {
            meta.insert(AVERAGED_UPDATES.to_owned(), averaged.updates.to_string());
            meta.insert(
                AVERAGING_METHOD.to_owned(),
                averaged.method.name().to_owned(),
            );
            if let Some(lrs) = &averaged.swa_lrs_from {
                meta.insert(SWA_LRS_FROM.to_owned(), to_json(lrs, path)?);
            }
        }
        kiln_core::safetensors::save_entries(
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

/// The metadata key counting a checkpoint's optimizer tensors.
const OPTIMIZER_TENSORS: &str = "kiln.optimizer_tensors";

/// Checks that `meta` is a Kiln checkpoint's metadata of the format this Kiln reads.
fn check_format(meta: &BTreeMap<String, String>, path: &Path) -> Result<()> {
    let bad = |reason: String| Error::checkpoint(path, reason);
    match meta.get("kiln.format").map(String::as_str) {
        Some(CHECKPOINT_FORMAT) => Ok(()),
        Some(other) => Err(bad(format!(
            "format `{other}`, this Kiln reads `{CHECKPOINT_FORMAT}`"
        ))),
        None => Err(bad(
            "no `kiln.format` metadata: a safetensors file, but not a Kiln checkpoint \
             (load a plain state dict with the model's `load` instead)"
                .to_owned(),
        )),
    }
}

impl Checkpoint {
    /// The metrics recorded in the checkpoint at `path` (`kiln.metrics`), read
    /// from its header alone: no tensor data is read.
    ///
    /// Fails as [`load`](Self::load) does for a file that is not a Kiln
    /// checkpoint or whose metrics metadata is damaged.
    pub fn load_metrics(path: &Path) -> Result<BTreeMap<String, f64>> {
        let meta = kiln_core::safetensors::load_safetensors_metadata(path)?;
        check_format(&meta, path)?;
        parse_metrics(&meta, path)
    }

    /// The files [`load`](Self::load) reads for the checkpoint at `path`: the
    /// file itself and, for a sharded checkpoint's index, every shard it names
    /// beside it. Only the header is read, so an output can be compared with
    /// every file of the set before anything is written.
    pub fn files(path: &Path) -> Result<Vec<PathBuf>> {
        let meta = kiln_core::safetensors::load_safetensors_metadata(path)?;
        let mut files = vec![path.to_path_buf()];
        if let Some(listing) = meta.get(sharded::INDEX_KEY) {
            let dir = path.parent().unwrap_or(Path::new("."));
            files.extend(
                sharded::listed_shards(path, listing)?
                    .iter()
                    .map(|n| dir.join(n)),
            );
        }
        Ok(files)
    }

    /// Reads a checkpoint written by [`save`](Self::save).
    ///
    /// A file that is not a Kiln checkpoint (a plain safetensors state dict, another
    /// format version), or whose metadata is damaged, is [`Error::Checkpoint`]
    /// naming the file and what is wrong; a truncated file too, and one with
    /// fewer or more optimizer tensors than it was written with.
    ///
    /// A sharded checkpoint ([`save_sharded_checkpoint`](crate::save_sharded_checkpoint)) is read through
    /// its index, the `step-<n>.safetensors` file: every rank's shard is read,
    /// checked to be of this set, and put together into the whole state, as
    /// one process's checkpoint holds it. A shard missing, damaged or of
    /// another checkpoint is [`Error::Checkpoint`] naming it.
    pub fn load(path: &Path) -> Result<Self> {
        let (tensors, meta) = StateDict::load_safetensors(path)?;
        check_format(&meta, path)?;
        if let Some(record) = meta.get(sharded::SHARD_KEY) {
            return Err(sharded::refuse_lone_shard(path, record));
        }
        if meta.contains_key(sharded::INDEX_KEY) {
            return sharded::load_set(path, tensors, &meta);
        }
        Self::from_parts(tensors, &meta, path)
    }

    /// A checkpoint from a file's tensors and metadata, checked.
    fn from_parts(
        tensors: StateDict,
        meta: &BTreeMap<String, String>,
        path: &Path,
    ) -> Result<Self> {
        let bad = |reason: String| Error::checkpoint(path, reason);
        let bad_json =
            |reason: String, e: serde_json::Error| Error::checkpoint_caused_by(path, reason, e);
        check_format(meta, path)?;
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
                        .map_err(|e| bad_json(format!("metadata `{key}` is not valid JSON"), e))
                })
                .transpose()
        };
        let model_definition = metadata_json(meta, "kiln.model", "a model definition", path)?;
        let lora = metadata_json(meta, "kiln.lora", "a LoRA config", path)?;
        let metrics = parse_metrics(meta, path)?;
        let mut model = StateDict::new();
        let mut optimizer = StateDict::new();
        let mut averaged = StateDict::new();
        for (key, value) in tensors.into_inner() {
            if let Some(k) = key.strip_prefix("model.") {
                model.insert(k.to_owned(), value);
            } else if let Some(k) = key.strip_prefix("optimizer.") {
                optimizer.insert(k.to_owned(), value);
            } else if let Some(k) = key.strip_prefix("averaged.") {
                averaged.insert(k.to_owned(), value);
            } else {
                return Err(bad(format!(
                    "unexpected tensor `{key}` (expected `model.*`, `optimizer.*` or \
                     `averaged.*`)"
                )));
            }
        }
        let averaged = match meta.get(AVERAGED_UPDATES) {
            Some(_) => Some(Averaged {
                tensors: averaged,
                updates: number(AVERAGED_UPDATES)?,
                method: match meta.get(AVERAGING_METHOD).map(String::as_str) {
                    None | Some("ema") => AveragingMethod::Ema,
                    Some("swa") => AveragingMethod::Swa,
                    Some(other) => {
                        return Err(bad(format!(
                            "metadata `{AVERAGING_METHOD}` is `{other}`, expected `ema` or `swa`"
                        )))
                    }
                },
                swa_lrs_from: metadata_json(meta, SWA_LRS_FROM, "a list of rates", path)?,
            }),
            None if averaged.is_empty() => None,
            None => {
                return Err(bad(format!(
                    "holds {} `averaged.*` tensors but no `{AVERAGED_UPDATES}` metadata",
                    averaged.len()
                )))
            }
        };
        let written = number(OPTIMIZER_TENSORS)?;
        if written != optimizer.len() as u64 {
            return Err(bad(format!(
                "holds {} optimizer tensors, but was written with {written} \
                 (`{OPTIMIZER_TENSORS}`): optimizer state was removed or added after saving, \
                 so resuming from it would not be exact",
                optimizer.len()
            )));
        }
        let step = number("kiln.step")?;
        // Checkpoints from before the record have none; resuming checks them
        // against the optimizer instead.
        if let Some(recorded) = meta.get(manifest::OPTIMIZER_STATE) {
            let kind = meta.get("kiln.optimizer").map(String::as_str);
            manifest::check_manifest(recorded, kind, step, &optimizer, path)?;
        }
        Ok(Self {
            model,
            optimizer,
            step,
            epoch: number("kiln.epoch")?,
            batch_in_epoch: number("kiln.batch_in_epoch")?,
            seed: number("kiln.seed")?,
            // Checkpoints written before data-parallel training: one process.
            world_size: match meta.get("kiln.world_size") {
                Some(_) => number("kiln.world_size")?,
                None => 1,
            },
            backend: meta.get("kiln.backend").cloned().unwrap_or_default(),
            optimizer_kind: meta.get("kiln.optimizer").cloned(),
            model_definition,
            lora,
            data: parse_json("kiln.data")?,
            data_order: meta.get(DATA_ORDER_KEY).cloned(),
            scheduler: parse_json("kiln.scheduler")?,
            metrics,
            epoch_loss: metadata_json(meta, "kiln.epoch_loss", "[sum, samples]", path)?,
            epoch_metrics: metadata_json(
                meta,
                "kiln.epoch_metrics",
                "an object of [sum, samples]",
                path,
            )?
            .unwrap_or_default(),
            averaged,
            callbacks: metadata_json(meta, "kiln.callbacks", "an object of states", path)?
                .unwrap_or_default(),
        })
    }
}

impl<S: Default> Checkpoint<S> {
    /// Model weights alone, from `backend` (a name, such as `"huggingface"`),
    /// as a checkpoint: no optimizer state, no training position, no recorded
    /// definition (so [`check_definition`](Self::check_definition) passes and
    /// the weights must fit the model by name and shape).
    ///
    /// ```
    /// use kiln_core::state_dict::StateDict;
    /// use kiln_train::Checkpoint;
    ///
    /// let checkpoint = Checkpoint::of_weights(StateDict::new(), "huggingface");
    /// assert_eq!((checkpoint.step, checkpoint.world_size), (0, 1));
    /// ```
    pub fn of_weights(model: S, backend: &str) -> Self {
        Checkpoint {
            model,
            optimizer: S::default(),
            step: 0,
            epoch: 0,
            batch_in_epoch: 0,
            seed: 0,
            world_size: 1,
            backend: backend.to_owned(),
            optimizer_kind: None,
            model_definition: None,
            lora: None,
            data: None,
            data_order: None,
            scheduler: None,
            metrics: BTreeMap::new(),
            epoch_loss: None,
            epoch_metrics: Default::default(),
            averaged: None,
            callbacks: BTreeMap::new(),
        }
    }
}

impl<S> Checkpoint<S> {
    /// Checks that the checkpoint's recorded model definition is `expected`
    /// (the config is the source of truth; a checkpoint that records no
    /// definition passes). A difference is [`Error::Checkpoint`] naming the
    /// first place where the two differ, with both values.
    pub fn check_definition(&self, expected: &Layer, path: &Path) -> Result<()> {
        let Some(recorded) = &self.model_definition else {
            return Ok(());
        };
        if recorded == expected {
            return Ok(());
        }
        let json = |layer: &Layer| serde_json::to_value(layer).unwrap_or_default();
        let (at, config, checkpoint) = first_difference(&json(expected), &json(recorded), "model");
        Err(Error::checkpoint(
            path,
            format!(
                "was trained with another model definition: at `{at}` the config has {config} \
                 and the checkpoint {checkpoint}. The config is the source of truth: give it \
                 the checkpoint's definition (`kiln inspect` shows it) or use another checkpoint"
            ),
        ))
    }
}

/// The first path at which the JSON values `a` and `b` differ (`at` names
/// their root, as `model`), with the two values there (`missing` where one side
/// lacks the key): what messages about two configs or definitions name.
///
/// ```
/// let a = serde_json::json!({"data": {"batch_size": 64, "workers": 2}});
/// let b = serde_json::json!({"data": {"batch_size": 16, "workers": 2}});
/// let (at, x, y) = kiln_train::first_difference(&a, &b, "config");
/// assert_eq!((at.as_str(), x.as_str(), y.as_str()), ("config.data.batch_size", "64", "16"));
/// ```
pub fn first_difference(
    a: &serde_json::Value,
    b: &serde_json::Value,
    at: &str,
) -> (String, String, String) {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            for key in keys {
                let path = format!("{at}.{key}");
                match (x.get(key), y.get(key)) {
                    (Some(p), Some(q)) if p == q => {}
                    (Some(p), Some(q)) => return first_difference(p, q, &path),
                    (p, q) => {
                        let show = |v: Option<&Value>| v.map_or("missing".into(), Value::to_string);
                        return (path, show(p), show(q));
                    }
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            if let Some((i, (p, q))) = x.iter().zip(y).enumerate().find(|(_, (p, q))| p != q) {
                return first_difference(p, q, &format!("{at}[{i}]"));
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            return (
                at.to_owned(),
                format!("{} entries", x.len()),
                format!("{} entries", y.len()),
            )
        }
        _ => {}
    }
    (at.to_owned(), a.to_string(), b.to_string())
}

/// The metadata `key`, JSON of type `T` (`what` it is, for the error), if the
/// checkpoint has it.
fn metadata_json<T: serde::de::DeserializeOwned>(
    meta: &BTreeMap<String, String>,
    key: &str,
    what: &str,
    path: &Path,
) -> Result<Option<T>> {
    let Some(text) = meta.get(key) else {
        return Ok(None);
    };
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| {
        Error::checkpoint_caused_by(path, format!("metadata `{key}` is not valid JSON"), e)
    })?;
    serde_json::from_value(value).map(Some).map_err(|e| {
        Error::checkpoint_caused_by(path, format!("metadata `{key}` is not {what}"), e)
    })
}

/// The `kiln.metrics` metadata (none when absent).
fn parse_metrics(meta: &BTreeMap<String, String>, path: &Path) -> Result<BTreeMap<String, f64>> {
    let Some(text) = meta.get("kiln.metrics") else {
        return Ok(BTreeMap::new());
    };
    serde_json::from_str(text).map_err(|e| {
        Error::checkpoint_caused_by(path, "metadata `kiln.metrics` is not a map of numbers", e)
    })
}

/// Serialises a metadata value to JSON, naming the file on failure.
fn to_json<T: serde::Serialize>(value: &T, path: &Path) -> Result<String> {
    serde_json::to_string(value)
        .map_err(|e| Error::checkpoint_caused_by(path, "cannot serialise metadata", e))
}

/// `<dir>/step-<step>.safetensors`.
pub fn checkpoint_path(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step:08}.safetensors"))
}

/// The entries of `dir` (none when it does not exist), each read error naming `dir`.
fn dir_entries(dir: &Path) -> Result<Vec<std::fs::DirEntry>> {
    match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .map(|entry| entry.map_err(|e| Error::io(dir, e)))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(Error::io(dir, e)),
    }
}
