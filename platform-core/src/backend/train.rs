//! What the trainer needs from a backend beyond [`Backend`].

use std::sync::Arc;

use crate::backend::Backend;
use crate::device::Device;
use crate::distributed::Collectives;
use crate::error::{Error, Result};
use crate::loss::Loss;
use crate::model::Layer;
use crate::module::Module;
use crate::objective::{Objective, ObjectiveBatch, ObjectiveEval, ObjectiveStep};
use crate::optim::{GradClip, Optimizer, OptimizerConfig, ParamGroup};
use crate::precision::FloatPrecision;
use crate::strategy::StepHooks;
use crate::tensor::HostTensor;

/// What one training micro-batch does, for [`Trainable::train_step`].
#[derive(Clone, Copy, Debug)]
pub struct StepPlan<'a> {
    /// The loss to minimise.
    pub loss: &'a Loss,
    /// Factor applied to the loss before differentiation (`1 / accumulate`
    /// with gradient accumulation, otherwise 1).
    pub scale: f64,
    /// Whether this micro-batch ends an accumulation: clip, then step the optimizer.
    pub apply: bool,
    /// Gradient clipping applied before the optimizer step (only when `apply`).
    pub clip: Option<&'a GradClip>,
}

impl<'a> StepPlan<'a> {
    /// What the plan asks of the update, without its loss.
    pub fn update(&self) -> UpdatePlan<'a> {
        UpdatePlan {
            scale: self.scale,
            apply: self.apply,
            clip: self.clip,
        }
    }
}

/// What a training micro-batch does with the loss an objective computes, for
/// [`Trainable::train_objective_step`]: [`StepPlan`] less its loss.
#[derive(Clone, Copy, Debug)]
pub struct UpdatePlan<'a> {
    /// Factor applied to the loss before differentiation (`1 / accumulate`
    /// with gradient accumulation, otherwise 1).
    pub scale: f64,
    /// Whether this micro-batch ends an accumulation: clip, then step the optimizer.
    pub apply: bool,
    /// Gradient clipping applied before the optimizer step (only when `apply`).
    pub clip: Option<&'a GradClip>,
}

impl<'a> UpdatePlan<'a> {
    /// The [`StepPlan`] that minimises `loss` this way.
    pub fn with_loss(&self, loss: &'a Loss) -> StepPlan<'a> {
        StepPlan {
            loss,
            scale: self.scale,
            apply: self.apply,
            clip: self.clip,
        }
    }
}

/// The loss of a training step as [`Trainable::train_step_deferred`] returns it:
/// already on the host, or still a one-element tensor on the device, read when
/// the caller needs the number, so that a GPU can run several steps ahead of the
/// host.
#[derive(Debug)]
pub enum StepLoss<T> {
    /// The value, already read.
    Host(f64),
    /// A one-element tensor holding the (unscaled) loss, detached from autograd.
    Device(T),
}

impl<T> StepLoss<T> {
    /// The value: the host's, or one read of the device tensor through `B`.
    pub fn value<B: Backend<Tensor = T>>(&self) -> Result<f64> {
        match self {
            StepLoss::Host(value) => Ok(*value),
            StepLoss::Device(tensor) => {
                let host = B::to_host(tensor)?;
                let value = host
                    .to_dtype(crate::dtype::DType::F64)
                    .as_slice::<f64>()?
                    .first()
                    .copied();
                value.ok_or_else(|| Error::ShapeMismatch {
                    context: "a step's loss".to_owned(),
                    expected: "one element".to_owned(),
                    actual: host.shape().to_string(),
                })
            }
        }
    }
}

/// A module the `Trainer` (in `kiln-train`) can train: it builds its optimizer
/// and runs training, evaluation and prediction steps on backend `B`.
///
/// Every model a backend offers implements it: on libtorch the models built
/// from [`Layer`] definitions, TorchScript models, `tch` code and chains of
/// them; on TensorFlow the built models and SavedModels with a training
/// signature. The steps are the unit of work: an eager engine runs them op by
/// op ([`EagerBackend`]'s provided `eager_*` steps, which any module can use),
/// a graph engine as one compiled program each, and a SavedModel through its
/// signatures.
///
/// ```
/// use kiln_core::{backend::{Backend, StepPlan, Trainable}, Result};
///
/// /// Trains any module of any backend for one micro-batch that applies.
/// fn one_step<B: Backend, M: Trainable<B>>(
///     model: &mut M,
///     optimizer: &mut M::Optim,
///     inputs: &B::Tensor,
///     targets: &B::Tensor,
///     plan: &StepPlan<'_>,
/// ) -> Result<f64> {
///     use kiln_core::optim::Optimizer;
///     optimizer.zero_grad()?;
///     model.train_step(optimizer, inputs, targets, plan)
/// }
/// ```
pub trait Trainable<B: Backend>: Module<B> + Send {
    /// The optimizer that updates this module.
    type Optim: Optimizer<B> + Send;

