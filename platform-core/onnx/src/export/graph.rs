//! The graph under construction: nodes with readable, unique names, weights
//! and constants as initializers, and the encoding of tensors and attributes.

use std::collections::{HashMap, HashSet};

use kiln_core::{DType, HostTensor};

use super::{Error, Result};
use crate::proto::{
    attribute_proto::AttributeType, tensor_proto::DataType, AttributeProto, NodeProto, TensorProto,
};

/// The ONNX element type of a Kiln dtype.
pub(crate) fn onnx_dtype(dtype: DType) -> DataType {
    match dtype {
        DType::U8 => DataType::Uint8,
        DType::I32 => DataType::Int32,
        DType::I64 => DataType::Int64,
        DType::F32 => DataType::Float,
        DType::F64 => DataType::Double,
        DType::BF16 => DataType::Bfloat16,
        DType::F16 => DataType::Float16,
        // DType is non-exhaustive; a new dtype needs its ONNX type here.
        _ => DataType::Undefined,
    }
}

/// A tensor initializer holding `tensor`'s bytes (little-endian `raw_data`).
pub(crate) fn tensor_proto(name: &str, tensor: &HostTensor) -> Result<TensorProto> {
    let data_type = onnx_dtype(tensor.dtype());
    if data_type == DataType::Undefined {
        return Err(Error::Invalid {
            what: format!("tensor `{name}`"),
            reason: format!("dtype {} has no ONNX element type", tensor.dtype()),
        });
    }
    Ok(TensorProto {
        name: Some(name.to_owned()),
        dims: tensor.dims().iter().map(|&d| d as i64).collect(),
        data_type: Some(data_type as i32),
        raw_data: Some(tensor.as_bytes().to_vec()),
        ..Default::default()
    })
}

/// Node attributes, by ONNX attribute type.
pub mod attr {
    use super::{AttributeProto, AttributeType};

    fn named(name: &str, kind: AttributeType) -> AttributeProto {
        AttributeProto {
            name: Some(name.to_owned()),
            r#type: Some(kind as i32),
            ..Default::default()
        }
    }

    /// An `INT` attribute.
    pub fn int(name: &str, value: i64) -> AttributeProto {
        AttributeProto {
            i: Some(value),
            ..named(name, AttributeType::Int)
        }
    }

    /// An `INTS` attribute.
    pub fn ints(name: &str, values: &[i64]) -> AttributeProto {
        AttributeProto {
            ints: values.to_vec(),
            ..named(name, AttributeType::Ints)
        }
    }

    /// A `FLOAT` attribute (ONNX attributes are single precision).
    pub fn float(name: &str, value: f64) -> AttributeProto {
        AttributeProto {
            f: Some(value as f32),
            ..named(name, AttributeType::Float)
        }
    }

    /// A `STRING` attribute.
    pub fn string(name: &str, value: &str) -> AttributeProto {
        AttributeProto {
            s: Some(value.as_bytes().to_vec()),
            ..named(name, AttributeType::String)
        }
    }
}

/// The nodes and initializers of the graph being built, and the float dtype
/// of the model (its weights'), in which constants are made.
pub(crate) struct Graph {
    pub(crate) nodes: Vec<NodeProto>,
    pub(crate) initializers: Vec<TensorProto>,
    /// Every name given to a node, value or initializer.
    taken: HashSet<String>,
    /// Initializers added from the state dict, by key.
    weights: HashMap<String, String>,
    pub(crate) float: DType,
}

/// `{path}/{label}`, or `label` at the root.
fn scoped(path: &str, label: &str) -> String {
    if path.is_empty() {
        label.to_owned()
    } else {
        format!("{path}/{label}")
    }
}

impl Graph {
    pub(crate) fn new(float: DType, reserved: &[&str]) -> Self {
        Graph {
            nodes: Vec::new(),
            initializers: Vec::new(),
            taken: reserved.iter().map(|s| (*s).to_owned()).collect(),
            weights: HashMap::new(),
            float,
        }
    }

    /// `base`, or `base_1`, `base_2`, ... : the first name not yet taken.
    fn unique(&mut self, base: String) -> String {
        let mut name = base.clone();
        let mut k = 1;
        while self.taken.contains(&name) {
            name = format!("{base}_{k}");
            k += 1;
        }
        self.taken.insert(name.clone());
        name
    }

    /// Appends an `op_type` node named `{path}/{op_type}` (made unique) with
    /// one output, and returns the output's name.
    pub(crate) fn op(
        &mut self,
        path: &str,
        op_type: &str,
        inputs: &[&str],
        attributes: Vec<AttributeProto>,
    ) -> String {
        self.op_n(path, op_type, inputs, attributes, 1).remove(0)
    }

