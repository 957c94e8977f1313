//! Kiln model definitions to ONNX: a [`Layer`] tree and its [`StateDict`]
//! become an ONNX model of standard operators (default domain, opset
//! [`OPSET`], IR version [`IR_VERSION`]) with inference (eval-mode) semantics.
//!
//! ```no_run
//! use kiln_core::{model::{Layer, LinearConfig}, state_dict::StateDict};
//! use kiln_onnx::OnnxExport;
//!
//! # fn weights() -> StateDict { StateDict::new() }
//! let net = Layer::sequential([LinearConfig::new(4, 2).into(), Layer::Relu]);
//! let state: StateDict = weights(); // `Module::state_dict()` of a built model
//! OnnxExport::new(&net, &state, &[1, 4]).write("net.onnx")?;
//! # Ok::<(), kiln_onnx::Error>(())
//! ```
//!
//! Weights are graph initializers named by their state-dict keys (`0.weight`),
//! in the state dict's float dtype; nodes are named by the layer path and the
//! operator (`2.block.0/Gemm`). Each layer family's mapping is in its own file.

mod activation;
mod attention;
mod conv;
mod custom;
mod graph;
mod norm;
mod pool;
mod structure;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_core::backend::Backend;
use kiln_core::model::{Definition, Layer};
use kiln_core::module::Module;
use kiln_core::state_dict::StateDict;
use kiln_core::DType;
use prost::Message;

use crate::error::{Error, Result};
use crate::proto::{
    self, tensor_shape_proto::dimension, tensor_shape_proto::Dimension, type_proto,
    OperatorSetIdProto, TensorShapeProto, TypeProto, ValueInfoProto,
};
use crate::{IR_VERSION, OPSET};

pub use custom::{CustomOp, CustomOpFn};
pub use graph::attr;

use graph::{onnx_dtype, Graph};

/// How the first dimension of a value relates to the model input's batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dim0 {
    /// Fixed: the model was exported without a dynamic batch.
    Static,
    /// The dynamic batch dimension (`dim_param "batch"`).
    Batch,
    /// Dynamic but no longer the batch (a `Flatten` from dimension 0 merged it).
    Unknown,
}

/// A value of the graph: its name, its shape for the example input (batch
/// included), its dtype and what its first dimension is.
#[derive(Clone, Debug)]
pub(crate) struct Value {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) dim0: Dim0,
}

/// The layer's path as errors show it: `2.block.0`, or `<root>`.
pub(crate) fn shown(path: &str) -> String {
    if path.is_empty() {
        "<root>".to_owned()
    } else {
        path.to_owned()
    }
}

/// `prefix.name`, or `name` at the root.
pub(crate) fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}.{name}")
    }
}

/// The layer's kind as errors show it: `Linear`, `Custom(kiln::my_op)`.
pub(crate) fn kind_of(layer: &Layer) -> String {
    match layer {
        Layer::Custom(c) => format!("Custom({})", c.op),
        other => other.kind().to_owned(),
    }
}

/// Walks the graph being built: the graph, the weights and the custom-op
/// mappings.
pub(crate) struct Emitter<'a> {
    pub(crate) g: Graph,
    state: &'a StateDict,
    custom: &'a HashMap<String, Arc<CustomOpFn>>,
}

