//! Kiln's training loop and everything around it, over any
//! [`TrainBackend`](kiln_core::backend::TrainBackend):
//!
//! * [`Trainer`] and [`TrainingState`]: `fit`, `evaluate` and `predict`, with
//!   gradient accumulation, clipping, schedules and exact resume; callbacks
//!   ([`Callback`], [`EarlyStopping`]);
//! * metrics ([`Metric`]: [`Accuracy`], [`TopKAccuracy`], [`Precision`],
//!   [`Recall`], [`F1`], [`MeanAbsoluteError`], [`LossMetric`]), chosen by name
//!   with [`metric_by_name`];
//! * metric sinks ([`MetricSink`]: [`CsvSink`], [`TensorBoardSink`],
//!   [`ProgressSink`], [`LogSink`], [`History`]) and PNG curves ([`plot_curves`]);
//! * [`Checkpoint`], [`Checkpointer`] and [`RunDirectory`]: exact-resume
//!   checkpoints, which of them to keep, and a run's locked output directory.
//!
//! The data it trains on comes from `kiln-data`; models, optimizers and
//! losses from `kiln-core` and a backend.

mod checkpoint;
mod learner;
mod logger;
mod metric;

pub use checkpoint::{
    checkpoint_path, find_non_finite, first_difference, refuse_non_finite, save_sharded_checkpoint,
    shard_path, Averaged, AveragingMethod, Checkpoint, CheckpointPolicy, Checkpointer, MonitorMode,
    NonFinite, RunDirectory, RunStart, CHECKPOINT_FORMAT, LOCK_FILE, RUN_OUTPUTS,
};
pub use learner::{
    find_lr, update_batch_norm, AveragingConfig, Callback, Context, EarlyStopping,
    EarlyStoppingConfig, EmaConfig, EpochRecord, FitInfo, Flow, LossReads, LrFinderConfig,
    LrFinderResult, LrSweep, MaxTime, MisclassifiedImages, MisclassifiedLogger, ProfileConfig,
    Profiler, ScheduleInterval, Sinks, StepViewLogger, StepViews, SwaConfig, SwaStart, Timer,
    TimerInterval, Trainer, TrainerConfig, TrainingState, ValidationBatch, WeightAverager,
    WeightAveraging, MISCLASSIFIED_TAG,
};
pub use logger::{
    plot_curves, plot_lr_finder, CsvSink, CurveSource, EpochValues, History, LogSink, LoggedImage,
    MetricSink, PlotOptions, ProgressSink, TensorBoardSink,
};
pub use metric::{
    metric_by_name, Accuracy, LossMetric, MeanAbsoluteError, Metric, Precision, Recall,
    TopKAccuracy, F1,
};

/// The training loop's most used names, in one `use kiln_train::prelude::*`:
/// enough to write a [`Callback`] without another import.
///
/// ```
/// use kiln_core::backend::{TrainBackend, Trainable};
/// use kiln_train::prelude::*;
///
/// /// Stops training after 100 steps, and logs each epoch's loss.
/// struct StopAt100;
///
/// impl<B: TrainBackend, M: Trainable<B>> Callback<B, M> for StopAt100 {
///     fn on_step_end(&mut self, cx: &mut Context<'_, B, M>, _loss: f64) -> kiln_core::Result<Flow> {
///         Ok(if cx.state.step >= 100 { Flow::Stop } else { Flow::Continue })
///     }
///
///     fn on_epoch_end(&mut self, cx: &mut Context<'_, B, M>, record: &EpochRecord) -> kiln_core::Result<Flow> {
///         log::info!("epoch {}: loss {}", cx.state.epoch, record["loss"]);
///         Ok(Flow::Continue)
///     }
/// }
/// ```
pub mod prelude {
    pub use crate::{
        Accuracy, Callback, Checkpoint, Checkpointer, Context, EarlyStopping, EpochRecord, Flow,
        Metric, Trainer, TrainerConfig, TrainingState,
    };
}
