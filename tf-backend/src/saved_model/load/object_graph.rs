//! What a MetaGraphDef's object graph (`SavedObjectGraph`) says about its variables:
//! whether each is trainable, and which belong to Keras's `optimizer_variables`
//! collection. Read from the serialized bytes with [`saver_def`](super::saver_def)'s
//! wire-format walker, as the `tensorflow` crate does not decode it.

use std::collections::{BTreeMap, BTreeSet};

use super::saver_def::{Fields, Value, WireError};

/// `MetaGraphDef.object_graph_def` (tensorflow/core/protobuf/meta_graph.proto).
const META_GRAPH_OBJECT_GRAPH: u64 = 7;
/// `SavedObjectGraph.nodes` (tensorflow/core/protobuf/saved_object_graph.proto).
const OBJECT_GRAPH_NODES: u64 = 1;
/// `SavedObject.children`.
const OBJECT_CHILDREN: u64 = 1;
/// `SavedObject.variable`.
const OBJECT_VARIABLE: u64 = 7;
/// `ObjectReference.node_id` (tensorflow/core/protobuf/trackable_object_graph.proto).
const REFERENCE_NODE_ID: u64 = 1;
/// `ObjectReference.local_name`.
const REFERENCE_LOCAL_NAME: u64 = 2;
/// `SavedVariable.trainable`.
const VARIABLE_TRAINABLE: u64 = 3;
/// `SavedVariable.name`.
const VARIABLE_NAME: u64 = 6;

/// The root attribute under which `keras.export.ExportArchive` tracks the variables
/// given to `add_variable_collection("optimizer_variables", ...)`.
pub(crate) const OPTIMIZER_COLLECTION: &str = "optimizer_variables";

/// The variables of a SavedModel's object graph, by name (`mlp/hidden/kernel`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ObjectGraph {
    /// Each variable name with its `trainable` flag; `None` where two variables of
    /// that name disagree.
    pub(crate) trainable: BTreeMap<String, Option<bool>>,
    /// The names of the variables in the root's `optimizer_variables` collection.
    pub(crate) optimizer_variables: BTreeSet<String>,
}

#[derive(Default)]
struct Node {
    children: Vec<(String, usize)>,
    variable: Option<(String, bool)>,
}

/// Reads the object graph of a serialized MetaGraphDef (empty when it has none).
pub(crate) fn object_graph(meta_graph_def: &[u8]) -> Result<ObjectGraph, WireError> {
    let mut nodes = Vec::new();
    for field in Fields::new(meta_graph_def) {
        let (META_GRAPH_OBJECT_GRAPH, Value::Bytes(graph)) = field? else {
            continue;
        };
        for field in Fields::new(graph) {
            if let (OBJECT_GRAPH_NODES, Value::Bytes(node)) = field? {
                nodes.push(read_node(node)?);
            }
        }
    }
    let mut out = ObjectGraph::default();
    for (name, trainable) in nodes.iter().filter_map(|n| n.variable.as_ref()) {
        out.trainable
            .entry(name.clone())
            .and_modify(|known| {
                if *known != Some(*trainable) {
                    *known = None;
                }
            })
            .or_insert(Some(*trainable));
    }
    let collection = nodes.first().and_then(|root| {
        root.children
            .iter()
            .find(|(name, _)| name == OPTIMIZER_COLLECTION)
            .and_then(|(_, id)| nodes.get(*id))
    });
    if let Some(collection) = collection {
        out.optimizer_variables = collection
            .children
            .iter()
            .filter_map(|(_, id)| nodes.get(*id)?.variable.as_ref())
            .map(|(name, _)| name.clone())
            .collect();
    }
    Ok(out)
}

fn read_node(bytes: &[u8]) -> Result<Node, WireError> {
    let mut node = Node::default();
    for field in Fields::new(bytes) {
        match field? {
            (OBJECT_CHILDREN, Value::Bytes(reference)) => {
                let (mut id, mut name) = (None, String::new());
                for field in Fields::new(reference) {
                    match field? {
                        (REFERENCE_NODE_ID, Value::Varint(v)) => id = usize::try_from(v).ok(),
                        (REFERENCE_LOCAL_NAME, Value::Bytes(text)) => {
                            name = String::from_utf8_lossy(text).into_owned();
                        }
                        _ => {}
                    }
                }
                if let Some(id) = id {
                    node.children.push((name, id));
                }
            }
            (OBJECT_VARIABLE, Value::Bytes(variable)) => {
                let (mut name, mut trainable) = (String::new(), false);
                for field in Fields::new(variable) {
                    match field? {
                        (VARIABLE_NAME, Value::Bytes(text)) => {
                            name = String::from_utf8_lossy(text).into_owned();
                        }
                        (VARIABLE_TRAINABLE, Value::Varint(v)) => trainable = v != 0,
                        _ => {}
                    }
                }
                node.variable = Some((name, trainable));
            }
            _ => {}
        }
    }
    Ok(node)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(number: u64, body: &[u8]) -> Vec<u8> {
        let mut out = vec![((number << 3) | 2) as u8, body.len() as u8];
        out.extend_from_slice(body);
        out
    }

    fn varint(number: u64, value: u8) -> Vec<u8> {
        vec![(number << 3) as u8, value]
    }

    fn child(name: &str, id: u8) -> Vec<u8> {
        let mut reference = varint(REFERENCE_NODE_ID, id);
        reference.extend(message(REFERENCE_LOCAL_NAME, name.as_bytes()));
        message(OBJECT_CHILDREN, &reference)
    }

    fn variable(name: &str, trainable: bool) -> Vec<u8> {
        let mut body = varint(VARIABLE_TRAINABLE, u8::from(trainable));
        body.extend(message(VARIABLE_NAME, name.as_bytes()));
        message(OBJECT_VARIABLE, &body)
    }

    #[test]
    fn reads_flags_and_the_optimizer_collection() {
        let root = [child("optimizer_variables", 1), child("w", 2)].concat();
        let collection = child("0", 3);
        let nodes = [
            root,
            collection,
            variable("m/w", true),
            variable("adam/iteration", false),
        ];
        let graph: Vec<u8> = nodes
            .iter()
            .flat_map(|n| message(OBJECT_GRAPH_NODES, n))
            .collect();
        let meta = message(META_GRAPH_OBJECT_GRAPH, &graph);
        let parsed = object_graph(&meta).ok().unwrap_or_default();
        assert_eq!(parsed.trainable.get("m/w"), Some(&Some(true)));
        assert_eq!(parsed.trainable.get("adam/iteration"), Some(&Some(false)));
        assert_eq!(
            parsed.optimizer_variables.iter().collect::<Vec<_>>(),
            ["adam/iteration"]
        );
    }

    #[test]
    fn no_object_graph_is_empty() {
        assert_eq!(
            object_graph(&[(2 << 3) | 2, 1, 0]),
            Ok(ObjectGraph::default())
        );
    }
}
