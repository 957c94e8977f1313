//! The `load` room: a SavedModel as TensorFlow wrote it, read. [`SavedModel`] loads
//! one (its signatures, its session, its saver), describes it, runs its signatures
//! and writes its variables back; the files beside this one read what the
//! `tensorflow` crate does not decode (the `SaverDef`, the object graph, by a
//! protobuf wire-format walker) and handle the directory's files.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | [`SavedModel`]: loading, the signatures resolved in the graph, `describe` |
//! | `run.rs` | [`SavedModel::run`] and [`SavedModel::train_step`], inputs checked first |
//! | `save.rs` | the saver: [`SavedModel::save_variables`], [`SavedModel::save_variables_to`] |
//! | `signature.rs` | [`SignatureInfo`], [`TensorSpec`], [`TensorDType`]: a signature in Kiln's terms |
//! | `saver_def.rs` | the wire-format reader, the `SaverDef` and `GraphDef` of a MetaGraphDef |
//! | `object_graph.rs` | what the object graph says of each variable |
//! | `files.rs` | checking, copying and syncing a SavedModel's files |
//!
//! This room imports from neither `finetune` nor `export`; both build on it, through
//! the crate-visible items here (the resolved [`Signature`]s, the session, the graph
//! to add ops to, the saver).

pub(crate) mod files;
mod object_graph;
mod run;
mod save;
pub(crate) mod saver_def;
mod signature;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use kiln_core::{Error, Result};
use tensorflow::{Graph, Operation, SavedModelBundle, Session, TensorInfo};

use crate::error::tf_error;
use crate::graph::Builder;
pub(crate) use object_graph::ObjectGraph;
pub(crate) use run::loss_not_scalar;
pub(crate) use save::Saver;
use saver_def::SaverDef;
pub use signature::{SignatureInfo, TensorDType, TensorSpec};

/// The name scope of the ops Kiln adds to a loaded graph (reads, writes, losses).
/// (TensorFlow node names cannot start with `_`; an invalid name is only refused when
/// the session is extended with the node.)
const KILN_SCOPE: &str = "kiln_saved_model";

/// The tag of the serving MetaGraph, the one TensorFlow 2 exports write.
pub(crate) const SERVE_TAG: &str = "serve";

/// Signature keys TensorFlow uses for its own purposes (`__saved_model_init_op`,
/// `__saved_model_train_op`): they name an operation to run, not a function.
const INTERNAL_SIGNATURE_PREFIX: &str = "__saved_model_";

/// The signature key under which TensorFlow 2 exports name their init op.
const INIT_OP_SIGNATURE: &str = "__saved_model_init_op";

/// The output [`SavedModel::train_step`] reads when a signature has several.
pub(crate) const LOSS_OUTPUT: &str = "loss";

/// A graph tensor: an operation and the index of one of its outputs.
#[derive(Debug, Clone)]
pub(crate) struct Port {
    pub(crate) operation: Operation,
    pub(crate) index: i32,
}

/// A signature with its tensors resolved in the graph, in the order of `info`'s.
#[derive(Debug)]
pub(crate) struct Signature {
    pub(crate) info: SignatureInfo,
    pub(crate) inputs: Vec<Port>,
    pub(crate) outputs: Vec<Port>,
}

