//! Strategies: how a training step is spread over processes, as wrappers
//! around a trainable module (Burn's learner strategies, PyTorch's DDP and FSDP
//! wrappers). The module knows nothing of ranks: its step calls a strategy's
//! [`StepHooks`] at fixed points, and the strategy does its collectives there.
//!
//! | hook | called | data parallelism (DDP) does |
//! |---|---|---|
//! | [`before_forward`](StepHooks::before_forward) | before each micro-batch's forward pass | rank 0's buffers; the reducer's bookkeeping |
//! | [`before_backward`](StepHooks::before_backward) | eager engines, loss known, before `backward` | starts the loss mean; hooks the gradients |
//! | [`backward_failed`](StepHooks::backward_failed) | the backward pass failed | names the rank that died |
//! | [`after_backward`](StepHooks::after_backward) | eager engines, after a `backward` that succeeded | (ZeRO-2: reduce-scatters the gradients, keeps its shard) |
//! | [`agreed_loss`](StepHooks::agreed_loss) | after `backward` | the loss averaged over the ranks |
//! | [`global_grad_norm`](StepHooks::global_grad_norm) | clipping by norm, this rank's gradients' norm known | (ZeRO-2: the norm over every rank's shard) |
//! | [`after_update`](StepHooks::after_update) | after the optimizer step | (ZeRO: every rank's updated parameters, gathered) |
//! | [`reduce_flat`](StepHooks::reduce_flat) | graph engines, gradients fetched as one vector | averages them (and the loss) in place |
//! | [`skipped`](StepHooks::skipped) | the agreed loss is not finite, nothing applied | undoes `before_forward` |
//! | [`sync_buffers`](StepHooks::sync_buffers) | before evaluating | rank 0's buffers |
//! | [`start_at_step`](StepHooks::start_at_step) | training starts or resumes | (post-local SGD: its step counter) |
//!
//! A [`Strategy`] is those hooks with the optimizer a module trains with and
//! what the strategy changes of the module's view of its state; the one
//! [`DataParallel`] wrapper implements [`Module`] and [`Trainable`] over any
//! of them. Every [`StepHooks`] is a strategy that replicates the module (DDP);
//! the sharded ones (ZeRO's stages, FSDP) are types of their own. No model
//! type changes.
//!
//! ```
//! use kiln_core::backend::Backend;
//! use kiln_core::strategy::StepHooks;
//! use kiln_core::Result;
//!
//! /// Counts the micro-batches whose gradients would be synchronised.
//! #[derive(Default)]
//! struct CountSyncs(usize);
//!
//! impl<B: Backend> StepHooks<B> for CountSyncs {
//!     fn name(&self) -> &str {
//!         "counting"
//!     }
//!     fn before_forward(&mut self, sync: bool) -> Result<()> {
//!         self.0 += usize::from(sync);
//!         Ok(())
//!     }
//! }
//! ```

use std::sync::Arc;

use crate::backend::{Backend, Mode, StepLoss, StepPlan, Trainable, UpdatePlan};
use crate::distributed::Collectives;
use crate::error::{Error, Result};
use crate::loss::Loss;
use crate::module::Module;
use crate::objective::{Objective, ObjectiveBatch, ObjectiveEval, ObjectiveStep};
use crate::optim::{Optimizer, OptimizerConfig, ParamGroup};
use crate::precision::FloatPrecision;
use crate::state_dict::StateDict;
use crate::state_tensors::{ShardState, StateTensors};
use crate::tensor::HostTensor;

/// What a ZeRO strategy shards across the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroStage {
    /// ZeRO-1: the optimizer state. Gradients are all-reduced as DDP does
    /// (on libtorch, `c10d::Reducer` during the backward pass); each rank updates the
    /// parameters it owns, and the updated parameters are all-gathered.
    One,
    /// ZeRO-2: the optimizer state and the gradients. After each backward
    /// pass the gradients are reduce-scattered: each rank keeps the mean of
    /// the gradients of the parameters it owns and frees the others.
    Two,
}

impl ZeroStage {
    /// `"ZeRO-1"` or `"ZeRO-2"`.
    pub fn name(self) -> &'static str {
        match self {
            ZeroStage::One => "ZeRO-1",
            ZeroStage::Two => "ZeRO-2",
        }
    }
}

