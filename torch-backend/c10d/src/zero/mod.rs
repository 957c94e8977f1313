//! ZeRO (the Zero Redundancy Optimizer's stages 1 and 2) on c10d: every rank
//! keeps the whole model but only its shard of the optimizer state (stage 1)
//! and of the reduced gradients (stage 2), as PyTorch's
//! `ZeroRedundancyOptimizer` and DeepSpeed's stages do.

use std::collections::BTreeSet;
use std::sync::Arc;

use kiln_core::backend::Trainable;
use kiln_core::distributed::{Collectives, DistributedOptions, ReduceOp};
use kiln_core::module::Module;
use kiln_core::optim::{OptimizerConfig, ParamGroup};
use kiln_core::strategy::{DataParallel, StepHooks, Strategy};
use kiln_core::{Error, Result};
use kiln_torch::torch_error;
use kiln_torch::{TorchBackend, TorchOptimizer};
use tch::Tensor;

mod optimizer;

pub use kiln_core::strategy::{partition, ZeroStage};
pub use optimizer::ShardedOptimizer;

use crate::ddp::{
    broadcast_buffers, bucket_cap_bytes, check_device_suits_group, norm_over_shards, start_mean,
    take_rank_zeros_model, PendingMean,
};
use crate::step_shared::StepShared;
use crate::{DistributedDataParallel, ProcessGroup};

/// Which rank owns which parameter, and where it sits in its owner's flat
/// segment: parameters, largest first, each to the rank owning the fewest
/// elements so far (`ZeroRedundancyOptimizer`'s partition), so that every
/// parameter's optimizer state lives on exactly one rank.
#[derive(Debug)]
pub struct Shards {
    group: Arc<ProcessGroup>,
    names: Vec<String>,
    params: StepShared<Vec<Tensor>>,
    owner: Vec<usize>,
    /// Each parameter's offset in its owner's segment, in elements.
    offset: Vec<i64>,
    /// The elements of the largest rank's share: every segment is padded to it.
    segment: i64,
    /// The bytes of the flat buffer of one reduce-scatter or all-gather
    /// (`DistributedOptions::bucket_cap_mb`): gradients and parameters move
    /// window by window, so that no rank ever holds a second copy of them all.
    window_bytes: i64,
}

impl Shards {
    /// The shards of `trained` (the module's parameters that require
    /// gradients, in model order) over `group`. They must share one dtype and
    /// one device: the flat collectives move them together.
    fn new(
        group: Arc<ProcessGroup>,
        trained: &[&(String, Tensor)],
        options: &DistributedOptions,
    ) -> Result<Self> {
        let window_bytes = bucket_cap_bytes(options)?;
        let first = &trained[0].1;
        for (name, t) in trained {
            if t.kind() != first.kind() || t.device() != first.device() {
                return Err(Error::unsupported(format!(
                    "ZeRO over parameters of more than one dtype or device: `{name}` is {:?} \
                     on {:?}, `{}` is {:?} on {:?}",
                    t.kind(),
                    t.device(),
                    trained[0].0,
                    first.kind(),
                    first.device()
                )));
            }
        }
        let sizes: Vec<i64> = trained.iter().map(|(_, t)| t.numel() as i64).collect();
        let world = group.world_size();
        let owner = partition(&sizes, world);
        let mut fill = vec![0i64; world];
        let mut offset = Vec::with_capacity(sizes.len());
        for (size, &rank) in sizes.iter().zip(&owner) {
            offset.push(fill[rank]);
            fill[rank] += size;
        }
        let segment = fill.iter().copied().max().unwrap_or(0).max(1);
        Ok(Shards {
            group,
            names: trained.iter().map(|(n, _)| n.clone()).collect(),
            params: StepShared::new(trained.iter().map(|(_, t)| t.shallow_clone()).collect()),
            owner,
            offset,
            segment,
            window_bytes,
        })
    }

    fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Whether this rank owns parameter `i`.
    fn owns(&self, i: usize) -> bool {
        self.owner[i] == self.rank()
    }

    /// The names of the parameters this rank owns.
    pub fn owned_names(&self) -> BTreeSet<&str> {
        (0..self.names.len())
            .filter(|&i| self.owns(i))
            .map(|i| self.names[i].as_str())
            .collect()
    }

    /// The elements of every rank's share, rank by rank.
    pub fn shares(&self) -> Vec<i64> {
        let mut shares = vec![0; self.group.world_size()];
        for (p, &rank) in self.params.iter().zip(&self.owner) {
            shares[rank] += p.numel() as i64;
        }
        shares
    }

