//! The few protobuf messages of a TF1-style `saved_model.pb`, written by hand.
//!
//! The `tensorflow` crate keeps its generated protobuf types private and the TF
//! wheel ships no `.proto` files (only `*_pb2.py` and C++ headers), so this is a
//! minimal protobuf wire-format writer, the counterpart of the reader in
//! [`saver_def`](crate::saved_model::load::saver_def). Field numbers are those of TensorFlow's
//! `saved_model.proto`, `meta_graph.proto`, `saver.proto` and
//! `tensor_shape.proto` (checked against the wheel's descriptors).

use tensorflow::DataType;

/// `SavedModel.saved_model_schema_version`.
const SAVED_MODEL_SCHEMA_VERSION: u32 = 1;
/// `SavedModel.meta_graphs`.
const SAVED_MODEL_META_GRAPHS: u32 = 2;
/// `MetaGraphDef.meta_info_def`.
const META_INFO_DEF: u32 = 1;
/// `MetaGraphDef.graph_def`.
const META_GRAPH_DEF: u32 = 2;
/// `MetaGraphDef.saver_def`.
const META_SAVER_DEF: u32 = 3;
/// `MetaGraphDef.collection_def` (a map).
const META_COLLECTION_DEF: u32 = 4;
/// `CollectionDef.bytes_list` and `BytesList.value`.
const COLLECTION_BYTES_LIST: u32 = 2;
const BYTES_LIST_VALUE: u32 = 1;
/// `VariableDef` fields (variable.proto).
const VARIABLE_NAME: u32 = 1;
const VARIABLE_INITIALIZER: u32 = 2;
const VARIABLE_SNAPSHOT: u32 = 3;
const VARIABLE_IS_RESOURCE: u32 = 5;
const VARIABLE_TRAINABLE: u32 = 7;
/// `MetaGraphDef.signature_def` (a map).
const META_SIGNATURE_DEF: u32 = 5;
/// `MetaInfoDef.meta_graph_version`.
const INFO_META_GRAPH_VERSION: u32 = 1;
/// `MetaInfoDef.tags`.
const INFO_TAGS: u32 = 4;
/// `MetaInfoDef.tensorflow_version`.
const INFO_TENSORFLOW_VERSION: u32 = 5;
/// `SaverDef` fields.
const SAVER_FILENAME: u32 = 1;
const SAVER_SAVE: u32 = 2;
const SAVER_RESTORE: u32 = 3;
const SAVER_MAX_TO_KEEP: u32 = 4;
const SAVER_SHARDED: u32 = 5;
const SAVER_KEEP_HOURS: u32 = 6;
const SAVER_VERSION: u32 = 7;
/// `SaverDef.CheckpointFormatVersion.V2`.
const SAVER_V2: u64 = 2;
/// `SignatureDef` fields.
const SIGNATURE_INPUTS: u32 = 1;
const SIGNATURE_OUTPUTS: u32 = 2;
const SIGNATURE_METHOD: u32 = 3;
/// `TensorInfo` fields.
const TENSOR_INFO_NAME: u32 = 1;
const TENSOR_INFO_DTYPE: u32 = 2;
const TENSOR_INFO_SHAPE: u32 = 3;
/// `TensorShapeProto.dim` and `Dim.size`.
const SHAPE_DIM: u32 = 2;
const DIM_SIZE: u32 = 1;
/// Map entries' key and value.
const MAP_KEY: u32 = 1;
const MAP_VALUE: u32 = 2;

/// Wire types.
const VARINT: u64 = 0;
const LENGTH_DELIMITED: u64 = 2;
const FIXED32: u64 = 5;

/// Appends protobuf fields to a buffer.
#[derive(Debug, Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8 & 0x7f) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn key(&mut self, field: u32, wire: u64) {
        self.varint((u64::from(field) << 3) | wire);
    }

    /// An integer field (`int32`, `int64`, `bool`, enums); negative values take
    /// ten bytes, as protobuf encodes them.
    fn int(&mut self, field: u32, v: i64) {
        self.key(field, VARINT);
        self.varint(v as u64);
    }

    fn float(&mut self, field: u32, v: f32) {
        self.key(field, FIXED32);
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    fn bytes(&mut self, field: u32, bytes: &[u8]) {
        self.key(field, LENGTH_DELIMITED);
        self.varint(bytes.len() as u64);
        self.0.extend_from_slice(bytes);
    }

    fn string(&mut self, field: u32, text: &str) {
        self.bytes(field, text.as_bytes());
    }

    /// A nested message, written by `f`.
    fn message(&mut self, field: u32, f: impl FnOnce(&mut Writer)) {
        let mut inner = Writer::default();
        f(&mut inner);
        self.bytes(field, &inner.0);
    }
}

