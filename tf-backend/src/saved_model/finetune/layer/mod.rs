//! `saved_model` layers ([`Layer::SavedModel`]): one signature of a SavedModel
//! imported into a [`TfModel`](crate::TfModel)'s graph as a frozen feature
//! extractor.
//!
//! The SavedModel's GraphDef (its nodes and its function library) is imported
//! with `TF_GraphImportGraphDef` under a fresh name prefix, the signature's input
//! placeholder mapped to the tensor reaching the layer, and a `StopGradient` put
//! after the signature's output. Each compiled program (one per input shape and
//! mode) imports it again; the imports share the SavedModel's variables, since a
//! `VarHandleOp` names its resource by its `shared_name` attribute, which a name
//! prefix leaves as it is. Those variables are filled once, when the model is
//! built, by one more import whose saver restore op (`SaverDef.restore_op_name`,
//! fed `<dir>/variables/variables`) is run.
//!
//! `mod.rs` holds the layers of one model (loading, restoring, importing);
//! `signature.rs` the signature a layer uses and the shapes through it.

mod signature;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use kiln_core::{
    model::{Layer, SavedModelLayerConfig},
    DType, Error, Result,
};
use tensorflow::{DataType, Graph, ImportGraphDefOptions, Output};

use crate::engine::{tf_dtype, Engine};
use crate::error::tf_error;
use crate::graph::Builder;
use crate::saved_model::load::TensorSpec;
pub use signature::resolve_saved_model_shapes;
use signature::{check_input, known_example_dims, open, shown};

/// The checkpoint prefix of a SavedModel's variables, inside its directory.
const VARIABLES_PREFIX: &str = "variables/variables";

/// One `saved_model` layer: the signature's tensors and the graph to import.
struct Frozen {
    /// The SavedModel directory as the layer names it.
    dir: PathBuf,
    signature: String,
    input: TensorSpec,
    output: TensorSpec,
    graph_def: Arc<[u8]>,
}

/// What restores one SavedModel's variables in a model's session.
struct Restore {
    /// The directory, canonical (one restore per SavedModel, however many layers use it).
    dir: PathBuf,
    graph_def: Arc<[u8]>,
    /// `SaverDef.filename_tensor_name` and `restore_op_name`, when it has a saver.
    saver: Option<(String, String)>,
    init_op: Option<String>,
}

/// The `saved_model` layers of a model, by layer path, loaded when it is built.
#[derive(Default)]
pub(crate) struct SavedModelLayers {
    layers: HashMap<String, Frozen>,
    restores: Vec<Restore>,
}

impl fmt::Debug for SavedModelLayers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut map = f.debug_map();
        for (path, layer) in &self.layers {
            map.entry(
                path,
                &format_args!("{} ({})", layer.dir.display(), layer.signature),
            );
        }
        map.finish()
    }
}
impl SavedModelLayers {
    /// Loads every `saved_model` layer of `spec` (missing directory: [`Error::Io`];
    /// unknown signature, input or output: [`Error::InvalidArgument`]) and returns
    /// them with `spec`, each layer's `output_shape` filled in from its signature
    /// where that knows it. A given `output_shape` that the signature contradicts
    /// is [`Error::ShapeMismatch`].
    pub(crate) fn load(spec: &Layer) -> Result<(Self, Layer)> {
        let mut resolved = spec.clone();
        let mut out = Self::default();
        let mut seen: BTreeMap<PathBuf, usize> = BTreeMap::new();
        for (path, config) in saved_model_layers_mut(&mut resolved) {
            let (model, input, output) = open(&path, config)?;
            if let Some(dims) = known_example_dims(&output) {
                match &config.output_shape {
                    Some(given) if *given != dims => {
                        return Err(Error::ShapeMismatch {
                            context: format!(
                                "{}.output_shape (SavedModel {}, signature `{}`, output `{}`)",
                                shown(&path),
                                config.path.display(),
                                config.signature,
                                output.name
                            ),
                            expected: output.shape_string(),
                            actual: format!("{given:?}"),
                        })
                    }
                    _ => config.output_shape = Some(dims),
                }
            }
            let canonical = config
                .path
                .canonicalize()
                .map_err(|e| Error::io(&config.path, e))?;
            let graph_def: Arc<[u8]> = match seen.get(&canonical) {
                Some(&i) => Arc::clone(&out.restores[i].graph_def),
                None => {
                    let graph_def: Arc<[u8]> = Arc::from(model.graph_def());
                    seen.insert(canonical.clone(), out.restores.len());
                    out.restores.push(Restore {
                        dir: canonical,
                        graph_def: Arc::clone(&graph_def),
                        saver: model
                            .saver_def()
                            .map(|def| (def.filename_tensor.clone(), def.restore_op.clone())),
                        init_op: model.init_op().map(str::to_owned),
                    });
                    graph_def
                }
            };
            log::info!(
                "saved_model layer `{}`: {} signature `{}` ({} -> {}), frozen",
                shown(&path),
                config.path.display(),
                config.signature,
                input,
                output
            );
            out.layers.insert(
                path,
                Frozen {
                    dir: config.path.clone(),
                    signature: config.signature.clone(),
                    input,
                    output,
                    graph_def,
                },
            );
        }
        Ok((out, resolved))
    }

