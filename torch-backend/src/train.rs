//! [`TrainBackend`] for libtorch, what the generic `Trainer` of `kiln-train` needs,
//! and [`EagerBackend`], the primitives its steps are made of.

use std::sync::Arc;

use kiln_core::{
    backend::{Backend, EagerBackend, StepLoss, StepPlan, TrainBackend, Trainable},
    distributed::{Collectives, DistributedOptions},
    loss::Loss,
    model::Layer,
    module::Module,
    optim::{GradClip, OptimizerConfig, ParamGroup},
    precision::{FloatPrecision, LossScaling},
    Device, Error, HostTensor, Result,
};
use tch::Tensor;

use crate::backend::TorchBackend;
use crate::custom::{Chain, TchModule};
use crate::distributed::{DistributedDataParallel, ProcessGroup};
use crate::error::torch_error;
use crate::freeze::Freeze;
use crate::loss::compute_loss;
use crate::model::TorchModel;
use crate::optim::{clip_grad_norm, clip_grad_norm_on_device, clip_grad_value, TorchOptimizer};
use crate::script::ScriptModule;

impl TrainBackend for TorchBackend {
    type Model = TorchModel;
    type Optim = TorchOptimizer;

    fn build_model(spec: &Layer, device: Device) -> Result<TorchModel> {
        TorchModel::new(spec, device)
    }

    fn set_precision(model: &mut TorchModel, precision: FloatPrecision) -> Result<()> {
        model.set_precision(precision)
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

    /// DDP on `c10d::Reducer` ([`DistributedDataParallel`]) over the c10d
    /// group `group` must be (a `kiln_torch::distributed::ProcessGroup`).
    fn distribute(
        model: &mut TorchModel,
        group: Arc<dyn Collectives>,
        options: &DistributedOptions,
    ) -> Result<()> {
        let group = group.into_any().downcast::<ProcessGroup>().map_err(|_| {
            Error::unsupported(
                "data-parallel torch training over a group that is not a \
                 kiln_torch::distributed::ProcessGroup",
            )
        })?;
        if model.device().is_cuda() != group.has_nccl() {
            return Err(Error::invalid_argument(
                "distributed.backend",
                format!(
                    "the model is on {} but the group's backend is {}: Gloo for CPU \
                     training, NCCL for CUDA",
                    model.device(),
                    if group.has_nccl() { "nccl" } else { "gloo" }
                ),
            ));
        }
        // DDP reduces the parameters that require gradients; every parameter
        // (frozen ones included) and buffer is rank 0's from the start.
        let ddp = DistributedDataParallel::new(
            group,
            &model.named_parameters()?,
            &model.named_buffers()?,
            options,
        )?;
        model.set_distributed(ddp);
        Ok(())
    }
}

/// The elements of a torch module's parameters that require gradients.
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

    fn precision(&self) -> FloatPrecision {
        TorchModel::precision(self)
    }

    /// [`EagerBackend::eager_train_step`]: forward, loss, backward, clipping and
    /// the optimizer step, op by op; with DDP's hooks when data-parallel.
    fn train_step(
        &mut self,
        optimizer: &mut TorchOptimizer,
        inputs: &Tensor,
        targets: &Tensor,
        plan: &StepPlan<'_>,
    ) -> Result<f64> {
        match self.distributed().cloned() {
            Some(ddp) => data_parallel_step(&ddp, self, optimizer, inputs, targets, plan),
            None => {
                eager_step(self, optimizer, inputs, targets, plan, false)?.value::<TorchBackend>()
            }
        }
    }

    /// The eager step without reading the loss back (data-parallel training
    /// reads it: the ranks average it).
    fn train_step_deferred(
        &mut self,
        optimizer: &mut TorchOptimizer,
        inputs: &Tensor,
        targets: &Tensor,
        plan: &StepPlan<'_>,
    ) -> Result<StepLoss<Tensor>> {
        match self.distributed().cloned() {
            Some(ddp) => {
                data_parallel_step(&ddp, self, optimizer, inputs, targets, plan).map(StepLoss::Host)
            }
            None => eager_step(self, optimizer, inputs, targets, plan, true),
        }
    }