/// The owner of each of parameters of `sizes` elements over `world` ranks, as
/// PyTorch's `ZeroRedundancyOptimizer` partitions them: largest first (ties
/// in model order), each to the rank with the fewest elements so far (the
/// lowest such rank). Both backends' ZeRO strategies use it.
///
/// ```
/// use kiln_core::strategy::partition;
/// // 100 -> r0, 60 -> r1, 50 -> r1 (110), 10 -> r0 (110), 5 -> r0.
/// assert_eq!(partition(&[10, 100, 50, 60, 5], 2), vec![0, 0, 1, 1, 0]);
/// assert_eq!(partition(&[4, 4, 4], 3), vec![0, 1, 2]);
/// assert_eq!(partition(&[7], 4), vec![0]);
/// ```
pub fn partition(sizes: &[i64], world: usize) -> Vec<usize> {
    let world = world.max(1);
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(sizes[i]));
    let mut load = vec![0i64; world];
    let mut owner = vec![0; sizes.len()];
    for i in order {
        let rank = (0..world).min_by_key(|&r| load[r]).unwrap_or(0);
        owner[i] = rank;
        load[rank] += sizes[i];
    }
    owner
}

/// The points of one training micro-batch at which a strategy acts (see the
/// [module docs](self) for the table). Every hook has a default that does
/// nothing, so a single-process step runs with [`NoHooks`] unchanged.
///
/// `sync` is the micro-batch's [`StepPlan::apply`]: gradients are synchronised
/// on the micro-batches that apply, as DDP's `no_sync()` leaves the others local.
///
/// Contract: the hooks of a data-parallel strategy are collectives, so every
/// rank's step must call the same hooks in the same order; a step calls
/// [`agreed_loss`](Self::agreed_loss) or [`reduce_flat`](Self::reduce_flat)
/// on every micro-batch, finite loss or not.
pub trait StepHooks<B: Backend>: Send {
    /// What the strategy is called in messages (`"DataParallel"`).
    fn name(&self) -> &str;

    /// Whether the step must let the strategy see gradients: an engine that
    /// otherwise computes and applies them in one program (TensorFlow's fused
    /// step) fetches them instead, for [`reduce_flat`](Self::reduce_flat).
    fn needs_gradients(&self) -> bool {
        false
    }

    /// Whether every rank must see the same loss before deciding to apply it
    /// (the step then reads it back even when asked not to wait for it).
    fn agrees_on_loss(&self) -> bool {
        false
    }

    /// Before the forward pass of a micro-batch.
    fn before_forward(&mut self, sync: bool) -> Result<()> {
        let _ = sync;
        Ok(())
    }

    /// Eager engines: the micro-batch's loss is `local_loss` on this rank, and
    /// `scaled` (the loss times the accumulation and loss scales) is about to
    /// be differentiated.
    fn before_backward(&mut self, local_loss: f64, scaled: &B::Tensor, sync: bool) -> Result<()> {
        let _ = (local_loss, scaled, sync);
        Ok(())
    }

    /// The error to report for a backward pass that failed with `error`.
    fn backward_failed(&mut self, error: Error, sync: bool) -> Error {
        let _ = sync;
        error
    }

    /// Eager engines, after a backward pass that succeeded: the gradients are
    /// in the parameters' `.grad` (accumulated over the micro-batches so far).
    fn after_backward(&mut self, sync: bool) -> Result<()> {
        let _ = sync;
        Ok(())
    }

    /// Clipping by norm: the `norm_type`-norm of every rank's gradients, given
    /// `local`, this rank's (the same value unless gradients are sharded).
    fn global_grad_norm(&mut self, local: f64, norm_type: f64) -> Result<f64> {
        let _ = norm_type;
        Ok(local)
    }

    /// After the optimizer step of a micro-batch that applies.
    fn after_update(&mut self) -> Result<()> {
        Ok(())
    }

    /// Eager engines, after the backward pass: the loss every rank decides on
    /// (the mean over the ranks under data parallelism).
    fn agreed_loss(&mut self, local_loss: f64) -> Result<f64> {
        Ok(local_loss)
    }

    /// Graph engines: the micro-batch's gradients as one flat `f32` vector
    /// with the loss as its last element, reduced in place: the whole vector
    /// when `sync`, else only the loss.
    fn reduce_flat(&mut self, flat: &mut [f32], sync: bool) -> Result<()> {
        let _ = (flat, sync);
        Ok(())
    }