    fn flat(&self, elements: i64) -> Result<Tensor> {
        let first = &self.params[0];
        Tensor::f_zeros([elements], (first.kind(), first.device()))
            .map_err(|e| torch_error("ZeRO's flat buffer", e))
    }

    /// Elements of each rank's segment one collective moves: its flat buffer
    /// holds the world size times as many, `window_bytes` in all.
    fn window(&self) -> i64 {
        let world = self.group.world_size() as i64;
        let element = self.params[0].kind().elt_size_in_bytes() as i64;
        (self.window_bytes / element / world).max(1)
    }

    /// The windows `[a, b)` of the segments, in order: one collective each.
    fn windows(&self) -> Vec<(i64, i64)> {
        let w = self.window();
        let mut out = Vec::new();
        let mut a = 0;
        while a < self.segment {
            out.push((a, (a + w).min(self.segment)));
            a += w;
        }
        out
    }

    /// The parts of the parameters that lie in window `[a, b)` of their
    /// owners' segments: (parameter, the part's first element in it, its place
    /// in the window, its length).
    fn pieces(&self, a: i64, b: i64) -> Vec<(usize, i64, i64, i64)> {
        let mut out = Vec::new();
        for (i, p) in self.params.iter().enumerate() {
            let (o, n) = (self.offset[i], p.numel() as i64);
            let (lo, hi) = (a.max(o), b.min(o + n));
            if lo < hi {
                out.push((i, lo - o, lo - a, hi - lo));
            }
        }
        out
    }

    /// Every rank's updated parameters on every rank: each rank's segment of
    /// owned parameters, all-gathered window by window into the parameters.
    fn gather_parameters(&self) -> Result<()> {
        let fail = |e| torch_error("ZeRO's parameter all-gather", e);
        let world = self.group.world_size() as i64;
        tch::no_grad(|| {
            for (a, b) in self.windows() {
                let w = b - a;
                let pieces = self.pieces(a, b);
                let mine = self.flat(w)?;
                for &(i, from, at, len) in pieces.iter().filter(|p| self.owns(p.0)) {
                    mine.narrow(0, at, len)
                        .f_copy_(&self.params[i].reshape([-1]).narrow(0, from, len))
                        .map_err(fail)?;
                }
                let whole = self.flat(w * world)?;
                self.group.all_gather_into(&whole, &mine)?;
                for &(i, from, at, len) in pieces.iter().filter(|p| !self.owns(p.0)) {
                    let start = self.owner[i] as i64 * w + at;
                    self.params[i]
                        .view([-1])
                        .narrow(0, from, len)
                        .f_copy_(&whole.narrow(0, start, len))
                        .map_err(fail)?;
                }
            }
            Ok(())
        })
    }
}

/// The [`StepHooks`] of a ZeRO stage over one module's parameters: see
/// [`ZeroStage`] for what each stage reduces and when. The loss is averaged
/// over the ranks and buffers come from rank 0, as under DDP; clipping by norm
/// takes the norm over every rank's shard. Private: alone, as a replicating
/// strategy, it would train with an unsharded optimizer.
struct ZeroHooks {
    stage: ZeroStage,
    shards: Arc<Shards>,
    /// ZeRO-1's gradient all-reduce: DDP's reducer.
    ddp: Option<DistributedDataParallel>,
    buffers: Vec<Tensor>,
    broadcast_buffers: bool,
    pending_loss: Option<PendingMean>,
    /// ZeRO-2: the sum of this rank's reduced shards of the micro-batches not
    /// yet applied (gradient accumulation).
    accumulated: Option<Tensor>,
    /// ZeRO-2: sets the gradients of the parameters this rank does not own
    /// to none (frees them).
    drop_others: tch::COptimizer,
}

impl std::fmt::Debug for ZeroHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroHooks")
            .field("stage", &self.stage)
            .field("shares", &self.shards.shares())
            .finish_non_exhaustive()
    }
}

