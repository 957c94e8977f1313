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

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use kiln_core::device::Device;
use kiln_core::distributed::{CommBackend, DistributedOptions};
use kiln_core::error::{Error, Result};
use kiln_core::loss::Loss;
use kiln_core::model::Layer;
use kiln_core::optim::{OptimizerConfig, ParamGroup};
use kiln_core::schedule::SchedulerConfig;
use kiln_data::vision::TransformSpec;
use kiln_train::metric_by_name;
use kiln_train::TrainerConfig;
use kiln_train::{CheckpointPolicy, MonitorMode};

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

/// Where the examples come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DatasetKind {
    /// The UCI handwritten digits (8x8) that scikit-learn's wheel ships; `path`
    /// defaults to the project's `.kiln/data/digits.csv.gz`.
    Digits,
    /// MNIST IDX files (raw or gzip) in the directory `path`; its test split is
    /// the validation set.
    Mnist,
    /// A CSV file `path` of numeric features and an integer label column.
    Csv,
    /// Images in class folders under `path` (torchvision's `ImageFolder`), or a
    /// CSV or JSON list of `path,label`; decoded in the loader's workers.
    ImageFolder,
    /// WebDataset `.tar` shards (`shards`), streamed by the loader's workers.
    Webdataset,
}

impl DatasetKind {
    /// The name the config uses.
    pub fn name(self) -> &'static str {
        match self {
            DatasetKind::Digits => "digits",
            DatasetKind::Mnist => "mnist",
            DatasetKind::Csv => "csv",
            DatasetKind::ImageFolder => "image_folder",
            DatasetKind::Webdataset => "webdataset",
        }
    }

    /// Whether the examples are image files, decoded and transformed by the loader.
    pub fn is_images(self) -> bool {
        matches!(self, DatasetKind::ImageFolder | DatasetKind::Webdataset)
    }
}

/// `data.image_size`: one number for square images, or `[height, width]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ImageSize {
    /// Square.
    Square(usize),
    /// `[height, width]`.
    Rect([usize; 2]),
}

impl ImageSize {
    /// `(height, width)`.
    pub fn dims(self) -> (usize, usize) {
        match self {
            ImageSize::Square(s) => (s, s),
            ImageSize::Rect([h, w]) => (h, w),
        }
    }
}

/// `data.color_mode`: the channels images are decoded to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ColorModeName {
    /// Three channels (what torchvision's `ImageFolder` gives: PIL's `convert("RGB")`).
    #[default]
    Rgb,
    /// One channel (PIL's `convert("L")`).
    Gray,
    /// Four channels, alpha last.
    Rgba,
}

/// `data.on_error`: what a corrupt or unreadable image does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnErrorName {
    /// Stops the run with an error naming the file.
    #[default]
    Fail,
    /// Leaves the image out of its batch with a warning naming it, and counts it.
    Skip,
}

fn yes() -> bool {
    true
}

/// The data section: the dataset, how it is split, batched and shaped.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// The source.
    pub dataset: DatasetKind,
    /// The file or directory (required for `mnist` and `csv`).
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// CSV only: the label column's name or 0-based index (default: the last column).
    #[serde(default)]
    pub label_column: Option<String>,
    /// CSV only: whether the first line names the columns.
    #[serde(default = "yes")]
    pub has_header: bool,
    /// Fraction held out for validation, in `[0, 1)`, when the dataset has no
    /// test split (default 0.2); 0 means no validation split (and no `val_*`
    /// metrics). Not with `val_path` or `val_shards`, which give the split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_fraction: Option<f64>,
    /// image_folder: the validation images (class folders or a list), instead
    /// of holding out `val_fraction` of `path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_path: Option<PathBuf>,
    /// webdataset: the training shards, `"data/train-{000000..000099}.tar"`
    /// (brace ranges and `{a,b}` lists expand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<String>,
    /// webdataset: the validation shards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_shards: Option<String>,
    /// webdataset: samples in the shuffle buffer the training stream passes
    /// through (after the shards are shuffled); 0 or 1 keeps the stream's order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shuffle_buffer: Option<usize>,
    /// Images: the size the model takes; without `transforms`, images are
    /// resized (shorter side) and centre-cropped to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_size: Option<ImageSize>,
    /// Images: the channels they are decoded to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub color_mode: Option<ColorModeName>,
    /// Images: whether a corrupt image stops the run or is skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_error: Option<OnErrorName>,
    /// Images: the training transforms, in order (torchvision's names:
    /// `resize`, `center_crop`, `random_resized_crop`, `random_horizontal_flip`,
    /// `color_jitter`, `to_tensor`, `normalize`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transforms: Option<Vec<TransformSpec>>,
    /// Images: the validation (and `eval`/`predict`) transforms; default the
    /// deterministic ones of `transforms` (`resize`, `center_crop`,
    /// `to_tensor`, `normalize`), or resize and centre-crop to `image_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_transforms: Option<Vec<TransformSpec>>,
    /// Examples per batch.
    #[serde(default = "batch")]
    pub batch_size: usize,
    /// Background loader threads (0 loads on the training thread).
    #[serde(default)]
    pub workers: usize,
    /// Shape of one example as the model takes it (e.g. `[1, 8, 8]`); default flat.
    #[serde(default)]
    pub input_shape: Option<Vec<usize>>,
    /// Features are divided by this (16 for digits, 255 for MNIST).
    #[serde(default = "unit")]
    pub scale: f64,
    /// Drop the last incomplete training batch.
    #[serde(default)]
    pub drop_last: bool,
}

