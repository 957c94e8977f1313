//! [`TrainBackend`] for libtorch, what the generic `Trainer` of `kiln-train` needs,
//! and [`EagerBackend`], the primitives its steps are made of.

use kiln_core::{
    backend::{Backend, EagerBackend, StepLoss, StepPlan, TrainBackend, Trainable, UpdatePlan},
    loss::Loss,
    model::Layer,
    module::Module,
    objective::{Objective, ObjectiveBatch, ObjectiveEval, ObjectiveStep},
    optim::{GradClip, OptimizerConfig, ParamGroup},
    precision::{FloatPrecision, LossScaling},
    strategy::{NoHooks, StepHooks},
    Device, Error, HostTensor, Result,
};
use tch::Tensor;

use crate::backend::TorchBackend;
use crate::custom::{Chain, TchModule};
use crate::error::torch_error;
use crate::freeze::Freeze;
use crate::loss::compute_loss;
use crate::model::TorchModel;
use crate::optim::{
    clip_grad_norm, clip_grad_norm_on_device, clip_grad_norm_with, clip_grad_value, TorchOptimizer,
};
use crate::script::ScriptModule;

impl TrainBackend for TorchBackend {
    const CAN_FREEZE: bool = true;
    const CAN_LORA: bool = true;
    type Model = TorchModel;
    type Optim = TorchOptimizer;

    fn build_model(spec: &Layer, device: Device) -> Result<TorchModel> {
        TorchModel::new(spec, device)
    }

    fn set_precision(model: &mut TorchModel, precision: FloatPrecision) -> Result<()> {
        model.set_precision(precision)
    }

    /// libtorch's profiler ([`crate::TorchProfiler`]): host operators, and CUDA
    /// kernels on a CUDA device.
    fn profiler(device: Device) -> Result<Box<dyn kiln_core::profile::StepProfiler>> {
        Ok(Box::new(crate::TorchProfiler::new(device)))
    }

    /// [`Freeze::freeze`] and [`Freeze::keep_frozen_batch_norm_in_eval`].
    fn freeze(
        model: &mut TorchModel,
        patterns: &[&str],
        batch_norm_eval: bool,
    ) -> Result<(Vec<String>, Vec<String>)> {
        let frozen = if patterns.is_empty() {
            Vec::new()
        } else {
            model.freeze(patterns)?
        };
        let pinned = if batch_norm_eval {
            model.keep_frozen_batch_norm_in_eval()?
        } else {
            Vec::new()
        };
        Ok((frozen, pinned))
    }

    /// [`TorchModel::add_lora`].
    fn add_lora(model: &mut TorchModel, lora: &kiln_core::lora::LoraConfig) -> Result<Vec<String>> {
        model.add_lora(lora)
    }

    /// [`TorchModel::checkpoint_activations`].
    fn checkpoint_activations(model: &mut TorchModel, patterns: &[&str]) -> Result<Vec<String>> {
        model.checkpoint_activations(patterns)
    }

    fn loss(loss: &Loss, output: &Tensor, target: &Tensor) -> Result<Tensor> {
        compute_loss(loss, output, target)
    }

    fn copy_tensor(tensor: &Tensor) -> Result<Tensor> {
        tensor
            .f_detach_copy()
            .map_err(|e| torch_error("copying a tensor for a weight average", e))
    }

    fn lerp_in_place(averages: &mut [Tensor], currents: &[Tensor], weight: f64) -> Result<()> {
        // The shapes first (lerp_ would broadcast a smaller tensor into the
        // average), so that a refused update changes nothing; libtorch checks
        // the dtypes, and the typed message is made if it refuses one.
        let fits = averages.len() == currents.len()
            && averages
                .iter()
                .zip(currents)
                .all(|(a, c)| a.size() == c.size());
        if !fits {
            return kiln_core::backend::check_lerp_pairs::<TorchBackend>(averages, currents);
        }
        tch::no_grad(|| {
            for (average, current) in averages.iter_mut().zip(currents) {
                if let Err(e) = average.f_lerp_(current, weight) {
                    kiln_core::backend::check_lerp_pairs::<TorchBackend>(
                        std::slice::from_ref(average),
                        std::slice::from_ref(current),
                    )?;
                    return Err(torch_error("updating a weight average", e));
                }
            }
            Ok(())
        })
    }
}

