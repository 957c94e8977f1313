//! What the trainer needs from a backend beyond [`Backend`].

use std::sync::Arc;

use crate::backend::Backend;
use crate::device::Device;
use crate::distributed::{Collectives, DistributedOptions};
use crate::error::{Error, Result};
use crate::loss::Loss;
use crate::model::Layer;
use crate::module::Module;
use crate::optim::{GradClip, Optimizer, OptimizerConfig, ParamGroup};
use crate::precision::FloatPrecision;
use crate::tensor::HostTensor;

/// What one training micro-batch does, for [`TrainBackend::train_step`].
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

    /// Gives every rank rank 0's buffers when the module trains data-parallel
    /// (see [`TrainBackend::distribute`]); nothing otherwise (the default).
    fn sync_buffers(&mut self) -> Result<()> {
        Ok(())
    }
}

/// A backend the `Trainer` (in `kiln-train`) can drive from Kiln [`Layer`]
/// definitions: it builds them as [`Model`](TrainBackend::Model)s, which are
/// [`Trainable`], so one training script runs on any backend that implements
/// it by changing one type parameter.
///
/// The step functions here are the model's [`Trainable`] methods, under the
/// backend's name (`B::train_step(&mut model, ...)`).
pub trait TrainBackend: Backend {
    /// A model built from a [`Layer`] definition.
    type Model: Trainable<Self, Optim = Self::Optim>;
    /// The optimizer over such a model.
    type Optim: Optimizer<Self> + Send;

    /// Builds `spec` on `device` (initial weights from the backend's generator).
    fn build_model(spec: &Layer, device: Device) -> Result<Self::Model>;

    /// Gives `model` a training [`FloatPrecision`]: converts its floating-point
    /// parameters to [`FloatPrecision::parameter_dtype`] and sets how its forward
    /// pass computes. Call it before [`build_optimizer`](Self::build_optimizer)
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

    /// The precision `model` was given by [`set_precision`](Self::set_precision)
    /// (`32-true` when built): [`Trainable::precision`].
    fn precision(model: &Self::Model) -> FloatPrecision {
        model.precision()
    }

    /// Freezes the parameters of `model` whose names match one of `patterns`
    /// (globs, [`name_matches`](crate::module::name_matches)), as PyTorch's
    /// `p.requires_grad_(False)`: no gradient, and left out of optimizers built
    /// afterwards; then, with `batch_norm_eval`, keeps every batch norm whose
    /// parameters are all frozen in eval mode while the model trains. Returns
    /// the frozen parameters' and the pinned batch norms' names. Call it before
    /// [`build_optimizer`](Self::build_optimizer). A pattern that matches no
    /// parameter is an error.
    ///
    /// The default refuses (unless there is nothing to do): a backend without
    /// freezing says so.
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

    /// Builds an optimizer over `model`'s parameters: [`Trainable::build_optimizer`].
    fn build_optimizer(
        config: &OptimizerConfig,
        model: &Self::Model,
        groups: &[ParamGroup],
    ) -> Result<Self::Optim> {
        model.build_optimizer(config, groups)
    }

    /// Makes `model` train data-parallel over `group`, with
    /// `DistributedDataParallel`'s semantics: rank 0's parameters and buffers
    /// on every rank now, and from then on every [`train_step`](Self::train_step)
    /// averages the gradients over the ranks before the optimizer applies them
    /// (not on the micro-batches gradient accumulation does not apply) and
    /// returns the loss averaged over the ranks, so every rank sees the same
    /// values and takes the same decisions. Call it after
    /// [`set_precision`](Self::set_precision) and before
    /// [`build_optimizer`](Self::build_optimizer), on every rank.
    ///
    /// The default refuses: a backend without data-parallel training says so.
    fn distribute(
        model: &mut Self::Model,
        group: Arc<dyn Collectives>,
        options: &DistributedOptions,
    ) -> Result<()> {
        let _ = (model, group, options);
        Err(Error::unsupported(format!(
            "data-parallel training on the {} backend",
            Self::NAME
        )))
    }

    /// Gives every rank rank 0's buffers (batch-norm running statistics, which
    /// each rank updates from its own rows) when `model` trains data-parallel;
    /// nothing otherwise. A collective: every rank calls it. The trainer does
    /// before evaluating, so that every rank evaluates the same model.
    /// [`Trainable::sync_buffers`].
    fn sync_buffers(model: &mut Self::Model) -> Result<()> {
        model.sync_buffers()
    }