fn batch() -> usize {
    64
}
fn unit() -> f64 {
    1.0
}

impl DataConfig {
    /// The fraction of the examples held out for validation: `val_fraction`,
    /// by default 0.2 where the data has no split of its own, else 0.
    pub fn val_fraction(&self) -> f64 {
        let own_split = self.dataset == DatasetKind::Mnist
            || self.val_path.is_some()
            || self.val_shards.is_some()
            || self.dataset == DatasetKind::Webdataset;
        self.val_fraction
            .unwrap_or(if own_split { 0.0 } else { 0.2 })
    }

    /// Checks the keys against the dataset kind and each value.
    fn validate(&self) -> Result<()> {
        let kind = self.dataset;
        let invalid =
            |key: &str, reason: String| Err(Error::invalid_argument(format!("data.{key}"), reason));
        if let Some(f) = self.val_fraction {
            if !(0.0..1.0).contains(&f) {
                return invalid("val_fraction", format!("must be in [0, 1), got {f}"));
            }
        }
        // Keys that only some kinds of data take.
        let set = |present: bool, key: &'static str| present.then_some(key);
        let image_keys = [
            set(self.image_size.is_some(), "image_size"),
            set(self.color_mode.is_some(), "color_mode"),
            set(self.on_error.is_some(), "on_error"),
            set(self.transforms.is_some(), "transforms"),
            set(self.val_transforms.is_some(), "val_transforms"),
        ];
        let table_keys = [
            set(self.input_shape.is_some(), "input_shape"),
            set(self.scale != 1.0, "scale"),
        ];
        let only = |keys: &[Option<&'static str>], kinds: &str| -> Result<()> {
            if let Some(key) = keys.iter().flatten().next() {
                return invalid(
                    key,
                    format!("applies to {kinds} data, not dataset = \"{}\"", kind.name()),
                );
            }
            Ok(())
        };
        if kind.is_images() {
            only(&table_keys, "tabular (digits, mnist, csv)")?;
        } else {
            only(&image_keys, "image (image_folder, webdataset)")?;
        }
        if kind != DatasetKind::ImageFolder {
            only(&[set(self.val_path.is_some(), "val_path")], "image_folder")?;
        }
        if kind != DatasetKind::Webdataset {
            only(
                &[
                    set(self.shards.is_some(), "shards"),
                    set(self.val_shards.is_some(), "val_shards"),
                    set(self.shuffle_buffer.is_some(), "shuffle_buffer"),
                ],
                "webdataset",
            )?;
        }
        if kind != DatasetKind::Csv {
            only(&[set(self.label_column.is_some(), "label_column")], "csv")?;
        }
        match kind {
            DatasetKind::Digits => {}
            DatasetKind::Mnist | DatasetKind::Csv | DatasetKind::ImageFolder => {
                if self.path.is_none() {
                    return invalid(
                        "path",
                        format!("dataset = \"{}\" needs a path", kind.name()),
                    );
                }
            }
            DatasetKind::Webdataset => {
                if self.path.is_some() {
                    return invalid(
                        "path",
                        "a webdataset is read from `shards` (and `val_shards`), not `path`".into(),
                    );
                }
                if self.shards.is_none() {
                    return invalid(
                        "shards",
                        "dataset = \"webdataset\" needs shards, e.g. \"data/train-{000000..000009}.tar\""
                            .into(),
                    );
                }
                if self.val_fraction.is_some_and(|f| f > 0.0) {
                    return invalid(
                        "val_fraction",
                        "a webdataset's validation split is its own shards: set `val_shards`"
                            .into(),
                    );
                }
            }
        }
        if (self.val_path.is_some() || self.val_shards.is_some())
            && self.val_fraction.is_some_and(|f| f > 0.0)
        {
            return invalid(
                "val_fraction",
                "the validation split is given by val_path / val_shards; remove val_fraction"
                    .into(),
            );
        }
        if kind.is_images() {
            if let Some(size) = self.image_size {
                let (h, w) = size.dims();
                if h == 0 || w == 0 {
                    return invalid("image_size", format!("must be positive, got {size:?}"));
                }
            }
            if self.transforms.is_none() && self.image_size.is_none() {
                return invalid(
                    "image_size",
                    "image data needs image_size (images are resized and centre-cropped to it), \
                     or a transforms list"
                        .into(),
                );
            }
            for (key, specs) in [
                ("transforms", &self.transforms),
                ("val_transforms", &self.val_transforms),
            ] {
                for (i, spec) in specs.iter().flatten().enumerate() {
                    spec.validate().map_err(|e| {
                        Error::invalid_argument(format!("data.{key}[{i}]"), e.to_string())
                    })?;
                }
            }
        }
        Ok(())
    }
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

/// Early stopping settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EarlyStoppingConfig {
    /// The metric watched (`val_loss`, `val_accuracy`, ...).
    pub monitor: String,
    /// Whether smaller or larger is better.
    #[serde(default)]
    pub mode: MonitorMode,
    /// Epochs without improvement before stopping.
    #[serde(default = "five")]
    pub patience: u64,
    /// The least change that counts as an improvement.
    #[serde(default)]
    pub min_delta: f64,
}