    /// Whether the model has no `saved_model` layer.
    pub(crate) fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// Imports each SavedModel once into `engine`'s graph and restores its
    /// variables from its checkpoint, then runs its init op. Two SavedModels (or
    /// a SavedModel and the model itself) naming a variable alike would share it:
    /// that is [`Error::Unsupported`].
    pub(crate) fn restore(&self, engine: &mut Engine) -> Result<()> {
        for restore in &self.restores {
            let taken = shared_names(&engine.b.graph, None)?;
            let prefix = engine.b.name("saved_model_restore");
            let context = format!(
                "importing the graph of the SavedModel {} into the model's graph",
                restore.dir.display()
            );
            let mut options = ImportGraphDefOptions::new();
            options.set_prefix(&prefix).map_err(|e| nul(&context, e))?;
            engine
                .b
                .graph
                .import_graph_def(&restore.graph_def, &options)
                .map_err(|s| tf_error(&context, s))?;
            let imported = shared_names(&engine.b.graph, Some(&prefix))?;
            if let Some(name) = imported.into_iter().find(|name| taken.contains(name)) {
                return Err(Error::unsupported(format!(
                    "the SavedModel {} names a variable `{name}`, as a SavedModel imported \
                     before it (or the model itself) does; TensorFlow would make them one \
                     variable. Use one of the two SavedModels, or re-export one with other \
                     variable names",
                    restore.dir.display()
                )));
            }
            match &restore.saver {
                Some((filename, restore_op)) => {
                    let checkpoint = restore.dir.join(VARIABLES_PREFIX);
                    let Some(checkpoint) = checkpoint.to_str() else {
                        return Err(Error::invalid_argument(
                            "path",
                            format!(
                                "{} is not valid UTF-8, which TensorFlow needs for a \
                                 checkpoint path",
                                checkpoint.display()
                            ),
                        ));
                    };
                    let feed = port(&engine.b.graph, &prefix, filename)?;
                    let (op, _) = split(restore_op);
                    let target = port(&engine.b.graph, &prefix, op)?;
                    engine.run_with_string(
                        &feed,
                        checkpoint,
                        &[&target.operation],
                        &format!(
                            "restoring the variables of the SavedModel {} from {checkpoint}",
                            restore.dir.display()
                        ),
                    )?;
                }
                None => log::debug!(
                    "SavedModel {}: no saver, so no variables to restore",
                    restore.dir.display()
                ),
            }
            if let Some(init) = &restore.init_op {
                let (op, _) = split(init);
                let target = port(&engine.b.graph, &prefix, op)?;
                engine.run(
                    &[],
                    &[],
                    &[&target.operation],
                    &format!(
                        "running the init op of the SavedModel {}",
                        restore.dir.display()
                    ),
                )?;
            }
            log::debug!(
                "restored the variables of the SavedModel {} (import `{prefix}`)",
                restore.dir.display()
            );
        }
        Ok(())
    }