    /// One training micro-batch: [`Trainable::train_step`].
    fn train_step(
        model: &mut Self::Model,
        optimizer: &mut Self::Optim,
        inputs: &Self::Tensor,
        targets: &Self::Tensor,
        plan: &StepPlan<'_>,
    ) -> Result<f64> {
        model.train_step(optimizer, inputs, targets, plan)
    }

    /// The loss value and the model's output on one batch, without gradients:
    /// [`Trainable::eval_step`].
    fn eval_step(
        model: &Self::Model,
        loss: &Loss,
        inputs: &Self::Tensor,
        targets: &Self::Tensor,
    ) -> Result<(f64, HostTensor)> {
        model.eval_step(loss, inputs, targets)
    }

    /// The model's output on one batch, without gradients, on the host:
    /// [`Trainable::predict_step`].
    fn predict_step(model: &Self::Model, inputs: &Self::Tensor) -> Result<HostTensor> {
        model.predict_step(inputs)
    }
}

/// A backend that runs operations one at a time and records them for autograd
/// (libtorch): the primitives an eager training loop is written from, and the
/// [`TrainBackend`] steps built from them, which such a backend's
/// `train_step`, `eval_step` and `predict_step` call.
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

    /// `loss(output, target)`, a tensor that [`backward`](Self::backward) accepts.
    fn loss(loss: &Loss, output: &Self::Tensor, target: &Self::Tensor) -> Result<Self::Tensor>;

    /// `tensor * factor`, keeping the autograd graph (gradient accumulation scales losses).
    fn scale(tensor: &Self::Tensor, factor: f64) -> Result<Self::Tensor>;

    /// The value of a one-element tensor (one copy to the host).
    fn item(tensor: &Self::Tensor) -> Result<f64>;

    /// Clips the gradients of `params` in place.
    fn clip_gradients(params: &[(String, Self::Tensor)], clip: &GradClip) -> Result<()>;

    /// Runs `f` without recording operations for autograd (evaluation).
    fn no_grad<T>(f: impl FnOnce() -> T) -> T;

    /// [`TrainBackend::train_step`] as the eager sequence: `forward`,
    /// [`loss`](Self::loss), [`item`](Self::item), [`backward`](Self::backward),
    /// [`clip_gradients`](Self::clip_gradients), [`Optimizer::step`].
    fn eager_train_step<M, O>(
        model: &mut M,
        optimizer: &mut O,
        inputs: &Self::Tensor,
        targets: &Self::Tensor,
        plan: &StepPlan<'_>,
    ) -> Result<f64>
    where
        M: Module<Self> + ?Sized,
        O: Optimizer<Self> + ?Sized,
    {
        let output = model.forward(inputs)?;
        let loss = Self::loss(plan.loss, &output, targets)?;
        let value = Self::item(&loss)?;
        if !value.is_finite() {
            return Ok(value);
        }
        let scaled = if plan.scale == 1.0 {
            loss
        } else {
            Self::scale(&loss, plan.scale)?
        };
        Self::backward(&scaled)?;
        if plan.apply {
            if let Some(clip) = plan.clip {
                Self::clip_gradients(&model.named_parameters()?, clip)?;
            }
            optimizer.step()?;
        }
        Ok(value)
    }

    /// [`TrainBackend::eval_step`] as forward and loss under [`no_grad`](Self::no_grad).
    fn eager_eval_step<M: Module<Self> + ?Sized>(
        model: &M,
        loss: &Loss,
        inputs: &Self::Tensor,
        targets: &Self::Tensor,
    ) -> Result<(f64, HostTensor)> {
        Self::no_grad(|| {
            let output = model.forward(inputs)?;
            let value = Self::item(&Self::loss(loss, &output, targets)?)?;
            Ok((value, Self::to_host(&output)?))
        })
    }

    /// [`TrainBackend::predict_step`] as forward under [`no_grad`](Self::no_grad).
    fn eager_predict_step<M: Module<Self> + ?Sized>(
        model: &M,
        inputs: &Self::Tensor,
    ) -> Result<HostTensor> {
        Self::no_grad(|| Self::to_host(&model.forward(inputs)?))
    }
}