impl ZeroHooks {
    fn of<M: Module<TorchBackend> + ?Sized>(
        group: Arc<ProcessGroup>,
        module: &M,
        stage: ZeroStage,
        options: &DistributedOptions,
    ) -> Result<Self> {
        let params = module.named_parameters()?;
        let buffers = module.named_buffers()?;
        let ddp = match stage {
            ZeroStage::One => Some(DistributedDataParallel::of(
                Arc::clone(&group),
                module,
                options,
            )?),
            ZeroStage::Two => {
                check_device_suits_group(&group, &params)?;
                take_rank_zeros_model(&group, stage.name(), &params, &buffers)?;
                None
            }
        };
        let trained: Vec<&(String, Tensor)> =
            params.iter().filter(|(_, t)| t.requires_grad()).collect();
        let shards = Arc::new(Shards::new(Arc::clone(&group), &trained, options)?);
        let mut drop_others = tch::COptimizer::sgd(0.0, 0.0, 0.0, 0.0, false)
            .map_err(|e| torch_error("creating ZeRO's gradient reset", e))?;
        for (i, p) in shards.params.iter().enumerate() {
            if !shards.owns(i) {
                drop_others
                    .add_parameters(p, 0)
                    .map_err(|e| torch_error("creating ZeRO's gradient reset", e))?;
            }
        }
        log::info!(
            "{}: rank {} of {} owns {} of {} parameter elements",
            stage.name(),
            group.rank(),
            group.world_size(),
            shards.shares()[group.rank()],
            shards.shares().iter().sum::<i64>()
        );
        Ok(ZeroHooks {
            stage,
            shards,
            ddp,
            buffers: buffers.iter().map(|(_, t)| t.shallow_clone()).collect(),
            broadcast_buffers: options.broadcast_buffers,
            pending_loss: None,
            accumulated: None,
            drop_others,
        })
    }

    /// ZeRO-2, after a backward pass: every rank's gradients reduce-scattered,
    /// this rank's shard kept (added up over the micro-batches that do not
    /// apply, written into its parameters' `.grad` on the one that does), the
    /// other gradients freed.
    fn reduce_scatter_gradients(&mut self, sync: bool) -> Result<()> {
        let shards = Arc::clone(&self.shards);
        let fail = |e| torch_error("ZeRO-2's gradient reduce-scatter", e);
        let world = shards.group.world_size() as i64;
        let mine = tch::no_grad(|| {
            let grads: Vec<Tensor> = shards
                .params
                .iter()
                .map(|p| {
                    let g = p.grad();
                    if g.defined() {
                        g.reshape([-1])
                    } else {
                        g
                    }
                })
                .collect();
            let mine = shards.flat(shards.segment)?;
            for (a, b) in shards.windows() {
                let w = b - a;
                let whole = shards.flat(w * world)?;
                for (i, from, at, len) in shards.pieces(a, b) {
                    if grads[i].defined() {
                        let start = shards.owner[i] as i64 * w + at;
                        whole
                            .narrow(0, start, len)
                            .f_copy_(&grads[i].narrow(0, from, len))
                            .map_err(fail)?;
                    }
                }
                // `whole` was built for this call only: reduced in place.
                shards
                    .group
                    .reduce_scatter_owned(&mine.narrow(0, a, w), whole, ReduceOp::Mean)?;
            }
            Ok::<_, Error>(mine)
        })?;
        self.drop_others.zero_grad().map_err(fail)?;
        let total = match self.accumulated.take() {
            Some(sum) => sum.f_add(&mine).map_err(fail)?,
            None => mine,
        };
        tch::no_grad(|| {
            for (i, p) in shards.params.iter().enumerate() {
                if !shards.owns(i) {
                    continue;
                }
                let mut grad = p.grad();
                if !grad.defined() {
                    continue;
                }
                if sync {
                    let part = total.narrow(0, shards.offset[i], p.numel() as i64);
                    grad.f_copy_(&part.view_(p.size())).map_err(fail)?;
                } else {
                    // The next backward pass adds this rank's next gradient here.
                    let _ = grad.f_zero_().map_err(fail)?;
                }
            }
            Ok::<_, Error>(())
        })?;
        if !sync {
            self.accumulated = Some(total);
        }
        Ok(())
    }
}

impl StepHooks<TorchBackend> for ZeroHooks {
    fn name(&self) -> &str {
        self.stage.name()
    }

    fn agrees_on_loss(&self) -> bool {
        true
    }

    fn before_forward(&mut self, sync: bool) -> Result<()> {
        if let Some(ddp) = self.ddp.as_mut() {
            return StepHooks::before_forward(ddp, sync);
        }
        self.pending_loss = None;
        if self.broadcast_buffers {
            broadcast_buffers(&self.shards.group, &self.buffers)?;
        }
        Ok(())
    }

    fn before_backward(&mut self, local_loss: f64, scaled: &Tensor, sync: bool) -> Result<()> {
        if let Some(ddp) = self.ddp.as_mut() {
            return ddp.before_backward(local_loss, scaled, sync);
        }
        self.pending_loss = Some(start_mean(&self.shards.group, local_loss)?);
        Ok(())
    }

    fn backward_failed(&mut self, error: Error, sync: bool) -> Error {
        if let Some(ddp) = self.ddp.as_mut() {
            return ddp.backward_failed(error, sync);
        }
        error
    }