/// The elements of a torch module's parameters that require gradients.
/// The names of the parameters that do not require gradients.
pub(crate) fn frozen_names<M: Module<TorchBackend> + ?Sized>(model: &M) -> Result<Vec<String>> {
    Ok(model
        .named_parameters()?
        .into_iter()
        .filter(|(_, t)| !t.requires_grad())
        .map(|(name, _)| name)
        .collect())
}

pub(crate) fn trainable_elements<M: Module<TorchBackend> + ?Sized>(model: &M) -> Result<usize> {
    Ok(model
        .named_parameters()?
        .iter()
        .filter(|(_, t)| t.requires_grad())
        .map(|(_, t)| t.numel())
        .sum())
}

/// The optimizer of any torch module: its parameters that require gradients.
pub(crate) fn optimizer_over<M: Module<TorchBackend> + ?Sized>(
    model: &M,
    config: &OptimizerConfig,
    groups: &[ParamGroup],
) -> Result<TorchOptimizer> {
    let trainable: Vec<(String, Tensor)> = model
        .named_parameters()?
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .collect();
    TorchOptimizer::new(config.clone(), trainable, groups)
}

/// The steps every torch module's [`Trainable`] has: [`train_step`] (forward,
/// loss, backward, clipping and the optimizer step, op by op; alone, deferred,
/// or with a strategy's hooks) and the eager evaluation and prediction steps.
macro_rules! torch_steps {
    () => {
        fn train_step(
            &mut self,
            optimizer: &mut TorchOptimizer,
            inputs: &Tensor,
            targets: &Tensor,
            plan: &StepPlan<'_>,
        ) -> Result<f64> {
            train_step(self, optimizer, inputs, targets, plan, &mut NoHooks, false)?
                .value::<TorchBackend>()
        }

        fn train_step_deferred(
            &mut self,
            optimizer: &mut TorchOptimizer,
            inputs: &Tensor,
            targets: &Tensor,
            plan: &StepPlan<'_>,
        ) -> Result<StepLoss<Tensor>> {
            train_step(self, optimizer, inputs, targets, plan, &mut NoHooks, true)
        }

        fn takes_step_hooks(&self) -> bool {
            true
        }

        fn train_step_hooked(
            &mut self,
            optimizer: &mut TorchOptimizer,
            inputs: &Tensor,
            targets: &Tensor,
            plan: &StepPlan<'_>,
            hooks: &mut dyn StepHooks<TorchBackend>,
            deferred: bool,
        ) -> Result<StepLoss<Tensor>> {
            train_step(self, optimizer, inputs, targets, plan, hooks, deferred)
        }

        fn train_objective_step(
            &mut self,
            optimizer: &mut TorchOptimizer,
            objective: &dyn Objective<TorchBackend>,
            batch: &ObjectiveBatch<'_, Tensor>,
            plan: &UpdatePlan<'_>,
            deferred: bool,
        ) -> Result<ObjectiveStep<Tensor>> {
            objective_step(
                self,
                optimizer,
                objective,
                batch,
                plan,
                &mut NoHooks,
                deferred,
            )
        }

        fn train_objective_step_hooked(
            &mut self,
            optimizer: &mut TorchOptimizer,
            objective: &dyn Objective<TorchBackend>,
            batch: &ObjectiveBatch<'_, Tensor>,
            plan: &UpdatePlan<'_>,
            hooks: &mut dyn StepHooks<TorchBackend>,
            deferred: bool,
        ) -> Result<ObjectiveStep<Tensor>> {
            objective_step(self, optimizer, objective, batch, plan, hooks, deferred)
        }

        fn eval_objective(
            &self,
            objective: &dyn Objective<TorchBackend>,
            batch: &ObjectiveBatch<'_, Tensor>,
        ) -> Result<ObjectiveEval> {
            eval_objective(self, objective, batch)
        }

        fn runs_any_objective(&self) -> bool {
            true
        }

        fn eval_step(
            &self,
            loss: &Loss,
            inputs: &Tensor,
            targets: &Tensor,
        ) -> Result<(f64, HostTensor)> {
            TorchBackend::eager_eval_step(self, loss, inputs, targets)
        }

        fn predict_step(&self, inputs: &Tensor) -> Result<HostTensor> {
            TorchBackend::eager_predict_step(self, inputs)
        }
    };
}

