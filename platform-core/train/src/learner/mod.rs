//! The training loop and its hooks (like burn-train's `learner`).

mod averaging;
mod callback;
mod state;
mod trainer;

pub use averaging::{EmaConfig, WeightAveraging};
pub use callback::{Callback, EarlyStopping, Flow};
pub use state::TrainingState;
pub use trainer::{EpochRecord, LossReads, ScheduleInterval, Trainer, TrainerConfig};