    /// The agreed loss was not finite and nothing was applied: undo what
    /// [`before_forward`](Self::before_forward) changed (buffers).
    fn skipped(&mut self) -> Result<()> {
        Ok(())
    }

    /// Gives every rank rank 0's buffers (before evaluating). A collective.
    fn sync_buffers(&mut self) -> Result<()> {
        Ok(())
    }

    /// The optimizer steps taken when training starts or resumes
    /// ([`Trainable::start_at_step`]): a strategy whose schedule counts
    /// steps sets its counter from it.
    fn start_at_step(&mut self, step: u64) -> Result<()> {
        let _ = step;
        Ok(())
    }

    /// The ranks this strategy spans, if it spans any.
    fn collectives(&self) -> Option<Arc<dyn Collectives>> {
        None
    }
}

impl<B: Backend> StepHooks<B> for Box<dyn StepHooks<B>> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn needs_gradients(&self) -> bool {
        (**self).needs_gradients()
    }
    fn agrees_on_loss(&self) -> bool {
        (**self).agrees_on_loss()
    }
    fn before_forward(&mut self, sync: bool) -> Result<()> {
        (**self).before_forward(sync)
    }
    fn before_backward(&mut self, local_loss: f64, scaled: &B::Tensor, sync: bool) -> Result<()> {
        (**self).before_backward(local_loss, scaled, sync)
    }
    fn backward_failed(&mut self, error: Error, sync: bool) -> Error {
        (**self).backward_failed(error, sync)
    }
    fn after_backward(&mut self, sync: bool) -> Result<()> {
        (**self).after_backward(sync)
    }
    fn agreed_loss(&mut self, local_loss: f64) -> Result<f64> {
        (**self).agreed_loss(local_loss)
    }
    fn global_grad_norm(&mut self, local: f64, norm_type: f64) -> Result<f64> {
        (**self).global_grad_norm(local, norm_type)
    }
    fn after_update(&mut self) -> Result<()> {
        (**self).after_update()
    }
    fn reduce_flat(&mut self, flat: &mut [f32], sync: bool) -> Result<()> {
        (**self).reduce_flat(flat, sync)
    }
    fn skipped(&mut self) -> Result<()> {
        (**self).skipped()
    }
    fn sync_buffers(&mut self) -> Result<()> {
        (**self).sync_buffers()
    }
    fn start_at_step(&mut self, step: u64) -> Result<()> {
        (**self).start_at_step(step)
    }
    fn collectives(&self) -> Option<Arc<dyn Collectives>> {
        (**self).collectives()
    }
}

/// The hooks of a single process: none.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHooks;

impl<B: Backend> StepHooks<B> for NoHooks {
    fn name(&self) -> &str {
        "single process"
    }
}

/// How a training step is spread over ranks, around a module of type `M`:
/// the hooks its step calls, the optimizer it trains with, and what it changes
/// in the module's view of its state. [`DataParallel`] implements [`Module`]
/// and [`Trainable`] once, over any strategy, by asking it:
///
/// | strategy | optimizer | state |
/// |---|---|---|
/// | any [`StepHooks`] (DDP: kiln-c10d's `DistributedDataParallel`, kiln-tf's `GradientAllReduce`) | the module's own | the module's own |
/// | ZeRO-1/2 (kiln-c10d's and kiln-tf's `ZeroRedundancy`) | this rank's share of the state | the module's own |
/// | FSDP (kiln-c10d's `FullShard`) | over this rank's shards | gathered from the shards |
///
/// Every [`StepHooks`] is a strategy in which every rank holds the whole
/// module and its whole optimizer: that is data parallelism, and a
/// single-process [`NoHooks`]. A strategy with an optimizer of its own is a
/// type that is not itself [`StepHooks`] but holds some.
///
/// What has a default forwards to the module; a strategy overrides what it
/// changes, so a method a wrapper forgets cannot drift from the others.
pub trait Strategy<B: Backend, M: Trainable<B>>: Send {
    /// The optimizer a module trains with under this strategy.
    type Optim: Optimizer<B> + Send;

    /// What the strategy is called in messages and in the wrapper's
    /// [`kind`](Trainable::kind) (`"DataParallel"`, `"ZeRO-2"`, `"FSDP"`).
    fn name(&self) -> &str;

