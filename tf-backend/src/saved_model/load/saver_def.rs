//! The `SaverDef` and the `GraphDef` of a loaded MetaGraphDef, read from its
//! serialized bytes.
//!
//! The `tensorflow` crate decodes only the signatures of a MetaGraphDef and keeps its
//! generated protobuf types private, so the three strings and the graph Kiln needs
//! are read here with a minimal protobuf wire-format walker (no schema, no dependency).

use std::fmt;

/// `MetaGraphDef.saver_def` (tensorflow/core/protobuf/meta_graph.proto).
const META_GRAPH_SAVER_DEF: u64 = 3;
/// `SaverDef.filename_tensor_name` (tensorflow/core/protobuf/saver.proto).
const SAVER_FILENAME_TENSOR: u64 = 1;
/// `SaverDef.save_tensor_name`.
const SAVER_SAVE_TENSOR: u64 = 2;
/// `SaverDef.restore_op_name`.
const SAVER_RESTORE_OP: u64 = 3;

/// The graph names through which a SavedModel's variables are saved and restored.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct SaverDef {
    /// The string placeholder fed with the checkpoint prefix (`saver_filename:0`).
    pub(crate) filename_tensor: String,
    /// The tensor whose evaluation writes the checkpoint (`StatefulPartitionedCall_3:0`).
    pub(crate) save_tensor: String,
    /// The operation that restores the variables (run by the loader).
    pub(crate) restore_op: String,
}

/// Malformed protobuf bytes: what was being read and at which byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WireError {
    offset: usize,
    what: &'static str,
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "malformed protobuf at byte {}: {}",
            self.offset, self.what
        )
    }
}

impl std::error::Error for WireError {}

/// Reads the SaverDef of a serialized MetaGraphDef; `Ok(None)` when it has none, or
/// one without a save tensor (as the `tensorflow` crate's own `SavedModelBuilder`
/// writes), since such a saver cannot write variables.
pub(crate) fn saver_def(meta_graph_def: &[u8]) -> Result<Option<SaverDef>, WireError> {
    // A repeated singular message may be split; protobuf merges the pieces.
    let mut saver = SaverDef::default();
    let mut present = false;
    for field in Fields::new(meta_graph_def) {
        let (number, value) = field?;
        if number != META_GRAPH_SAVER_DEF {
            continue;
        }
        let Value::Bytes(bytes) = value else {
            return Err(WireError {
                offset: 0,
                what: "MetaGraphDef.saver_def is not length-delimited",
            });
        };
        present = true;
        for field in Fields::new(bytes) {
            let (number, value) = field?;
            let target = match number {
                SAVER_FILENAME_TENSOR => &mut saver.filename_tensor,
                SAVER_SAVE_TENSOR => &mut saver.save_tensor,
                SAVER_RESTORE_OP => &mut saver.restore_op,
                _ => continue,
            };
            let Value::Bytes(text) = value else {
                return Err(WireError {
                    offset: 0,
                    what: "a SaverDef name is not length-delimited",
                });
            };
            *target = String::from_utf8_lossy(text).into_owned();
        }
    }
    Ok(
        (present && !saver.save_tensor.is_empty() && !saver.filename_tensor.is_empty())
            .then_some(saver),
    )
}

/// `MetaGraphDef.graph_def`.
const META_GRAPH_GRAPH_DEF: u64 = 2;

/// The serialized `GraphDef` (nodes and function library) of a serialized
/// MetaGraphDef; empty when it has none.
pub(crate) fn graph_def(meta_graph_def: &[u8]) -> Result<&[u8], WireError> {
    let mut found: &[u8] = &[];
    for field in Fields::new(meta_graph_def) {
        if let (META_GRAPH_GRAPH_DEF, Value::Bytes(bytes)) = field? {
            // A singular message split in pieces is rare; TensorFlow never writes one.
            found = bytes;
        }
    }
    Ok(found)
}

/// `SavedModel.meta_graphs` (tensorflow/core/protobuf/saved_model.proto).
const SAVED_MODEL_META_GRAPHS: u64 = 2;

/// Walks a serialized `SavedModel` (a `saved_model.pb`) field by field and
/// returns its MetaGraphDefs' bytes; a file cut short or damaged fails where
/// its bytes stop making sense.
pub(crate) fn meta_graphs(saved_model: &[u8]) -> Result<Vec<&[u8]>, WireError> {
    let mut graphs = Vec::new();
    for field in Fields::new(saved_model) {
        if let (SAVED_MODEL_META_GRAPHS, Value::Bytes(bytes)) = field? {
            graphs.push(bytes);
        }
    }
    Ok(graphs)
}

