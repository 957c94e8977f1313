//! The training loop and its hooks (like burn-train's `learner`).

mod averaging;
mod batch_norm;
mod callback;
mod lr_finder;
mod state;
mod trainer;

pub use averaging::{AveragingConfig, EmaConfig, SwaConfig, SwaStart, WeightAveraging};
pub use batch_norm::update_batch_norm;
pub use callback::{Callback, EarlyStopping, Flow};
pub use lr_finder::{find_lr, LrFinderConfig, LrFinderResult, LrSweep};
pub use state::TrainingState;
pub use trainer::{
    EpochRecord, LossReads, MisclassifiedImages, ProfileConfig, ScheduleInterval, StepViews,
    Trainer, TrainerConfig, MISCLASSIFIED_TAG,
};