impl Emitter<'_> {
    /// The initializer of the layer's state-dict entry `name` (checked up
    /// front, so a miss here names the same problem).
    pub(crate) fn param(&mut self, path: &str, layer: &Layer, name: &str) -> Result<String> {
        let key = join(path, name);
        match self.state.get(&key) {
            Some(tensor) => self.g.weight(&key, tensor),
            None => Err(Error::Weight {
                path: shown(path),
                layer: kind_of(layer),
                key,
                reason: format!(
                    "is missing (the state dict has {} entries)",
                    self.state.len()
                ),
            }),
        }
    }

    /// A `Reshape` of `x` to `to`: the first dimension copies the input's
    /// (`0`) where `keep_batch` and it is dynamic, or is inferred (`-1`) where it
    /// merged the batch; every other dimension is static.
    pub(crate) fn reshape(
        &mut self,
        path: &str,
        x: &Value,
        to: &[usize],
        keep_batch: bool,
    ) -> Result<String> {
        let mut dims: Vec<i64> = to.iter().map(|&d| d as i64).collect();
        if x.dim0 != Dim0::Static {
            if let Some(first) = dims.first_mut() {
                *first = if keep_batch { 0 } else { -1 };
            }
        }
        let shape = self.g.ints(path, "shape", &dims)?;
        Ok(self.g.op(path, "Reshape", &[&x.name, &shape], vec![]))
    }

    /// Emits `layer` at `path` on `x`.
    pub(crate) fn layer(&mut self, path: &str, layer: &Layer, x: Value) -> Result<Value> {
        match layer {
            Layer::Sequential { layers } => {
                let mut x = x;
                for (i, child) in layers.iter().enumerate() {
                    x = self.layer(&join(path, &i.to_string()), child, x)?;
                }
                Ok(x)
            }
            Layer::Residual { block } => {
                let y = self.layer(&join(path, "block"), block, x.clone())?;
                let name = self.g.op(path, "Add", &[&x.name, &y.name], vec![]);
                Ok(Value { name, ..y })
            }
            leaf => self.leaf(path, leaf, x),
        }
    }

    fn leaf(&mut self, path: &str, layer: &Layer, x: Value) -> Result<Value> {
        let shape = layer.output_shape(&x.shape)?;
        let takes_indices = matches!(layer, Layer::Embedding(_));
        let dtype_ok = if takes_indices {
            matches!(x.dtype, DType::I64 | DType::I32)
        } else {
            x.dtype == self.g.float
        };
        if !dtype_ok {
            return Err(Error::Invalid {
                what: format!("{} ({})", shown(path), kind_of(layer)),
                reason: format!(
                    "receives {} data; it takes {}",
                    x.dtype,
                    if takes_indices {
                        "int64 or int32 indices".to_owned()
                    } else {
                        format!("{} features (the weights' dtype)", self.g.float)
                    }
                ),
            });
        }
        let name = match layer {
            Layer::Linear(_) | Layer::Conv1d(_) | Layer::Conv2d(_) | Layer::ConvTranspose2d(_) => {
                self.conv(path, layer, &x)?
            }
            Layer::MaxPool2d(_) | Layer::AvgPool2d(_) | Layer::AdaptiveAvgPool2d { .. } => {
                self.pool(path, layer, &x)?
            }
            Layer::BatchNorm1d(_)
            | Layer::BatchNorm2d(_)
            | Layer::LayerNorm(_)
            | Layer::GroupNorm(_) => self.norm(path, layer, &x)?,
            Layer::MultiHeadSelfAttention(c) => self.attention(path, layer, c, &x)?,
            Layer::Custom(c) => self.custom_op(path, layer, c, &x)?,
            Layer::Dropout { .. } | Layer::Embedding(_) | Layer::Flatten { .. } => {
                self.structure(path, layer, &x, &shape)?
            }
            _ => self.activation(path, layer, &x)?,
        };
        let dim0 = match layer {
            Layer::Flatten { start_dim, .. }
                if x.dim0 != Dim0::Static && flatten_start(*start_dim, x.shape.len()) == 0 =>
            {
                Dim0::Unknown
            }
            _ => x.dim0,
        };
        let dtype = if takes_indices { self.g.float } else { x.dtype };
        Ok(Value {
            name,
            shape,
            dtype,
            dim0,
        })
    }
}

/// A layer sent to a family that does not map it (the dispatch in
/// `Emitter::leaf` never does this).
pub(crate) fn wrong_family(path: &str, layer: &Layer) -> Error {
    Error::Unsupported {
        path: shown(path),
        layer: kind_of(layer),
        reason: "kiln-onnx sent the layer to the wrong mapping (a bug)".to_owned(),
    }
}

