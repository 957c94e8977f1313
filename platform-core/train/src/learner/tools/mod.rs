//! The training tools that live in callbacks: each is a file of its own and
//! joins a run with one registration (a `Trainer::with_*` builder, or
//! [`Trainer::with_callback`](crate::Trainer::with_callback)).

mod misclassified;
mod profiler;
mod step_views;
mod timer;
mod weight_averager;

pub use misclassified::{MisclassifiedImages, MisclassifiedLogger, MISCLASSIFIED_TAG};
pub use profiler::{ProfileConfig, Profiler};
pub use step_views::{StepViewLogger, StepViews};
pub use timer::{Timer, TimerInterval};
pub use weight_averager::WeightAverager;