/// A loaded TensorFlow SavedModel: its signatures and a session holding its variables.
///
/// A SavedModel written by TensorFlow 2 (`tf.saved_model.save`, Keras 3's
/// `model.export` or `keras.export.ExportArchive`) holds a graph whose *signatures*
/// are named functions from input tensors to output tensors, plus a checkpoint of its
/// variables under `variables/`. [`SavedModel`] loads one through the TensorFlow C API
/// (`TF_LoadSessionFromSavedModel`), checks every call against the signature before
/// running it, and runs each call as one session run.
///
/// ```no_run
/// use kiln_core::HostTensor;
/// use kiln_tf::SavedModel;
///
/// let model = SavedModel::load("exported/mlp")?;
/// println!("{}", model.describe());
/// let x = HostTensor::new(vec![0.5f32; 2 * 8], [2, 8])?;
/// let outputs = model.run("serving_default", &[("x", &x)])?;
/// println!("{:?}", outputs["output_0"]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
///
/// # Fine-tuning
///
/// Kiln does not differentiate a loaded SavedModel's graph (its layers sit inside
/// function calls); the training step is exported from Python instead, as a signature
/// that computes the loss and applies the optimizer inside the function. With Keras 3:
///
/// ```python
/// optimizer = keras.optimizers.Adam(1e-3)
/// optimizer.build(model.trainable_variables)   # create its slots before tracing
///
/// def train(x, y):
///     with tf.GradientTape() as tape:
///         loss = loss_fn(y, model(x, training=True))
///     grads = tape.gradient(loss, model.trainable_variables)
///     optimizer.apply_gradients(zip(grads, model.trainable_variables))
///     return {"loss": loss}
///
/// archive = keras.export.ExportArchive()
/// archive.track(model)
/// archive.add_endpoint("serve", lambda x: model(x, training=False),
///                      input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")])
/// archive.add_endpoint("train", train, input_signature=[
///     tf.TensorSpec([None, 8], tf.float32, name="x"),
///     tf.TensorSpec([None], tf.int32, name="y")])
/// archive.write_out("exported/mlp")
/// ```
///
/// [`SavedModel::train_step`] then runs `train` and returns its `loss`. The optimizer's
/// variables are saved with the model because the `train` function uses them, so a
/// fine-tuning run can stop, [save](SavedModel::save_variables) and resume.
/// To fine-tune with the `Trainer` (loop, metrics, callbacks, schedules, exact-resume
/// checkpoints), wrap the model in a [`SavedModelModule`].
///
/// # Saving
///
/// Every TensorFlow 2 SavedModel carries a `SaverDef`: a string placeholder
/// (`saver_filename:0`) fed with a checkpoint prefix, and a tensor
/// (`StatefulPartitionedCall_<n>:0`) whose evaluation writes an object-graph
/// checkpoint there, which Python's `tf.saved_model.load` restores.
/// [`SavedModel::save_variables`] and [`SavedModel::save_variables_to`] run it.
///
/// Keras 3 exports keep two graph variables per Keras variable: the one the graph's
/// functions use (and Kiln trains) and a mirror, the one Python's loader binds the
/// functions to. Saving first copies each variable into its mirror, so Python sees
/// the trained weights.
///
/// Running a training signature changes the variables in this session only; write
/// them out with [`save_variables`](Self::save_variables) or
/// [`save_variables_to`](Self::save_variables_to).
///
/// [`SavedModelModule`]: crate::SavedModelModule
pub struct SavedModel {
    dir: PathBuf,
    tags: Vec<String>,
    session: Session,
    signatures: BTreeMap<String, Signature>,
    saver: Option<Saver>,
    /// The graph the session runs, kept so that ops can be added to it (the C API
    /// extends the session with them on its next run); see
    /// [`SavedModelModule`](crate::SavedModelModule).
    graph: Mutex<Builder>,
    /// What the object graph says about the variables.
    objects: ObjectGraph,
    /// The serialized GraphDef of the loaded MetaGraph (with its function
    /// library), for importing into another graph (a `saved_model` layer).
    graph_def: Vec<u8>,
    /// The op that initializes what the checkpoint does not hold (tables), from
    /// the `__saved_model_init_op` entry, when there is one.
    init_op: Option<String>,
}

impl fmt::Debug for SavedModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SavedModel")
            .field("dir", &self.dir)
            .field("tags", &self.tags)
            .field("signatures", &self.signatures.keys().collect::<Vec<_>>())
            .field("saver", &self.saver.as_ref().map(|s| &s.def))
            .finish_non_exhaustive()
    }
}