    /// Builds an optimizer over the parameters this module trains: those that
    /// require gradients (frozen parameters stay out, as PyTorch users build
    /// optimizers from `filter(lambda p: p.requires_grad, ...)`), grouped by
    /// `groups`.
    fn build_optimizer(
        &self,
        config: &OptimizerConfig,
        groups: &[ParamGroup],
    ) -> Result<Self::Optim>;

    /// Number of parameter elements the optimizer trains: all of them unless
    /// some are frozen ([`TrainBackend::freeze`]).
    fn num_trainable_parameters(&self) -> Result<usize> {
        self.num_parameters()
    }

    /// The names of the parameters the optimizer leaves alone (frozen ones,
    /// the base weights of a LoRA model); none unless some are frozen.
    fn frozen_parameters(&self) -> Result<Vec<String>> {
        Ok(Vec::new())
    }

    /// The precision the module computes in (`32-true` unless given another;
    /// see [`TrainBackend::set_precision`]).
    fn precision(&self) -> FloatPrecision {
        FloatPrecision::F32
    }

    /// One training micro-batch: forward in the module's mode, loss, gradients
    /// of `loss * plan.scale` (accumulated), and, when `plan.apply`, gradient
    /// clipping and one optimizer step. Returns the unscaled loss.
    ///
    /// Gradients accumulate across calls until
    /// [`Optimizer::zero_grad`], as in PyTorch: call it before the first
    /// micro-batch of each optimizer step (the trainer does). A backend may
    /// clear them itself after applying them.
    ///
    /// Contract: when the loss is not finite, nothing changes (no gradient is
    /// accumulated, no parameter or optimizer state is updated) and the value is
    /// returned for the caller to report. (Data-parallel torch training, which
    /// averages the loss over the ranks while the backward pass runs, leaves the
    /// parameters and optimizer state as they were but adds the gradients; a
    /// SavedModel's training signature updates the variables in the same run
    /// that computes the loss, so there a non-finite loss has been applied.)
    fn train_step(
        &mut self,
        optimizer: &mut Self::Optim,
        inputs: &B::Tensor,
        targets: &B::Tensor,
        plan: &StepPlan<'_>,
    ) -> Result<f64>;

    /// [`train_step`](Self::train_step) without waiting for the loss: an engine
    /// that runs asynchronously (libtorch on CUDA) returns it as
    /// [`StepLoss::Device`] and reads nothing back, so the host can queue the next
    /// step while the device computes this one. The `Trainer` reads the values
    /// when it logs them, before every checkpoint and at the end of each epoch.
    ///
    /// Contract: as `train_step`, except for a non-finite loss, which the step
    /// does not see: the update is applied (unless loss scaling skips it, see
    /// `16-mixed`), and the caller finds out when it reads the value. The
    /// default calls `train_step` and returns [`StepLoss::Host`].
    fn train_step_deferred(
        &mut self,
        optimizer: &mut Self::Optim,
        inputs: &B::Tensor,
        targets: &B::Tensor,
        plan: &StepPlan<'_>,
    ) -> Result<StepLoss<B::Tensor>> {
        self.train_step(optimizer, inputs, targets, plan)
            .map(StepLoss::Host)
    }

