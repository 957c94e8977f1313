//! Kiln's bridge to libtorch's own c10d, the engine PyTorch's
//! `torch.distributed` and `DistributedDataParallel` run on, reached through a cxx
//! bridge (tch has no distributed API). It is the one crate that knows of ranks
//! on libtorch; models, optimizers and the trainer do not.
//!
//! - [`ProcessGroup`]: the ranks of a job after their rendezvous
//!   ([`Rendezvous`]: a TCP store hosted by rank 0 or torchrun's agent, or a
//!   file store), with Gloo for CPU tensors and, with the `cuda` feature, NCCL
//!   for CUDA tensors; typed collectives on `tch::Tensor`s, on
//!   [`HostTensor`](kiln_core::HostTensor)s and on host `f32` memory in place
//!   ([`Collectives`], which the TensorFlow backend's data parallelism uses).
//! - [`DistributedDataParallel`]: DDP's semantics on `c10d::Reducer`, as the
//!   [`StepHooks`](kiln_core::strategy::StepHooks) of
//!   [`DataParallel`] around any torch
//!   module: parameters and buffers broadcast from rank 0, gradients averaged
//!   in buckets while the backward pass runs, buffers broadcast before each
//!   training forward pass, and no synchronisation on the micro-batches
//!   gradient accumulation does not apply. [`data_parallel`] builds the wrapper.
//! - Post-local SGD ([`post_local_sgd`]): DDP for a warm-up, then local
//!   steps with the parameters averaged periodically.
//! - ZeRO stages 1 and 2 ([`zero_data_parallel`]): the optimizer state, and the
//!   reduced gradients, sharded over the ranks.
//! - Full sharding ([`fully_shard`], PyTorch's FSDP): parameters, gradients and
//!   optimizer state sharded, each unit's parameters gathered while it runs.
//!
//! ```no_run
//! use kiln_c10d::{data_parallel, ProcessGroup};
//! use kiln_core::distributed::{DistributedOptions, ReduceOp, Rendezvous};
//! use kiln_core::{backend::Trainable, model::{Layer, LinearConfig}, Device};
//! use std::sync::Arc;
//!
//! // Started by `torchrun --nproc-per-node=2 --no-python ...` or `kiln launch`.
//! let rendezvous = Rendezvous::from_env()?.expect("started by a launcher");
//! let options = DistributedOptions::default();
//! let group = Arc::new(ProcessGroup::join(&rendezvous, &options)?);
//! let x = tch::Tensor::from_slice(&[group.rank() as f32 + 1.0]);
//! group.all_reduce(&x, ReduceOp::Sum)?; // 3.0 on both ranks
//!
//! // Any torch module trains data-parallel inside the wrapper.
//! let model = kiln_torch::TorchModel::new(&Layer::Linear(LinearConfig::new(4, 2)), Device::Cpu)?;
//! let model = data_parallel(model, group, &options)?;
//! # let _ = model.num_trainable_parameters()?;
//! # Ok::<(), kiln_core::Error>(())
//! ```
//!
//! `unsafe` is denied but for the cxx bridge (`bridge.rs`, with the `Send`
//! promises of the c10d objects it declares), the process group's `Send` and
//! `Sync` (`group.rs`), and the one type that confines the tensor handles a
//! strategy's parts share to the training step's sequence
//! (`step_shared.rs`), each with a `// SAFETY:` note.

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod bridge;
mod ddp;
mod fsdp;
mod group;
mod post_local_sgd;
mod step_shared;
mod zero;

use std::sync::Arc;

use kiln_core::backend::Trainable;
use kiln_core::distributed::DistributedOptions;
use kiln_core::module::Module;
use kiln_core::strategy::DataParallel;
use kiln_core::Result;
use kiln_torch::{TorchBackend, TorchOptimizer};

pub use ddp::DistributedDataParallel;
pub use fsdp::{
    fully_shard, FsdpOptimizer, FullShard, FullShardOptions, FullyShardedDataParallel,
    PrefetchStats,
};
pub use group::ProcessGroup;
pub use kiln_core::distributed::{Collectives, Rendezvous};
pub use post_local_sgd::{PostLocalSgd, PostLocalSgdOptions};
pub use zero::{partition, ShardedOptimizer, Shards, ZeroDataParallel, ZeroRedundancy, ZeroStage};

