//! What the trainer needs from a backend beyond [`Backend`].

use crate::backend::Backend;
use crate::device::Device;
use crate::error::Result;
use crate::loss::Loss;
use crate::model::Layer;
use crate::module::Module;
use crate::optim::{GradClip, Optimizer, OptimizerConfig, ParamGroup};

/// A backend the [`Trainer`](super::Trainer) can drive: it builds models and
/// optimizers from Kiln definitions and computes losses, so one training script
/// runs on any backend that implements it.
pub trait TrainBackend: Backend {
    /// A model built from a [`Layer`] definition.
    type Model: Module<Self> + Send;
    /// The optimizer over such a model.
    type Optim: Optimizer<Self> + Send;

    /// Builds `spec` on `device` (initial weights from the backend's generator).
    fn build_model(spec: &Layer, device: Device) -> Result<Self::Model>;

    /// Builds an optimizer over `model`'s parameters.
    fn build_optimizer(
        config: &OptimizerConfig,
        model: &Self::Model,
        groups: &[ParamGroup],
    ) -> Result<Self::Optim>;

    /// `loss(output, target)`, a tensor that [`Backend::backward`] accepts.
    fn loss(loss: &Loss, output: &Self::Tensor, target: &Self::Tensor) -> Result<Self::Tensor>;

    /// `tensor * factor`, keeping the autograd graph (gradient accumulation scales losses).
    fn scale(tensor: &Self::Tensor, factor: f64) -> Result<Self::Tensor>;

    /// The value of a one-element tensor (one copy to the host).
    fn item(tensor: &Self::Tensor) -> Result<f64>;

    /// Clips the gradients of `params` in place.
    fn clip_gradients(params: &[(String, Self::Tensor)], clip: &GradClip) -> Result<()>;

    /// Runs `f` without recording operations for autograd (evaluation).
    fn no_grad<T>(f: impl FnOnce() -> T) -> T;
}