impl Trainable<TorchBackend> for TorchModel {
    type Optim = TorchOptimizer;

    /// The optimizer over the trainable parameters; in `16-mixed`, with loss
    /// scaling on ([`TorchOptimizer::set_loss_scaling`], `GradScaler`'s defaults)
    /// and, for Adam and AdamW on CUDA, the step counts on the device
    /// ([`TorchOptimizer::set_steps_on_device`]), so no step waits for the host.
    fn build_optimizer(
        &self,
        config: &OptimizerConfig,
        groups: &[ParamGroup],
    ) -> Result<TorchOptimizer> {
        let mut optimizer = optimizer_over(self, config, groups)?;
        if self.precision().scales_loss() {
            optimizer.set_loss_scaling(Some(LossScaling::default()))?;
            let adam = matches!(config, OptimizerConfig::Adam(_) | OptimizerConfig::AdamW(_));
            if adam && self.device().is_cuda() {
                // The fused kernel skips inf/NaN steps on the device: no flag read.
                optimizer.set_steps_on_device(true)?;
            }
        }
        Ok(optimizer)
    }

    fn num_trainable_parameters(&self) -> Result<usize> {
        trainable_elements(self)
    }

    fn frozen_parameters(&self) -> Result<Vec<String>> {
        frozen_names(self)
    }

    fn precision(&self) -> FloatPrecision {
        TorchModel::precision(self)
    }

    torch_steps!();
}

