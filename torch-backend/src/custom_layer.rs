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

/// A custom op written in TorchScript from standard ops, for
/// [`export_torchscript`](crate::export_torchscript): the class name of the
/// layer's exported module and the statements of its
/// `forward(self, x: Tensor) -> Tensor`, ending in a `return`, which reach the
/// layer's parameters as `self.<name>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TorchScriptLowering {
    /// The module's class (`BiasGelu` becomes `__torch__.kiln.BiasGelu`).
    pub class: String,
    /// The body of `forward`, one statement per line (`return torch.mul(x, self.scale)`).
    pub forward: String,
}

/// Writes a custom layer's [`TorchScriptLowering`] from its configuration
/// (checking its parameters and attributes: an error refuses the export).
pub type TorchScriptLoweringFn = dyn Fn(&CustomConfig) -> Result<TorchScriptLowering> + Send + Sync;

static LOWERINGS: CustomLayerRegistry<TorchScriptLoweringFn> = CustomLayerRegistry::new(
    "TorchScript export",
    "kiln_torch::register_torchscript_lowering",
);

/// Registers how [`export_torchscript`](crate::export_torchscript) writes the
/// custom op `op` from standard TorchScript ops, so that Python loads the
/// file without Kiln's op library. The crate that defines an op registers it
/// beside the op's kernels (kiln-fused-ops' `register_layers` registers
/// `kiln::bias_gelu` and `kiln::swish`); registering a name again replaces it.
///
/// ```no_run
/// use kiln_core::model::{CustomConfig, Init, Layer};
/// use kiln_core::export::ExportOptions;
/// use kiln_torch::{export_torchscript, register_torchscript_lowering, TorchModel, TorchScriptLowering};
///
/// register_torchscript_lowering("demo::scale", |_config| {
///     Ok(TorchScriptLowering {
///         class: "Scale".into(),
///         forward: "return torch.mul(x, self.s)".into(),
///     })
/// });
/// # kiln_torch::register_custom_layer("demo::scale", |x, p, _| Ok(x * p[0]));
/// let layer = Layer::from(CustomConfig::new("demo::scale").with_param("s", [1], Init::Ones));
/// let model = TorchModel::new(&layer, kiln_core::Device::Cpu)?;
/// export_torchscript(&model, "scale.pt", &ExportOptions::default())?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn register_torchscript_lowering<F>(op: &str, lowering: F)
where
    F: Fn(&CustomConfig) -> Result<TorchScriptLowering> + Send + Sync + 'static,
{
    LOWERINGS.register(op, Arc::new(lowering));
}

/// Whether `op` has a TorchScript lowering ([`register_torchscript_lowering`]).
pub fn torchscript_lowering_registered(op: &str) -> bool {
    LOWERINGS.contains(op)
}

/// The TorchScript lowering registered for `op`.
pub(crate) fn torchscript_lowering(op: &str) -> Option<Arc<TorchScriptLoweringFn>> {
    LOWERINGS.get(op)
}