    /// The optimizer for `module`'s parameters in `groups`.
    fn build_optimizer(
        &self,
        module: &M,
        config: &OptimizerConfig,
        groups: &[ParamGroup],
    ) -> Result<Self::Optim>;

    /// The module's optimizer inside `optimizer`, and the hooks the module's
    /// step calls: what the default steps hand to
    /// [`Trainable::train_step_hooked`].
    fn step_parts<'a>(
        &'a mut self,
        optimizer: &'a mut Self::Optim,
    ) -> (&'a mut M::Optim, &'a mut dyn StepHooks<B>);

    /// One training micro-batch of `module` (see [`Trainable::train_step`]):
    /// the module's hooked step by default.
    fn train_step(
        &mut self,
        module: &mut M,
        optimizer: &mut Self::Optim,
        inputs: &B::Tensor,
        targets: &B::Tensor,
        plan: &StepPlan<'_>,
        deferred: bool,
    ) -> Result<StepLoss<B::Tensor>> {
        let (optimizer, hooks) = self.step_parts(optimizer);
        module.train_step_hooked(optimizer, inputs, targets, plan, hooks, deferred)
    }

    /// One training micro-batch of `objective` (see
    /// [`Trainable::train_objective_step`]): the module's hooked step by default.
    fn train_objective_step(
        &mut self,
        module: &mut M,
        optimizer: &mut Self::Optim,
        objective: &dyn Objective<B>,
        batch: &ObjectiveBatch<'_, B::Tensor>,
        plan: &UpdatePlan<'_>,
        deferred: bool,
    ) -> Result<ObjectiveStep<B::Tensor>> {
        let (optimizer, hooks) = self.step_parts(optimizer);
        module.train_objective_step_hooked(optimizer, objective, batch, plan, hooks, deferred)
    }

    /// Whether [`train_objective_step`](Self::train_objective_step) runs
    /// objectives other than a supervised loss.
    fn runs_any_objective(&self, module: &M) -> bool {
        module.runs_any_objective()
    }

    /// Before every pass outside a training step (a forward pass, an
    /// evaluation or prediction batch). A collective when parameters are
    /// sharded (FSDP gathers them).
    fn before_inference(&self) -> Result<()> {
        Ok(())
    }

    /// Gives every rank rank 0's buffers (before evaluating). A collective.
    fn sync_buffers(&mut self) -> Result<()>;

    /// The optimizer steps taken when training starts or resumes
    /// ([`Trainable::start_at_step`]); nothing by default.
    fn start_at_step(&mut self, step: u64) -> Result<()> {
        let _ = step;
        Ok(())
    }

    /// The ranks the strategy spans, if it spans any.
    fn collectives(&self) -> Option<Arc<dyn Collectives>>;

    /// The whole module's state dict.
    fn state_dict(&self, module: &M) -> Result<StateDict> {
        module.state_dict()
    }

    /// The whole module's state.
    fn state_tensors(&self, module: &M) -> Result<StateTensors<B>> {
        module.state_tensors()
    }

    /// Loads a whole module's state.
    fn load_state_dict(&mut self, module: &mut M, state: &StateDict) -> Result<()> {
        module.load_state_dict(state)
    }

    /// The whole module's parameter elements.
    fn num_parameters(&self, module: &M) -> Result<usize> {
        module.num_parameters()
    }

    /// The whole module's trained parameter elements.
    fn num_trainable_parameters(&self, module: &M) -> Result<usize> {
        module.num_trainable_parameters()
    }

    /// The whole module's names of the parameters that do not train.
    fn frozen_parameters(&self, module: &M) -> Result<Vec<String>> {
        module.frozen_parameters()
    }

    /// Whether parameters are sharded over the ranks
    /// ([`Trainable::shards_parameters`]).
    fn shards_parameters(&self) -> bool {
        false
    }

    /// This rank's part of the state when parameters are sharded
    /// ([`Trainable::shard_state_tensors`]).
    fn shard_state_tensors(&self, module: &M) -> Result<Option<ShardState<B>>> {
        module.shard_state_tensors()
    }
}