    /// Imports the layer at `path` on `x` (per-example dims `dims`) into `b`'s
    /// graph and returns its output, after a `StopGradient`.
    pub(crate) fn import(
        &self,
        b: &mut Builder,
        path: &str,
        config: &SavedModelLayerConfig,
        x: &Output,
        dims: &[i64],
    ) -> Result<Output> {
        let layer = self.layers.get(path).ok_or_else(|| {
            Error::backend(
                "tensorflow",
                "building a saved_model layer",
                format!("the layer `{}` was not loaded", shown(path)),
            )
        })?;
        let example: Vec<usize> = dims.iter().map(|&d| d.max(0) as usize).collect();
        let dtype = kiln_dtype(x.operation.output_type(x.index as usize));
        check_input(path, config, &layer.input, &example, dtype)?;

        let prefix = b.name("saved_model");
        let context = format!(
            "importing signature `{}` of the SavedModel {} as the layer `{}`",
            layer.signature,
            layer.dir.display(),
            shown(path)
        );
        let mut options = ImportGraphDefOptions::new();
        options.set_prefix(&prefix).map_err(|e| nul(&context, e))?;
        let (input, input_index) = split(&layer.input.tensor);
        options
            .add_input_mapping(input, input_index as usize, x)
            .map_err(|e| nul(&context, e))?;
        let (output, output_index) = split(&layer.output.tensor);
        options
            .add_return_output(output, output_index as usize)
            .map_err(|e| nul(&context, e))?;
        let outputs = b
            .graph
            .import_graph_def_with_return_outputs(&layer.graph_def, &options)
            .map_err(|s| tf_error(&context, s))?;
        let y = outputs
            .into_iter()
            .next()
            .ok_or_else(|| Error::backend("tensorflow", context.clone(), "no output came back"))?;
        // Frozen: no gradient reaches the SavedModel's graph, or the layers before it.
        b.stop_gradient(&y)
    }
}

/// The [`Layer::SavedModel`] layers of `spec` with their paths, mutable.
fn saved_model_layers_mut(spec: &mut Layer) -> Vec<(String, &mut SavedModelLayerConfig)> {
    fn walk<'a>(
        layer: &'a mut Layer,
        path: String,
        out: &mut Vec<(String, &'a mut SavedModelLayerConfig)>,
    ) {
        let join = |name: &str| {
            if path.is_empty() {
                name.to_owned()
            } else {
                format!("{path}.{name}")
            }
        };
        match layer {
            Layer::Sequential { layers } | Layer::Parallel { branches: layers } => {
                for (i, child) in layers.iter_mut().enumerate() {
                    walk(child, join(&i.to_string()), out);
                }
            }
            Layer::Residual { block } => walk(block, join("block"), out),
            Layer::SavedModel(c) => out.push((path, c)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(spec, String::new(), &mut out);
    out
}

/// The `shared_name`s of the graph's `VarHandleOp`s (those imported under
/// `prefix/` when given).
///
/// Every import of a SavedModel reaches the variables the restore filled only
/// through these names: an imported handle without one is
/// [`Error::Unsupported`] (TensorFlow 2's exporter always writes one).
fn shared_names(graph: &Graph, prefix: Option<&str>) -> Result<HashSet<String>> {
    let mut names = HashSet::new();
    for op in graph.operation_iter() {
        if !op.op_type().is_ok_and(|t| t == "VarHandleOp") {
            continue;
        }
        let name = op.name().unwrap_or_default();
        let imported = prefix.is_some_and(|p| {
            name.strip_prefix(p)
                .is_some_and(|rest| rest.starts_with('/'))
        });
        if prefix.is_some() && !imported {
            continue;
        }
        match op.get_attr_string("shared_name") {
            Ok(shared) if !shared.is_empty() => {
                names.insert(shared);
            }
            _ if imported => {
                return Err(Error::unsupported(format!(
                    "the SavedModel variable `{name}` has no shared_name, so the copies of \
                     the SavedModel's graph in the model's programs could not reach the \
                     values restored into it; re-export it with TensorFlow 2 \
                     (`tf.saved_model.save` or Keras's `model.export`)"
                )))
            }
            _ => {
                names.insert(name);
            }
        }
    }
    Ok(names)
}

/// `op:index` as `(op, index)`; a bare name is output 0.
fn split(name: &str) -> (&str, i32) {
    match name.rsplit_once(':') {
        Some((op, index)) => match index.parse() {
            Ok(index) => (op, index),
            Err(_) => (name, 0),
        },
        None => (name, 0),
    }
}

/// The imported tensor `prefix/name`.
fn port(graph: &Graph, prefix: &str, name: &str) -> Result<Output> {
    let (op, index) = split(name);
    let full = format!("{prefix}/{op}");
    let operation = graph
        .operation_by_name_required(&full)
        .map_err(|s| tf_error(&format!("finding `{full}` in the imported SavedModel"), s))?;
    Ok(Output { operation, index })
}

fn nul(context: &str, e: std::ffi::NulError) -> Error {
    Error::invalid_argument("name", format!("{context}: a name holds a NUL byte ({e})"))
}

fn kiln_dtype(dtype: DataType) -> Option<DType> {
    [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8]
        .into_iter()
        .find(|d| tf_dtype(*d).is_ok_and(|t| t == dtype))
}