impl SavedModel {
    /// Loads the SavedModel in `dir` with the `serve` tag.
    ///
    /// A missing `dir` is [`Error::Io`]; a directory without `saved_model.pb` is
    /// [`Error::InvalidArgument`]; TensorFlow's own failures (no MetaGraph with the
    /// tag, a corrupt checkpoint) are [`Error::Backend`].
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        Self::load_with_tags(dir, &[SERVE_TAG])
    }

    /// Loads the SavedModel in `dir`, choosing the MetaGraph whose tag set is `tags`.
    pub fn load_with_tags(dir: impl AsRef<Path>, tags: &[&str]) -> Result<Self> {
        let dir = dir.as_ref();
        files::check_saved_model_dir(dir)?;
        if tags.is_empty() {
            return Err(Error::invalid_argument(
                "tags",
                "no tags given; a SavedModel's MetaGraph is chosen by its tags (`serve` for \
                 TensorFlow 2 exports)",
            ));
        }
        let mut graph = Graph::new();
        let context = format!(
            "loading the SavedModel {} with tags [{}]",
            dir.display(),
            tags.join(", ")
        );
        let mut bundle =
            SavedModelBundle::load(&crate::runtime::session_options()?, tags, &mut graph, dir)
                .map_err(|status| {
                    tf_error(
                        &format!("{context}, from its files {}", files::describe_files(dir)),
                        status,
                    )
                })?;
        // The decoded MetaGraphDef has only the signatures; the SaverDef is read from
        // the raw bytes, which the crate still exposes (deprecated, not removed).
        #[allow(deprecated)]
        let raw_meta_graph = std::mem::take(&mut bundle.meta_graph_def);

        let mut signatures = BTreeMap::new();
        let mut init_op = None;
        for (name, def) in bundle.meta_graph_def().signatures() {
            if name == INIT_OP_SIGNATURE {
                init_op = def
                    .outputs()
                    .values()
                    .next()
                    .map(|info| info.name().name.clone());
            }
            if name.starts_with(INTERNAL_SIGNATURE_PREFIX) {
                log::debug!("SavedModel {}: skipping `{name}`", dir.display());
                continue;
            }
            let (inputs, input_ports) = resolve(&graph, name, def.inputs())?;
            let (outputs, output_ports) = resolve(&graph, name, def.outputs())?;
            let info = SignatureInfo {
                name: name.clone(),
                method_name: def.method_name().to_owned(),
                inputs,
                outputs,
            };
            let signature = Signature {
                info,
                inputs: input_ports,
                outputs: output_ports,
            };
            signatures.insert(name.clone(), signature);
        }

        let saver = match saver_def::saver_def(&raw_meta_graph) {
            Ok(Some(def)) => Some(Saver::find(&graph, def, dir)?),
            Ok(None) => None,
            Err(e) => {
                return Err(Error::backend_with_source(
                    "tensorflow",
                    format!("reading the SaverDef of the SavedModel {}", dir.display()),
                    e,
                ))
            }
        };
        let graph_def = match saver_def::graph_def(&raw_meta_graph) {
            Ok(bytes) => bytes.to_vec(),
            Err(e) => {
                return Err(Error::backend_with_source(
                    "tensorflow",
                    format!("reading the GraphDef of the SavedModel {}", dir.display()),
                    e,
                ))
            }
        };
        let objects = object_graph::object_graph(&raw_meta_graph).unwrap_or_else(|e| {
            log::debug!(
                "SavedModel {}: cannot read its object graph ({e}); variables are classified \
                 from the graph alone",
                dir.display()
            );
            ObjectGraph::default()
        });
        log::info!(
            "loaded the SavedModel {} (tags [{}]): signatures {}; {}",
            dir.display(),
            tags.join(", "),
            signatures.keys().cloned().collect::<Vec<_>>().join(", "),
            if saver.is_some() {
                "variables can be saved"
            } else {
                "no saver"
            }
        );
        Ok(Self {
            dir: dir.to_path_buf(),
            tags: tags.iter().map(|t| (*t).to_owned()).collect(),
            session: bundle.session,
            signatures,
            saver,
            graph: Mutex::new(Builder::over(graph, KILN_SCOPE)),
            objects,
            graph_def,
            init_op,
        })
    }

    /// The graph, to add ops to; a poisoned lock is an error.
    pub(crate) fn graph(&self) -> Result<MutexGuard<'_, Builder>> {
        self.graph.lock().map_err(|_| {
            Error::backend(
                "tensorflow",
                format!("adding ops to the SavedModel {}", self.dir.display()),
                "a thread panicked while adding ops to its graph",
            )
        })
    }

    /// The graph the session runs now (the MetaGraph and the ops Kiln added),
    /// serialised.
    pub(crate) fn running_graph_def(&self) -> Result<Vec<u8>> {
        self.graph()?.graph.graph_def().map_err(|s| {
            tf_error(
                &format!("serialising the graph of {}", self.dir.display()),
                s,
            )
        })
    }

    /// The session holding the variables, which runs the graph.
    pub(crate) fn session(&self) -> &Session {
        &self.session
    }

    /// The signatures with their tensors resolved in the graph, by name.
    pub(crate) fn resolved_signatures(&self) -> &BTreeMap<String, Signature> {
        &self.signatures
    }

    /// What the object graph says about the variables.
    pub(crate) fn objects(&self) -> &ObjectGraph {
        &self.objects
    }

    /// The serialized GraphDef of the loaded MetaGraph, with its function library.
    pub(crate) fn graph_def(&self) -> &[u8] {
        &self.graph_def
    }

    /// The op that initializes what the checkpoint does not hold (tables), if any.
    pub(crate) fn init_op(&self) -> Option<&str> {
        self.init_op.as_deref()
    }

    /// The saver's names in the graph, when the SavedModel has a saver.
    pub(crate) fn saver_def(&self) -> Option<&SaverDef> {
        self.saver.as_ref().map(|s| &s.def)
    }

    /// The directory it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tags of the loaded MetaGraph.
    pub fn tags(&self) -> &[String] {
        &self.tags
    }

    /// Every signature, sorted by name, each with its inputs and outputs sorted by
    /// name. TensorFlow's internal entries (`__saved_model_init_op`) are left out.
    pub fn signatures(&self) -> Vec<SignatureInfo> {
        self.signatures.values().map(|s| s.info.clone()).collect()
    }

    /// The signature called `name`; an unknown name is [`Error::InvalidArgument`]
    /// listing the available ones.
    pub fn signature(&self, name: &str) -> Result<&SignatureInfo> {
        self.lookup(name).map(|s| &s.info)
    }

    /// Whether the SavedModel has a saver, i.e. whether
    /// [`save_variables`](Self::save_variables) can work.
    pub fn has_saver(&self) -> bool {
        self.saver.is_some()
    }

    /// A listing of the SavedModel for people (what `kiln inspect` prints): the
    /// directory and tags, one line per signature, and whether variables can be saved.
    ///
    /// ```text
    /// SavedModel exported/mlp (tags: serve), 3 signatures:
    ///   serve: inputs x: f32[?, 8] -> outputs output_0: f32[?, 3]
    ///   serving_default: inputs x: f32[?, 8] -> outputs output_0: f32[?, 3]
    ///   train: inputs x: f32[?, 8], y: i32[?] -> outputs loss: f32[]
    /// variables: can be saved (SaverDef: saver_filename:0 -> StatefulPartitionedCall_3:0)
    /// ```
    pub fn describe(&self) -> String {
        let count = self.signatures.len();
        let mut out = format!(
            "SavedModel {} (tags: {}), {count} signature{}:\n",
            self.dir.display(),
            self.tags.join(", "),
            if count == 1 { "" } else { "s" }
        );
        for signature in self.signatures.values() {
            let info = &signature.info;
            out.push_str(&format!("  {info}"));
            if info.method_name != tensorflow::PREDICT_METHOD_NAME {
                out.push_str(&format!(" (method {})", info.method_name));
            }
            out.push('\n');
        }
        match &self.saver {
            Some(saver) => out.push_str(&format!(
                "variables: can be saved (SaverDef: {} -> {})\n",
                saver.def.filename_tensor, saver.def.save_tensor
            )),
            None => out.push_str("variables: no saver, cannot be saved\n"),
        }
        out
    }
    fn lookup(&self, name: &str) -> Result<&Signature> {
        self.signatures.get(name).ok_or_else(|| {
            let available: Vec<&str> = self.signatures.keys().map(String::as_str).collect();
            Error::invalid_argument(
                "signature",
                format!(
                    "the SavedModel {} has no signature `{name}`; available: {}",
                    self.dir.display(),
                    if available.is_empty() {
                        "(none)".to_owned()
                    } else {
                        available.join(", ")
                    }
                ),
            )
        })
    }
}