/// Replication: every rank holds the whole module and its optimizer, and the
/// hooks keep them identical (or there are no ranks: [`NoHooks`]).
impl<B, M, S> Strategy<B, M> for S
where
    B: Backend,
    M: Trainable<B>,
    S: StepHooks<B>,
{
    type Optim = M::Optim;

    fn name(&self) -> &str {
        StepHooks::name(self)
    }

    fn build_optimizer(
        &self,
        module: &M,
        config: &OptimizerConfig,
        groups: &[ParamGroup],
    ) -> Result<M::Optim> {
        module.build_optimizer(config, groups)
    }

    fn step_parts<'a>(
        &'a mut self,
        optimizer: &'a mut M::Optim,
    ) -> (&'a mut M::Optim, &'a mut dyn StepHooks<B>) {
        (optimizer, self)
    }

    fn sync_buffers(&mut self) -> Result<()> {
        StepHooks::sync_buffers(self)
    }

    fn start_at_step(&mut self, step: u64) -> Result<()> {
        StepHooks::start_at_step(self, step)
    }

    fn collectives(&self) -> Option<Arc<dyn Collectives>> {
        StepHooks::collectives(self)
    }
}

/// A module trained under a [`Strategy`] over ranks: data parallelism
/// (`DataParallel<M, DistributedDataParallel>` on libtorch,
/// `DataParallel<TfModel, GradientAllReduce>` on TensorFlow, with
/// `DistributedDataParallel`'s semantics: rank 0's parameters and buffers
/// when built, gradients averaged over the ranks before every update, the loss
/// averaged so that every rank takes the same decisions), ZeRO's stages and
/// FSDP. [`Module`] and [`Trainable`] are implemented here once, for every
/// strategy.
///
/// It is a [`Trainable`] like the module it wraps, so the `Trainer` and any
/// hand-written loop train it unchanged; parameters and state-dict names are
/// the module's own (no `module.` prefix).
///
/// Building it checks, by one typed query ([`Trainable::takes_step_hooks`]),
/// that the module's step calls the hooks; a module that cannot (a SavedModel
/// trained through its own `train` signature) is refused with
/// [`Error::Unsupported`].
#[derive(Debug)]
pub struct DataParallel<M, S> {
    module: M,
    strategy: S,
}

impl<M, S> DataParallel<M, S> {
    /// Wraps `module`, trained under `strategy` (built from the same module,
    /// which it has already made rank 0's).
    pub fn new<B: Backend>(module: M, strategy: S) -> Result<Self>
    where
        M: Trainable<B>,
        S: Strategy<B, M>,
    {
        if !module.takes_step_hooks() {
            return Err(Error::unsupported(format!(
                "{} cannot train under {}: its training step takes no strategy's hooks",
                module.kind(),
                strategy.name()
            )));
        }
        Ok(DataParallel { module, strategy })
    }

    /// The wrapped module. There is no mutable access: the strategy holds the
    /// module's tensors, so moving or converting them is done before wrapping.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The strategy.
    pub fn strategy(&self) -> &S {
        &self.strategy
    }

    /// The module, unwrapped.
    pub fn into_inner(self) -> M {
        self.module
    }
}

impl<B, M, S> Module<B> for DataParallel<M, S>
where
    B: Backend,
    M: Trainable<B>,
    S: Strategy<B, M>,
{
    fn forward(&self, input: &B::Tensor) -> Result<B::Tensor> {
        self.strategy.before_inference()?;
        self.module.forward(input)
    }
    fn forward_many(&self, inputs: &[B::Tensor]) -> Result<Vec<B::Tensor>> {
        self.strategy.before_inference()?;
        self.module.forward_many(inputs)
    }
    fn mode(&self) -> Mode {
        self.module.mode()
    }
    fn set_mode(&mut self, mode: Mode) {
        self.module.set_mode(mode);
    }
    /// This rank's parameters (under FSDP, its shards: what its optimizer updates).
    fn named_parameters(&self) -> Result<Vec<(String, B::Tensor)>> {
        self.module.named_parameters()
    }
    fn named_buffers(&self) -> Result<Vec<(String, B::Tensor)>> {
        self.module.named_buffers()
    }
    fn running_stats(&self) -> Result<Vec<crate::module::RunningStats>> {
        self.module.running_stats()
    }
    fn graph_def(&self) -> Result<Option<Vec<u8>>> {
        self.module.graph_def()
    }
    fn state_dict(&self) -> Result<StateDict> {
        self.strategy.state_dict(&self.module)
    }
    fn state_tensors(&self) -> Result<StateTensors<B>> {
        self.strategy.state_tensors(&self.module)
    }
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.strategy.load_state_dict(&mut self.module, state)
    }
    fn num_parameters(&self) -> Result<usize> {
        self.strategy.num_parameters(&self.module)
    }
    fn auxiliary_loss_names(&self) -> Vec<String> {
        self.module.auxiliary_loss_names()
    }
    fn add_auxiliary_losses(
        &self,
        loss: B::Tensor,
    ) -> Result<crate::module::WithAuxiliaryLosses<B::Tensor>> {
        self.module.add_auxiliary_losses(loss)
    }
}

