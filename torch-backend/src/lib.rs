//! Kiln's libtorch backend, through [`tch`].
//!
//! [`TorchBackend`] implements [`kiln_core::backend::Backend`] with `tch::Tensor` as its
//! tensor type. Every libtorch call made here uses tch's fallible `f_*` form, so a
//! libtorch error (a C++ exception on the other side) comes back as
//! [`kiln_core::Error::Backend`] whose source, a [`TorchError`], carries libtorch's
//! message without its C++ stack trace; never as a panic.
//!
//! ```no_run
//! use kiln_core::{backend::Backend, Device, HostTensor};
//! use kiln_torch::TorchBackend;
//!
//! let host = HostTensor::new(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2])?;
//! let tensor = TorchBackend::from_host(&host, Device::Cpu)?;
//! let back = TorchBackend::to_host(&tensor)?;
//! assert_eq!(back, host);
//! # Ok::<(), kiln_core::Error>(())
//! ```
//!
//! `unsafe` is denied everywhere but `host_view`, where libtorch reads host memory
//! in place and checkpoints read libtorch's (raw pointers given to `from_blob` and
//! taken from `data_ptr`, each use with a `// SAFETY:` note),
//! [`cxx_tensor`], the one conversion between a `tch::Tensor` and the C++
//! `at::Tensor` that every crate's cxx bridges pass (`&Tensor` in,
//! `UniquePtr<Tensor>` out), and the cxx bridges themselves (of [`autocast`], the
//! fused Adam kernels, TorchScript modules and their export and, with the `cuda`
//! feature, `graph`; C++ compiled by the build script).
//!
//! [`export_torchscript`] writes a [`TorchModel`] as a TorchScript file that
//! Python's `torch.jit.load` runs and trains, with the model's state-dict names;
//! [`ScriptModule`] loads TorchScript files (that one included) back into Kiln.
//!
//! Nothing here knows of ranks: data-parallel training is a strategy around any
//! of these modules (`kiln_core::strategy::DataParallel`), and the `kiln-c10d`
//! crate holds libtorch's c10d (process groups, DDP's `c10d::Reducer`).
//!
//! With the `cuda` feature, `kiln_torch::graph` captures a whole training step in a
//! CUDA graph (`GraphedTrainStep`) and replays it with one launch.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod autocast;
mod backend;
mod checkpoint;
mod convert;
mod custom;
mod custom_layer;
pub mod cxx_tensor;
mod device;
mod distillation;
mod error;
mod export;
mod freeze;
mod generate;
#[cfg(feature = "cuda")]
pub mod graph;
mod host_view;
mod layers;
mod loss;
mod model;
mod optim;
mod preference;
mod profile;
mod script;
pub mod sharded_unit;
mod train;

pub use autocast::autocast;
pub use backend::TorchBackend;
pub use checkpoint::checkpoint;
pub use convert::{dtype_from_kind, from_tch, kind_from_dtype, to_tch, to_tch_pinned};
pub use custom::{Chain, TchModule};
pub use custom_layer::{
    custom_layer_registered, register_custom_layer, register_torchscript_lowering,
    torchscript_lowering_registered, CustomLayerFn, TorchScriptLowering, TorchScriptLoweringFn,
};
pub use device::{cuda_device_count, cuda_is_available, device_from_tch, device_to_tch};
pub use distillation::{Distillation, DistillationConfig};
pub use error::{torch_error, TorchError};
pub use export::export_torchscript;
pub use freeze::Freeze;
pub use generate::{generate, KvCache};
pub use loss::compute_loss;
pub use model::{ShardedUnit, TorchModel};
pub use optim::{
    clip_grad_norm, clip_grad_norm_on_device, clip_grad_norm_with, clip_grad_value, TorchOptimizer,
};
pub use preference::{Simpo, SimpoConfig};
pub use profile::TorchProfiler;
pub use script::{resolve_torchscript_shapes, ScriptModule};
pub use train::{eval_objective, objective_step, train_step};

/// The libtorch version this crate is built for.
pub const LIBTORCH_VERSION: &str = "2.11.0";
