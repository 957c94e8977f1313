//! What an ONNX file declares, read without running it: IR version, opsets,
//! producer, the graph's inputs and outputs with their dtypes and shapes, the
//! operators it uses and how many parameters it holds.
//!
//! ```no_run
//! let info = kiln_onnx::ModelInfo::read("model.onnx")?;
//! for input in &info.inputs {
//!     println!("{input}"); // x: float32 [batch, 4]
//! }
//! println!("{info}"); // the summary `kiln inspect model.onnx` prints
//! # Ok::<(), kiln_onnx::Error>(())
//! ```

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};

use kiln_core::DType;
use prost::Message;

use crate::error::{Error, Result};
use crate::proto::{self, tensor_proto::DataType, type_proto, TypeProto, ValueInfoProto};

/// One dimension of a declared tensor shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Dim {
    /// A fixed size (`dim_value`).
    Fixed(usize),
    /// A named size fixed at run time (`dim_param`, like `"batch"`); inputs
    /// sharing a name must agree on it.
    Symbolic(String),
    /// A size the file leaves open (neither a value nor a name).
    Unknown,
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Symbolic(s) => f.write_str(s),
            Dim::Unknown => f.write_str("?"),
        }
    }
}

/// A graph input or output as the file declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The value's name in the graph.
    pub name: String,
    /// The element type, or `None` where Kiln has no such dtype (`bool`,
    /// `string`, `int8`, ...) or the value is not a tensor; [`type_name`](Self::type_name)
    /// then says what it is.
    pub dtype: Option<DType>,
    /// The type's name: Kiln's dtype name (`float32`, `int64`) for tensors of
    /// a Kiln dtype, otherwise the ONNX element name in lowercase (`bool`,
    /// `string`, `int8`), or the kind for other values (`sequence(float32)`,
    /// `map(int64,float32)`, `optional(float32)`, `sparse_tensor(float32)`,
    /// `opaque`), or `undefined`.
    pub type_name: String,
    /// The declared dimensions (empty for a scalar or where [`ranked`](Self::ranked) is false).
    pub shape: Vec<Dim>,
    /// Whether the file declares a shape (and so a rank); when false any rank is accepted.
    pub ranked: bool,
}

impl TensorInfo {
    /// The declared shape as text: `[batch, 4]`, `[]` for a scalar, `[*]` when
    /// no shape is declared.
    pub fn shape_string(&self) -> String {
        if !self.ranked {
            return "[*]".to_string();
        }
        let dims: Vec<String> = self.shape.iter().map(Dim::to_string).collect();
        format!("[{}]", dims.join(", "))
    }
}

impl fmt::Display for TensorInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} {}",
            self.name,
            self.type_name,
            self.shape_string()
        )
    }
}

/// One operator set the model imports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opset {
    /// The domain, `ai.onnx` for the default (empty) domain.
    pub domain: String,
    /// The opset version.
    pub version: i64,
}

/// What an ONNX file declares: read with [`ModelInfo::read`] (or
/// [`ModelInfo::from_bytes`]); its `Display` is a readable multi-line summary.
///
/// Counts are of the main graph (nodes inside `If`/`Loop` bodies and local
/// functions are not counted).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// The file it was read from (as given).
    pub path: PathBuf,
    /// The ONNX IR version (`ir_version`); ONNX Runtime 1.31 reads up to 13.
    pub ir_version: i64,
    /// The imported opsets, in file order.
    pub opsets: Vec<Opset>,
    /// `producer_name` (empty if absent).
    pub producer_name: String,
    /// `producer_version` (empty if absent).
    pub producer_version: String,
    /// The main graph's name (empty if absent).
    pub graph_name: String,
    /// The graph inputs that are not initializers, in graph order.
    pub inputs: Vec<TensorInfo>,
    /// The graph outputs, in graph order.
    pub outputs: Vec<TensorInfo>,
    /// Number of nodes of the main graph.
    pub node_count: usize,
    /// How many nodes use each operator, keyed by `op_type` (`domain::op_type`
    /// outside the default domain).
    pub op_types: BTreeMap<String, usize>,
    /// Number of initializers (dense and sparse).
    pub initializer_count: usize,
    /// Total elements of all initializers (saturating at `u64::MAX`).
    pub parameter_count: u64,
}