fn five() -> u64 {
    5
}

/// Where metrics go, besides the log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoggingConfig {
    /// `steps.csv` and `epochs.csv` in the output directory.
    #[serde(default = "yes")]
    pub csv: bool,
    /// TensorBoard event files in `<output_dir>/tensorboard`.
    #[serde(default = "yes")]
    pub tensorboard: bool,
    /// A progress bar per epoch (plain lines when not on a terminal).
    #[serde(default = "yes")]
    pub progress: bool,
    /// PNG plots of the training and validation curves at the end.
    #[serde(default = "yes")]
    pub plots: bool,
    /// Extra metrics on validation: `accuracy`, `top5_accuracy`, `precision`,
    /// `recall`, `f1`, `mae`.
    #[serde(default = "accuracy")]
    pub metrics: Vec<String>,
}

fn accuracy() -> Vec<String> {
    vec!["accuracy".to_owned()]
}

impl Default for LoggingConfig {
    fn default() -> Self {
        Self {
            csv: true,
            tensorboard: true,
            progress: true,
            plots: true,
            metrics: accuracy(),
        }
    }
}

/// Data-parallel training (`[distributed]`): used when the run is started by a
/// launcher (`kiln launch`, `torchrun`, `srun`), ignored otherwise.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DistributedConfig {
    /// `"gloo"` (CPU), `"nccl"` (CUDA) or `"auto"` (by the device).
    #[serde(default)]
    pub backend: CommBackendName,
    /// Seconds the rendezvous and any collective wait for the other ranks.
    #[serde(default = "thirty_minutes")]
    pub timeout: f64,
}

/// The `[distributed] backend` names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CommBackendName {
    /// Gloo on CPU, NCCL on CUDA.
    #[default]
    Auto,
    /// Gloo.
    Gloo,
    /// NCCL.
    Nccl,
}

fn thirty_minutes() -> f64 {
    1800.0
}

impl Default for DistributedConfig {
    fn default() -> Self {
        Self {
            backend: CommBackendName::Auto,
            timeout: thirty_minutes(),
        }
    }
}

impl DistributedConfig {
    /// The options of the process group and of DDP on `device` (DDP's
    /// defaults for the rest: buffers broadcast, 25 MiB buckets, no
    /// unused-parameter search).
    pub fn options(&self, device: Device) -> DistributedOptions {
        let backend = match (self.backend, device.is_cuda()) {
            (CommBackendName::Gloo, _) | (CommBackendName::Auto, false) => CommBackend::Gloo,
            (CommBackendName::Nccl, _) | (CommBackendName::Auto, true) => CommBackend::Nccl,
        };
        DistributedOptions {
            backend,
            timeout: Duration::from_secs_f64(self.timeout),
            ..DistributedOptions::default()
        }
    }