/// The graph tensor `name` (`op:index`), looked up for `what`.
fn port(graph: &Graph, what: &str, name: &str) -> Result<Port> {
    let (op, index) = match name.rsplit_once(':') {
        Some((op, index)) => match index.parse::<i32>() {
            Ok(index) => (op, index),
            Err(_) => (name, 0),
        },
        None => (name, 0),
    };
    let operation = graph.operation_by_name_required(op).map_err(|status| {
        tf_error(
            &format!("finding the tensor `{name}` of {what} in the graph"),
            status,
        )
    })?;
    Ok(Port { operation, index })
}
/// The specs (sorted by name) and graph ports of a signature's inputs or outputs.
fn resolve(
    graph: &Graph,
    signature: &str,
    tensors: &std::collections::HashMap<String, TensorInfo>,
) -> Result<(Vec<TensorSpec>, Vec<Port>)> {
    let mut sorted: Vec<_> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let mut specs = Vec::with_capacity(sorted.len());
    let mut ports = Vec::with_capacity(sorted.len());
    for (name, info) in sorted {
        let tensor = info.name().to_string();
        let what = format!("signature `{signature}`");
        ports.push(port(graph, &what, &tensor)?);
        let shape = Option::<Vec<Option<i64>>>::from(info.shape().clone()).map(|dims| {
            dims.into_iter()
                .map(|d| d.and_then(|d| usize::try_from(d).ok()))
                .collect()
        });
        specs.push(TensorSpec {
            name: name.clone(),
            dtype: TensorDType::from_tf(info.dtype()),
            shape,
            tensor,
        });
    }
    Ok((specs, ports))
}