/// `start_dim` of a `Flatten` counted from the front, as torch.flatten does
/// (a scalar counts as rank 1).
pub(crate) fn flatten_start(start_dim: isize, rank: usize) -> usize {
    let rank = rank.max(1) as isize;
    if start_dim < 0 {
        (rank + start_dim).max(0) as usize
    } else {
        start_dim as usize
    }
}

/// Exports a Kiln model definition and its weights to ONNX.
///
/// Built with [`new`](OnnxExport::new), refined with the other methods, then
/// turned into a [`ModelProto`](proto::ModelProto), bytes, or a file. Every
/// check (every layer has a mapping, every weight is in the state dict with
/// its declared shape and one float dtype, the settings fit the model, the
/// target file) runs before the first byte is written.
#[derive(Clone)]
pub struct OnnxExport<'a> {
    spec: &'a Layer,
    state: &'a StateDict,
    input_shape: Vec<usize>,
    input_name: String,
    output_name: String,
    dynamic_batch: bool,
    input_dtype: Option<DType>,
    overwrite: bool,
    custom: HashMap<String, Arc<CustomOpFn>>,
}

impl std::fmt::Debug for OnnxExport<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut ops: Vec<&String> = self.custom.keys().collect();
        ops.sort();
        f.debug_struct("OnnxExport")
            .field("input_shape", &self.input_shape)
            .field("input_name", &self.input_name)
            .field("output_name", &self.output_name)
            .field("dynamic_batch", &self.dynamic_batch)
            .field("input_dtype", &self.input_dtype)
            .field("overwrite", &self.overwrite)
            .field("custom_ops", &ops)
            .finish_non_exhaustive()
    }
}

impl<'a> OnnxExport<'a> {
    /// An export of `spec` with the weights `state` (a module's
    /// `state_dict()`) for inputs of `input_shape`, batch dimension included
    /// (`[1, 1, 8, 8]`).
    ///
    /// Kiln's own custom ops (`kiln::bias_gelu`, `kiln::swish`) have their
    /// mappings already; add others with [`custom_op`](OnnxExport::custom_op).
    pub fn new(spec: &'a Layer, state: &'a StateDict, input_shape: &[usize]) -> Self {
        OnnxExport {
            spec,
            state,
            input_shape: input_shape.to_vec(),
            input_name: "input".to_owned(),
            output_name: "output".to_owned(),
            dynamic_batch: true,
            input_dtype: None,
            overwrite: false,
            custom: custom::builtin(),
        }
    }

    /// The graph input's name (default `"input"`).
    pub fn input_name(mut self, name: impl Into<String>) -> Self {
        self.input_name = name.into();
        self
    }

    /// The graph output's name (default `"output"`).
    pub fn output_name(mut self, name: impl Into<String>) -> Self {
        self.output_name = name.into();
        self
    }

    /// Whether dimension 0 of the input and output is the symbolic `batch`
    /// (default `true`); otherwise every dimension is fixed.
    pub fn dynamic_batch(mut self, yes: bool) -> Self {
        self.dynamic_batch = yes;
        self
    }

    /// The input's element type. By default int64 where the first layer is
    /// an `Embedding`, otherwise the weights' float dtype (float32 for a
    /// float32 state dict).
    pub fn input_dtype(mut self, dtype: DType) -> Self {
        self.input_dtype = Some(dtype);
        self
    }

    /// Whether [`write`](OnnxExport::write) may replace an existing file
    /// (default `false`).
    pub fn overwrite(mut self, yes: bool) -> Self {
        self.overwrite = yes;
        self
    }