    fn after_backward(&mut self, sync: bool) -> Result<()> {
        match self.stage {
            ZeroStage::One => Ok(()),
            ZeroStage::Two => self.reduce_scatter_gradients(sync),
        }
    }

    fn agreed_loss(&mut self, local_loss: f64) -> Result<f64> {
        if let Some(ddp) = self.ddp.as_mut() {
            return ddp.agreed_loss(local_loss);
        }
        match self.pending_loss.take() {
            Some(pending) => pending.value(),
            None => start_mean(&self.shards.group, local_loss)?.value(),
        }
    }

    /// ZeRO-1's gradients are whole on every rank; ZeRO-2's norm is the
    /// `norm_type`-norm of the ranks' norms (the largest for the infinity norm).
    fn global_grad_norm(&mut self, local: f64, norm_type: f64) -> Result<f64> {
        if self.stage == ZeroStage::One {
            return Ok(local);
        }
        norm_over_shards(&self.shards.group, local, norm_type)
    }

    fn after_update(&mut self) -> Result<()> {
        self.shards.gather_parameters()
    }

    fn skipped(&mut self) -> Result<()> {
        match self.ddp.as_mut() {
            Some(ddp) => ddp.skipped(),
            None => Ok(()),
        }
    }

    fn sync_buffers(&mut self) -> Result<()> {
        broadcast_buffers(&self.shards.group, &self.buffers)
    }

    fn collectives(&self) -> Option<Arc<dyn Collectives>> {
        Some(Arc::clone(&self.shards.group) as Arc<dyn Collectives>)
    }
}

/// ZeRO stage 1 or 2 as a [`Strategy`]: every rank holds the whole module
/// and trains it on its share of each batch, as under
/// [`DistributedDataParallel`], but its optimizer ([`ShardedOptimizer`])
/// keeps only this rank's share of the state, and under ZeRO-2 only this
/// rank's share of the reduced gradients outlives the step. Losses and
/// weights equal one process's on the global batch.
///
/// Build the wrapped module with [`zero_data_parallel`](crate::zero_data_parallel).
#[derive(Debug)]
pub struct ZeroRedundancy {
    hooks: ZeroHooks,
}

/// A module trained under a ZeRO stage.
pub type ZeroDataParallel<M> = DataParallel<M, ZeroRedundancy>;

impl ZeroRedundancy {
    /// ZeRO `stage` over `group` for `module`: rank 0's parameters and buffers
    /// on every rank now, and the parameters that require gradients assigned
    /// to owners. Call it on every rank, after setting precision and
    /// freezing, before building the optimizer.
    pub fn of<M: Module<TorchBackend> + ?Sized>(
        group: Arc<ProcessGroup>,
        module: &M,
        stage: ZeroStage,
        options: &DistributedOptions,
    ) -> Result<Self> {
        let hooks = ZeroHooks::of(group, module, stage, options)?;
        Ok(ZeroRedundancy { hooks })
    }

    /// The stage.
    pub fn stage(&self) -> ZeroStage {
        self.hooks.stage
    }

    /// The partition of the parameters over the ranks.
    pub fn shards(&self) -> &Arc<Shards> {
        &self.hooks.shards
    }
}

impl<M: Trainable<TorchBackend, Optim = TorchOptimizer>> Strategy<TorchBackend, M>
    for ZeroRedundancy
{
    type Optim = ShardedOptimizer;

    fn name(&self) -> &str {
        self.hooks.stage.name()
    }

    /// This rank's share of the optimizer, groups resolved over every
    /// parameter. `16-mixed` loss scaling is refused: each rank would decide
    /// to skip a step from its own share of the gradients.
    fn build_optimizer(
        &self,
        module: &M,
        config: &OptimizerConfig,
        groups: &[ParamGroup],
    ) -> Result<ShardedOptimizer> {
        if module.precision().scales_loss() {
            return Err(Error::unsupported(format!(
                "{} with {} (its loss scaling skips steps by each rank's own \
                 gradients); use bf16-mixed",
                self.hooks.stage.name(),
                module.precision()
            )));
        }
        ShardedOptimizer::new(config, groups, Arc::clone(&self.hooks.shards))
    }

    fn step_parts<'a>(
        &'a mut self,
        optimizer: &'a mut ShardedOptimizer,
    ) -> (&'a mut TorchOptimizer, &'a mut dyn StepHooks<TorchBackend>) {
        (&mut optimizer.inner, &mut self.hooks)
    }

    fn sync_buffers(&mut self) -> Result<()> {
        StepHooks::sync_buffers(&mut self.hooks)
    }

    fn collectives(&self) -> Option<Arc<dyn Collectives>> {
        StepHooks::collectives(&self.hooks)
    }
}
