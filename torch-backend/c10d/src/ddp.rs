//! `DistributedDataParallel`'s semantics on `c10d::Reducer`, the engine PyTorch's
//! DDP runs on.

use std::sync::Arc;

use cxx::UniquePtr;
use kiln_core::distributed::{Collectives, DistributedOptions, ReduceOp, FIRST_BUCKET_BYTES};
use kiln_core::module::Module;
use kiln_core::strategy::StepHooks;
use kiln_core::{Error, Result};
use kiln_torch::{device_from_tch, torch_error, TorchBackend};
use tch::Tensor;

use crate::bridge::ffi;
use crate::group::{c10d_error, tensor_list, PendingAllReduce, ProcessGroup};

/// DDP's buffer for broadcasting the model from rank 0 (`broadcast_bucket_size`).
const BROADCAST_BUCKET_BYTES: usize = 250 * 1024 * 1024;

/// A model's parameters and buffers kept identical across the ranks of a
/// [`ProcessGroup`], as PyTorch's `DistributedDataParallel` keeps them:
///
/// - at construction, every rank checks that it has rank 0's parameter count,
///   shapes and dtypes, then takes rank 0's parameters and buffers;
/// - before each synchronised forward pass ([`before_forward`](Self::before_forward)),
///   buffers (batch-norm running statistics) come from rank 0 again, unless
///   `broadcast_buffers` is off;
/// - after it ([`after_forward`](Self::after_forward)), `c10d::Reducer` expects the
///   parameters' gradients: as the backward pass produces them, it averages them
///   over the ranks in buckets (1 MiB first, then up to `bucket_cap_mb`, in
///   reverse parameter order, rebuilt in gradient-arrival order after the first
///   step), overlapping communication with the rest of the backward pass, and
///   writes the means into the parameters' `.grad`.
///
/// A micro-batch that gradient accumulation does not apply is run with
/// `sync = false`, DDP's `no_sync()`: its gradients accumulate locally and are
/// reduced with the next synchronised one.
pub struct DistributedDataParallel {
    group: Arc<ProcessGroup>,
    reducer: UniquePtr<ffi::DdpReducer>,
    buffers: Vec<Tensor>,
    broadcast_buffers: bool,
    /// The loss mean started before the backward pass ([`StepHooks::before_backward`]).
    pending_loss: Option<PendingMean>,
}

/// A mean over the ranks under way ([`DistributedDataParallel::start_mean`]).
pub(crate) struct PendingMean(PendingAllReduce);

impl PendingMean {
    /// Waits for the mean.
    pub(crate) fn value(self) -> Result<f64> {
        self.0
            .wait()?
            .f_double_value(&[0])
            .map_err(|e| torch_error("loss mean", e))
    }
}

impl std::fmt::Debug for DistributedDataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedDataParallel")
            .field("group", &self.group)
            .field("buffers", &self.buffers.len())
            .field("broadcast_buffers", &self.broadcast_buffers)
            .finish_non_exhaustive()
    }
}

impl DistributedDataParallel {
    /// Synchronises `params` and `buffers` (name, tensor; the tensors are
    /// updated in place) from rank 0 and builds the gradient reducer over the
    /// parameters that require gradients.
    pub fn new(
        group: Arc<ProcessGroup>,
        params: &[(String, Tensor)],
        buffers: &[(String, Tensor)],
        options: &DistributedOptions,
    ) -> Result<Self> {
        // Checked before any collective, so that every rank fails alike.
        let cap = bucket_cap_bytes(options)?;
        let trained = take_rank_zeros_model(&group, "DistributedDataParallel", params, buffers)?;
        let tensors: Vec<&Tensor> = trained.iter().map(|(_, t)| t).collect();
        let list = tensor_list(&tensors);
        let config = ffi::ReducerConfig {
            bucket_cap_bytes: cap,
            first_bucket_bytes: FIRST_BUCKET_BYTES,
            find_unused_parameters: options.find_unused_parameters,
            param_names: trained.iter().map(|(n, _)| n.clone()).collect(),
        };
        let reducer = group
            .with(|g| ffi::new_ddp_reducer(g, &list, &config))
            .map_err(|e| c10d_error("creating DDP's gradient reducer", e))?;
        log::info!(
            "DistributedDataParallel: rank {} of {}, {} parameters, {} buffers, bucket cap {} MiB",
            group.rank(),
            group.world_size(),
            trained.len(),
            buffers.len(),
            options.bucket_cap_mb
        );
        Ok(DistributedDataParallel {
            group,
            reducer,
            buffers: buffers.iter().map(|(_, t)| t.shallow_clone()).collect(),
            broadcast_buffers: options.broadcast_buffers,
            pending_loss: None,
        })
    }