    /// Maps the custom op `name` (a [`Layer::Custom`]'s `op`, such as
    /// `"my::scale"`) to ONNX: `mapping` appends nodes through the
    /// [`CustomOp`] it is given and returns the name of the layer's output
    /// value, which must have the input's shape. Replaces an earlier mapping
    /// of the same name (Kiln's own included).
    ///
    /// ```
    /// use kiln_onnx::{export::attr, OnnxExport};
    /// # use kiln_core::{model::{CustomConfig, Init, Layer}, state_dict::StateDict, HostTensor};
    /// # let net = Layer::sequential([CustomConfig::new("my::scale").with_param("s", [1], Init::Ones).into()]);
    /// # let mut state = StateDict::new();
    /// # state.insert("0.s", HostTensor::new(vec![2.0f32], [1])?);
    /// let export = OnnxExport::new(&net, &state, &[2, 3]).custom_op("my::scale", |op| {
    ///     let s = op.param("s")?;
    ///     let x = op.input().to_owned();
    ///     Ok(op.node("Mul", &[&x, &s], vec![]))
    /// });
    /// let model = export.to_model()?;
    /// assert_eq!(model.graph.unwrap().node[0].name.as_deref(), Some("0/Mul"));
    /// # let _ = attr::int("axis", 0);
    /// # Ok::<(), kiln_onnx::Error>(())
    /// ```
    pub fn custom_op(
        mut self,
        name: impl Into<String>,
        mapping: impl Fn(&mut CustomOp<'_, '_>) -> Result<String> + Send + Sync + 'static,
    ) -> Self {
        self.custom.insert(name.into(), Arc::new(mapping));
        self
    }

    /// The ONNX model, built in memory after every check.
    pub fn to_model(&self) -> Result<proto::ModelProto> {
        self.check_settings()?;
        self.check_supported()?;
        // Shapes and configurations, with the failing layer's path.
        let output_shape = self.spec.output_shape(&self.input_shape)?;
        let float = self.check_weights()?;
        let input_dtype = self.resolve_input_dtype(float)?;

        let reserved = [self.input_name.as_str(), self.output_name.as_str()];
        let mut emitter = Emitter {
            g: Graph::new(float, &reserved),
            state: self.state,
            custom: &self.custom,
        };
        let dim0 = if self.dynamic_batch {
            Dim0::Batch
        } else {
            Dim0::Static
        };
        let x = Value {
            name: self.input_name.clone(),
            shape: self.input_shape.clone(),
            dtype: input_dtype,
            dim0,
        };
        let y = emitter.layer("", self.spec, x)?;
        if y.shape != output_shape {
            return Err(Error::Invalid {
                what: "the exported graph".to_owned(),
                reason: format!(
                    "computes shape {:?} where the model's is {output_shape:?}",
                    y.shape
                ),
            });
        }
        let mut g = emitter.g;
        if g.produces(&y.name) {
            g.rename(&y.name, &self.output_name);
        } else {
            // The output is the input itself (no layer changes it).
            let out = g.op("", "Identity", &[&y.name], vec![]);
            g.rename(&out, &self.output_name);
        }
        log::debug!(
            "ONNX export: {} nodes, {} initializers",
            g.nodes.len(),
            g.initializers.len()
        );
        let graph = proto::GraphProto {
            name: Some("kiln".to_owned()),
            node: g.nodes,
            initializer: g.initializers,
            input: vec![value_info(
                &self.input_name,
                input_dtype,
                &self.input_shape,
                dim0,
            )],
            output: vec![value_info(&self.output_name, y.dtype, &y.shape, y.dim0)],
            ..Default::default()
        };
        Ok(proto::ModelProto {
            ir_version: Some(IR_VERSION),
            opset_import: vec![OperatorSetIdProto {
                domain: Some(String::new()),
                version: Some(OPSET),
            }],
            producer_name: Some("kiln".to_owned()),
            producer_version: Some(env!("CARGO_PKG_VERSION").to_owned()),
            doc_string: Some("Exported by Kiln (eval-mode semantics).".to_owned()),
            graph: Some(graph),
            ..Default::default()
        })
    }

