//! `Layer::Custom` ops: Kiln's own fused ops as their standard-operator
//! decompositions (`kiln::bias_gelu`: `Gelu(x + bias)`, exact GELU, as
//! kiln-fused-ops' kernels compute it; `kiln::swish`: `x * Sigmoid(beta * x)`), and
//! the mappings users register with
//! [`OnnxExport::custom_op`](super::OnnxExport::custom_op).

use std::collections::HashMap;
use std::sync::Arc;

use kiln_core::model::{CustomConfig, Layer};
use kiln_core::DType;

use super::graph::attr;
use super::{Emitter, Value};
use crate::error::{Error, Result};
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

/// Kiln's own custom ops' mappings (kiln-fused-ops' `kiln::bias_gelu` and `kiln::swish`).
pub(crate) fn builtin() -> HashMap<String, Arc<CustomOpFn>> {
    let mut ops: HashMap<String, Arc<CustomOpFn>> = HashMap::new();
    // gelu(x + bias), exact (erf) GELU, bias on the last dimension.
    ops.insert(
        "kiln::bias_gelu".to_owned(),
        Arc::new(|op: &mut CustomOp<'_, '_>| {
            let bias = op.param("bias")?;
            let x = op.input().to_owned();
            let z = op.node("Add", &[&x, &bias], vec![]);
            Ok(op.node("Gelu", &[&z], vec![attr::string("approximate", "none")]))
        }),
    );
    // x * sigmoid(beta * x), beta of one element.
    ops.insert(
        "kiln::swish".to_owned(),
        Arc::new(|op: &mut CustomOp<'_, '_>| {
            let beta = op.param("beta")?;
            let x = op.input().to_owned();
            let bx = op.node("Mul", &[&beta, &x], vec![]);
            let s = op.node("Sigmoid", &[&bx], vec![]);
            Ok(op.node("Mul", &[&x, &s], vec![]))
        }),
    );
    ops
}

impl Emitter<'_> {
    pub(crate) fn custom_op(
        &mut self,
        path: &str,
        layer: &Layer,
        config: &CustomConfig,
        x: &Value,
    ) -> Result<String> {
        let Some(mapping) = self.custom.get(&config.op).cloned() else {
            return Err(Error::Unsupported {
                path: super::shown(path),
                layer: super::kind_of(layer),
                reason: format!(
                    "the custom op `{}` has no ONNX mapping; register one with \
                     OnnxExport::custom_op",
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
