//! Kiln: train neural networks from Rust on libtorch or TensorFlow.
//!
//! This facade re-exports the backend-neutral API of [`kiln_core`] and, behind
//! features, the backends: `torch` (`kiln-torch`, libtorch through tch), `tf`
//! (`kiln-tf`, the TensorFlow C API) and `ops` (`kiln-ops`, custom C++ ops).
//! Training code is written against [`Backend`], [`Module`], [`Optimizer`] and
//! [`DataLoader`] and monomorphised for a backend.
//!
//! ```no_run
//! use kiln::prelude::*;
//!
//! fn roundtrip<B: Backend>(device: Device) -> kiln::Result<HostTensor> {
//!     let host = HostTensor::new(vec![1.0f32, 2.0, 3.0], [3])?;
//!     B::to_host(&B::from_host(&host, device)?)
//! }
//! # #[cfg(feature = "torch")]
//! # roundtrip::<kiln::torch::TorchBackend>(Device::Cpu)?;
//! # Ok::<(), kiln::Error>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use kiln_core as core;
#[cfg(feature = "ops")]
pub use kiln_ops as ops;
#[cfg(feature = "tf")]
pub use kiln_tf as tf;
#[cfg(feature = "torch")]
pub use kiln_torch as torch;

pub use kiln_core::{
    Backend, Batch, DType, DataLoader, Dataset, Device, Element, Error, HostTensor, LrScheduler,
    Mode, Module, Optimizer, Result, Shape, StateDict,
};

/// The names most training scripts need, in one `use kiln::prelude::*`.
pub mod prelude {
    pub use kiln_core::{
        Backend, Batch, DType, DataLoader, Dataset, Device, EagerBackend, HostTensor, Mode, Module,
        Optimizer, Shape, StateDict,
    };
    #[cfg(feature = "tf")]
    pub use kiln_tf::TfTensor;
    #[cfg(feature = "torch")]
    pub use kiln_torch::TorchBackend;
}