    /// One training micro-batch of `objective`: its
    /// [`compute`](Objective::compute) inside the step, then as
    /// [`train_step`](Self::train_step) (or, when `deferred`,
    /// [`train_step_deferred`](Self::train_step_deferred)) with its loss. What
    /// the `Trainer` calls.
    ///
    /// The default runs an objective that is a supervised loss
    /// ([`Objective::supervised_loss`]) through `train_step`, and refuses any
    /// other, naming it: what a module whose step is one compiled program
    /// (TensorFlow's) can do. Eager modules (libtorch's) run every objective.
    fn train_objective_step(
        &mut self,
        optimizer: &mut Self::Optim,
        objective: &dyn Objective<B>,
        batch: &ObjectiveBatch<'_, B::Tensor>,
        plan: &UpdatePlan<'_>,
        deferred: bool,
    ) -> Result<ObjectiveStep<B::Tensor>> {
        supervised_objective_step(objective, &self.kind(), plan, |plan| {
            if deferred {
                self.train_step_deferred(optimizer, batch.inputs, batch.targets, plan)
            } else {
                self.train_step(optimizer, batch.inputs, batch.targets, plan)
                    .map(StepLoss::Host)
            }
        })
    }

    /// [`train_objective_step`](Self::train_objective_step) with a strategy's
    /// [`StepHooks`], as [`train_step_hooked`](Self::train_step_hooked) is
    /// `train_step` with them. The default runs a supervised objective
    /// through `train_step_hooked` and refuses any other.
    fn train_objective_step_hooked(
        &mut self,
        optimizer: &mut Self::Optim,
        objective: &dyn Objective<B>,
        batch: &ObjectiveBatch<'_, B::Tensor>,
        plan: &UpdatePlan<'_>,
        hooks: &mut dyn StepHooks<B>,
        deferred: bool,
    ) -> Result<ObjectiveStep<B::Tensor>> {
        supervised_objective_step(objective, &self.kind(), plan, |plan| {
            self.train_step_hooked(
                optimizer,
                batch.inputs,
                batch.targets,
                plan,
                hooks,
                deferred,
            )
        })
    }

    /// `objective` on one evaluation batch, without gradients (in the
    /// module's current mode; the trainer sets eval mode). The default
    /// evaluates a supervised objective through
    /// [`eval_step`](Self::eval_step) and refuses any other.
    fn eval_objective(
        &self,
        objective: &dyn Objective<B>,
        batch: &ObjectiveBatch<'_, B::Tensor>,
    ) -> Result<ObjectiveEval> {
        let Some(loss) = objective.supervised_loss() else {
            return Err(objective_unsupported(objective, &self.kind()));
        };
        let (loss, outputs) = self.eval_step(loss, batch.inputs, batch.targets)?;
        Ok(ObjectiveEval {
            loss,
            outputs: Some(outputs),
            metrics: Vec::new(),
        })
    }

    /// Whether [`train_objective_step`](Self::train_objective_step) runs
    /// objectives other than a supervised loss: the query the trainer makes
    /// before the first step. `false` unless the module implements them.
    fn runs_any_objective(&self) -> bool {
        false
    }

    /// The loss value and the module's output on one batch, without gradients
    /// (the module's current mode is used; the trainer sets eval mode).
    fn eval_step(
        &self,
        loss: &Loss,
        inputs: &B::Tensor,
        targets: &B::Tensor,
    ) -> Result<(f64, HostTensor)>;

