//! A whole training run described in one TOML file: the `kiln train` config.
//!
//! ```toml
//! seed = 0
//! backend = "torch"          # or "tensorflow"
//! device = "cpu"             # or "cuda:0"
//! output_dir = "runs/digits-cnn"
//!
//! [model]                    # a kiln_core::model::Layer
//! type = "sequential"
//! layers = [
//!   { type = "conv2d", in_channels = 1, out_channels = 32, kernel_size = 3, padding = 1 },
//!   { type = "relu" },
//!   { type = "flatten" },
//!   { type = "linear", in_features = 2048, out_features = 10 },
//! ]
//!
//! [data]
//! dataset = "digits"         # digits | mnist | csv | image_folder | webdataset
//! batch_size = 64
//!
//! [training]                 # a kiln_train::TrainerConfig
//! epochs = 20
//!
//! [optimizer]                # a kiln_core::optim::OptimizerConfig
//! type = "adamw"
//! lr = 0.002
//!
//! [loss]                     # a kiln_core::loss::Loss
//! type = "cross_entropy"
//! ```
//!
//! Here: [`RunConfig`], reading it (`from_toml`, `load`) and its checks
//! (`validate`); its sections in `data.rs` (`[data]`), `logging.rs`
//! (`[logging]`, `[early_stopping]`), `distributed.rs` (`[distributed]`); which key
//! of a section that fails to parse is the culprit in `key_path.rs`.

mod data;
mod distributed;
mod key_path;
mod logging;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use kiln_core::device::Device;
use kiln_core::error::{Error, Result};
use kiln_core::loss::Loss;
use kiln_core::model::Layer;
use kiln_core::optim::{OptimizerConfig, ParamGroup};
use kiln_core::schedule::SchedulerConfig;
use kiln_train::metric_by_name;
use kiln_train::CheckpointPolicy;
use kiln_train::TrainerConfig;

#[cfg(not(feature = "text"))]
use crate::features::{Feature, FeatureMissing};
#[cfg(feature = "text")]
use kiln_text::IGNORE_INDEX;

#[cfg(feature = "text")]
pub use data::TextSource;
pub use data::{DataConfig, DataSource};
#[cfg(feature = "vision")]
pub use data::{ImageFolderSource, ImageSize, ShardSource};
pub use distributed::{DistributedConfig, StrategyName};
use key_path::tagged_key_path;
pub use kiln_train::EarlyStoppingConfig;
pub use logging::LoggingConfig;

/// Which engine runs the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// libtorch through tch.
    #[default]
    Torch,
    /// The TensorFlow C API.
    Tensorflow,
}

/// How batch-norm layers whose parameters are all frozen (`freeze`, or a
/// torchscript layer with `trainable = false`) run while the model trains.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FrozenBatchNorm {
    /// As PyTorch leaves them: batch statistics, running statistics updated.
    #[default]
    Train,
    /// Eval mode: normalised with the running statistics as loaded, which stay
    /// unchanged (what fine-tuning recipes do with a frozen backbone).
    Eval,
}

/// `true`, the default of the sections' switches.
fn yes() -> bool {
    true
}

/// `[model] pretrained = "dir"`: a Hugging Face model directory to start from
/// (or a model named as on the Hub, `"Qwen/Qwen3-0.6B"`, at `revision`, found
/// in the local Hugging Face cache), with the layers of `head` in place of
/// its language-model head.
#[derive(Clone, Debug, PartialEq)]
pub struct PretrainedModel {
    /// The directory (`config.json`, `model.safetensors` or shards): a Hub
    /// model's snapshot in the cache.
    pub dir: PathBuf,
    /// The new head, when the config gives one.
    pub head: Option<Vec<Layer>>,
    /// A classification head for this many labels (`*ForSequenceClassification`).
    pub num_labels: Option<usize>,
    /// Keys of `config.json` replaced (`[model] config = { output_router_logits
    /// = true }`), as `from_pretrained`'s keyword arguments replace them.
    pub config: serde_json::Map<String, serde_json::Value>,
}

impl PretrainedModel {
    /// The directory read, with the config's overrides and the head.
    #[cfg(feature = "text")]
    pub fn open(&self) -> std::result::Result<kiln_hf::Pretrained, kiln_hf::HfError> {
        let pretrained = kiln_hf::Pretrained::open_with_config(&self.dir, &self.config)?;
        match (&self.head, self.num_labels) {
            (Some(head), _) => pretrained.with_head(head.clone()),
            (None, Some(n)) => pretrained.with_num_labels(n),
            (None, None) => Ok(pretrained),
        }
    }
}

