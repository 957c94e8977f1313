//! Kiln model definitions to ONNX: a [`Layer`] tree and its [`StateDict`]
//! become an ONNX model of standard operators (default domain, opset
//! [`OPSET`], IR version [`IR_VERSION`]) with inference (eval-mode) semantics.
//!
//! ```no_run
//! use kiln_core::{export::ExportOptions, model::{Layer, LinearConfig}, state_dict::StateDict};
//! use kiln_onnx::OnnxExport;
//!
//! # fn weights() -> StateDict { StateDict::new() }
//! let net = Layer::sequential([LinearConfig::new(4, 2).into(), Layer::Relu]);
//! let state: StateDict = weights(); // `Module::state_dict()` of a built model
//! OnnxExport::new(&net, &state, &ExportOptions::new(&[1, 4])).write("net.onnx")?;
//! # Ok::<(), kiln_core::export::ExportError>(())
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
mod moe;
mod norm;
mod pool;
mod structure;
mod transformer;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use kiln_core::backend::Backend;
use kiln_core::model::{Definition, Layer};
use kiln_core::module::Module;
use kiln_core::state_dict::StateDict;
use kiln_core::DType;
use prost::Message;

use kiln_core::export::{ExportFormat, ExportOptions, FileTarget};

/// The exporters' one error ([`kiln_core::export::ExportError`]).
pub use kiln_core::export::ExportError as Error;
/// Result alias of the export.
pub type Result<T, E = Error> = std::result::Result<T, E>;
use crate::proto::{
    self, tensor_shape_proto::dimension, tensor_shape_proto::Dimension, type_proto,
    OperatorSetIdProto, TensorShapeProto, TypeProto, ValueInfoProto,
};
use crate::{IR_VERSION, OPSET};

pub use custom::{onnx_lowering_registered, register_onnx_lowering, CustomOp, CustomOpFn};
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
pub(crate) use kiln_core::export::shown_path as shown;

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

/// Walks the graph being built: the graph, the weights, the custom-op
/// mappings, and the attention mask of a model that takes one.
pub(crate) struct Emitter<'a> {
    pub(crate) g: Graph,
    state: &'a StateDict,
    custom: &'a HashMap<String, Arc<CustomOpFn>>,
    pub(crate) padding: Option<Padding>,
}

/// The graph's `attention_mask` input as the layers read it.
pub(crate) struct Padding {
    /// `[batch, 1, 1, seq]` booleans, true on the tokens (the keys a query may see).
    pub(crate) keys: String,
    /// `[batch, seq]` booleans, true on the tokens.
    pub(crate) tokens: String,
    /// The sequence length.
    pub(crate) seq: usize,
}

pub use kiln_core::export::ATTENTION_MASK_INPUT;

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
            Layer::Parallel { branches } => {
                let mut sum: Option<Value> = None;
                for (i, child) in branches.iter().enumerate() {
                    let y = self.layer(&join(path, &i.to_string()), child, x.clone())?;
                    sum = Some(match sum {
                        None => y,
                        Some(s) => {
                            let name = self.g.op(path, "Add", &[&s.name, &y.name], vec![]);
                            Value { name, ..y }
                        }
                    });
                }
                sum.ok_or_else(|| Error::Invalid {
                    what: format!("{} (Parallel)", shown(path)),
                    reason: "has no branch".to_owned(),
                })
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
            Layer::RmsNorm(_)
            | Layer::SelfAttention(_)
            | Layer::GatedMlp(_)
            | Layer::PositionEmbedding(_)
            | Layer::TiedLinear(_)
            | Layer::TokenTypeEmbedding(_)
            | Layer::ClassToken(_) => self.transformer(path, layer, &x)?,
            Layer::Custom(c) => self.custom_op(path, layer, c, &x)?,
            Layer::SparseMoe(c) => self.sparse_moe(path, layer, c, &x)?,
            Layer::Dropout { .. }
            | Layer::Embedding(_)
            | Layer::Flatten { .. }
            | Layer::Select { .. }
            | Layer::Transpose { .. } => self.structure(path, layer, &x, &shape)?,
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
        format: ExportFormat::Onnx,
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
    options: ExportOptions,
    custom: HashMap<String, Arc<CustomOpFn>>,
}

