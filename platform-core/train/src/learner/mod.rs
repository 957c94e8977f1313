//! The training loop and its hooks (like burn-train's `learner`).

mod averaging;
mod batch_norm;
mod callback;
mod config;
mod early_stopping;
mod lr_finder;
mod state;
mod tools;
mod trainer;

pub use averaging::{AveragingConfig, EmaConfig, SwaConfig, SwaStart, WeightAveraging};
pub use batch_norm::update_batch_norm;
pub use callback::{Callback, Context, FitInfo, Flow, Sinks, ValidationBatch};
pub use config::MaxTime;
pub use early_stopping::{EarlyStopping, EarlyStoppingConfig};
pub use lr_finder::{find_lr, LrFinderConfig, LrFinderResult, LrSweep};
pub use state::TrainingState;
pub use tools::{
    MisclassifiedImages, MisclassifiedLogger, ProfileConfig, Profiler, StepViewLogger, StepViews,
    Timer, TimerInterval, WeightAverager, MISCLASSIFIED_TAG,
};
pub use trainer::{EpochRecord, LossReads, ScheduleInterval, Trainer, TrainerConfig};