    /// As [`op`](Graph::op), with `outputs` outputs.
    pub(crate) fn op_n(
        &mut self,
        path: &str,
        op_type: &str,
        inputs: &[&str],
        attributes: Vec<AttributeProto>,
        outputs: usize,
    ) -> Vec<String> {
        let name = self.unique(scoped(path, op_type));
        let outputs: Vec<String> = (0..outputs)
            .map(|i| self.unique(format!("{name}:{i}")))
            .collect();
        self.nodes.push(NodeProto {
            name: Some(name),
            op_type: Some(op_type.to_owned()),
            input: inputs.iter().map(|s| (*s).to_owned()).collect(),
            output: outputs.clone(),
            attribute: attributes,
            ..Default::default()
        });
        outputs
    }

    /// The initializer of state-dict entry `key`, added on first use under
    /// the key's own name (`0.weight`).
    pub(crate) fn weight(&mut self, key: &str, tensor: &HostTensor) -> Result<String> {
        if let Some(name) = self.weights.get(key) {
            return Ok(name.clone());
        }
        let name = self.unique(key.to_owned());
        self.initializers.push(tensor_proto(&name, tensor)?);
        self.weights.insert(key.to_owned(), name.clone());
        Ok(name)
    }

    /// A constant initializer named `{path}/{label}` holding `tensor`.
    pub(crate) fn constant(
        &mut self,
        path: &str,
        label: &str,
        tensor: &HostTensor,
    ) -> Result<String> {
        let name = self.unique(scoped(path, label));
        self.initializers.push(tensor_proto(&name, tensor)?);
        Ok(name)
    }

    /// An `int64` constant (shapes, axes, split sizes).
    pub(crate) fn ints(&mut self, path: &str, label: &str, values: &[i64]) -> Result<String> {
        let tensor = HostTensor::from_slice(values, [values.len()])?;
        self.constant(path, label, &tensor)
    }

    /// A constant of the model's float dtype with `dims`.
    pub(crate) fn floats(
        &mut self,
        path: &str,
        label: &str,
        values: &[f64],
        dims: &[usize],
    ) -> Result<String> {
        let tensor = HostTensor::from_slice(values, dims.to_vec())?.to_dtype(self.float);
        self.constant(path, label, &tensor)
    }

    /// A scalar constant of the model's float dtype.
    pub(crate) fn scalar(&mut self, path: &str, label: &str, value: f64) -> Result<String> {
        self.floats(path, label, &[value], &[])
    }

    /// Renames value `from` to `to` everywhere (the graph output gets the
    /// name the user asked for).
    pub(crate) fn rename(&mut self, from: &str, to: &str) {
        for node in &mut self.nodes {
            for name in node.input.iter_mut().chain(node.output.iter_mut()) {
                if name == from {
                    *name = to.to_owned();
                }
            }
        }
    }

    /// Whether a node produces `value`.
    pub(crate) fn produces(&self, value: &str) -> bool {
        self.nodes
            .iter()
            .any(|n| n.output.iter().any(|o| o == value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_and_value_names_are_readable_and_unique() {
        let mut g = Graph::new(DType::F32, &["input"]);
        let a = g.op("2.block.0", "Gemm", &["input"], vec![]);
        let b = g.op("2.block.0", "Gemm", &[&a], vec![]);
        let c = g.op("", "Relu", &[&b], vec![]);
        let names: Vec<_> = g
            .nodes
            .iter()
            .map(|n| n.name.clone().unwrap_or_default())
            .collect();
        assert_eq!(names, ["2.block.0/Gemm", "2.block.0/Gemm_1", "Relu"]);
        assert_eq!(
            [a.as_str(), b.as_str(), c.as_str()],
            ["2.block.0/Gemm:0", "2.block.0/Gemm_1:0", "Relu:0"]
        );
    }

    #[test]
    fn attributes_carry_their_type() {
        let a = attr::ints("pads", &[1, 2, 1, 2]);
        assert_eq!(a.r#type, Some(AttributeType::Ints as i32));
        assert_eq!(a.ints, [1, 2, 1, 2]);
        let f = attr::float("epsilon", 1e-5);
        assert_eq!(
            (f.r#type, f.f),
            (Some(AttributeType::Float as i32), Some(1e-5f32))
        );
        let s = attr::string("approximate", "tanh");
        assert_eq!(s.s.as_deref(), Some(b"tanh".as_slice()));
        assert_eq!(attr::int("axis", -1).i, Some(-1));
    }

    #[test]
    fn constants_take_the_model_dtype_and_weights_their_key() -> Result<()> {
        let mut g = Graph::new(DType::F64, &[]);
        let eps = g.scalar("1", "eps", 0.5)?;
        let w = HostTensor::new(vec![1.0f32, 2.0], [2])?;
        let name = g.weight("1.weight", &w)?;
        assert_eq!(g.weight("1.weight", &w)?, name, "added once");
        assert_eq!((eps.as_str(), name.as_str()), ("1/eps", "1.weight"));
        let t = &g.initializers[0];
        assert_eq!(t.data_type, Some(DataType::Double as i32));
        assert_eq!(t.raw_data.as_deref(), Some(0.5f64.to_le_bytes().as_slice()));
        assert_eq!(g.initializers[1].dims, [2]);
        assert_eq!(g.initializers.len(), 2);
        Ok(())
    }
}