    fn sync_buffers(&mut self) -> Result<()> {
        match self.distributed() {
            Some(ddp) => ddp.sync_buffers(),
            None => Ok(()),
        }
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

            fn train_step(
                &mut self,
                optimizer: &mut TorchOptimizer,
                inputs: &Tensor,
                targets: &Tensor,
                plan: &StepPlan<'_>,
            ) -> Result<f64> {
                eager_step(self, optimizer, inputs, targets, plan, false)?
                    .value::<TorchBackend>()
            }

            fn train_step_deferred(
                &mut self,
                optimizer: &mut TorchOptimizer,
                inputs: &Tensor,
                targets: &Tensor,
                plan: &StepPlan<'_>,
            ) -> Result<StepLoss<Tensor>> {
                eager_step(self, optimizer, inputs, targets, plan, true)
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

/// One training micro-batch of a torch module, op by op: forward, loss, the
/// backward pass of the loss times `plan.scale` and the optimizer's loss scale
/// (`16-mixed`), and when the micro-batch applies, [`apply_update`].
///
/// Unless `deferred`, the loss is read first and a non-finite one returned with
/// nothing changed ([`Trainable::train_step`]'s contract). When `deferred`,
/// nothing is read back from the device (clipping included), and the loss comes
/// back as a detached tensor; only loss scaling's skip decision may read one flag
/// (see [`TorchOptimizer::set_loss_scaling`]).
fn eager_step<M: Module<TorchBackend> + ?Sized>(
    model: &M,
    optimizer: &mut TorchOptimizer,
    inputs: &Tensor,
    targets: &Tensor,
    plan: &StepPlan<'_>,
    deferred: bool,
) -> Result<StepLoss<Tensor>> {
    let output = model.forward(inputs)?;
    let loss = TorchBackend::loss(plan.loss, &output, targets)?;
    let result = if deferred {
        StepLoss::Device(
            loss.f_detach()
                .map_err(|e| torch_error("keeping the loss", e))?,
        )
    } else {
        let value = TorchBackend::item(&loss)?;
        if !value.is_finite() {
            return Ok(StepLoss::Host(value));
        }
        StepLoss::Host(value)
    };
    let scaled = if plan.scale == 1.0 {
        loss
    } else {
        TorchBackend::scale(&loss, plan.scale)?
    };
    TorchBackend::backward(&optimizer.scale_loss(&scaled)?)?;
    if plan.apply {
        apply_update(model, optimizer, plan.clip, deferred)?;
    }
    Ok(result)
}

/// The end of a micro-batch that applies: under loss scaling the gradients are
/// unscaled first, so that clipping sees their true values (`scaler.unscale_`
/// before `clip_grad_norm_`); then clipping (on the device when `on_device`: no
/// norm read back) and the optimizer step, which under loss scaling skips
/// inf/NaN gradients and updates the scale.
fn apply_update<M: Module<TorchBackend> + ?Sized>(
    model: &M,
    optimizer: &mut TorchOptimizer,
    clip: Option<&GradClip>,
    on_device: bool,
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
            _ => TorchBackend::clip_gradients(&params, clip)?,
        }
    }
    optimizer.step()
}

/// [`EagerBackend::eager_train_step`] with DDP's hooks around the forward pass
/// and the loss averaged over the ranks, which also makes every rank take the
/// same decision on a non-finite loss. That average runs during the backward
/// pass (every rank runs it: a rank that skipped it would leave the others
/// waiting for its gradients), so when the mean loss is not finite, parameters
/// and optimizer state are unchanged but this micro-batch's gradients were
/// added (the trainer then stops with `NonFiniteLoss`).
fn data_parallel_step(
    ddp: &DistributedDataParallel,
    model: &mut TorchModel,
    optimizer: &mut TorchOptimizer,
    inputs: &Tensor,
    targets: &Tensor,
    plan: &StepPlan<'_>,
) -> Result<f64> {
    ddp.before_forward(plan.apply)?;
    let output = model.forward(inputs)?;
    let loss = TorchBackend::loss(plan.loss, &output, targets)?;
    let mean = ddp.start_mean(TorchBackend::item(&loss)?)?;
    let scaled = if plan.scale == 1.0 {
        loss
    } else {
        TorchBackend::scale(&loss, plan.scale)?
    };
    let scaled = optimizer.scale_loss(&scaled)?;
    ddp.after_forward(&scaled, plan.apply)?;
    TorchBackend::backward(&scaled).map_err(
        |e| {
            if plan.apply {
                ddp.backward_error(e)
            } else {
                e
            }
        },
    )?;
    let value = mean.value()?;
    if !value.is_finite() {
        return Ok(value);
    }
    if plan.apply {
        apply_update(model, optimizer, plan.clip, false)?;
    }
    Ok(value)
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

    fn loss(loss: &Loss, output: &Tensor, target: &Tensor) -> Result<Tensor> {
        compute_loss(loss, output, target)
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