/// A signature's tensor: its graph name (`op:index`), dtype and dims (`-1`: any size).
#[derive(Debug, Clone)]
pub(crate) struct TensorInfoDef {
    pub(crate) name: String,
    pub(crate) dtype: DataType,
    pub(crate) dims: Vec<i64>,
}

/// The names of TF1's `Saver` ops in the graph.
#[derive(Debug, Clone)]
pub(crate) struct SaverNames {
    /// The string tensor fed with the checkpoint prefix.
    pub(crate) filename_tensor: String,
    /// The tensor whose evaluation writes the checkpoint.
    pub(crate) save_tensor: String,
    /// The op restoring every variable.
    pub(crate) restore_op: String,
}

/// A resource variable as TF1's `VariableDef` names it, so that Python's loader
/// lifts it into a `tf.Variable` (`loaded.variables`).
#[derive(Debug, Clone)]
pub(crate) struct VariableDefSpec {
    /// The `VarHandleOp`'s output (`op:0`).
    pub(crate) handle: String,
    /// An op assigning the variable (an `AssignVariableOp`).
    pub(crate) initializer: String,
    /// A `ReadVariableOp`'s output.
    pub(crate) snapshot: String,
    /// Trained (a parameter) rather than a buffer.
    pub(crate) trainable: bool,
}

/// One signature: key, method name, inputs and outputs by key.
#[derive(Debug, Clone)]
pub(crate) struct SignatureDefSpec {
    pub(crate) key: String,
    pub(crate) method_name: String,
    pub(crate) inputs: Vec<(String, TensorInfoDef)>,
    pub(crate) outputs: Vec<(String, TensorInfoDef)>,
}

/// Everything `saved_model.pb` holds here: one MetaGraphDef.
#[derive(Debug, Clone)]
pub(crate) struct SavedModelDef<'a> {
    pub(crate) tags: Vec<String>,
    pub(crate) tensorflow_version: String,
    /// A serialized `GraphDef` (`TF_GraphToGraphDef`).
    pub(crate) graph_def: &'a [u8],
    pub(crate) saver: Option<SaverNames>,
    /// The `variables` collection (and the trainable ones in `trainable_variables`).
    pub(crate) variables: Vec<VariableDefSpec>,
    pub(crate) signatures: Vec<SignatureDefSpec>,
}

/// The `DataType` enum value of `types.proto` (`DT_FLOAT = 1`, ...); the
/// `tensorflow` crate keeps its own conversion private.
fn dtype_number(dtype: DataType) -> i64 {
    match dtype {
        DataType::Float => 1,
        DataType::Double => 2,
        DataType::Int32 => 3,
        DataType::UInt8 => 4,
        DataType::String => 7,
        DataType::Int64 => 9,
        DataType::Bool => 10,
        // Only the dtypes above reach a signature (Kiln's inputs and outputs).
        _ => 0,
    }
}

fn tensor_info(w: &mut Writer, info: &TensorInfoDef) {
    w.string(TENSOR_INFO_NAME, &info.name);
    w.int(TENSOR_INFO_DTYPE, dtype_number(info.dtype));
    w.message(TENSOR_INFO_SHAPE, |shape| {
        for &d in &info.dims {
            shape.message(SHAPE_DIM, |dim| dim.int(DIM_SIZE, d));
        }
    });
}

fn variable_def(w: &mut Writer, v: &VariableDefSpec) {
    w.string(VARIABLE_NAME, &v.handle);
    w.string(VARIABLE_INITIALIZER, &v.initializer);
    w.string(VARIABLE_SNAPSHOT, &v.snapshot);
    w.int(VARIABLE_IS_RESOURCE, 1);
    w.int(VARIABLE_TRAINABLE, i64::from(v.trainable));
}

fn tensor_map(w: &mut Writer, field: u32, entries: &[(String, TensorInfoDef)]) {
    for (key, info) in entries {
        w.message(field, |entry| {
            entry.string(MAP_KEY, key);
            entry.message(MAP_VALUE, |value| tensor_info(value, info));
        });
    }
}