/// Replaces `[model] pretrained = "dir"` (and its `head`) in `root` by the
/// definition the directory describes; returns what it named.
fn expand_pretrained(
    root: &mut toml::Value,
) -> std::result::Result<Option<PretrainedModel>, String> {
    let Some(model) = root.get_mut("model").and_then(toml::Value::as_table_mut) else {
        return Ok(None);
    };
    let Some(dir) = model.remove("pretrained") else {
        return Ok(None);
    };
    let revision = match model.remove("revision") {
        None => None,
        Some(toml::Value::String(r)) => Some(r),
        Some(other) => {
            return Err(format!(
            "key `model.revision`: expected a branch, tag or commit of the Hub model, got {other}"
        ))
        }
    };
    // A directory, or a model named as on the Hub (`"Qwen/Qwen3-0.6B"`)
    // found in the local Hugging Face cache.
    let dir = match dir {
        toml::Value::String(s) => resolve_pretrained(&s, revision.as_deref())
            .map_err(|e| format!("key `model.pretrained`: {e}"))?,
        other => {
            return Err(format!(
                "key `model.pretrained`: expected a directory or a Hub model id, got {other}"
            ))
        }
    };
    let head = match model.remove("head") {
        None => None,
        Some(value) => Some(
            Vec::<Layer>::deserialize(value)
                .map_err(|e| format!("key `model.head`: expected a list of layers: {e}"))?,
        ),
    };
    let num_labels = match model.remove("num_labels") {
        None => None,
        Some(toml::Value::Integer(n)) if n > 0 => Some(n as usize),
        Some(other) => {
            return Err(format!(
                "key `model.num_labels`: expected a positive integer, got {other}"
            ))
        }
    };
    if head.is_some() && num_labels.is_some() {
        return Err("key `model.num_labels`: give `head` or `num_labels`, not both".to_owned());
    }
    let config = match model.remove("config") {
        None => serde_json::Map::new(),
        Some(toml::Value::Table(table)) => match serde_json::to_value(&table) {
            Ok(serde_json::Value::Object(map)) => map,
            _ => {
                return Err(
                    "key `model.config`: its values must be JSON values (no dates)".to_owned(),
                )
            }
        },
        Some(other) => {
            return Err(format!(
                "key `model.config`: expected a table of config.json keys to replace \
                 (`config = {{ output_router_logits = true }}`), got {other}"
            ))
        }
    };
    if let Some(key) = model.keys().next() {
        return Err(format!(
            "key `model.{key}`: a pretrained model takes `pretrained`, `revision`, `config`, \
             `head` and `num_labels` only (its layers come from the directory's config.json)"
        ));
    }
    let source = PretrainedModel {
        dir,
        head,
        num_labels,
        config,
    };
    root["model"] = pretrained_definition(&source)?;
    Ok(Some(source))
}

/// The directory of a pretrained model: `id` itself, or a model named as on the
/// Hub in the local Hugging Face cache.
#[cfg(feature = "text")]
fn resolve_pretrained(id: &str, revision: Option<&str>) -> std::result::Result<PathBuf, String> {
    kiln_hf::resolve_model(id, revision).map_err(|e| e.to_string())
}

#[cfg(not(feature = "text"))]
fn resolve_pretrained(_: &str, _: Option<&str>) -> std::result::Result<PathBuf, String> {
    Err(FeatureMissing::new(Feature::Text, "a Hugging Face model").to_string())
}

/// The definition (as TOML) of the model `source` describes.
#[cfg(feature = "text")]
fn pretrained_definition(source: &PretrainedModel) -> std::result::Result<toml::Value, String> {
    let pretrained = source
        .open()
        .map_err(|e| format!("key `model.pretrained`: {e}"))?;
    toml::Value::try_from(pretrained.layer())
        .map_err(|e| format!("key `model.pretrained`: the definition does not fit TOML: {e}"))
}

#[cfg(not(feature = "text"))]
fn pretrained_definition(_: &PretrainedModel) -> std::result::Result<toml::Value, String> {
    Err(FeatureMissing::new(Feature::Text, "a Hugging Face model").to_string())
}

