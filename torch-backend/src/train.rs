//! [`TrainBackend`] for libtorch, what the generic `Trainer` of `kiln-train` needs,
//! and [`EagerBackend`], the primitives its steps are made of.

use kiln_core::{
    backend::{Backend, EagerBackend, StepPlan, TrainBackend},
    loss::Loss,
    model::Layer,
    optim::{GradClip, OptimizerConfig, ParamGroup},
    precision::FloatPrecision,
    Device, Error, HostTensor, Result,
};
use tch::Tensor;

use crate::backend::TorchBackend;
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
        Self::eager_train_step(model, optimizer, inputs, targets, plan)
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