impl ModelInfo {
    /// Reads and checks the ONNX model file at `path`.
    ///
    /// Fails with [`Error::Io`] when the file cannot be read and with
    /// [`Error::InvalidModel`] (naming the path and what was found) when it is
    /// truncated, not protobuf, or protobuf that is not an ONNX model.
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Error::io("reading", path, e))?;
        Self::from_bytes(&bytes, path)
    }

    /// Decodes and checks a serialized `ModelProto`; `path` names it in errors.
    ///
    /// Never panics, whatever the bytes.
    pub fn from_bytes(bytes: &[u8], path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let model = decode_model(bytes, path)?;
        Self::from_proto(&model, path)
    }

    /// Summarises an already decoded model, after the same checks as
    /// [`from_bytes`](Self::from_bytes).
    pub fn from_proto(model: &proto::ModelProto, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let invalid = |reason: String| Error::InvalidModel {
            path: path.to_path_buf(),
            reason,
        };
        let ir_version = model.ir_version.unwrap_or(0);
        let Some(graph) = model.graph.as_ref() else {
            return Err(invalid(format!(
                "it decodes as protobuf but has no graph (ir_version {ir_version}, {} opset imports): \
                 not an ONNX model",
                model.opset_import.len()
            )));
        };
        if ir_version <= 0 {
            return Err(invalid(format!(
                "ir_version is {ir_version}; an ONNX model has a positive IR version \
                 (graph '{}' with {} nodes)",
                graph.name(),
                graph.node.len()
            )));
        }
        if model.opset_import.is_empty() {
            return Err(invalid(format!(
                "it has no opset_import (IR version {ir_version}); every ONNX model imports \
                 at least the default opset (is the file truncated?)"
            )));
        }
        let opsets = model
            .opset_import
            .iter()
            .map(|o| Opset {
                domain: match o.domain() {
                    "" => "ai.onnx".to_string(),
                    d => d.to_string(),
                },
                version: o.version(),
            })
            .collect();

        let initializer_names: HashSet<&str> = graph
            .initializer
            .iter()
            .map(|t| t.name())
            .chain(
                graph
                    .sparse_initializer
                    .iter()
                    .filter_map(|s| s.values.as_ref().map(|v| v.name())),
            )
            .collect();
        let inputs = graph
            .input
            .iter()
            .filter(|v| !initializer_names.contains(v.name()))
            .map(tensor_info)
            .collect();
        let outputs = graph.output.iter().map(tensor_info).collect();

        let mut op_types = BTreeMap::new();
        for node in &graph.node {
            let key = match node.domain() {
                "" | "ai.onnx" => node.op_type().to_string(),
                d => format!("{d}::{}", node.op_type()),
            };
            *op_types.entry(key).or_insert(0) += 1;
        }

        let mut parameter_count = 0u64;
        for t in &graph.initializer {
            let n = element_count(&t.dims).ok_or_else(|| {
                invalid(format!("initializer '{}' has dims {:?}", t.name(), t.dims))
            })?;
            parameter_count = parameter_count.saturating_add(n);
        }
        for s in &graph.sparse_initializer {
            let name = s.values.as_ref().map_or("", |v| v.name());
            let n = element_count(&s.dims).ok_or_else(|| {
                invalid(format!("sparse initializer '{name}' has dims {:?}", s.dims))
            })?;
            parameter_count = parameter_count.saturating_add(n);
        }

        Ok(ModelInfo {
            path: path.to_path_buf(),
            ir_version,
            opsets,
            producer_name: model.producer_name().to_string(),
            producer_version: model.producer_version().to_string(),
            graph_name: graph.name().to_string(),
            inputs,
            outputs,
            node_count: graph.node.len(),
            op_types,
            initializer_count: graph.initializer.len() + graph.sparse_initializer.len(),
            parameter_count,
        })
    }

    /// The version of the default-domain (`ai.onnx`) opset, if imported.
    pub fn default_opset(&self) -> Option<i64> {
        self.opsets
            .iter()
            .find(|o| o.domain == "ai.onnx")
            .map(|o| o.version)
    }
}