impl<B, M, S> Trainable<B> for DataParallel<M, S>
where
    B: Backend,
    M: Trainable<B>,
    S: Strategy<B, M>,
{
    type Optim = S::Optim;

    fn build_optimizer(&self, config: &OptimizerConfig, groups: &[ParamGroup]) -> Result<S::Optim> {
        self.strategy.build_optimizer(&self.module, config, groups)
    }

    fn num_trainable_parameters(&self) -> Result<usize> {
        self.strategy.num_trainable_parameters(&self.module)
    }

    fn frozen_parameters(&self) -> Result<Vec<String>> {
        self.strategy.frozen_parameters(&self.module)
    }

    fn precision(&self) -> FloatPrecision {
        self.module.precision()
    }

    fn kind(&self) -> String {
        format!("{} ({})", self.strategy.name(), self.module.kind())
    }

    /// The module's step under the strategy: the loss averaged over the
    /// ranks; when that mean is not finite, parameters and optimizer state are
    /// unchanged on every rank.
    fn train_step(
        &mut self,
        optimizer: &mut S::Optim,
        inputs: &B::Tensor,
        targets: &B::Tensor,
        plan: &StepPlan<'_>,
    ) -> Result<f64> {
        self.strategy
            .train_step(&mut self.module, optimizer, inputs, targets, plan, false)?
            .value::<B>()
    }

    fn train_step_deferred(
        &mut self,
        optimizer: &mut S::Optim,
        inputs: &B::Tensor,
        targets: &B::Tensor,
        plan: &StepPlan<'_>,
    ) -> Result<StepLoss<B::Tensor>> {
        self.strategy
            .train_step(&mut self.module, optimizer, inputs, targets, plan, true)
    }

    fn train_objective_step(
        &mut self,
        optimizer: &mut S::Optim,
        objective: &dyn Objective<B>,
        batch: &ObjectiveBatch<'_, B::Tensor>,
        plan: &UpdatePlan<'_>,
        deferred: bool,
    ) -> Result<ObjectiveStep<B::Tensor>> {
        self.strategy.train_objective_step(
            &mut self.module,
            optimizer,
            objective,
            batch,
            plan,
            deferred,
        )
    }

    fn runs_any_objective(&self) -> bool {
        self.strategy.runs_any_objective(&self.module)
    }

    fn eval_objective(
        &self,
        objective: &dyn Objective<B>,
        batch: &ObjectiveBatch<'_, B::Tensor>,
    ) -> Result<ObjectiveEval> {
        self.strategy.before_inference()?;
        self.module.eval_objective(objective, batch)
    }

    fn eval_step(
        &self,
        loss: &Loss,
        inputs: &B::Tensor,
        targets: &B::Tensor,
    ) -> Result<(f64, HostTensor)> {
        self.strategy.before_inference()?;
        self.module.eval_step(loss, inputs, targets)
    }

    fn predict_step(&self, inputs: &B::Tensor) -> Result<HostTensor> {
        self.strategy.before_inference()?;
        self.module.predict_step(inputs)
    }

    fn sync_buffers(&mut self) -> Result<()> {
        self.strategy.sync_buffers()
    }

    fn start_at_step(&mut self, step: u64) -> Result<()> {
        self.strategy.start_at_step(step)
    }

    fn collectives(&self) -> Option<Arc<dyn Collectives>> {
        self.strategy.collectives()
    }

    fn shards_parameters(&self) -> bool {
        self.strategy.shards_parameters()
    }

    fn shard_state_tensors(&self) -> Result<Option<ShardState<B>>> {
        self.strategy.shard_state_tensors(&self.module)
    }
}
