//! Backend-neutral core of Kiln.
//!
//! This crate has no native dependency. It defines what every backend and
//! every piece of training code agrees on:
//!
//! * [`HostTensor`], [`Shape`], [`DType`] and [`Device`]: data in host memory
//!   and where computation runs;
//! * [`Backend`], [`Module`], [`Optimizer`] and [`LrScheduler`]: the traits
//!   training code is generic over;
//! * [`Layer`]: declarative model definitions that know their output shapes
//!   and their PyTorch-compatible parameter names, shapes and initial
//!   distributions ([`ParamSpec`]), built natively by each backend;
//! * [`Loss`], [`OptimizerConfig`] (with [`ParamGroup`]s and [`GradClip`])
//!   and [`SchedulerConfig`]: what to train with, as serde-readable configs
//!   with PyTorch's defaults; the schedulers themselves ([`StepLr`],
//!   [`OneCycleLr`], [`ReduceLrOnPlateau`], ...) reproduce
//!   `torch.optim.lr_scheduler`;
//! * [`StateDict`]: named tensors as saved in checkpoints, read and written
//!   as safetensors files ([`StateDict::save_safetensors`]); [`StateTensors`],
//!   the backend's own tensors, which checkpoints are written from without
//!   copying the weights first;
//! * [`Dataset`], [`DataLoader`] and friends ([`PrefetchLoader`]), with
//!   readers for scikit-learn's digits ([`load_digits`]), MNIST IDX files
//!   ([`load_mnist`]) and CSV ([`load_csv`]);
//! * [`Trainer`] and [`TrainingState`]: the training loop over any
//!   [`TrainBackend`], with callbacks ([`EarlyStopping`]), metrics
//!   ([`Metric`]) and sinks ([`CsvSink`], [`TensorBoardSink`], ...);
//! * [`Checkpoint`], [`Checkpointer`] and [`RunDirectory`]: exact-resume
//!   checkpoints, which of them to keep, and a run's locked output directory;
//! * [`RunConfig`]: a whole run as the `kiln` CLI reads it from TOML;
//! * [`Error`] and [`Result`], shared by all Kiln crates.
//!
//! ```
//! use kiln_core::{DType, HostTensor, Shape};
//!
//! let t = HostTensor::zeros(DType::F32, [2, 3])?;
//! assert_eq!(t.shape(), &Shape::from([2, 3]));
//! # Ok::<(), kiln_core::Error>(())
//! ```

// `unsafe` only in `host_memory`, the one call into the C library (mallopt).
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod backend;
mod checkpoint;
mod config;
mod data;
mod device;
mod dtype;
mod error;
pub mod host_memory;
mod learner;
mod logger;
mod loss;
mod metric;
mod model;
mod module;
mod optim;
mod precision;
mod safetensors;
mod schedule;
mod shape;
mod state_dict;
mod state_tensors;
mod tensor;
#[cfg(test)]
mod testing;

pub use backend::{Backend, Mode};
pub use checkpoint::{
    checkpoint_path, Checkpoint, CheckpointPolicy, Checkpointer, MonitorMode, RunDirectory,
    RunStart, CHECKPOINT_FORMAT, LOCK_FILE,
};
pub use config::{
    metric_by_name, BackendKind, DataConfig, DatasetKind, EarlyStoppingConfig, LoggingConfig,
    RunConfig,
};
pub use data::SplitMix64;
pub use data::{
    load_csv, load_digits, load_mnist, load_mnist_images, load_mnist_labels, one_hot, read_idx,
    train_test_split, Batch, Collate, Compose, CsvOptions, DataLoader, Dataset, EpochSampler,
    InMemoryDataset, IndexableDataset, IterableDataset, IterableLoader, LabelColumn, LabelKind,
    MapDataset, Mnist, Normalize, PrefetchLoader, RandomCrop, RandomHorizontalFlip,
    SequentialLoader, Split, StackCollate, ToFloat, Transform, TransformRng, TransformedDataset,
};
pub use device::Device;
pub use dtype::{DType, Element};
pub use error::{BackendMessage, BoxedSource, Error, ErrorChain, Result};
pub use learner::{
    Callback, EagerBackend, EarlyStopping, EpochRecord, Flow, ScheduleInterval, StepPlan,
    TrainBackend, Trainer, TrainerConfig, TrainingState,
};
pub use logger::{
    plot_curves, CsvSink, CurveSource, EpochValues, History, LogSink, MetricSink, PlotOptions,
    ProgressSink, TensorBoardSink,
};
pub use loss::{
    BceWithLogitsConfig, CrossEntropyConfig, Loss, NllConfig, Reduction, SmoothL1Config,
};
pub use metric::{
    Accuracy, LossMetric, MeanAbsoluteError, Metric, Precision, Recall, TopKAccuracy, F1,
};
pub use model::CustomLayerRegistry;
pub use model::{
    fan_in_and_fan_out, AttentionConfig, BatchNormConfig, Conv1dConfig, Conv2dConfig,
    ConvTranspose2dConfig, CustomConfig, CustomParam, EmbeddingConfig, FanMode, GeluApproximation,
    GroupNormConfig, Init, InitDistribution, Layer, LayerNormConfig, LinearConfig, Nonlinearity,
    ParamKind, ParamSpec, Pool2dConfig,
};
pub use module::Module;
pub use optim::{
    assign_groups, load_group_hypers, optimizer_state_key, read_optimizer_state, resolve_groups,
    save_group_hypers, set_group_learning_rates, AdagradConfig, AdamConfig, AdamWConfig, GradClip,
    GroupHyper, Optimizer, OptimizerConfig, ParamGroup, ParamSelector, ParamState, RmsPropConfig,
    SgdConfig, StateBuffer,
};
pub use precision::FloatPrecision;
pub use schedule::{
    AnnealStrategy, CosineAnnealingLr, CosineAnnealingLrConfig, CosineAnnealingWarmRestarts,
    CosineAnnealingWarmRestartsConfig, ExponentialLr, ExponentialLrConfig, LinearLr,
    LinearLrConfig, LrScheduler, MultiStepLr, MultiStepLrConfig, OneCycleLr, OneCycleLrConfig,
    PerGroup, PlateauMode, ReduceLrOnPlateau, ReduceLrOnPlateauConfig, SchedulerConfig, StepLr,
    StepLrConfig, ThresholdMode,
};
pub use shape::Shape;
pub use state_dict::StateDict;
pub use state_tensors::{StateTensor, StateTensors, WritableState, WritableTensor};
pub use tensor::HostTensor;
