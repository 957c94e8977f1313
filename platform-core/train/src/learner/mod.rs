//! The training loop and its hooks (like burn-train's `learner`).

mod callback;
mod state;
mod trainer;

pub use callback::{Callback, EarlyStopping, Flow};
pub use state::TrainingState;
pub use trainer::{EpochRecord, LossReads, ScheduleInterval, Trainer, TrainerConfig};
