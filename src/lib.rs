//! Kiln: train neural networks from Rust on libtorch or TensorFlow.
//!
//! This facade re-exports Kiln's backend-neutral crates as modules
//! ([`core`]: tensors, traits, model/loss/optimizer definitions; [`data`]:
//! datasets, loaders, readers, transforms; [`train`]: the `Trainer`,
//! callbacks, metrics, sinks and checkpoints), the most used names at the root
//! and in [`prelude`], and, behind features (all on by default), the backends:
//! `torch` (`kiln-torch`, libtorch through tch), `tf` (`kiln-tf`, the
//! TensorFlow C API); `ops` (`kiln-fused-ops` as `fused_ops`: Kiln's own fused
//! C++/CUDA ops, and `torch_op`: ops written in Rust registered in libtorch);
//! `text` ([`text`]: text rows tokenized for language models; [`hf`]: Hugging
//! Face checkpoints, tokenizers and PEFT adapters), `vision` ([`vision`]: image
//! decoding, image datasets and torchvision's transforms) and `onnx`
//! ([`onnx`]: ONNX export, `OnnxModel` on ONNX Runtime, `ModelInfo`). Writing
//! your own ops in Rust is [`custom_op`] (`kiln-custom-op`), always present.
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

#[cfg(feature = "torch")]
pub use kiln_c10d as c10d;
pub use kiln_core as core;
/// Ops written in Rust: one definition for both engines (`kiln::custom_op::CustomOp`).
pub use kiln_custom_op as custom_op;
pub use kiln_data as data;
#[cfg(feature = "ops")]
pub use kiln_fused_ops as fused_ops;
#[cfg(feature = "text")]
pub use kiln_hf as hf;
#[cfg(feature = "onnx")]
pub use kiln_onnx as onnx;
#[cfg(feature = "text")]
pub use kiln_text as text;
#[cfg(feature = "tf")]
pub use kiln_tf as tf;
/// Registers Rust ops ([`custom_op`]) in TensorFlow.
#[cfg(feature = "tf")]
pub use kiln_tf_op as tf_op;
#[cfg(feature = "torch")]
pub use kiln_torch as torch;
/// Registers Rust ops ([`custom_op`]) in libtorch.
#[cfg(feature = "ops")]
pub use kiln_torch_op as torch_op;
pub use kiln_train as train;
#[cfg(feature = "vision")]
pub use kiln_vision as vision;

pub use kiln_core::backend::{Backend, Mode};
pub use kiln_core::module::Module;
pub use kiln_core::optim::Optimizer;
pub use kiln_core::schedule::LrScheduler;
pub use kiln_core::state_dict::StateDict;
pub use kiln_core::{dtype::Element, DType, Device, Error, HostTensor, Result, Shape};
pub use kiln_data::{Batch, DataLoader, Dataset};

/// The names most training scripts need, in one `use kiln::prelude::*`: the
/// preludes of [`core`](kiln_core::prelude), [`data`](kiln_data::prelude) and
/// [`train`](kiln_train::prelude), and the backends' entry points.
pub mod prelude {
    pub use kiln_core::prelude::*;
    pub use kiln_data::prelude::*;
    #[cfg(feature = "tf")]
    pub use kiln_tf::{TfBackend, TfTensor};
    #[cfg(feature = "torch")]
    pub use kiln_torch::TorchBackend;
    pub use kiln_train::prelude::*;
}

/// The guide (`docs/src/*.md`, the mdBook built by `cargo xtask book`) as doctests:
/// `cargo test -p kiln --doc` compiles every Rust block of every chapter against this
/// crate with its default features, so the guide's code cannot drift from the API.
#[cfg(doctest)]
mod guide {
    #[doc = include_str!("../docs/src/introduction.md")]
    pub struct GuideIntroduction;
    #[doc = include_str!("../docs/src/install.md")]
    pub struct GuideInstall;
    #[doc = include_str!("../docs/src/models.md")]
    pub struct GuideModels;
    #[doc = include_str!("../docs/src/training.md")]
    pub struct GuideTraining;
    #[doc = include_str!("../docs/src/images.md")]
    pub struct GuideImages;
    #[doc = include_str!("../docs/src/tools.md")]
    pub struct GuideTools;
    #[doc = include_str!("../docs/src/checkpoints.md")]
    pub struct GuideCheckpoints;
    #[doc = include_str!("../docs/src/precision.md")]
    pub struct GuidePrecision;
    #[doc = include_str!("../docs/src/distributed.md")]
    pub struct GuideDistributed;
    #[doc = include_str!("../docs/src/tensorflow.md")]
    pub struct GuideTensorflow;
    #[doc = include_str!("../docs/src/torchscript-savedmodel.md")]
    pub struct GuideTorchscriptSavedmodel;
    #[doc = include_str!("../docs/src/pretrained.md")]
    pub struct GuidePretrained;
    #[doc = include_str!("../docs/src/finetuning.md")]
    pub struct GuideFinetuning;
    #[doc = include_str!("../docs/src/export.md")]
    pub struct GuideExport;
    #[doc = include_str!("../docs/src/custom-ops.md")]
    pub struct GuideCustomOps;
    #[doc = include_str!("../docs/src/gpu.md")]
    pub struct GuideGpu;
    #[doc = include_str!("../docs/src/benchmarks.md")]
    pub struct GuideBenchmarks;
    #[doc = include_str!("../docs/src/examples.md")]
    pub struct GuideExamples;
    #[doc = include_str!("../docs/src/own-crate.md")]
    pub struct GuideOwnCrate;
    #[doc = include_str!("../docs/src/development.md")]
    pub struct GuideDevelopment;
}