    /// The module's output on one batch, without gradients, on the host.
    fn predict_step(&self, inputs: &B::Tensor) -> Result<HostTensor>;

    /// Gives every rank rank 0's buffers when the module trains under a
    /// strategy that spans ranks ([`DataParallel`](crate::strategy::DataParallel));
    /// nothing otherwise (the default). A collective: every rank calls it. The
    /// trainer does before evaluating, so that every rank evaluates the same model.
    fn sync_buffers(&mut self) -> Result<()> {
        Ok(())
    }

    /// What this module is, in messages (`"a SavedModel trained through its train
    /// signature"`); the type's name unless given.
    fn kind(&self) -> String {
        std::any::type_name::<Self>().to_owned()
    }

    /// Whether [`train_step_hooked`](Self::train_step_hooked) calls a
    /// strategy's hooks: the one query a strategy such as
    /// [`DataParallel`](crate::strategy::DataParallel) makes before wrapping the
    /// module. `false` unless the module implements it.
    fn takes_step_hooks(&self) -> bool {
        false
    }

    /// [`train_step`](Self::train_step) (or, when `deferred`,
    /// [`train_step_deferred`](Self::train_step_deferred)) with a strategy's
    /// [`StepHooks`] called at their points: what a strategy wrapper calls. The
    /// loss returned is the one the hooks agreed on
    /// ([`StepHooks::agreed_loss`]); when it is not finite, parameters and
    /// optimizer state are unchanged.
    ///
    /// The default refuses: a module whose step cannot be hooked says so, and
    /// [`takes_step_hooks`](Self::takes_step_hooks) is `false` for it.
    fn train_step_hooked(
        &mut self,
        optimizer: &mut Self::Optim,
        inputs: &B::Tensor,
        targets: &B::Tensor,
        plan: &StepPlan<'_>,
        hooks: &mut dyn StepHooks<B>,
        deferred: bool,
    ) -> Result<StepLoss<B::Tensor>> {
        let _ = (optimizer, inputs, targets, plan, deferred);
        Err(Error::unsupported(format!(
            "{} under {}: its training step cannot be hooked",
            self.kind(),
            hooks.name()
        )))
    }

    /// The ranks this module trains across, when a strategy spans several
    /// (the trainer adds metrics up over them); `None` for a single process.
    fn collectives(&self) -> Option<Arc<dyn Collectives>> {
        None
    }

    /// Tells the module how many optimizer steps training has taken when it
    /// starts or resumes (`0`, or a checkpoint's step): what a strategy whose
    /// schedule counts steps needs (post-local SGD's warm-up and averaging
    /// period). The trainer calls it before the first step; nothing by default.
    fn start_at_step(&mut self, step: u64) -> Result<()> {
        let _ = step;
        Ok(())
    }

    /// Whether the module's parameters are sharded over its ranks (full
    /// sharding): then every forward pass, evaluation's included, and
    /// [`Module::state_tensors`](crate::module::Module::state_tensors) (which
    /// gathers them) are collectives, which every rank runs at the same point
    /// (the trainer evaluates the same number of batches on every rank, and
    /// takes part in each checkpoint rank 0 writes). `false` by default.
    fn shards_parameters(&self) -> bool {
        false
    }