impl std::fmt::Debug for OnnxExport<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut ops: Vec<&String> = self.custom.keys().collect();
        ops.sort();
        f.debug_struct("OnnxExport")
            .field("options", &self.options)
            .field("custom_ops", &ops)
            .finish_non_exhaustive()
    }
}

impl<'a> OnnxExport<'a> {
    /// An export of `spec` with the weights `state` (a module's
    /// `state_dict()`) with `options` (the input's shape, batch dimension
    /// included, such as `[1, 1, 8, 8]`; names; a fixed or dynamic batch).
    ///
    /// A custom op exports through the lowering its crate registered
    /// ([`register_onnx_lowering`]: kiln-fused-ops'
    /// `register_layers` registers its ops'), or one given for this export
    /// with [`custom_op`](OnnxExport::custom_op).
    pub fn new(spec: &'a Layer, state: &'a StateDict, options: &ExportOptions) -> Self {
        OnnxExport {
            spec,
            state,
            options: options.clone(),
            custom: HashMap::new(),
        }
    }

    /// Maps the custom op `name` (a [`Layer::Custom`]'s `op`, such as
    /// `"my::scale"`) to ONNX: `mapping` appends nodes through the
    /// [`CustomOp`] it is given and returns the name of the layer's output
    /// value, which must have the input's shape. Takes the place of a
    /// registered lowering of the same name for this export.
    ///
    /// ```
    /// use kiln_onnx::{export::attr, OnnxExport};
    /// use kiln_core::export::ExportOptions;
    /// # use kiln_core::{model::{CustomConfig, Init, Layer}, state_dict::StateDict, HostTensor};
    /// # let net = Layer::sequential([CustomConfig::new("my::scale").with_param("s", [1], Init::Ones).into()]);
    /// # let mut state = StateDict::new();
    /// # state.insert("0.s", HostTensor::new(vec![2.0f32], [1])?);
    /// let export = OnnxExport::new(&net, &state, &ExportOptions::new(&[2, 3])).custom_op("my::scale", |op| {
    ///     let s = op.param("s")?;
    ///     let x = op.input().to_owned();
    ///     Ok(op.node("Mul", &[&x, &s], vec![]))
    /// });
    /// let model = export.to_model()?;
    /// assert_eq!(model.graph.unwrap().node[0].name.as_deref(), Some("0/Mul"));
    /// # let _ = attr::int("axis", 0);
    /// # Ok::<(), kiln_core::export::ExportError>(())
    /// ```
    pub fn custom_op(
        mut self,
        name: impl Into<String>,
        mapping: impl Fn(&mut CustomOp<'_, '_>) -> Result<String> + Send + Sync + 'static,
    ) -> Self {
        self.custom.insert(name.into(), Arc::new(mapping));
        self
    }

    /// The lowering of the custom op `op`: this export's own, else the registered one.
    fn lowering(&self, op: &str) -> Option<Arc<CustomOpFn>> {
        custom::lowering(&self.custom, op)
    }

