//! `Layer::Custom` ops: the lowerings to standard operators that the crates
//! defining the ops register ([`register_onnx_lowering`]), or that one export
//! is given ([`OnnxExport::custom_op`](super::OnnxExport::custom_op)).

use std::collections::HashMap;
use std::sync::Arc;

use kiln_core::model::{CustomConfig, CustomLayerRegistry, Layer};
use kiln_core::DType;

use super::{Emitter, Value};
use super::{Error, Result};
use crate::proto::AttributeProto;

/// A custom op's ONNX mapping: appends nodes through the [`CustomOp`] and
/// returns the name of the layer's output value (the input's shape).
pub type CustomOpFn = dyn Fn(&mut CustomOp<'_, '_>) -> Result<String> + Send + Sync;

/// What a custom op's mapping sees and can add to the graph: the layer (its
/// path and config), its input, its parameters as initializers, new nodes
/// (named `{path}/{op_type}`) and constants.
pub struct CustomOp<'e, 'a> {
    emitter: &'e mut Emitter<'a>,
    layer: &'e Layer,
    config: &'e CustomConfig,
    path: &'e str,
    input: &'e Value,
}

impl CustomOp<'_, '_> {
    /// The layer's path in the model (`""` at the root).
    pub fn path(&self) -> &str {
        self.path
    }

    /// The layer's config (op name, parameters, attributes).
    pub fn config(&self) -> &CustomConfig {
        self.config
    }

    /// The name of the layer's input value.
    pub fn input(&self) -> &str {
        &self.input.name
    }

    /// The input's shape for the example input (batch dimension included).
    pub fn input_shape(&self) -> &[usize] {
        &self.input.shape
    }

    /// The model's float dtype (the weights', and the input's).
    pub fn dtype(&self) -> DType {
        self.emitter.g.float
    }

    /// The initializer of the layer's parameter `name` (its state-dict key
    /// `{path}.{name}`).
    pub fn param(&mut self, name: &str) -> Result<String> {
        self.emitter.param(self.path, self.layer, name)
    }

    /// Appends an `op_type` node of the default domain and returns its output's name.
    pub fn node(
        &mut self,
        op_type: &str,
        inputs: &[&str],
        attributes: Vec<AttributeProto>,
    ) -> String {
        self.emitter.g.op(self.path, op_type, inputs, attributes)
    }

    /// A constant of the model's float dtype with `dims`, named `{path}/{label}`.
    pub fn constant(&mut self, label: &str, values: &[f64], dims: &[usize]) -> Result<String> {
        self.emitter.g.floats(self.path, label, values, dims)
    }

    /// An `int64` vector constant (shapes, axes), named `{path}/{label}`.
    pub fn constant_i64(&mut self, label: &str, values: &[i64]) -> Result<String> {
        self.emitter.g.ints(self.path, label, values)
    }
}

/// The ONNX lowerings registered by the crates that define custom ops.
static LOWERINGS: CustomLayerRegistry<CustomOpFn> =
    CustomLayerRegistry::new("ONNX", "kiln_onnx::register_onnx_lowering");

/// Registers the ONNX lowering of the custom op `op` (a [`Layer::Custom`]'s
/// `op`, such as `"my::scale"`), used by every later export: `lowering`
/// appends standard ONNX nodes through the [`CustomOp`] it is given and
/// returns the name of the layer's output value, which must have the input's
/// shape. The crate that defines an op registers it beside the op's kernels
/// (kiln-fused-ops' `register_layers` registers `kiln::bias_gelu` and
/// `kiln::swish`); registering a name again replaces its lowering.
///
/// ```
/// use kiln_core::{export::ExportOptions, model::{CustomConfig, Init, Layer}, state_dict::StateDict, HostTensor};
/// use kiln_onnx::{register_onnx_lowering, OnnxExport};
///
/// register_onnx_lowering("demo::scale", |op| {
///     let s = op.param("s")?;
///     let x = op.input().to_owned();
///     Ok(op.node("Mul", &[&x, &s], vec![]))
/// });
/// let net = Layer::from(CustomConfig::new("demo::scale").with_param("s", [1], Init::Ones));
/// let mut state = StateDict::new();
/// state.insert("s", HostTensor::new(vec![2.0f32], [1])?);
/// let model = OnnxExport::new(&net, &state, &ExportOptions::new(&[2, 3])).to_model()?;
/// assert_eq!(model.graph.unwrap().node[0].op_type.as_deref(), Some("Mul"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn register_onnx_lowering<F>(op: &str, lowering: F)
where
    F: Fn(&mut CustomOp<'_, '_>) -> Result<String> + Send + Sync + 'static,
{
    LOWERINGS.register(op, Arc::new(lowering));
}

/// Whether `op` has a registered ONNX lowering ([`register_onnx_lowering`]).
pub fn onnx_lowering_registered(op: &str) -> bool {
    LOWERINGS.contains(op)
}

/// The lowering of `op`: the export's own (`overrides`), else the registered one.
pub(crate) fn lowering(
    overrides: &HashMap<String, Arc<CustomOpFn>>,
    op: &str,
) -> Option<Arc<CustomOpFn>> {
    overrides.get(op).cloned().or_else(|| LOWERINGS.get(op))
}

impl Emitter<'_> {
    pub(crate) fn custom_op(
        &mut self,
        path: &str,
        layer: &Layer,
        config: &CustomConfig,
        x: &Value,
    ) -> Result<String> {
        let Some(mapping) = lowering(self.custom, &config.op) else {
            return Err(Error::Unsupported {
                format: kiln_core::export::ExportFormat::Onnx,
                path: super::shown(path),
                layer: super::kind_of(layer),
                reason: format!(
                    "the custom op `{}` has no ONNX lowering; register one with \
                     kiln_onnx::register_onnx_lowering",
                    config.op
                ),
            });
        };
        let mut op = CustomOp {
            emitter: self,
            layer,
            config,
            path,
            input: x,
        };
        mapping(&mut op)
    }
}