    /// This rank's part of the module's state when its parameters are
    /// sharded over the ranks, for a sharded checkpoint: read locally, not a
    /// collective. `None` (the default) for a module every rank holds whole.
    fn shard_state_tensors(&self) -> Result<Option<crate::state_tensors::ShardState<B>>> {
        Ok(None)
    }
}

/// One micro-batch of an objective that is a supervised loss, run by `step`
/// (a module's plain training step, given the plan with that loss); any other
/// objective is refused, naming `kind`: what a step that computes a supervised
/// loss only (TensorFlow's one compiled program) does with an objective.
pub fn supervised_objective_step<B: Backend>(
    objective: &dyn Objective<B>,
    kind: &str,
    plan: &UpdatePlan<'_>,
    step: impl FnOnce(&StepPlan<'_>) -> Result<StepLoss<B::Tensor>>,
) -> Result<ObjectiveStep<B::Tensor>> {
    let Some(loss) = objective.supervised_loss() else {
        return Err(objective_unsupported(objective, kind));
    };
    Ok(ObjectiveStep {
        loss: step(&plan.with_loss(loss))?,
        metrics: Vec::new(),
    })
}

/// The refusal of an objective that a module's step cannot compute.
pub fn objective_unsupported<B: Backend>(objective: &dyn Objective<B>, kind: &str) -> Error {
    Error::unsupported(format!(
        "the {} objective on {kind}: its training step computes a supervised loss only \
         (objectives that compute their own loss train on the torch backend)",
        objective.name()
    ))
}

/// A backend the `Trainer` (in `kiln-train`) can drive from Kiln [`Layer`]
/// definitions: it builds them as [`Model`](TrainBackend::Model)s, which are
/// [`Trainable`], so one training script runs on any backend that implements
/// it by changing one type parameter.
///
/// Training itself is the model's: [`Trainable`]'s steps (`model.train_step(...)`),
/// and strategies such as [`DataParallel`](crate::strategy::DataParallel) wrap it.
pub trait TrainBackend: Backend {
    /// Whether [`freeze`](Self::freeze) can freeze parameters on this backend:
    /// the query to make before anything is read or built.
    const CAN_FREEZE: bool = false;

    /// Whether [`add_lora`](Self::add_lora) can add LoRA adapters on this backend.
    const CAN_LORA: bool = false;

    /// A model built from a [`Layer`] definition.
    type Model: Trainable<Self, Optim = Self::Optim>;
    /// The optimizer over such a model.
    type Optim: Optimizer<Self> + Send;

    /// Builds `spec` on `device` (initial weights from the backend's generator).
    fn build_model(spec: &Layer, device: Device) -> Result<Self::Model>;

    /// A profiler for a window of training steps on `device` (see
    /// [`crate::profile`]), created when the trainer is asked to profile, before the
    /// run's first step. The default: this backend cannot profile.
    fn profiler(device: Device) -> Result<Box<dyn crate::profile::StepProfiler>> {
        Err(Error::unsupported(format!(
            "profiling on {} ({})",
            Self::NAME,
            device
        )))
    }

    /// Gives `model` a training [`FloatPrecision`]: converts its floating-point
    /// parameters to [`FloatPrecision::parameter_dtype`] and sets how its forward
    /// pass computes. Call it before [`Trainable::build_optimizer`]
    /// (the optimizer holds the parameters it updates); nothing changes on error.
    ///
    /// The default accepts only [`FloatPrecision::F32`], what every model starts in.
    fn set_precision(model: &mut Self::Model, precision: FloatPrecision) -> Result<()> {
        let _ = model;
        match precision {
            FloatPrecision::F32 => Ok(()),
            other => Err(Error::unsupported(format!(
                "precision {other} on this backend (it trains in 32-true only)"
            ))),
        }
    }

    /// Freezes the parameters of `model` whose names match one of `patterns`
    /// (globs, [`name_matches`](crate::module::name_matches)), as PyTorch's
    /// `p.requires_grad_(False)`: no gradient, and left out of optimizers built
    /// afterwards; then, with `batch_norm_eval`, keeps every batch norm whose
    /// parameters are all frozen in eval mode while the model trains. Returns
    /// the frozen parameters' and the pinned batch norms' names. Call it before
    /// [`Trainable::build_optimizer`]. A pattern that matches no
    /// parameter is an error.
    ///
    /// The default refuses (unless there is nothing to do): a backend without
    /// freezing says so, and [`CAN_FREEZE`](Self::CAN_FREEZE) is `false` for it.
    fn freeze(
        model: &mut Self::Model,
        patterns: &[&str],
        batch_norm_eval: bool,
    ) -> Result<(Vec<String>, Vec<String>)> {
        let _ = model;
        if patterns.is_empty() && !batch_norm_eval {
            return Ok((Vec::new(), Vec::new()));
        }
        Err(Error::unsupported(format!(
            "freezing parameters on the {} backend",
            Self::NAME
        )))
    }

    /// Adds the LoRA adapters `lora` declares to `model` and freezes every
    /// other parameter (PEFT's `get_peft_model`); returns the adapters' names.
    /// Call it after loading the base weights and before
    /// [`set_precision`](Self::set_precision) and [`Trainable::build_optimizer`].
    ///
    /// The default refuses: a backend without adapters says so before anything runs.
    fn add_lora(model: &mut Self::Model, lora: &crate::lora::LoraConfig) -> Result<Vec<String>> {
        let _ = (model, lora);
        Err(Error::unsupported(format!(
            "LoRA adapters on the {} backend (they train on the torch backend)",
            Self::NAME
        )))
    }

    /// Activation checkpointing: the layers of `model` whose paths match one
    /// of `patterns` (globs) keep only their inputs while training and run
    /// again in the backward pass. Returns the checkpointed paths.
    ///
    /// The default refuses: a backend without it says so before anything runs.
    fn checkpoint_activations(model: &mut Self::Model, patterns: &[&str]) -> Result<Vec<String>> {
        let _ = (model, patterns);
        Err(Error::unsupported(format!(
            "activation checkpointing on the {} backend (the torch backend has it)",
            Self::NAME
        )))
    }

    /// `loss(output, target)` as a tensor: on an eager engine one that
    /// [`EagerBackend::backward`] accepts, what [`Supervised`](crate::objective::Supervised) computes
    /// inside a step. The default refuses: a graph engine computes its losses
    /// inside its compiled step.
    fn loss(loss: &Loss, output: &Self::Tensor, target: &Self::Tensor) -> Result<Self::Tensor> {
        let _ = (output, target);
        Err(Error::unsupported(format!(
            "computing the {} loss outside the {} backend's compiled training step",
            loss.name(),
            Self::NAME
        )))
    }

    /// A copy of `tensor` on its device that shares no storage with it and
    /// records nothing for autograd (`tensor.detach().clone()`): where a weight
    /// average starts.
    ///
    /// The default goes through the host.
    fn copy_tensor(tensor: &Self::Tensor) -> Result<Self::Tensor> {
        Self::from_host(&Self::to_host(tensor)?, Self::device(tensor))
    }

    /// Moves each of `averages` towards its partner in `currents` by `weight`:
    /// `average += weight * (current - average)`, without autograd, as
    /// `torch._foreach_lerp_` does for an exponential moving average of the
    /// weights (`weight = 1 - decay`) and for SWA's running mean
    /// (`weight = 1 / (n + 1)`). The pairs must agree in shape and dtype, a
    /// floating-point one.
    ///
    /// The default computes on the host in float64 and puts each result back on
    /// its tensor's device (a new tensor in its place); libtorch updates in place.
    fn lerp_in_place(
        averages: &mut [Self::Tensor],
        currents: &[Self::Tensor],
        weight: f64,
    ) -> Result<()> {
        check_lerp_pairs::<Self>(averages, currents)?;
        let mut updated = Vec::with_capacity(averages.len());
        for (average, current) in averages.iter().zip(currents) {
            let a = Self::to_host(average)?;
            let c = Self::to_host(current)?.to_dtype(crate::dtype::DType::F64);
            let dtype = a.dtype();
            let a64 = a.to_dtype(crate::dtype::DType::F64);
            let out: Vec<f64> = a64
                .as_slice::<f64>()?
                .iter()
                .zip(c.as_slice::<f64>()?)
                .map(|(a, c)| a + weight * (c - a))
                .collect();
            let host = HostTensor::new(out, a.dims().to_vec())?.to_dtype(dtype);
            updated.push(Self::from_host(&host, Self::device(average))?);
        }
        for (average, new) in averages.iter_mut().zip(updated) {
            *average = new;
        }
        Ok(())
    }
}

/// [`TrainBackend::lerp_in_place`]'s checks: as many averages as currents,
/// pairwise of one shape and one floating-point dtype.
pub fn check_lerp_pairs<B: Backend>(averages: &[B::Tensor], currents: &[B::Tensor]) -> Result<()> {
    if averages.len() != currents.len() {
        return Err(Error::invalid_argument(
            "weight averaging",
            format!("{} averages for {} tensors", averages.len(), currents.len()),
        ));
    }
    for (i, (a, c)) in averages.iter().zip(currents).enumerate() {
        let (da, dc) = (B::dtype(a)?, B::dtype(c)?);
        if da != dc || !da.is_float() || B::shape(a) != B::shape(c) {
            return Err(Error::invalid_argument(
                "weight averaging",
                format!(
                    "tensor {i}: the average is {da} {:?} and the tensor {dc} {:?}; both must \
                     be one floating-point dtype and shape",
                    B::shape(a),
                    B::shape(c)
                ),
            ));
        }
    }
    Ok(())
}

/// A backend that runs operations one at a time and records them for autograd
/// (libtorch): the primitives an eager training loop is written from, and the
/// evaluation and prediction steps built from them, which such a backend's
/// modules' [`Trainable::eval_step`] and [`Trainable::predict_step`] call.
///
/// ```
/// use kiln_core::{backend::EagerBackend, optim::Optimizer, Result};
///
/// fn train_step<B: EagerBackend>(opt: &mut B::Optim, loss: &B::Tensor) -> Result<()> {
///     opt.zero_grad()?;
///     B::backward(loss)?;
///     opt.step()
/// }
/// ```
pub trait EagerBackend: TrainBackend {
    /// Computes gradients of the scalar `loss` with respect to every parameter
    /// that requires them, accumulating into their `.grad` (PyTorch semantics).
    fn backward(loss: &Self::Tensor) -> Result<()>;

    /// `tensor * factor`, keeping the autograd graph (gradient accumulation scales losses).
    fn scale(tensor: &Self::Tensor, factor: f64) -> Result<Self::Tensor>;

    /// The value of a one-element tensor (one copy to the host).
    fn item(tensor: &Self::Tensor) -> Result<f64>;

    /// Clips the gradients of `params` in place.
    fn clip_gradients(params: &[(String, Self::Tensor)], clip: &GradClip) -> Result<()>;

    /// Runs `f` without recording operations for autograd (evaluation).
    fn no_grad<T>(f: impl FnOnce() -> T) -> T;

    /// [`Trainable::eval_step`] as forward and loss (with the model's
    /// auxiliary losses, [`Module::add_auxiliary_losses`]) under
    /// [`no_grad`](Self::no_grad).
    fn eager_eval_step<M: Module<Self> + ?Sized>(
        model: &M,
        loss: &Loss,
        inputs: &Self::Tensor,
        targets: &Self::Tensor,
    ) -> Result<(f64, HostTensor)> {
        Self::no_grad(|| {
            let output = model.forward(inputs)?;
            let value = model.add_auxiliary_losses(Self::loss(loss, &output, targets)?)?;
            let value = Self::item(&value.loss)?;
            Ok((value, Self::to_host(&output)?))
        })
    }

    /// [`Trainable::predict_step`] as forward under [`no_grad`](Self::no_grad).
    fn eager_predict_step<M: Module<Self> + ?Sized>(
        model: &M,
        inputs: &Self::Tensor,
    ) -> Result<HostTensor> {
        Self::no_grad(|| Self::to_host(&model.forward(inputs)?))
    }
}
