//! Backend-neutral core of Kiln.
//!
//! This crate has no native dependency. It defines what every backend and
//! every piece of training code agrees on:
//!
//! * [`HostTensor`], [`Shape`], [`DType`] and [`Device`]: data in host memory
//!   and where computation runs;
//! * [`Backend`], [`Module`], [`Optimizer`] and [`LrScheduler`]: the traits
//!   training code is generic over;
//! * [`StateDict`]: named tensors as saved in checkpoints;
//! * [`Dataset`], [`DataLoader`] and friends, including a reader for
//!   scikit-learn's digits data ([`load_digits`]);
//! * [`Error`] and [`Result`], shared by all Kiln crates.
//!
//! ```
//! use kiln_core::{DType, HostTensor, Shape};
//!
//! let t = HostTensor::zeros(DType::F32, [2, 3])?;
//! assert_eq!(t.shape(), &Shape::from([2, 3]));
//! # Ok::<(), kiln_core::Error>(())
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod backend;
mod data;
mod device;
mod dtype;
mod error;
mod module;
mod optim;
mod shape;
mod state_dict;
mod tensor;
#[cfg(test)]
mod testing;

pub use backend::{Backend, Mode};
pub use data::{
    load_digits, train_test_split, Batch, DataLoader, Dataset, InMemoryDataset, SequentialLoader,
    Split,
};
pub use device::Device;
pub use dtype::{DType, Element};
pub use error::{BoxedSource, Error, Result};
pub use module::Module;
pub use optim::{LrScheduler, Optimizer};
pub use shape::Shape;
pub use state_dict::StateDict;
pub use tensor::HostTensor;