/// Whether text data trains a causal language model (next-token targets).
#[cfg(feature = "text")]
fn is_causal(text: &data::TextSource) -> Result<bool> {
    Ok(text.task()?.is_causal())
}

#[cfg(not(feature = "text"))]
fn is_causal(_: &data::TextSource) -> Result<bool> {
    Err(Error::invalid_argument(
        "data.dataset",
        FeatureMissing::new(Feature::Text, "text data").to_string(),
    ))
}

/// The target of a position that has none (PyTorch's `ignore_index` default).
#[cfg(not(feature = "text"))]
const IGNORE_INDEX: i64 = -100;

/// A whole run: model, data, optimisation, outputs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// The seed of everything random in the run.
    #[serde(default)]
    pub seed: u64,
    /// The engine.
    #[serde(default)]
    pub backend: BackendKind,
    /// The device, `"cpu"` or `"cuda:N"`.
    #[serde(default, with = "device_string")]
    pub device: Device,
    /// Where checkpoints, metrics and plots go.
    pub output_dir: PathBuf,
    /// Parameters to freeze, as globs over their names (`["0.*"]`, `["*.bn*"]`):
    /// no gradient, and not in the optimizer (torch backend).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub freeze: Vec<String>,
    /// How the batch norms of frozen parts run while the rest trains.
    #[serde(default)]
    pub frozen_batch_norm: FrozenBatchNorm,
    /// Layers whose activations are recomputed in the backward pass instead
    /// of kept, as globs over their paths (`["1", "2.*"]`; torch backend).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub activation_checkpointing: Vec<String>,
    /// LoRA adapters on the model's projections, the rest frozen (torch backend):
    /// `lora = { r = 8, alpha = 16, dropout = 0.05, target_modules = ["q_proj", "v_proj"] }`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<kiln_core::lora::LoraConfig>,
    /// The model definition (with `[model] pretrained = "dir"`, the one that
    /// directory's `config.json` describes, and its `head`).
    pub model: Layer,
    /// The Hugging Face directory `[model] pretrained` names, whose weights a
    /// fresh run starts from; `None` for a model defined in the config.
    #[serde(skip)]
    pub pretrained: Option<PretrainedModel>,
    /// The data.
    pub data: DataConfig,
    /// The loop.
    #[serde(default)]
    pub training: TrainerConfig,
    /// The optimizer.
    pub optimizer: OptimizerConfig,
    /// Parameter groups with their own learning rate or weight decay.
    #[serde(default)]
    pub param_groups: Vec<ParamGroup>,
    /// The learning-rate schedule.
    #[serde(default)]
    pub schedule: Option<SchedulerConfig>,
    /// The loss.
    pub loss: Loss,
    /// When to checkpoint and what to keep.
    #[serde(default)]
    pub checkpoint: CheckpointPolicy,
    /// Early stopping.
    #[serde(default)]
    pub early_stopping: Option<EarlyStoppingConfig>,
    /// Metric outputs.
    #[serde(default)]
    pub logging: LoggingConfig,
    /// Data-parallel training, when started by a launcher.
    #[serde(default)]
    pub distributed: DistributedConfig,
}

mod device_string {
    use serde::{Deserialize, Deserializer, Serializer};

    use kiln_core::device::Device;

