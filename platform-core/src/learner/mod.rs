//! The training loop and its hooks (like burn-train's `learner`).

mod backend;
mod callback;
mod trainer;

pub use backend::{EagerBackend, StepPlan, TrainBackend};
pub use callback::{Callback, EarlyStopping, Flow};
pub use trainer::{EpochRecord, ScheduleInterval, Trainer, TrainerConfig, TrainingState};