    /// The process group.
    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.group
    }

    /// Before a training forward pass: rank 0's buffers (when
    /// `broadcast_buffers`), and, when `sync`, the reducer's bookkeeping.
    pub fn before_forward(&self, sync: bool) -> Result<()> {
        if self.broadcast_buffers {
            broadcast_buffers(&self.group, &self.buffers)?;
        }
        if sync {
            self.group
                .with(|_| self.reducer.prepare_for_forward())
                .map_err(|e| self.reducer_error(e))?;
        }
        Ok(())
    }

    /// Rank 0's buffers on every rank now, whatever `broadcast_buffers` says
    /// (what evaluation after training needs).
    pub fn sync_buffers(&self) -> Result<()> {
        broadcast_buffers(&self.group, &self.buffers)
    }

    /// After a training forward pass whose backward pass follows: with `sync`,
    /// the reducer hooks the gradients of the coming backward pass (searching
    /// the graph of `loss` for unused parameters when asked to).
    pub fn after_forward(&self, loss: &Tensor, sync: bool) -> Result<()> {
        if !sync {
            return Ok(());
        }
        let outputs = tensor_list(&[loss]);
        self.group
            .with(|_| self.reducer.prepare_for_backward(&outputs))
            .map_err(|e| self.reducer_error(e))
    }

    /// The mean of a scalar (a micro-batch's loss) over the ranks: what the
    /// training loop reports, and the one value every rank decides on.
    pub fn mean_scalar(&self, value: f64) -> Result<f64> {
        self.start_mean(value)?.value()
    }

    /// [`mean_scalar`](Self::mean_scalar), started: the training step waits
    /// for it after the backward pass, so that it costs no time of its own.
    pub(crate) fn start_mean(&self, value: f64) -> Result<PendingMean> {
        start_mean(&self.group, value)
    }

    /// The error of a backward pass that failed while the reducer was
    /// averaging its gradients: a rank gone is named (see
    /// [`ProcessGroup`]'s collectives).
    pub(crate) fn backward_error(&self, error: Error) -> Error {
        let cause = error.display_chain().to_string();
        self.group
            .diagnose("backward (gradient all-reduce)", &cause)
    }

    fn reducer_error(&self, e: cxx::Exception) -> Error {
        let message = e.what();
        if message.contains("find_unused_parameters") {
            Error::distributed(
                "DistributedDataParallel",
                format!(
                    "a parameter got no gradient in the last step; set \
                     DistributedOptions::find_unused_parameters (DDP's argument) if the \
                     model does not use every parameter in every step. c10d said: {message}"
                ),
            )
        } else {
            c10d_error("DDP's gradient reducer", e)
        }
    }
}

/// `options.bucket_cap_mb` in bytes; not a positive size is an error naming it.
pub(crate) fn bucket_cap_bytes(options: &DistributedOptions) -> Result<i64> {
    let cap = (options.bucket_cap_mb * 1024.0 * 1024.0).round();
    if !(cap >= 1.0 && cap < i64::MAX as f64) {
        return Err(Error::invalid_argument(
            "bucket_cap_mb",
            format!("must be positive, got {}", options.bucket_cap_mb),
        ));
    }
    Ok(cap as i64)
}

/// What every data-parallel strategy does first, as DDP does: checks that
/// every rank's parameters that require gradients have rank 0's count, shapes
/// and dtypes, then gives every rank rank 0's parameters and buffers (in
/// place). Returns the parameters that require gradients.
pub(crate) fn take_rank_zeros_model<'a>(
    group: &ProcessGroup,
    strategy: &str,
    params: &'a [(String, Tensor)],
    buffers: &[(String, Tensor)],
) -> Result<Vec<&'a (String, Tensor)>> {
    let trained: Vec<&(String, Tensor)> =
        params.iter().filter(|(_, t)| t.requires_grad()).collect();
    if trained.is_empty() {
        return Err(Error::distributed(
            strategy,
            "the model has no parameter that requires a gradient",
        ));
    }
    let tensors: Vec<&Tensor> = trained.iter().map(|(_, t)| t).collect();
    let list = tensor_list(&tensors);
    group.with(|g| g.verify_same_tensors(&list)).map_err(|e| {
        Error::distributed(
            strategy,
            format!(
                "rank {} does not have rank 0's parameters (count, shapes or dtypes): {}",
                group.rank(),
                e.what()
            ),
        )
    })?;
    // Rank 0's model, to every rank: parameters then buffers.
    let state: Vec<&Tensor> = params.iter().chain(buffers).map(|(_, t)| t).collect();
    tch::no_grad(|| group.broadcast_coalesced(&state, BROADCAST_BUCKET_BYTES, 0))?;
    Ok(trained)
}