/// Decodes `bytes` as a `ModelProto`, mapping failures to [`Error::InvalidModel`].
pub(crate) fn decode_model(bytes: &[u8], path: &Path) -> Result<proto::ModelProto> {
    let invalid = |reason: String| Error::InvalidModel {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.is_empty() {
        return Err(invalid("the file is empty (0 bytes)".to_string()));
    }
    proto::ModelProto::decode(bytes).map_err(|e| {
        let start = &bytes[..bytes.len().min(16)];
        let looks_like_text = start
            .iter()
            .all(|b| b.is_ascii_graphic() || b.is_ascii_whitespace());
        invalid(format!(
            "its {} bytes are not a protobuf ModelProto ({e}); it {}",
            bytes.len(),
            if looks_like_text {
                format!("starts with the text {:?}", String::from_utf8_lossy(start))
            } else {
                "may be truncated or not an ONNX file".to_string()
            }
        ))
    })
}

/// Product of `dims` as u64, `None` if one is negative (saturating on overflow).
fn element_count(dims: &[i64]) -> Option<u64> {
    dims.iter().try_fold(1u64, |acc, &d| {
        u64::try_from(d).ok().map(|d| acc.saturating_mul(d))
    })
}

/// The Kiln dtype of an ONNX element type, if Kiln has it.
pub(crate) fn kiln_dtype(elem_type: i32) -> Option<DType> {
    match DataType::try_from(elem_type).ok()? {
        DataType::Float => Some(DType::F32),
        DataType::Double => Some(DType::F64),
        DataType::Int32 => Some(DType::I32),
        DataType::Int64 => Some(DType::I64),
        DataType::Uint8 => Some(DType::U8),
        DataType::Float16 => Some(DType::F16),
        DataType::Bfloat16 => Some(DType::BF16),
        _ => None,
    }
}

/// Name of an ONNX element type: Kiln's name where Kiln has the dtype, else ONNX's in lowercase.
fn elem_type_name(elem_type: i32) -> String {
    if let Some(d) = kiln_dtype(elem_type) {
        return d.name().to_string();
    }
    match DataType::try_from(elem_type) {
        Ok(t) => t.as_str_name().to_ascii_lowercase(),
        Err(_) => format!("unknown element type {elem_type}"),
    }
}

/// Name of an ONNX type (`float32`, `sequence(float32)`, ...).
fn type_name(tp: Option<&TypeProto>) -> String {
    match tp.and_then(|t| t.value.as_ref()) {
        None => "undefined".to_string(),
        Some(type_proto::Value::TensorType(t)) => elem_type_name(t.elem_type()),
        Some(type_proto::Value::SparseTensorType(t)) => {
            format!("sparse_tensor({})", elem_type_name(t.elem_type()))
        }
        Some(type_proto::Value::SequenceType(s)) => {
            format!("sequence({})", type_name(s.elem_type.as_deref()))
        }
        Some(type_proto::Value::OptionalType(o)) => {
            format!("optional({})", type_name(o.elem_type.as_deref()))
        }
        Some(type_proto::Value::MapType(m)) => format!(
            "map({},{})",
            elem_type_name(m.key_type()),
            type_name(m.value_type.as_deref())
        ),
        Some(type_proto::Value::OpaqueType(_)) => "opaque".to_string(),
    }
}

/// The [`TensorInfo`] of a graph input or output.
fn tensor_info(v: &ValueInfoProto) -> TensorInfo {
    let tensor = match v.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => Some(t),
        _ => None,
    };
    let dtype = tensor.and_then(|t| kiln_dtype(t.elem_type()));
    let shape = tensor.and_then(|t| t.shape.as_ref());
    let dims = shape
        .map(|s| {
            s.dim
                .iter()
                .map(|d| match &d.value {
                    Some(proto::tensor_shape_proto::dimension::Value::DimValue(n)) => {
                        usize::try_from(*n).map_or(Dim::Unknown, Dim::Fixed)
                    }
                    Some(proto::tensor_shape_proto::dimension::Value::DimParam(p))
                        if !p.is_empty() =>
                    {
                        Dim::Symbolic(p.clone())
                    }
                    _ => Dim::Unknown,
                })
                .collect()
        })
        .unwrap_or_default();
    TensorInfo {
        name: v.name().to_string(),
        dtype,
        type_name: type_name(v.r#type.as_ref()),
        shape: dims,
        ranked: shape.is_some(),
    }
}

/// Groups digits in threes: `1234567` -> `1,234,567`.
fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

impl fmt::Display for ModelInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "ONNX model {}", self.path.display())?;
        let opsets: Vec<String> = self
            .opsets
            .iter()
            .map(|o| format!("{} {}", o.domain, o.version))
            .collect();
        writeln!(
            f,
            "  IR version {}, opsets: {}",
            self.ir_version,
            opsets.join(", ")
        )?;
        let producer = match (self.producer_name.as_str(), self.producer_version.as_str()) {
            ("", "") => "(not recorded)".to_string(),
            (name, "") => name.to_string(),
            (name, version) => format!("{name} {version}"),
        };
        writeln!(f, "  producer: {producer}")?;
        if !self.graph_name.is_empty() {
            writeln!(f, "  graph: {}", self.graph_name)?;
        }
        for (title, values) in [("inputs", &self.inputs), ("outputs", &self.outputs)] {
            writeln!(f, "  {title} ({}):", values.len())?;
            for v in values {
                writeln!(f, "    {v}")?;
            }
        }
        let ops: Vec<String> = self
            .op_types
            .iter()
            .map(|(op, n)| format!("{op} x{n}"))
            .collect();
        writeln!(f, "  nodes: {} ({})", self.node_count, ops.join(", "))?;
        write!(
            f,
            "  initializers: {} ({} parameters)",
            self.initializer_count,
            thousands(self.parameter_count)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{
        tensor_shape_proto::{dimension, Dimension},
        GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto, TensorShapeProto,
    };

    fn value(name: &str, elem: DataType, dims: &[Option<&str>]) -> ValueInfoProto {
        let dim = dims
            .iter()
            .map(|d| Dimension {
                value: d.map(|s| match s.parse::<i64>() {
                    Ok(n) => dimension::Value::DimValue(n),
                    Err(_) => dimension::Value::DimParam(s.to_string()),
                }),
                ..Default::default()
            })
            .collect();
        ValueInfoProto {
            name: Some(name.to_string()),
            r#type: Some(TypeProto {
                value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                    elem_type: Some(elem as i32),
                    shape: Some(TensorShapeProto { dim }),
                })),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn model() -> ModelProto {
        let weight = TensorProto {
            name: Some("w".to_string()),
            dims: vec![3, 4],
            data_type: Some(DataType::Float as i32),
            float_data: vec![0.0; 12],
            ..Default::default()
        };
        ModelProto {
            ir_version: Some(10),
            producer_name: Some("unit".to_string()),
            opset_import: vec![OperatorSetIdProto {
                domain: Some(String::new()),
                version: Some(21),
            }],
            graph: Some(GraphProto {
                name: Some("g".to_string()),
                node: vec![
                    NodeProto {
                        op_type: Some("MatMul".to_string()),
                        ..Default::default()
                    },
                    NodeProto {
                        op_type: Some("Relu".to_string()),
                        ..Default::default()
                    },
                    NodeProto {
                        op_type: Some("Relu".to_string()),
                        ..Default::default()
                    },
                    NodeProto {
                        op_type: Some("bias_gelu".to_string()),
                        domain: Some("kiln".to_string()),
                        ..Default::default()
                    },
                ],
                initializer: vec![weight],
                // IR < 4 style: the initializer is listed as an input too.
                input: vec![
                    value("x", DataType::Float, &[Some("batch"), Some("4"), None]),
                    value("w", DataType::Float, &[Some("3"), Some("4")]),
                    value("mask", DataType::Bool, &[Some("batch")]),
                ],
                output: vec![value("y", DataType::Double, &[])],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn summarises_a_model() {
        let bytes = model().encode_to_vec();
        let info = ModelInfo::from_bytes(&bytes, "m.onnx").unwrap();
        assert_eq!(info.ir_version, 10);
        assert_eq!(info.default_opset(), Some(21));
        assert_eq!(info.inputs.len(), 2, "initializer 'w' is not an input");
        assert_eq!(info.inputs[0].dtype, Some(DType::F32));
        assert_eq!(
            info.inputs[0].shape,
            vec![Dim::Symbolic("batch".into()), Dim::Fixed(4), Dim::Unknown]
        );
        assert_eq!(info.inputs[1].dtype, None);
        assert_eq!(info.inputs[1].type_name, "bool");
        assert_eq!(info.outputs[0].dtype, Some(DType::F64));
        assert!(info.outputs[0].ranked && info.outputs[0].shape.is_empty());
        assert_eq!(info.node_count, 4);
        assert_eq!(info.op_types["Relu"], 2);
        assert_eq!(info.op_types["kiln::bias_gelu"], 1);
        assert_eq!(info.initializer_count, 1);
        assert_eq!(info.parameter_count, 12);
        let text = info.to_string();
        assert!(text.contains("x: float32 [batch, 4, ?]"), "{text}");
        assert!(text.contains("mask: bool [batch]"), "{text}");
        assert!(text.contains("y: float64 []"), "{text}");
        assert!(text.contains("Relu x2"), "{text}");
        assert!(text.contains("ai.onnx 21"), "{text}");
    }

    #[test]
    fn protobuf_that_is_not_onnx_is_invalid() {
        let mut m = model();
        m.graph = None;
        let err = ModelInfo::from_bytes(&m.encode_to_vec(), "a.onnx").unwrap_err();
        assert!(err.to_string().contains("no graph"), "{err}");
        let mut m = model();
        m.ir_version = None;
        let err = ModelInfo::from_bytes(&m.encode_to_vec(), "a.onnx").unwrap_err();
        assert!(err.to_string().contains("ir_version is 0"), "{err}");
        let mut m = model();
        m.opset_import.clear();
        let err = ModelInfo::from_bytes(&m.encode_to_vec(), "a.onnx").unwrap_err();
        assert!(err.to_string().contains("no opset_import"), "{err}");
        if let Some(g) = m.graph.as_mut() {
            g.initializer[0].dims = vec![3, -1];
        }
        m.opset_import = model().opset_import;
        let err = ModelInfo::from_bytes(&m.encode_to_vec(), "a.onnx").unwrap_err();
        assert!(err.to_string().contains("[3, -1]"), "{err}");
    }

    /// A small deterministic generator (xorshift64*), so the test needs no crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    #[test]
    fn no_bytes_panic() {
        let good = model().encode_to_vec();
        // Every truncation of a valid model: an error or (cut at a field
        // boundary after the required fields) a model, never a panic.
        for n in 0..good.len() {
            match ModelInfo::from_bytes(&good[..n], "t.onnx") {
                Ok(info) => assert_eq!(info.ir_version, 10),
                Err(Error::InvalidModel { path, .. }) => assert_eq!(path, Path::new("t.onnx")),
                Err(e) => panic!("unexpected error kind: {e}"),
            }
        }
        assert!(matches!(
            ModelInfo::from_bytes(&[], "e.onnx"),
            Err(Error::InvalidModel { .. })
        ));
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut valid = 0;
        for round in 0..3000 {
            let len = (rng.next() % 512) as usize;
            let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            if round % 2 == 0 && !good.is_empty() {
                // Mutate a valid model instead of pure noise.
                bytes = good.clone();
                for _ in 0..1 + rng.next() % 4 {
                    let i = (rng.next() as usize) % bytes.len();
                    bytes[i] = rng.next() as u8;
                }
            }
            if ModelInfo::from_bytes(&bytes, "r.onnx").is_ok() {
                valid += 1;
            }
        }
        // Most single-byte mutations of a valid model still decode.
        assert!(valid > 0);
    }

    #[test]
    fn text_is_invalid() {
        let err = ModelInfo::from_bytes(b"hello, this is not a model\n", "t.txt").unwrap_err();
        match err {
            Error::InvalidModel { path, reason } => {
                assert_eq!(path, Path::new("t.txt"));
                assert!(!reason.is_empty());
            }
            e => panic!("expected InvalidModel, got {e}"),
        }
    }
}