/// [`Trainable`] for torch modules that train op by op with a
/// [`TorchOptimizer`] over their parameters that require gradients.
macro_rules! eager_trainable {
    ($($(#[$doc:meta])* $ty:ty;)*) => {$(
        $(#[$doc])*
        impl Trainable<TorchBackend> for $ty {
            type Optim = TorchOptimizer;

            fn build_optimizer(
                &self,
                config: &OptimizerConfig,
                groups: &[ParamGroup],
            ) -> Result<TorchOptimizer> {
                optimizer_over(self, config, groups)
            }

            fn num_trainable_parameters(&self) -> Result<usize> {
                trainable_elements(self)
            }

            fn frozen_parameters(&self) -> Result<Vec<String>> {
                frozen_names(self)
            }

            torch_steps!();
        }
    )*};
}

eager_trainable! {
    /// A TorchScript model trains op by op, as in Python.
    ScriptModule;
    /// `tch` code trains op by op.
    TchModule;
    /// A chain (a pretrained part plus new layers) trains op by op.
    Chain;
    /// Any torch module of the user's, boxed.
    Box<dyn Module<TorchBackend> + Send>;
}

/// The one training step of every torch module, op by op: forward, loss, the
/// backward pass of the loss times `plan.scale` and the optimizer's loss scale
/// (`16-mixed`), and when the micro-batch applies, the update (unscaling,
/// clipping, the optimizer step). A strategy takes part through `hooks` (see
/// [`StepHooks`]: DDP averages the gradients during the backward pass and the
/// loss over the ranks); a single process passes [`NoHooks`]. A CUDA graph
/// captures this same step (`kiln_torch::graph`).
///
/// Unless `deferred`, the loss is read and, when the agreed value is not finite,
/// returned with parameters and optimizer state unchanged
/// ([`Trainable::train_step`]'s contract: alone, before the backward pass, so no
/// gradient is added either; under a strategy that agrees on the loss, after
/// it, since every rank must run it). When `deferred` and the hooks need no
/// agreement, nothing is read back from the device (clipping included) and the
/// loss comes back as a detached tensor; only loss scaling's skip decision may
/// read one flag (see [`TorchOptimizer::set_loss_scaling`]).
pub fn train_step<M: Module<TorchBackend> + ?Sized>(
    model: &M,
    optimizer: &mut TorchOptimizer,
    inputs: &Tensor,
    targets: &Tensor,
    plan: &StepPlan<'_>,
    hooks: &mut dyn StepHooks<TorchBackend>,
    deferred: bool,
) -> Result<StepLoss<Tensor>> {
    let loss = |model: &M| -> Result<(Tensor, Vec<Tensor>)> {
        let output = model.forward(inputs)?;
        let loss = TorchBackend::loss(plan.loss, &output, targets)?;
        Ok((model.add_auxiliary_losses(loss)?.loss, Vec::new()))
    };
    step_with(model, optimizer, loss, &plan.update(), hooks, deferred).map(|step| step.loss)
}

/// [`train_step`] for an [`Objective`]: its
/// [`compute`](Objective::compute) gives the loss (and its metrics), and the
/// rest of the step is the same. The metrics are read with the loss: now,
/// or when deferred, left on the device as detached tensors.
pub fn objective_step<M: Module<TorchBackend>>(
    model: &M,
    optimizer: &mut TorchOptimizer,
    objective: &dyn Objective<TorchBackend>,
    batch: &ObjectiveBatch<'_, Tensor>,
    plan: &UpdatePlan<'_>,
    hooks: &mut dyn StepHooks<TorchBackend>,
    deferred: bool,
) -> Result<ObjectiveStep<Tensor>> {
    let expected = objective.metric_names(model).len();
    let loss = |model: &M| -> Result<(Tensor, Vec<Tensor>)> {
        let out = objective.compute(model, batch)?;
        if out.metrics.len() != expected {
            return Err(Error::invalid_argument(
                "objective",
                format!(
                    "the {} objective returned {} metrics but names {expected}",
                    objective.name(),
                    out.metrics.len()
                ),
            ));
        }
        Ok((out.loss, out.metrics))
    };
    step_with(model, optimizer, loss, plan, hooks, deferred)
}

/// [`Trainable::eval_objective`] for an eager torch module: `compute` under
/// `no_grad`, every number read.
pub fn eval_objective<M: Module<TorchBackend>>(
    model: &M,
    objective: &dyn Objective<TorchBackend>,
    batch: &ObjectiveBatch<'_, Tensor>,
) -> Result<ObjectiveEval> {
    TorchBackend::no_grad(|| {
        let out = objective.compute(model, batch)?;
        let outputs = out
            .outputs
            .as_ref()
            .map(TorchBackend::to_host)
            .transpose()?;
        let metrics = out
            .metrics
            .iter()
            .map(TorchBackend::item)
            .collect::<Result<Vec<f64>>>()?;
        Ok(ObjectiveEval {
            loss: TorchBackend::item(&out.loss)?,
            outputs,
            metrics,
        })
    })
}

/// The step every torch training step is: `compute` gives the loss and the
/// metrics (see [`train_step`] for the rest).
fn step_with<M: Module<TorchBackend> + ?Sized>(
    model: &M,
    optimizer: &mut TorchOptimizer,
    compute: impl FnOnce(&M) -> Result<(Tensor, Vec<Tensor>)>,
    plan: &UpdatePlan<'_>,
    hooks: &mut dyn StepHooks<TorchBackend>,
    deferred: bool,
) -> Result<ObjectiveStep<Tensor>> {
    let agree = hooks.agrees_on_loss();
    let on_device = deferred && !agree;
    hooks.before_forward(plan.apply)?;
    let (loss, metrics) = compute(model)?;
    // The metrics as the loss is: read now, or detached and left on the device.
    let metrics = metrics
        .iter()
        .map(|m| {
            if on_device {
                m.f_detach()
                    .map(StepLoss::Device)
                    .map_err(|e| torch_error("keeping an objective's metric", e))
            } else {
                TorchBackend::item(m).map(StepLoss::Host)
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let done = |loss: f64, metrics: Vec<StepLoss<Tensor>>| ObjectiveStep {
        loss: StepLoss::Host(loss),
        metrics,
    };
    // The loss on the host, or kept on the device.
    let local = if on_device {
        StepLoss::Device(
            loss.f_detach()
                .map_err(|e| torch_error("keeping the loss", e))?,
        )
    } else {
        let value = TorchBackend::item(&loss)?;
        if !value.is_finite() && !agree {
            return Ok(done(value, metrics));
        }
        StepLoss::Host(value)
    };
    let scaled = if plan.scale == 1.0 {
        loss
    } else {
        TorchBackend::scale(&loss, plan.scale)?
    };
    let scaled = optimizer.scale_loss(&scaled)?;
    if let StepLoss::Host(value) = local {
        hooks.before_backward(value, &scaled, plan.apply)?;
    }
    TorchBackend::backward(&scaled).map_err(|e| hooks.backward_failed(e, plan.apply))?;
    hooks.after_backward(plan.apply)?;
    let result = match local {
        StepLoss::Host(value) => {
            let agreed = hooks.agreed_loss(value)?;
            if !agreed.is_finite() {
                hooks.skipped()?;
                return Ok(done(agreed, metrics));
            }
            StepLoss::Host(agreed)
        }
        device => device,
    };
    if plan.apply {
        apply_update(model, optimizer, plan.clip, on_device, hooks)?;
        hooks.after_update()?;
    }
    Ok(ObjectiveStep {
        loss: result,
        metrics,
    })
}

/// The end of a micro-batch that applies: under loss scaling the gradients are
/// unscaled first, so that clipping sees their true values (`scaler.unscale_`
/// before `clip_grad_norm_`); then clipping (on the device when `on_device`: no
/// norm read back) and the optimizer step, which under loss scaling skips
/// inf/NaN gradients and updates the scale. Clipping by norm on the host
/// takes the norm over every rank's gradients from `hooks` (a strategy that
/// shards them knows it).
fn apply_update<M: Module<TorchBackend> + ?Sized>(
    model: &M,
    optimizer: &mut TorchOptimizer,
    clip: Option<&GradClip>,
    on_device: bool,
    hooks: &mut dyn StepHooks<TorchBackend>,
) -> Result<()> {
    use kiln_core::optim::Optimizer;
    if let Some(clip) = clip {
        optimizer.unscale_gradients()?;
        let params = model.named_parameters()?;
        match clip {
            GradClip::Norm {
                max_norm,
                norm_type,
            } if on_device => {
                let tensors: Vec<&Tensor> = params.iter().map(|(_, t)| t).collect();
                clip_grad_norm_on_device(&tensors, *max_norm, *norm_type)?;
            }
            GradClip::Norm {
                max_norm,
                norm_type,
            } => {
                let tensors: Vec<&Tensor> = params.iter().map(|(_, t)| t).collect();
                clip_grad_norm_with(&tensors, *max_norm, *norm_type, |local| {
                    hooks.global_grad_norm(local, *norm_type)
                })?;
            }
            _ => TorchBackend::clip_gradients(&params, clip)?,
        }
    }
    optimizer.step()
}

impl EagerBackend for TorchBackend {
    fn backward(loss: &Tensor) -> Result<()> {
        if loss.numel() != 1 {
            return Err(Error::ShapeMismatch {
                context: "backward".to_owned(),
                expected: "a scalar loss (one element)".to_owned(),
                actual: Self::shape(loss).to_string(),
            });
        }
        loss.f_backward().map_err(|e| torch_error("backward", e))
    }

    fn scale(tensor: &Tensor, factor: f64) -> Result<Tensor> {
        tensor
            .f_mul_scalar(factor)
            .map_err(|e| torch_error("scaling the loss", e))
    }

    fn item(tensor: &Tensor) -> Result<f64> {
        tensor
            .f_double_value(&[])
            .map_err(|e| torch_error("reading a scalar", e))
    }

    fn clip_gradients(params: &[(String, Tensor)], clip: &GradClip) -> Result<()> {
        let tensors: Vec<&Tensor> = params.iter().map(|(_, t)| t).collect();
        match clip {
            GradClip::Norm {
                max_norm,
                norm_type,
            } => clip_grad_norm(&tensors, *max_norm, *norm_type).map(|_| ()),
            GradClip::Value { clip_value } => clip_grad_value(&tensors, *clip_value),
        }
    }

    fn no_grad<T>(f: impl FnOnce() -> T) -> T {
        tch::no_grad(f)
    }
}
