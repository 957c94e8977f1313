//! The libtorch side of [`Layer::Custom`](kiln_core::model::Layer::Custom): ops
//! registered by name, looked up when a [`TorchModel`](crate::TorchModel) is built.

use std::sync::Arc;

use kiln_core::{
    model::{CustomConfig, CustomLayerRegistry},
    Result,
};
use tch::Tensor;

/// A custom layer's computation on libtorch: the input, the layer's parameters in
/// declaration order, and its configuration (for the attributes). It must be
/// differentiable through autograd and return a tensor of the input's shape.
pub type CustomLayerFn = dyn Fn(&Tensor, &[&Tensor], &CustomConfig) -> Result<Tensor> + Send + Sync;

static REGISTRY: CustomLayerRegistry<CustomLayerFn> =
    CustomLayerRegistry::new("torch", "kiln_torch::register_custom_layer");

/// Makes `op` (`namespace::name`) available to [`Layer::Custom`](kiln_core::model::Layer::Custom)
/// layers built on libtorch. Registering a name again replaces its function, so
/// registering at start-up is idempotent. Models built before keep the function
/// they were built with.
///
/// ```
/// use kiln_core::{model::{CustomConfig, Init, Layer}, module::Module, Device};
/// use kiln_torch::{register_custom_layer, torch_error, TorchModel};
///
/// // A leaky ReLU with a learned slope, from built-in libtorch ops.
/// register_custom_layer("demo::learned_leaky_relu", |x, params, _config| {
///     let slope = params[0];
///     (|| x.f_relu()?.f_sub(&x.f_neg()?.f_relu()?.f_mul(slope)?))()
///         .map_err(|e| torch_error("demo::learned_leaky_relu", e))
/// });
/// let layer: Layer = CustomConfig::new("demo::learned_leaky_relu")
///     .with_param("slope", [1], Init::Constant { value: 0.1 })
///     .into();
/// let model = TorchModel::new(&layer, Device::Cpu)?;
/// let y = model.forward(&tch::Tensor::from_slice(&[-2.0f32, 3.0]))?;
/// assert_eq!(Vec::<f32>::try_from(&y).unwrap(), [-0.2, 3.0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn register_custom_layer<F>(op: &str, f: F)
where
    F: Fn(&Tensor, &[&Tensor], &CustomConfig) -> Result<Tensor> + Send + Sync + 'static,
{
    REGISTRY.register(op, Arc::new(f));
}

/// Whether `op` is registered with [`register_custom_layer`].
pub fn custom_layer_registered(op: &str) -> bool {
    REGISTRY.contains(op)
}

/// The function registered for the custom layer at `path`.
pub(crate) fn lookup(path: &str, op: &str) -> Result<Arc<CustomLayerFn>> {
    let field = if path.is_empty() {
        "op".to_owned()
    } else {
        format!("{path}.op")
    };
    REGISTRY.lookup(&field, op)
}
