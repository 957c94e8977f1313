//! [`TrainBackend`] for libtorch, what the generic `Trainer` of `kiln-train` needs,
//! and [`EagerBackend`], the primitives its steps are made of.

use std::sync::Arc;

use kiln_core::{
    backend::{Backend, EagerBackend, StepPlan, TrainBackend},
    distributed::{Collectives, DistributedOptions},
    loss::Loss,
    model::Layer,
    optim::{GradClip, OptimizerConfig, ParamGroup},
    precision::FloatPrecision,
    Device, Error, HostTensor, Result,
};
use tch::Tensor;

use crate::backend::TorchBackend;
use crate::distributed::{DistributedDataParallel, ProcessGroup};
use crate::error::torch_error;
use crate::loss::compute_loss;
use crate::model::TorchModel;
use crate::optim::{clip_grad_norm, clip_grad_value, TorchOptimizer};

impl TrainBackend for TorchBackend {
    type Model = TorchModel;
    type Optim = TorchOptimizer;

    fn build_model(spec: &Layer, device: Device) -> Result<TorchModel> {
        TorchModel::new(spec, device)
    }

    fn set_precision(model: &mut TorchModel, precision: FloatPrecision) -> Result<()> {
        model.set_precision(precision)
    }

    fn precision(model: &TorchModel) -> FloatPrecision {
        model.precision()
    }

    fn build_optimizer(
        config: &OptimizerConfig,
        model: &TorchModel,
        groups: &[ParamGroup],
    ) -> Result<TorchOptimizer> {
        use kiln_core::module::Module;
        TorchOptimizer::new(config.clone(), model.named_parameters()?, groups)
    }

    /// [`EagerBackend::eager_train_step`]: forward, loss, backward, clipping and
    /// the optimizer step, op by op.
    fn train_step(
        model: &mut TorchModel,
        optimizer: &mut TorchOptimizer,
        inputs: &Tensor,
        targets: &Tensor,
        plan: &StepPlan<'_>,
    ) -> Result<f64> {
        match model.distributed().cloned() {
            Some(ddp) => data_parallel_step(&ddp, model, optimizer, inputs, targets, plan),
            None => Self::eager_train_step(model, optimizer, inputs, targets, plan),
        }
    }

    fn sync_buffers(model: &mut TorchModel) -> Result<()> {
        match model.distributed() {
            Some(ddp) => ddp.sync_buffers(),
            None => Ok(()),
        }
    }

    /// DDP on `c10d::Reducer` ([`DistributedDataParallel`]) over the c10d
    /// group `group` must be (a `kiln_torch::distributed::ProcessGroup`).
    fn distribute(
        model: &mut TorchModel,
        group: Arc<dyn Collectives>,
        options: &DistributedOptions,
    ) -> Result<()> {
        use kiln_core::module::Module;
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
        let ddp = DistributedDataParallel::new(
            group,
            &model.named_parameters()?,
            &model.named_buffers()?,
            options,
        )?;
        model.set_distributed(ddp);
        Ok(())
    }

    fn eval_step(
        model: &TorchModel,
        loss: &Loss,
        inputs: &Tensor,
        targets: &Tensor,
    ) -> Result<(f64, HostTensor)> {
        Self::eager_eval_step(model, loss, inputs, targets)
    }

    fn predict_step(model: &TorchModel, inputs: &Tensor) -> Result<HostTensor> {
        Self::eager_predict_step(model, inputs)
    }
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
    use kiln_core::{module::Module, optim::Optimizer};
    ddp.before_forward(plan.apply)?;
    let output = model.forward(inputs)?;
    let loss = TorchBackend::loss(plan.loss, &output, targets)?;
    let mean = ddp.start_mean(TorchBackend::item(&loss)?)?;
    let scaled = if plan.scale == 1.0 {
        loss
    } else {
        TorchBackend::scale(&loss, plan.scale)?
    };
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
        if let Some(clip) = plan.clip {
            TorchBackend::clip_gradients(&model.named_parameters()?, clip)?;
        }
        optimizer.step()?;
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