    /// The ONNX model as protobuf bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let model = self.to_model()?;
        // Protobuf messages cannot exceed 2 GiB; larger models need external data.
        let len = model.encoded_len();
        if len > i32::MAX as usize {
            return Err(Error::Unsupported {
                path: "<root>".to_owned(),
                layer: self.spec.kind().to_owned(),
                reason: format!(
                    "the model is {len} bytes, over protobuf's 2 GiB limit; weights as \
                     external data are not written yet"
                ),
            });
        }
        Ok(model.encode_to_vec())
    }

    /// Writes the model to `path` atomically (a temporary file next to it,
    /// renamed into place). Fails with [`Error::FileExists`] if `path` exists
    /// and [`overwrite`](OnnxExport::overwrite) was not asked for, and with
    /// [`Error::MissingParent`] if its directory does not exist; in every
    /// failure nothing is left at `path` that was not there before.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        self.check_target(path)?;
        let bytes = self.to_bytes()?;
        self.check_target(path)?;
        write_atomically(path, &bytes, self.overwrite)?;
        log::info!("wrote {} ({} bytes)", path.display(), bytes.len());
        Ok(())
    }

    fn check_target(&self, path: &Path) -> Result<()> {
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !parent.is_dir() {
            return Err(Error::MissingParent {
                path: path.to_path_buf(),
            });
        }
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.is_dir() => Err(Error::Invalid {
                what: format!("output path {}", path.display()),
                reason: "is a directory; expected a file name".to_owned(),
            }),
            Ok(_) if !self.overwrite => Err(Error::FileExists {
                path: path.to_path_buf(),
            }),
            Ok(_) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("checking", path, e)),
        }
    }

    fn check_settings(&self) -> Result<()> {
        for (what, name) in [
            ("input name", &self.input_name),
            ("output name", &self.output_name),
        ] {
            if name.is_empty() {
                return Err(Error::Invalid {
                    what: what.to_owned(),
                    reason: "must not be empty".to_owned(),
                });
            }
            if self.state.contains_key(name) {
                return Err(Error::Invalid {
                    what: what.to_owned(),
                    reason: format!("`{name}` is also a weight's name; choose another"),
                });
            }
        }
        if self.input_name == self.output_name {
            return Err(Error::Invalid {
                what: "output name".to_owned(),
                reason: format!("`{}` is also the input's name", self.output_name),
            });
        }
        if self.input_shape.is_empty() {
            return Err(Error::Invalid {
                what: "input shape".to_owned(),
                reason:
                    "is empty; expected the batch dimension and the sample's, like [1, 1, 8, 8]"
                        .to_owned(),
            });
        }
        Ok(())
    }

    /// Every leaf layer has an ONNX mapping.
    fn check_supported(&self) -> Result<()> {
        for (path, layer) in self.spec.layers() {
            let reason = match layer {
                Layer::TorchScript(c) => format!(
                    "a TorchScript module ({}) is opaque to Kiln's exporter; export the \
                     scripted model with torch.onnx.export in Python",
                    c.path.display()
                ),
                Layer::SavedModel(c) => format!(
                    "a SavedModel signature ({}) is opaque to Kiln's exporter; convert the \
                     SavedModel with tf2onnx",
                    c.path.display()
                ),
                Layer::Custom(c) if !self.custom.contains_key(&c.op) => format!(
                    "the custom op `{}` has no ONNX mapping; register one with \
                     OnnxExport::custom_op(\"{}\", ..)",
                    c.op, c.op
                ),
                _ => continue,
            };
            return Err(Error::Unsupported {
                path: shown(&path),
                layer: kind_of(layer),
                reason,
            });
        }
        Ok(())
    }

    /// Every parameter and buffer each layer declares is in the state dict
    /// with its shape; the float ones share one dtype, which is returned.
    fn check_weights(&self) -> Result<DType> {
        let mut float: Option<(DType, String)> = None;
        for (path, layer) in self.spec.layers() {
            if matches!(layer, Layer::Sequential { .. } | Layer::Residual { .. }) {
                continue;
            }
            for spec in layer.parameter_specs(&path)? {
                let fail = |reason: String| Error::Weight {
                    path: shown(&path),
                    layer: kind_of(layer),
                    key: spec.name.clone(),
                    reason,
                };
                let Some(tensor) = self.state.get(&spec.name) else {
                    return Err(fail(format!(
                        "is missing (the state dict has {} entries)",
                        self.state.len()
                    )));
                };
                if tensor.dims() != spec.shape.as_slice() {
                    return Err(fail(format!(
                        "has shape {:?}, expected {:?}",
                        tensor.dims(),
                        spec.shape
                    )));
                }
                let dtype = tensor.dtype();
                if spec.dtype.is_float() {
                    match &float {
                        _ if !dtype.is_float() => {
                            return Err(fail(format!("has dtype {dtype}, expected a float dtype")))
                        }
                        Some((first, key)) if *first != dtype => {
                            return Err(fail(format!(
                                "has dtype {dtype}, but `{key}` has {first}; an ONNX graph \
                                 computes in one float dtype"
                            )))
                        }
                        Some(_) => {}
                        None => float = Some((dtype, spec.name.clone())),
                    }
                } else if dtype != spec.dtype {
                    return Err(fail(format!("has dtype {dtype}, expected {}", spec.dtype)));
                }
            }
        }
        Ok(float.map_or(DType::F32, |(d, _)| d))
    }

    fn resolve_input_dtype(&self, float: DType) -> Result<DType> {
        let embedding_first = matches!(self.spec.first_leaf(), Some(Layer::Embedding(_)));
        let default = if embedding_first { DType::I64 } else { float };
        let dtype = self.input_dtype.unwrap_or(default);
        if onnx_dtype(dtype) == proto::tensor_proto::DataType::Undefined {
            return Err(Error::Invalid {
                what: "input dtype".to_owned(),
                reason: format!("{dtype} has no ONNX element type"),
            });
        }
        Ok(dtype)
    }
}