/// `module` wrapped to train data-parallel over `group`
/// ([`DistributedDataParallel::of`], then [`DataParallel::new`]): rank 0's
/// parameters and buffers on every rank now, DDP's gradient averaging in every
/// step. Call it on every rank, after setting precision and freezing, before
/// building the optimizer.
pub fn data_parallel<M>(
    module: M,
    group: Arc<ProcessGroup>,
    options: &DistributedOptions,
) -> Result<DataParallel<M, DistributedDataParallel>>
where
    M: Trainable<TorchBackend> + Module<TorchBackend>,
{
    if !module.takes_step_hooks() {
        // Refused before any collective, alike on every rank.
        return Err(kiln_core::Error::unsupported(format!(
            "{} under DataParallel: its training step cannot be hooked",
            module.kind()
        )));
    }
    let ddp = DistributedDataParallel::of(group, &module, options)?;
    DataParallel::new(module, ddp)
}

/// `module` wrapped to train under ZeRO `stage` over `group`
/// ([`ZeroRedundancy::of`], then [`DataParallel::new`]): rank 0's
/// parameters and buffers on every rank now; the optimizer it builds keeps
/// this rank's share of the state. Call it on every rank, after setting
/// precision and freezing, before building the optimizer.
///
/// ```no_run
/// use kiln_c10d::{zero_data_parallel, ProcessGroup, ZeroStage};
/// use kiln_core::distributed::{DistributedOptions, Rendezvous};
/// use kiln_core::{backend::Trainable, model::{Layer, LinearConfig}, optim::{AdamConfig, OptimizerConfig}, Device};
/// use std::sync::Arc;
///
/// let rendezvous = Rendezvous::from_env()?.expect("started by a launcher");
/// let options = DistributedOptions::default();
/// let group = Arc::new(ProcessGroup::join(&rendezvous, &options)?);
/// let model = kiln_torch::TorchModel::new(&Layer::Linear(LinearConfig::new(4, 2)), Device::Cpu)?;
/// let model = zero_data_parallel(model, group, ZeroStage::Two, &options)?;
/// let optimizer = model.build_optimizer(&OptimizerConfig::Adam(AdamConfig::new(1e-3)), &[])?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn zero_data_parallel<M>(
    module: M,
    group: Arc<ProcessGroup>,
    stage: ZeroStage,
    options: &DistributedOptions,
) -> Result<ZeroDataParallel<M>>
where
    M: Trainable<TorchBackend, Optim = TorchOptimizer> + Module<TorchBackend>,
{
    if !module.takes_step_hooks() {
        return Err(kiln_core::Error::unsupported(format!(
            "{} under {}: its training step cannot be hooked",
            module.kind(),
            stage.name()
        )));
    }
    let strategy = ZeroRedundancy::of(group, &module, stage, options)?;
    DataParallel::new(module, strategy)
}

/// `module` wrapped to train under post-local SGD over `group`
/// ([`PostLocalSgd::of`], then [`DataParallel::new`]): DDP for
/// `options.warmup_steps` optimizer steps, then each rank's own steps with
/// the parameters averaged over the ranks every `options.period` steps, as
/// PyTorch's `post_localSGD_hook` with `PostLocalSGDOptimizer` and
/// `PeriodicModelAverager` train. Call it on every rank, after setting
/// precision and freezing, before building the optimizer.
///
/// ```no_run
/// use kiln_c10d::{post_local_sgd, PostLocalSgdOptions, ProcessGroup};
/// use kiln_core::distributed::{DistributedOptions, Rendezvous};
/// use kiln_core::{model::{Layer, LinearConfig}, Device};
/// use std::sync::Arc;
///
/// let rendezvous = Rendezvous::from_env()?.expect("started by a launcher");
/// let options = DistributedOptions::default();
/// let group = Arc::new(ProcessGroup::join(&rendezvous, &options)?);
/// let model = kiln_torch::TorchModel::new(&Layer::Linear(LinearConfig::new(4, 2)), Device::Cpu)?;
/// let local = PostLocalSgdOptions { warmup_steps: 100, period: 4 };
/// let model = post_local_sgd(model, group, &local, &options)?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn post_local_sgd<M>(
    module: M,
    group: Arc<ProcessGroup>,
    options: &PostLocalSgdOptions,
    distributed: &DistributedOptions,
) -> Result<DataParallel<M, PostLocalSgd>>
where
    M: Trainable<TorchBackend> + Module<TorchBackend>,
{
    if !module.takes_step_hooks() {
        return Err(kiln_core::Error::unsupported(format!(
            "{} under post-local SGD: its training step cannot be hooked",
            module.kind()
        )));
    }
    let strategy = PostLocalSgd::of(group, &module, options, distributed)?;
    DataParallel::new(module, strategy)
}