    /// The ONNX model, built in memory after every check.
    pub fn to_model(&self) -> Result<proto::ModelProto> {
        self.check_settings()?;
        self.check_supported()?;
        // Shapes and configurations, with the failing layer's path.
        let output_shape = self.spec.output_shape(&self.options.input_shape)?;
        let float = self.check_weights()?;
        let input_dtype = self.resolve_input_dtype(float)?;

        // A model that reads an attention mask takes it as a second input
        // beside its token ids, whether the shape given is the ids' or
        // Kiln's stacked `[batch, 2, seq]`.
        let takes_mask = self.spec.takes_attention_mask();
        let input_shape = self.spec.token_ids_dims(&self.options.input_shape);
        let reserved = [
            self.options.input_name.as_str(),
            self.options.output_name.as_str(),
            ATTENTION_MASK_INPUT,
        ];
        let mut emitter = Emitter {
            g: Graph::new(float, &reserved),
            state: self.state,
            custom: &self.custom,
            padding: None,
        };
        let dim0 = if self.options.dynamic_batch {
            Dim0::Batch
        } else {
            Dim0::Static
        };
        if takes_mask {
            let g = &mut emitter.g;
            let zero = g.ints("", "mask_zero", &[0])?;
            let padded = g.op("", "Equal", &[ATTENTION_MASK_INPUT, &zero], vec![]);
            let tokens = g.op("", "Not", &[&padded], vec![]);
            let axes = g.ints("", "mask_axes", &[1, 2])?;
            let keys = g.op("", "Unsqueeze", &[&tokens, &axes], vec![]);
            emitter.padding = Some(Padding {
                keys,
                tokens,
                seq: input_shape.get(1).copied().unwrap_or(0),
            });
        }
        let x = Value {
            name: self.options.input_name.clone(),
            shape: input_shape.clone(),
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
            g.rename(&y.name, &self.options.output_name);
        } else {
            // The output is the input itself (no layer changes it).
            let out = g.op("", "Identity", &[&y.name], vec![]);
            g.rename(&out, &self.options.output_name);
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
            input: {
                let mut inputs = vec![value_info(
                    &self.options.input_name,
                    input_dtype,
                    &input_shape,
                    dim0,
                )];
                if takes_mask {
                    inputs.push(value_info(
                        ATTENTION_MASK_INPUT,
                        DType::I64,
                        &input_shape,
                        dim0,
                    ));
                }
                inputs
            },
            output: vec![value_info(
                &self.options.output_name,
                y.dtype,
                &y.shape,
                y.dim0,
            )],
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
                format: ExportFormat::Onnx,
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
    /// moved into place). Fails with [`Error::Exists`] if `path` exists and
    /// the options do not allow overwriting, and with [`Error::MissingParent`]
    /// if its directory does not exist; in every failure nothing is left at
    /// `path` that was not there before.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let target = FileTarget::check(path, self.options.overwrite)?;
        let bytes = self.to_bytes()?;
        target.write_bytes(&bytes)?;
        log::info!("wrote {} ({} bytes)", path.display(), bytes.len());
        Ok(())
    }

    fn check_settings(&self) -> Result<()> {
        self.options.check(ExportFormat::Onnx)?;
        for (what, name) in [
            ("input name", &self.options.input_name),
            ("output name", &self.options.output_name),
        ] {
            if self.state.contains_key(name) {
                return Err(Error::invalid(
                    what,
                    format!("`{name}` is also a weight's name; choose another"),
                ));
            }
            if name == ATTENTION_MASK_INPUT && self.spec.takes_attention_mask() {
                return Err(Error::invalid(
                    what,
                    format!(
                        "`{name}` is the name of the model's second input, the attention mask \
                         beside its token ids; choose another"
                    ),
                ));
            }
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
                Layer::Custom(c) if self.lowering(&c.op).is_none() => format!(
                    "the custom op `{}` has no ONNX lowering; register one with \
                     kiln_onnx::register_onnx_lowering(\"{}\", ..) (kiln-fused-ops' \
                     register_layers() registers Kiln's fused ops'), or give one to this \
                     export with OnnxExport::custom_op",
                    c.op, c.op
                ),
                _ => continue,
            };
            return Err(Error::Unsupported {
                format: ExportFormat::Onnx,
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
            if matches!(
                layer,
                Layer::Sequential { .. } | Layer::Residual { .. } | Layer::Parallel { .. }
            ) {
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
        let dtype = self.options.input_dtype.unwrap_or(default);
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

/// Writes `model` (its definition and weights, with eval-mode semantics) as an
/// ONNX file at `path` with `options`: the Rust one-liner for [`OnnxExport`].
/// Fails with [`Error::Exists`] if `path` exists and the options do not allow
/// overwriting.
pub fn export_onnx<B: Backend, M: Module<B> + Definition>(
    model: &M,
    path: impl AsRef<Path>,
    options: &ExportOptions,
) -> Result<()> {
    let state = model.state_dict()?;
    OnnxExport::new(model.definition(), &state, options).write(path)
}

#[cfg(test)]
mod tests;
