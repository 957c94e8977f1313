//! The core of Kiln: what every backend and every piece of training code
//! agrees on. It has no native dependency and no heavy one (no plotting, no
//! file formats beyond safetensors); the data pipeline is `kiln-data` and the
//! training loop `kiln-train`.
//!
//! * [`tensor`], [`shape`], [`dtype`] and [`device`]: data in host memory
//!   ([`HostTensor`]) and where computation runs ([`Device`]);
//! * [`backend`] and [`module`]: the traits training code is generic over
//!   ([`Backend`](backend::Backend), [`TrainBackend`](backend::TrainBackend),
//!   [`EagerBackend`](backend::EagerBackend), [`Module`](module::Module));
//! * [`model`]: declarative model definitions ([`Layer`](model::Layer)) that
//!   know their output shapes and their PyTorch-compatible parameter names,
//!   shapes and initial distributions, built natively by each backend;
//! * [`objective`]: what a training step minimises, the seam between the
//!   loop and the method ([`Supervised`](objective::Supervised) first);
//! * [`loss`], [`optim`] and [`schedule`]: what to train with, as serde-readable
//!   configs with PyTorch's defaults, the [`Optimizer`](optim::Optimizer) trait
//!   and the portable optimizer-state layout, and the learning-rate schedulers,
//!   which reproduce `torch.optim.lr_scheduler`;
//! * [`state_dict`] and [`state_tensors`]: named tensors as saved in
//!   checkpoints (safetensors files), and the backend's own tensors that
//!   checkpoints are written from without a host copy;
//! * [`rng`]: the one seeded generator Kiln shuffles and draws with;
//! * [`distributed`]: data-parallel jobs, backend-neutral: where the ranks meet
//!   (from torchrun's, srun's or `kiln launch`'s variables) and the collectives;
//! * [`error`]: the [`Error`] and [`Result`] shared by all Kiln crates.
//!
//! The most used names are re-exported at the root and in [`prelude`]:
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

pub mod backend;
pub mod device;
pub mod distributed;
pub mod dtype;
pub mod error;
pub mod export;
pub mod fs;
pub mod generation;
pub mod host_memory;
pub mod lora;
pub mod loss;
pub mod model;
pub mod module;
pub mod objective;
pub mod optim;
pub mod precision;
pub mod profile;
pub mod rng;
pub mod safetensors;
pub mod schedule;
pub mod shape;
pub mod state_dict;
pub mod state_tensors;
pub mod strategy;
pub mod tensor;
#[cfg(test)]
mod testing;

pub use device::Device;
pub use dtype::DType;
pub use error::{Error, Result};
pub use shape::Shape;
pub use tensor::HostTensor;

/// The traits and types most code written against Kiln needs, in one
/// `use kiln_core::prelude::*`. (It leaves out [`Error`] and [`Result`], which
/// would shadow the standard library's; write `kiln_core::Result`.)
pub mod prelude {
    pub use crate::backend::{Backend, EagerBackend, Mode, TrainBackend, Trainable};
    pub use crate::device::Device;
    pub use crate::dtype::{DType, Element};
    pub use crate::loss::Loss;
    pub use crate::model::Layer;
    pub use crate::module::Module;
    pub use crate::optim::{GradClip, Optimizer, OptimizerConfig, ParamGroup};
    pub use crate::precision::FloatPrecision;
    pub use crate::schedule::{LrScheduler, SchedulerConfig};
    pub use crate::shape::Shape;
    pub use crate::state_dict::StateDict;
    pub use crate::strategy::{DataParallel, StepHooks};
    pub use crate::tensor::HostTensor;
}