/// The bytes of `saved_model.pb`: schema version 1 and one MetaGraphDef.
pub(crate) fn saved_model_bytes(def: &SavedModelDef<'_>) -> Vec<u8> {
    let mut w = Writer::default();
    w.int(SAVED_MODEL_SCHEMA_VERSION, 1);
    w.message(SAVED_MODEL_META_GRAPHS, |meta| {
        meta.message(META_INFO_DEF, |info| {
            info.string(INFO_META_GRAPH_VERSION, &def.tensorflow_version);
            for tag in &def.tags {
                info.string(INFO_TAGS, tag);
            }
            info.string(INFO_TENSORFLOW_VERSION, &def.tensorflow_version);
        });
        meta.bytes(META_GRAPH_DEF, def.graph_def);
        if let Some(saver) = &def.saver {
            meta.message(META_SAVER_DEF, |s| {
                s.string(SAVER_FILENAME, &saver.filename_tensor);
                s.string(SAVER_SAVE, &saver.save_tensor);
                s.string(SAVER_RESTORE, &saver.restore_op);
                // TF1's `Saver` defaults.
                s.int(SAVER_MAX_TO_KEEP, 5);
                s.int(SAVER_SHARDED, 0);
                s.float(SAVER_KEEP_HOURS, 10000.0);
                s.int(SAVER_VERSION, SAVER_V2 as i64);
            });
        }
        let all: Vec<&VariableDefSpec> = def.variables.iter().collect();
        let trainable: Vec<&VariableDefSpec> =
            all.iter().copied().filter(|v| v.trainable).collect();
        for (key, vars) in [("variables", all), ("trainable_variables", trainable)] {
            if vars.is_empty() {
                continue;
            }
            meta.message(META_COLLECTION_DEF, |entry| {
                entry.string(MAP_KEY, key);
                entry.message(MAP_VALUE, |collection| {
                    collection.message(COLLECTION_BYTES_LIST, |list| {
                        for v in &vars {
                            list.message(BYTES_LIST_VALUE, |var| variable_def(var, v));
                        }
                    });
                });
            });
        }
        for sig in &def.signatures {
            meta.message(META_SIGNATURE_DEF, |entry| {
                entry.string(MAP_KEY, &sig.key);
                entry.message(MAP_VALUE, |value| {
                    tensor_map(value, SIGNATURE_INPUTS, &sig.inputs);
                    tensor_map(value, SIGNATURE_OUTPUTS, &sig.outputs);
                    value.string(SIGNATURE_METHOD, &sig.method_name);
                });
            });
        }
    });
    w.0
}

#[cfg(test)]
mod tests {
    //! What is written reads back through Kiln's own wire-format reader.

    use super::*;
    use crate::saved_model::load::saver_def::{graph_def, meta_graphs, saver_def, Fields, Value};

    #[test]
    fn varints_match_protobuf() {
        let mut w = Writer::default();
        w.varint(300);
        assert_eq!(w.0, [0xac, 0x02]);
        let mut w = Writer::default();
        w.int(1, -1);
        // key 0x08, then -1 as ten bytes.
        assert_eq!(w.0.len(), 11);
        assert_eq!(w.0[10], 0x01);
    }

    #[test]
    fn a_saved_model_reads_back() {
        let graph = [0x0a, 0x03, b'a', b'b', b'c'];
        let def = SavedModelDef {
            tags: vec!["serve".to_owned()],
            tensorflow_version: "2.21.0".to_owned(),
            graph_def: &graph,
            saver: Some(SaverNames {
                filename_tensor: "save/Placeholder_1:0".to_owned(),
                save_tensor: "save/Identity_5:0".to_owned(),
                restore_op: "save/NoOp_9".to_owned(),
            }),
            variables: vec![],
            signatures: vec![SignatureDefSpec {
                key: "serving_default".to_owned(),
                method_name: "tensorflow/serving/predict".to_owned(),
                inputs: vec![(
                    "input".to_owned(),
                    TensorInfoDef {
                        name: "x:0".to_owned(),
                        dtype: DataType::Float,
                        dims: vec![-1, 3],
                    },
                )],
                outputs: vec![],
            }],
        };
        let bytes = saved_model_bytes(&def);
        let metas = meta_graphs(&bytes).expect("well-formed");
        assert_eq!(metas.len(), 1);
        let saver = saver_def(metas[0]).expect("well-formed").expect("a saver");
        assert_eq!(saver.filename_tensor, "save/Placeholder_1:0");
        assert_eq!(saver.save_tensor, "save/Identity_5:0");
        assert_eq!(saver.restore_op, "save/NoOp_9");
        assert_eq!(graph_def(metas[0]).expect("well-formed"), graph);
        let mut version = None;
        for field in Fields::new(&bytes) {
            if let (1, Value::Varint(v)) = field.expect("well-formed") {
                version = Some(v);
            }
        }
        assert_eq!(version, Some(1));
    }
}