    pub(super) fn serialize<S: Serializer>(device: &Device, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&device.to_string())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Device, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl RunConfig {
    /// Parses a TOML config; errors name the file, the key and what is allowed
    /// (serde's messages list the accepted variants and fields).
    pub fn from_toml(text: &str, path: &Path) -> Result<Self> {
        let config = Self::parse(text, path)?;
        config.validate().map_err(|e| Error::Config {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Ok(config)
    }

    /// Reads a config and fills in what follows from it, without validating.
    fn parse(text: &str, path: &Path) -> Result<Self> {
        let bad = |reason: String| Error::Config {
            path: path.to_path_buf(),
            reason,
        };
        let mut root: toml::Value =
            toml::from_str(text).map_err(|e: toml::de::Error| bad(e.to_string()))?;
        let pretrained = expand_pretrained(&mut root).map_err(bad)?;
        let expanded;
        let text = match pretrained {
            Some(_) => {
                expanded = toml::to_string(&root).map_err(|e| bad(e.to_string()))?;
                expanded.as_str()
            }
            None => text,
        };
        let deserializer = toml::Deserializer::parse(text).map_err(|e| bad(e.to_string()))?;
        // The path to the failing key (`optimizer.type`) leads the message; toml's
        // own message after it shows the line.
        let mut config: RunConfig =
            serde_path_to_error::deserialize(deserializer).map_err(|e| {
                let mut key = e.path().to_string();
                // serde loses the path inside internally tagged sections (`type = ...`);
                // find the key there by probing the section.
                if let Ok(root) = toml::from_str::<toml::Value>(text) {
                    key.push_str(&tagged_key_path(&root, &key));
                }
                bad(format!("key `{key}`: {}", e.into_inner()))
            })?;
        config.pretrained = pretrained;
        config.fit_text_data().map_err(|e| Error::Config {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Ok(config)
    }

    /// Reads and parses a TOML config file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = kiln_core::fs::read_regular_to_string(path)?;
        Self::from_toml(&text, path)
    }

    /// [`load`](Self::load) without [`validate`](Self::validate), for a caller
    /// that puts command-line values in place first (`kiln train --device`) and
    /// then validates: a flag can make a config valid (`backend = "nccl"` with
    /// `--device cuda:0`), so the file alone is not judged.
    pub fn load_unvalidated(path: &Path) -> Result<Self> {
        let text = kiln_core::fs::read_regular_to_string(path)?;
        Self::parse(&text, path)
    }

    /// Language-model text data (`dataset = "text"` with a causal task):
    /// the model's `[batch, len, vocab]` logits are flattened to
    /// `[batch * len, vocab]` for the loss (a `flatten` layer is appended),
    /// the targets being the next tokens with -100 where there is none, and
    /// cross-entropy ignores -100 (set when the config leaves it out).
    fn fit_text_data(&mut self) -> Result<()> {
        let DataSource::Text(text) = &self.data.source else {
            return Ok(());
        };
        if !is_causal(text)? {
            return Ok(());
        }
        match &mut self.loss {
            Loss::CrossEntropy(c) => match c.ignore_index {
                None => c.ignore_index = Some(IGNORE_INDEX),
                Some(IGNORE_INDEX) => {}
                Some(other) => {
                    return Err(Error::invalid_argument(
                        "loss.ignore_index",
                        format!(
                        "text data marks the positions without a target with -100, not {other}; \
                             leave ignore_index out or set it to -100"
                    ),
                    ))
                }
            },
            other => {
                return Err(Error::invalid_argument(
                    "loss",
                    format!(
                        "a language model's text trains with loss = \"cross_entropy\", not `{}`",
                        other.torch_name()
                    ),
                ))
            }
        }
        if let Ok(out) = self.model.output_shape(&[1, 2]) {
            if out.len() == 3 {
                let mut layers = match std::mem::replace(&mut self.model, Layer::Relu) {
                    Layer::Sequential { layers } => layers,
                    single => vec![single],
                };
                layers.push(Layer::Flatten {
                    start_dim: 0,
                    end_dim: 1,
                });
                self.model = Layer::Sequential { layers };
            }
        }
        Ok(())
    }

    /// Checks every section's values.
    pub fn validate(&self) -> Result<()> {
        self.validate_model()?;
        self.training.validate()?;
        self.optimizer.validate()?;
        self.loss.validate()?;
        self.checkpoint.validate()?;
        self.distributed.validate(self.device)?;
        if self.distributed.strategy == StrategyName::PostLocalSgd
            && self.backend != BackendKind::Torch
        {
            return Err(Error::invalid_argument(
                "distributed.strategy",
                "\"post_local_sgd\" needs the torch backend (its DDP runs on libtorch's \
                 c10d::Reducer); TensorFlow trains data-parallel with \"ddp\"",
            ));
        }
        if self.distributed.strategy == StrategyName::Fsdp && self.backend != BackendKind::Torch {
            return Err(Error::invalid_argument(
                "distributed.strategy",
                "\"fsdp\" shards every parameter and needs the torch backend: a TensorFlow \
                 model's variables live whole in its graph. TensorFlow shards its optimizer \
                 state with \"zero1\" and its gradients too with \"zero2\"",
            ));
        }
        if let Some(schedule) = &self.schedule {
            schedule.validate()?;
        }
        if self.output_dir.as_os_str().is_empty() {
            return Err(Error::invalid_argument(
                "output_dir",
                "is empty; name the directory the run writes to (e.g. \"runs/digits\")",
            ));
        }
        self.data.validate()?;
        for metric in &self.logging.metrics {
            if metric_by_name(metric).is_none() {
                return Err(Error::invalid_argument(
                    "logging.metrics",
                    format!("unknown metric `{metric}`; allowed: accuracy, top5_accuracy, precision, recall, f1, mae"),
                ));
            }
        }
        self.validate_monitors()
    }

    /// Checks the model, its LoRA adapters, and what the backend can run of it.
    fn validate_model(&self) -> Result<()> {
        self.model.validate()?;
        if let Some(lora) = &self.lora {
            lora.targets(&self.model)?;
            if let Some(p) = &self.pretrained {
                if p.head.is_some() || p.num_labels.is_some() {
                    return Err(Error::invalid_argument(
                        "lora",
                        "with a new head (`model.head`, `model.num_labels`) the head would stay \
                         frozen at its initial weights: LoRA adapts a pretrained model's own \
                         projections (PEFT's `modules_to_save` is not implemented)",
                    ));
                }
            }
            if self.backend != BackendKind::Torch {
                return Err(Error::invalid_argument(
                    "lora",
                    "LoRA adapters train on the torch backend (backend = \"torch\")",
                ));
            }
        }
        // A TorchScript layer's parameters are the file's, not the definition's.
        if self.model.torchscript_layers().is_empty() && self.model.num_parameters()? == 0 {
            let (key, found) = match &self.model {
                Layer::Sequential { layers } if layers.is_empty() => ("model.layers", "no layers"),
                Layer::Sequential { .. } => ("model.layers", "only layers without weights"),
                _ => ("model", "a layer without weights"),
            };
            return Err(Error::invalid_argument(
                key,
                format!(
                    "the model has {found}, so there is no parameter to train; add a layer \
                     with weights, such as {{ type = \"linear\", in_features = 64, \
                     out_features = 10 }}"
                ),
            ));
        }
        if self.backend == BackendKind::Torch {
            if let Some((path, layer)) = self.model.saved_model_layers().first() {
                return Err(Error::invalid_argument(
                    format!("model{}{path}", if path.is_empty() { "" } else { "." }),
                    format!(
                        "a saved_model layer ({}) runs on TensorFlow, not libtorch; set \
                         backend = \"tensorflow\"",
                        layer.path.display()
                    ),
                ));
            }
        }
        if self.backend == BackendKind::Tensorflow {
            if let Some((path, layer)) = self.model.torchscript_layers().first() {
                return Err(Error::invalid_argument(
                    format!("model{}{path}", if path.is_empty() { "" } else { "." }),
                    format!(
                        "a torchscript layer ({}) runs on libtorch, not TensorFlow; set \
                         backend = \"torch\"",
                        layer.path.display()
                    ),
                ));
            }
            if !self.freeze.is_empty() || self.frozen_batch_norm == FrozenBatchNorm::Eval {
                return Err(Error::invalid_argument(
                    "freeze",
                    "freezing parameters needs the torch backend (backend = \"torch\")",
                ));
            }
            if !self.activation_checkpointing.is_empty() {
                return Err(Error::invalid_argument(
                    "activation_checkpointing",
                    "activation checkpointing needs the torch backend (backend = \"torch\")",
                ));
            }
        }
        Ok(())
    }

    /// Checks that every monitored metric (`checkpoint.monitor`,
    /// `early_stopping.monitor`, `schedule.monitor`) is one the run records.
    fn validate_monitors(&self) -> Result<()> {
        let monitors = [
            ("checkpoint.monitor", self.checkpoint.monitor.as_deref()),
            (
                "early_stopping.monitor",
                self.early_stopping.as_ref().map(|e| e.monitor.as_str()),
            ),
            (
                "schedule.monitor",
                self.schedule.as_ref().and_then(|s| s.monitor()),
            ),
        ];
        if let Some(monitor) = self.schedule.as_ref().and_then(|s| s.monitor()) {
            if self.training.schedule_interval == kiln_train::ScheduleInterval::Step {
                return Err(Error::invalid_argument(
                    "training.schedule_interval",
                    format!(
                        "the schedule steps on the epoch metric `{monitor}`, so it needs \
                         schedule_interval = \"epoch\""
                    ),
                ));
            }
        }
        let known = self.epoch_metrics();
        for (key, monitor) in monitors {
            if let Some(monitor) = monitor {
                if !known.iter().any(|k| k == monitor) {
                    return Err(Error::invalid_argument(
                        key,
                        format!(
                            "`{monitor}` is not a metric of this run; it records {}{}",
                            known.join(", "),
                            if self.has_validation() {
                                " (add a metric to `logging.metrics` to monitor it)"
                            } else {
                                " (no `val_*` metrics: data.val_fraction is 0)"
                            }
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether the run validates after each epoch: the dataset has a test
    /// split (MNIST), or `data.val_fraction` holds one out.
    pub fn has_validation(&self) -> bool {
        self.data.has_validation_split() || self.data.val_fraction() > 0.0
    }

    /// The names of the metrics each epoch records, which `monitor` keys can
    /// name: `loss`, `lr`, and with validation `val_loss` and `val_<metric>`
    /// for each of `logging.metrics`.
    pub fn epoch_metrics(&self) -> Vec<String> {
        let mut names = vec!["loss".to_owned(), "lr".to_owned()];
        if self.has_validation() {
            names.push("val_loss".to_owned());
            for metric in &self.logging.metrics {
                // The name the metric records under (the config's, for every metric Kiln has).
                let name = metric_by_name(metric)
                    .map_or_else(|| metric.clone(), |make| make().name().to_owned());
                names.push(format!("val_{name}"));
            }
        }
        names
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const BASE: &str = r#"
seed = 1
output_dir = "runs/x"
[data]
dataset = "digits"
[model]
type = "sequential"
layers = [
  { type = "linear", in_features = 64, out_features = 32 },
  { type = "relu" },
  { type = "residual", block = { type = "linear", in_features = 32, out_features = 32 } },
  { type = "linear", in_features = 32, out_features = 10 },
]
[loss]
type = "cross_entropy"
[optimizer]
type = "adam"
lr = 0.001
[schedule]
type = "reduce_lr_on_plateau"
patience = 1
[training]
clip = { type = "norm", max_norm = 1.0 }
"#;

    fn error_of(edit: (&str, &str)) -> String {
        assert!(BASE.contains(edit.0), "{}", edit.0);
        let text = BASE.replace(edit.0, edit.1);
        RunConfig::from_toml(&text, Path::new("c.toml"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn the_base_config_parses() {
        let config = RunConfig::from_toml(BASE, Path::new("c.toml")).unwrap();
        assert_eq!(config.schedule.unwrap().monitor(), Some("val_loss"));
    }

    #[test]
    fn errors_inside_tagged_sections_name_the_full_key() {
        for (edit, key) in [
            (("lr = 0.001", "lr = \"fast\""), "optimizer.lr"),
            (
                (
                    "type = \"cross_entropy\"",
                    "type = \"cross_entropy\"\nlabel_smoothing = \"x\"",
                ),
                "loss.label_smoothing",
            ),
            (("patience = 1", "patience = -1"), "schedule.patience"),
            (
                ("max_norm = 1.0", "max_norm = \"big\""),
                "training.clip.max_norm",
            ),
            (
                (
                    "in_features = 32, out_features = 10",
                    "in_features = 32, out_features = \"ten\"",
                ),
                "model.layers[3].out_features",
            ),
            (
                (
                    "block = { type = \"linear\", in_features = 32,",
                    "block = { type = \"linear\", in_features = true,",
                ),
                "model.layers[2].block.in_features",
            ),
        ] {
            let err = error_of(edit);
            assert!(err.contains(&format!("key `{key}`")), "{key}: {err}");
        }
    }

    #[test]
    fn monitors_must_name_a_metric_of_the_run() {
        let err = error_of((
            "[training]",
            "[checkpoint]\nkeep_best = 1\nmonitor = \"val_acc\"\n[training]",
        ));
        assert!(
            err.contains("checkpoint.monitor") && err.contains("val_accuracy"),
            "{err}"
        );
        let err = error_of(("patience = 1", "patience = 1\nmonitor = \"val_f1\""));
        assert!(err.contains("schedule.monitor"), "{err}");
        let err = error_of((
            "dataset = \"digits\"",
            "dataset = \"digits\"\nval_fraction = 0.0",
        ));
        assert!(
            err.contains("schedule.monitor") && err.contains("val_fraction is 0"),
            "{err}"
        );
        let err = error_of(("[training]", "[training]\nschedule_interval = \"step\""));
        assert!(err.contains("training.schedule_interval"), "{err}");
        let err = error_of(("output_dir = \"runs/x\"", "output_dir = \"\""));
        assert!(err.contains("output_dir"), "{err}");
    }
}