fn value_info(name: &str, dtype: DType, shape: &[usize], dim0: Dim0) -> ValueInfoProto {
    let dims = shape
        .iter()
        .enumerate()
        .map(|(i, &d)| Dimension {
            value: match (i, dim0) {
                (0, Dim0::Batch) => Some(dimension::Value::DimParam("batch".to_owned())),
                (0, Dim0::Unknown) => None,
                _ => Some(dimension::Value::DimValue(d as i64)),
            },
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: Some(name.to_owned()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(onnx_dtype(dtype) as i32),
                shape: Some(TensorShapeProto { dim: dims }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Writes `bytes` to a temporary file next to `path`, flushes it to disk and
/// moves it into place: with `overwrite` by renaming over `path`, otherwise by
/// hard-linking, which fails if `path` appeared meanwhile.
fn write_atomically(path: &Path, bytes: &[u8], overwrite: bool) -> Result<()> {
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model.onnx".to_owned());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let temp = path.with_file_name(format!(
        ".{file_name}.kiln-tmp-{}-{nanos}",
        std::process::id()
    ));
    let result = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)
            .map_err(|e| Error::io("creating", &temp, e))?;
        file.write_all(bytes)
            .map_err(|e| Error::io("writing", &temp, e))?;
        file.sync_all()
            .map_err(|e| Error::io("flushing", &temp, e))?;
        if overwrite {
            std::fs::rename(&temp, path).map_err(|e| Error::io("renaming into", path, e))
        } else {
            match std::fs::hard_link(&temp, path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(Error::FileExists {
                    path: path.to_path_buf(),
                }),
                Err(e) => Err(Error::io("linking into", path, e)),
            }
        }
    })();
    // After a rename the temporary name is gone; after a link (or a failure)
    // it is removed here.
    if temp.exists() {
        if let Err(e) = std::fs::remove_file(&temp) {
            log::warn!("could not remove {}: {e}", temp.display());
        }
    }
    result
}

/// Writes `model` (its definition and weights, with eval-mode semantics) as an
/// ONNX file at `path`, for inputs of `input_shape` (batch dimension
/// included) with a dynamic batch: the Rust one-liner for
/// [`OnnxExport`]. Fails with [`Error::FileExists`] if `path` exists.
pub fn export_onnx<B: Backend, M: Module<B> + Definition>(
    model: &M,
    input_shape: &[usize],
    path: impl AsRef<Path>,
) -> Result<()> {
    let state = model.state_dict()?;
    OnnxExport::new(model.definition(), &state, input_shape).write(path)
}

#[cfg(test)]
mod tests;
