//! [`TrainBackend`] for libtorch: what the generic [`kiln_core::Trainer`] needs.

use kiln_core::{
    Device, FloatPrecision, GradClip, Layer, Loss, OptimizerConfig, ParamGroup, Result,
    TrainBackend,
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
        use kiln_core::Module;
        TorchOptimizer::new(config.clone(), model.named_parameters(), groups)
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