/// One field value; fixed-width values are only skipped.
pub(crate) enum Value<'a> {
    /// A varint (integers, bools, enums).
    Varint(u64),
    /// A fixed-width value, skipped.
    Scalar,
    /// A length-delimited value (strings, bytes, messages, packed repeated).
    Bytes(&'a [u8]),
}

/// The top-level fields of one message, in order.
pub(crate) struct Fields<'a> {
    bytes: &'a [u8],
    pos: usize,
    failed: bool,
}

impl<'a> Fields<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self {
            bytes,
            pos: 0,
            failed: false,
        }
    }

    fn error(&mut self, what: &'static str) -> WireError {
        self.failed = true;
        WireError {
            offset: self.pos,
            what,
        }
    }

    fn varint(&mut self) -> Result<u64, WireError> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let Some(&byte) = self.bytes.get(self.pos) else {
                return Err(self.error("truncated varint"));
            };
            self.pos += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(self.error("varint longer than 10 bytes"))
    }

    fn skip(&mut self, len: usize) -> Result<&'a [u8], WireError> {
        let end = self
            .pos
            .checked_add(len)
            .filter(|&end| end <= self.bytes.len());
        let Some(end) = end else {
            return Err(self.error("field runs past the end of the message"));
        };
        let slice = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(slice)
    }

    fn field(&mut self) -> Result<(u64, Value<'a>), WireError> {
        let key = self.varint()?;
        let number = key >> 3;
        let value = match key & 7 {
            0 => self.varint().map(Value::Varint)?,
            1 => self.skip(8).map(|_| Value::Scalar)?,
            2 => {
                let len = self.varint()?;
                let len = usize::try_from(len)
                    .map_err(|_| self.error("length-delimited field too long"))?;
                Value::Bytes(self.skip(len)?)
            }
            5 => self.skip(4).map(|_| Value::Scalar)?,
            // Groups (3, 4) are proto2-only and absent from TensorFlow's protos.
            _ => return Err(self.error("unsupported wire type")),
        };
        Ok((number, value))
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u64, Value<'a>), WireError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.pos >= self.bytes.len() {
            return None;
        }
        Some(self.field())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string_field(number: u64, text: &str) -> Vec<u8> {
        let mut out = vec![((number << 3) | 2) as u8, text.len() as u8];
        out.extend_from_slice(text.as_bytes());
        out
    }

    fn meta_graph(saver: &[u8]) -> Vec<u8> {
        // A graph_def (field 2) and a varint field before the saver_def.
        let mut out = vec![(2 << 3) | 2, 3, 1, 2, 3, 8 << 3, 0x96, 0x01];
        out.push(((META_GRAPH_SAVER_DEF << 3) | 2) as u8);
        out.push(saver.len() as u8);
        out.extend_from_slice(saver);
        out
    }

    #[test]
    fn reads_the_three_names() {
        let mut saver = string_field(1, "saver_filename:0");
        saver.extend(string_field(2, "StatefulPartitionedCall_3:0"));
        saver.extend(string_field(3, "StatefulPartitionedCall_4"));
        saver.extend([7 << 3, 2]); // version: V2
        let def = saver_def(&meta_graph(&saver)).ok().flatten();
        assert_eq!(
            def,
            Some(SaverDef {
                filename_tensor: "saver_filename:0".into(),
                save_tensor: "StatefulPartitionedCall_3:0".into(),
                restore_op: "StatefulPartitionedCall_4".into(),
            })
        );
    }

    #[test]
    fn no_saver_or_no_save_tensor_is_none() {
        assert_eq!(saver_def(&[(2 << 3) | 2, 1, 0]), Ok(None));
        let only_restore = string_field(3, "restore_all");
        assert_eq!(saver_def(&meta_graph(&only_restore)), Ok(None));
    }

    #[test]
    fn reads_the_graph_def() {
        let bytes = meta_graph(&string_field(1, "saver_filename:0"));
        assert_eq!(graph_def(&bytes), Ok(&[1u8, 2, 3][..]));
        assert_eq!(graph_def(&string_field(3, "no graph")), Ok(&[][..]));
    }

    #[test]
    fn truncated_bytes_are_an_error() {
        let mut bytes = meta_graph(&string_field(1, "saver_filename:0"));
        bytes.truncate(bytes.len() - 3);
        assert!(saver_def(&bytes).is_err());
    }
}