    fn validate(&self, device: Device) -> Result<()> {
        if !(self.timeout.is_finite() && self.timeout > 0.0 && self.timeout < 1e9) {
            return Err(Error::invalid_argument(
                "distributed.timeout",
                format!("must be a positive number of seconds, got {}", self.timeout),
            ));
        }
        match (self.backend, device.is_cuda()) {
            (CommBackendName::Nccl, false) => Err(Error::invalid_argument(
                "distributed.backend",
                format!("\"nccl\" reduces CUDA tensors, but the device is {device}; use \"gloo\""),
            )),
            (CommBackendName::Gloo, true) => Err(Error::invalid_argument(
                "distributed.backend",
                format!("\"gloo\" reduces CPU tensors, but the device is {device}; use \"nccl\""),
            )),
            _ => Ok(()),
        }
    }
}

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
    /// The model definition.
    pub model: Layer,
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
        let bad = |reason: String| Error::Config {
            path: path.to_path_buf(),
            reason,
        };
        let deserializer = toml::Deserializer::parse(text).map_err(|e| bad(e.to_string()))?;
        // The path to the failing key (`optimizer.type`) leads the message; toml's
        // own message after it shows the line.
        let config: RunConfig = serde_path_to_error::deserialize(deserializer).map_err(|e| {
            let mut key = e.path().to_string();
            // serde loses the path inside internally tagged sections (`type = ...`);
            // find the key there by probing the section.
            if let Ok(root) = toml::from_str::<toml::Value>(text) {
                key.push_str(&tagged_key_path(&root, &key));
            }
            bad(format!("key `{key}`: {}", e.into_inner()))
        })?;
        config.validate().map_err(|e| Error::Config {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Ok(config)
    }

    /// Reads and parses a TOML config file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_toml(&text, path)
    }

    /// Checks every section's values.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
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
        }
        self.training.validate()?;
        self.optimizer.validate()?;
        self.loss.validate()?;
        self.checkpoint.validate()?;
        self.distributed.validate(self.device)?;
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
        if self.data.batch_size == 0 {
            return Err(Error::invalid_argument(
                "data.batch_size",
                "must be at least 1",
            ));
        }
        if self.data.scale == 0.0 || !self.data.scale.is_finite() {
            return Err(Error::invalid_argument(
                "data.scale",
                "must be a finite, non-zero number",
            ));
        }
        for metric in &self.logging.metrics {
            if metric_by_name(metric).is_none() {
                return Err(Error::invalid_argument(
                    "logging.metrics",
                    format!("unknown metric `{metric}`; allowed: accuracy, top5_accuracy, precision, recall, f1, mae"),
                ));
            }
        }
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
        self.data.dataset == DatasetKind::Mnist
            || self.data.val_path.is_some()
            || self.data.val_shards.is_some()
            || self.data.val_fraction() > 0.0
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

/// The path below `section` (e.g. `.lr` under `optimizer`) of the value that
/// makes an internally tagged section fail, or an empty string where it
/// cannot be told.
fn tagged_key_path(root: &toml::Value, section: &str) -> String {
    let mut value = root;
    for part in section.split('.') {
        match value.get(part) {
            Some(v) => value = v,
            None => return String::new(),
        }
    }
    match section {
        "optimizer" => culprit::<OptimizerConfig>(value),
        "loss" => culprit::<Loss>(value),
        "schedule" => culprit::<kiln_core::schedule::SchedulerConfig>(value),
        "training.clip" => culprit::<kiln_core::optim::GradClip>(value),
        "model" => culprit::<Layer>(value),
        _ => String::new(),
    }
}

/// Finds which key of `value` (a table that does not deserialize as `T`)
/// causes the error: the one whose removal changes the error. Inside a model,
/// recurses into `layers` and `block`, which are layers themselves.
fn culprit<T: serde::de::DeserializeOwned>(value: &toml::Value) -> String {
    let Err(error) = value.clone().try_into::<T>() else {
        return String::new();
    };
    let error = error.to_string();
    let Some(table) = value.as_table() else {
        return String::new();
    };
    for key in table.keys().filter(|k| *k != "type") {
        let mut without = table.clone();
        let removed = without.remove(key);
        let changed = match toml::Value::Table(without).try_into::<T>() {
            Ok(_) => true,
            Err(e) => e.to_string() != error,
        };
        if !changed {
            continue;
        }
        let inner = match (key.as_str(), removed) {
            ("layers", Some(toml::Value::Array(layers))) => layers
                .iter()
                .position(|l| l.clone().try_into::<Layer>().is_err())
                .map(|i| format!("[{i}]{}", culprit::<Layer>(&layers[i])))
                .unwrap_or_default(),
            ("block", Some(block)) => culprit::<Layer>(&block),
            _ => String::new(),
        };
        return format!(".{key}{inner}");
    }
    String::new()
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