/// Checks that the model of `params` is where `group` reduces: Gloo for CPU
/// tensors, NCCL for CUDA ones.
pub(crate) fn check_device_suits_group(
    group: &ProcessGroup,
    params: &[(String, Tensor)],
) -> Result<()> {
    let Some((_, first)) = params.first() else {
        return Ok(());
    };
    let device = device_from_tch(first.device())?;
    if device.is_cuda() != group.has_nccl() {
        return Err(Error::invalid_argument(
            "distributed.backend",
            format!(
                "the model is on {device} but the group's backend is {}: Gloo for CPU \
                 training, NCCL for CUDA",
                if group.has_nccl() { "nccl" } else { "gloo" }
            ),
        ));
    }
    Ok(())
}

/// Buffers (batch-norm statistics) from rank 0 to every rank.
pub(crate) fn broadcast_buffers(group: &ProcessGroup, buffers: &[Tensor]) -> Result<()> {
    if buffers.is_empty() {
        return Ok(());
    }
    let buffers: Vec<&Tensor> = buffers.iter().collect();
    tch::no_grad(|| group.broadcast_coalesced(&buffers, BROADCAST_BUCKET_BYTES, 0))
}

/// The `norm_type`-norm of every rank's gradients from this rank's `local`
/// norm of its shard: the ranks' norms combined (the largest for the
/// infinity norm), in one 8-byte all-reduce.
pub(crate) fn norm_over_shards(group: &ProcessGroup, local: f64, norm_type: f64) -> Result<f64> {
    if norm_type.is_infinite() {
        let mut v = [local];
        group.all_reduce_f64(&mut v, ReduceOp::Max)?;
        return Ok(v[0]);
    }
    let mut v = [local.powf(norm_type)];
    group.all_reduce_f64(&mut v, ReduceOp::Sum)?;
    Ok(v[0].powf(1.0 / norm_type))
}

/// Starts the mean of a scalar over the ranks.
pub(crate) fn start_mean(group: &Arc<ProcessGroup>, value: f64) -> Result<PendingMean> {
    let t = Tensor::f_from_slice(&[value]).map_err(|e| torch_error("loss mean", e))?;
    Ok(PendingMean(group.all_reduce_start(&t, ReduceOp::Mean)?))
}

impl DistributedDataParallel {
    /// DDP over `group` for `module` (any torch module: a built model, a
    /// TorchScript module, `tch` code, a chain): checks that the module's device
    /// suits the group (Gloo for CPU, NCCL for CUDA), then [`new`](Self::new)
    /// over its parameters (every one rank 0's; those that require gradients
    /// reduced) and buffers. Call it after setting the module's precision and
    /// freezing, before building its optimizer, on every rank.
    pub fn of<M: Module<TorchBackend> + ?Sized>(
        group: Arc<ProcessGroup>,
        module: &M,
        options: &DistributedOptions,
    ) -> Result<Self> {
        let params = module.named_parameters()?;
        check_device_suits_group(&group, &params)?;
        Self::new(group, &params, &module.named_buffers()?, options)
    }
}

/// DDP's part in the one torch step (`kiln_torch::train`): rank 0's buffers and
/// the reducer's bookkeeping before the forward pass; the loss mean started and
/// the gradients hooked before the backward pass, which averages them in
/// buckets as it runs; the mean waited for after it. Micro-batches that do not
/// apply run as DDP's `no_sync()`.
impl StepHooks<TorchBackend> for DistributedDataParallel {
    fn name(&self) -> &str {
        "DataParallel"
    }

    fn agrees_on_loss(&self) -> bool {
        true
    }

    fn before_forward(&mut self, sync: bool) -> Result<()> {
        self.pending_loss = None;
        DistributedDataParallel::before_forward(self, sync)
    }

    fn before_backward(&mut self, local_loss: f64, scaled: &Tensor, sync: bool) -> Result<()> {
        self.pending_loss = Some(self.start_mean(local_loss)?);
        self.after_forward(scaled, sync)
    }

    fn backward_failed(&mut self, error: Error, sync: bool) -> Error {
        if sync {
            self.backward_error(error)
        } else {
            error
        }
    }

    fn agreed_loss(&mut self, local_loss: f64) -> Result<f64> {
        match self.pending_loss.take() {
            Some(pending) => pending.value(),
            // A step that did not start the mean: every rank takes this path.
            None => self.mean_scalar(local_loss),
        }
    }

    fn sync_buffers(&mut self) -> Result<()> {
        DistributedDataParallel::sync_buffers(self)
    }

    fn collectives(&self) -> Option<Arc<dyn Collectives>> {
        Some(Arc::clone(&self.group) as Arc<dyn Collectives>)
    }
}
