//! TensorFlow SavedModels: list their signatures, run them, fine-tune them through a
//! training signature, and write the trained variables back. See [`SavedModel`].

mod export;
mod files;
mod layer;
mod module;
mod object_graph;
mod proto;
mod saver_def;
mod signature;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use kiln_core::{DType, Error, HostTensor, Result};
use tensorflow::{Graph, Operation, SavedModelBundle, Session, SessionRunArgs, Tensor, TensorInfo};

use crate::convert::{from_tf, TfTensor};
use crate::error::tf_error;
use crate::graph::Builder;
pub use export::{export_saved_model, SavedModelExport, SERVING_SIGNATURE};
pub use layer::resolve_saved_model_shapes;
pub(crate) use layer::SavedModelLayers;
pub use module::{SavedModelModule, SavedModelModuleBuilder, SignatureOptimizer, VariableRole};
use object_graph::ObjectGraph;
use saver_def::SaverDef;
pub use signature::{SignatureInfo, TensorDType, TensorSpec};

/// The name scope of the ops Kiln adds to a loaded graph (reads, writes, losses).
/// (TensorFlow node names cannot start with `_`; an invalid name is only refused when
/// the session is extended with the node.)
const KILN_SCOPE: &str = "kiln_saved_model";

/// The tag of the serving MetaGraph, the one TensorFlow 2 exports write.
const SERVE_TAG: &str = "serve";

/// Signature keys TensorFlow uses for its own purposes (`__saved_model_init_op`,
/// `__saved_model_train_op`): they name an operation to run, not a function.
const INTERNAL_SIGNATURE_PREFIX: &str = "__saved_model_";

/// The signature key under which TensorFlow 2 exports name their init op.
const INIT_OP_SIGNATURE: &str = "__saved_model_init_op";

/// The output [`SavedModel::train_step`] reads when a signature has several.
const LOSS_OUTPUT: &str = "loss";

/// A graph tensor: an operation and the index of one of its outputs.
#[derive(Debug, Clone)]
struct Port {
    operation: Operation,
    index: i32,
}

/// A signature with its tensors resolved in the graph, in the order of `info`'s.
#[derive(Debug)]
struct Signature {
    info: SignatureInfo,
    inputs: Vec<Port>,
    outputs: Vec<Port>,
}

#[derive(Debug)]
struct Saver {
    def: SaverDef,
    filename: Port,
    save: Port,
    /// Initializers of Keras mirror variables, run before every save (see
    /// [`keras_mirrors`]).
    mirrors: Vec<Operation>,
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
pub struct SavedModel {
    dir: PathBuf,
    tags: Vec<String>,
    session: Session,
    signatures: BTreeMap<String, Signature>,
    saver: Option<Saver>,
    /// The graph the session runs, kept so that ops can be added to it (the C API
    /// extends the session with them on its next run); see [`SavedModelModule`].
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
            Ok(Some(def)) => {
                let save = port(&graph, "the SaverDef", &def.save_tensor)?;
                let mirrors = keras_mirrors(&graph, &save.operation);
                if !mirrors.is_empty() {
                    log::debug!(
                        "SavedModel {}: {} mirror variables are synced before each save",
                        dir.display(),
                        mirrors.len()
                    );
                }
                Some(Saver {
                    filename: port(&graph, "the SaverDef", &def.filename_tensor)?,
                    save,
                    mirrors,
                    def,
                })
            }
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
    fn graph(&self) -> Result<MutexGuard<'_, Builder>> {
        self.graph.lock().map_err(|_| {
            Error::backend(
                "tensorflow",
                format!("adding ops to the SavedModel {}", self.dir.display()),
                "a thread panicked while adding ops to its graph",
            )
        })
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

    /// Runs `signature` on `inputs` (name, tensor) and returns every output by name.
    ///
    /// Everything is checked before TensorFlow runs, so a rejected call changes no
    /// variable: an unknown signature or input name, a missing input
    /// ([`Error::InvalidArgument`], naming the expected ones), a wrong dtype
    /// ([`Error::DTypeMismatch`]), a wrong rank or fixed dimension
    /// ([`Error::ShapeMismatch`], with `?` for dimensions of any size), and inputs
    /// or outputs of a dtype Kiln has no host type for ([`Error::Unsupported`]).
    pub fn run(
        &self,
        signature: &str,
        inputs: &[(&str, &HostTensor)],
    ) -> Result<BTreeMap<String, HostTensor>> {
        let signature = self.lookup(signature)?;
        let feeds = check_inputs(signature, inputs)?;
        let outputs = fetchable_outputs(signature)?;

        let mut args = SessionRunArgs::new();
        for (port, tensor) in signature.inputs.iter().zip(&feeds) {
            add_feed(&mut args, port, tensor);
        }
        let tokens: Vec<_> = signature
            .outputs
            .iter()
            .map(|port| args.request_fetch(&port.operation, port.index))
            .collect();
        self.session.run(&mut args).map_err(|status| {
            tf_error(
                &format!(
                    "running signature `{}` of the SavedModel {}",
                    signature.info.name,
                    self.dir.display()
                ),
                status,
            )
        })?;

        let mut results = BTreeMap::new();
        for ((spec, dtype), token) in signature.info.outputs.iter().zip(outputs).zip(tokens) {
            let context = format!(
                "fetching output `{}` of signature `{}`",
                spec.name, signature.info.name
            );
            let host = match dtype {
                DType::U8 => args.fetch::<u8>(token).map(|t| from_tf(&t)),
                DType::I32 => args.fetch::<i32>(token).map(|t| from_tf(&t)),
                DType::I64 => args.fetch::<i64>(token).map(|t| from_tf(&t)),
                DType::F32 => args.fetch::<f32>(token).map(|t| from_tf(&t)),
                DType::F64 => args.fetch::<f64>(token).map(|t| from_tf(&t)),
                other => Ok(Err(Error::unsupported(format!(
                    "{context}: {other} tensors"
                )))),
            }
            .map_err(|status| tf_error(&context, status))??;
            results.insert(spec.name.clone(), host);
        }
        Ok(results)
    }

    /// Runs one step of a training signature and returns its loss: the output named
    /// `loss`, or the only output when there is just one. The loss must be a single
    /// number; it is returned as is, NaN included.
    ///
    /// The signature is expected to apply the optimizer itself (see the
    /// [type documentation](SavedModel#fine-tuning) for the Python side): this is
    /// [`run`](Self::run) plus picking out the loss.
    pub fn train_step(&self, signature: &str, inputs: &[(&str, &HostTensor)]) -> Result<f64> {
        let info = &self.lookup(signature)?.info;
        let loss = match info.output(LOSS_OUTPUT) {
            Some(spec) => spec,
            None => match info.outputs.as_slice() {
                [only] => only,
                _ => {
                    return Err(Error::invalid_argument(
                        "signature",
                        format!(
                            "training signature `{signature}` has no output `{LOSS_OUTPUT}` \
                             and {} outputs ({}); return {{\"{LOSS_OUTPUT}\": loss}} from it",
                            info.outputs.len(),
                            info.output_names()
                        ),
                    ))
                }
            },
        };
        if let Some(dims) = &loss.shape {
            if dims.iter().any(|d| *d != Some(1)) {
                return Err(loss_not_scalar(signature, &loss.name, &loss.shape_string()));
            }
        }
        let name = loss.name.clone();
        let outputs = self.run(signature, inputs)?;
        let value = outputs.get(&name).ok_or_else(|| {
            Error::backend(
                "tensorflow",
                format!("running training signature `{signature}`"),
                format!("output `{name}` was not fetched"),
            )
        })?;
        match value.to_f64_vec().as_slice() {
            [loss] => Ok(*loss),
            _ => Err(loss_not_scalar(
                signature,
                &name,
                &value.shape().to_string(),
            )),
        }
    }

    /// Writes the session's current variable values over the SavedModel's own
    /// checkpoint (`<dir>/variables/variables.*`), so that Python's
    /// `tf.saved_model.load(dir)` and every signature see them.
    ///
    /// TensorFlow writes the checkpoint under a temporary prefix in `variables/`;
    /// the files are synced, then renamed into place, the index last. A SavedModel
    /// without a saver is [`Error::Unsupported`].
    pub fn save_variables(&self) -> Result<()> {
        let saver = self.saver()?;
        self.write_checkpoint(saver, &self.dir.join("variables"))
    }

    /// Writes a new SavedModel at `dir`: a copy of this one's files (`saved_model.pb`,
    /// `fingerprint.pb`, `assets/`, ...) with the session's current variable values
    /// as its checkpoint. The original directory is left as it is.
    ///
    /// `dir` must not exist or be an empty directory, and must lie outside the
    /// SavedModel's own directory. The copy is assembled in a temporary sibling
    /// directory and renamed to `dir` when complete.
    pub fn save_variables_to(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dest = dir.as_ref();
        let saver = self.saver()?;
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let Some(dest_name) = dest.file_name() else {
            return Err(Error::invalid_argument(
                "dir",
                format!("{} does not name a directory to create", dest.display()),
            ));
        };
        self.check_destination(dest, parent, dest_name)?;

        let staging = parent.join(format!(
            "{}-{}",
            files::temp_name("export"),
            dest_name.to_string_lossy()
        ));
        let result = (|| {
            files::copy_tree(&self.dir, &staging, &["variables"])?;
            self.write_checkpoint(saver, &staging.join("variables"))?;
            files::sync_dir(&staging)?;
            // rename(2) replaces an empty directory.
            fs::rename(&staging, dest).map_err(|e| Error::io(dest, e))?;
            files::sync_dir(parent)
        })();
        if result.is_err() && staging.exists() {
            if let Err(e) = fs::remove_dir_all(&staging) {
                log::warn!("cannot remove the temporary {}: {e}", staging.display());
            }
        }
        result?;
        log::info!(
            "wrote the SavedModel {} with the variables of {}",
            dest.display(),
            self.dir.display()
        );
        Ok(())
    }

    /// Refuses a destination inside (or equal to) the SavedModel's own directory, a
    /// file, or a non-empty directory; creates the parent directory.
    fn check_destination(&self, dest: &Path, parent: &Path, dest_name: &OsStr) -> Result<()> {
        fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        let source = fs::canonicalize(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        let parent = fs::canonicalize(parent).map_err(|e| Error::io(parent, e))?;
        if parent.starts_with(&source) || source.starts_with(parent.join(dest_name)) {
            return Err(Error::invalid_argument(
                "dir",
                format!(
                    "{} is inside (or is) the SavedModel directory {}; give a directory \
                     outside it, or use save_variables to write in place",
                    dest.display(),
                    self.dir.display()
                ),
            ));
        }
        match fs::read_dir(dest) {
            Ok(mut entries) => {
                if entries.next().is_some() {
                    return Err(Error::invalid_argument(
                        "dir",
                        format!(
                            "{} already exists and is not empty; give a new or empty directory",
                            dest.display()
                        ),
                    ));
                }
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(_) if dest.exists() => Err(Error::invalid_argument(
                "dir",
                format!("{} exists and is not a directory", dest.display()),
            )),
            Err(e) => Err(Error::io(dest, e)),
        }
    }

    fn saver(&self) -> Result<&Saver> {
        self.saver.as_ref().ok_or_else(|| {
            Error::unsupported(format!(
                "saving the variables of the SavedModel {}: it has no saver (its MetaGraphDef \
                 has no SaverDef with a save tensor); re-export it with TensorFlow 2 \
                 (`tf.saved_model.save`, Keras's `model.export` or \
                 `keras.export.ExportArchive`), which always adds one",
                self.dir.display()
            ))
        })
    }

    /// Runs the saver into a temporary prefix in `variables_dir` and installs the
    /// result as `variables_dir/variables.*`.
    fn write_checkpoint(&self, saver: &Saver, variables_dir: &Path) -> Result<()> {
        fs::create_dir_all(variables_dir).map_err(|e| Error::io(variables_dir, e))?;
        let stem = files::temp_name("save");
        let prefix = variables_dir.join(&stem);
        let Some(prefix_text) = prefix.to_str() else {
            return Err(Error::invalid_argument(
                "dir",
                format!(
                    "{} is not valid UTF-8, which TensorFlow needs for a checkpoint path",
                    prefix.display()
                ),
            ));
        };
        let result = (|| {
            if !saver.mirrors.is_empty() {
                let mut args = SessionRunArgs::new();
                for op in &saver.mirrors {
                    args.add_target(op);
                }
                self.session.run(&mut args).map_err(|status| {
                    tf_error(
                        "copying variables into their Keras mirrors before saving",
                        status,
                    )
                })?;
            }
            let filename = Tensor::from(prefix_text.to_owned());
            let mut args = SessionRunArgs::new();
            args.add_feed(&saver.filename.operation, saver.filename.index, &filename);
            let token = args.request_fetch(&saver.save.operation, saver.save.index);
            let context = format!("saving variables to {}", variables_dir.display());
            self.session
                .run(&mut args)
                .map_err(|status| tf_error(&context, status))?;
            if let Ok(written) = args.fetch::<String>(token) {
                log::debug!("TensorFlow's saver wrote {:?}", written.first());
            }
            files::install_checkpoint(variables_dir, &stem)
        })();
        if result.is_err() {
            files::remove_temp(variables_dir, &stem);
        }
        result
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

/// The initializers of the *mirror variables* among the variables `save_op` writes.
///
/// Keras 3 exports each `keras.Variable` twice: its inner `tf.Variable` as an
/// uninitialized handle that the graph's functions use (`mlp/hidden/kernel_1`), and
/// the Keras variable itself as a second handle initialized from the first
/// (`Variable_13`, with `Variable_13/Assign` = `AssignVariableOp(Variable_13,
/// ReadVariableOp(mlp/hidden/kernel_1))`). Both are checkpointed under their own keys
/// (`_all_variables/0/...` and `variables/0/...`), and Python's
/// `tf.saved_model.load` binds the functions to the *second* object. A session that
/// trains updates only the first, so saving as is would leave Python the old
/// weights. Running these initializers before saving copies the trained values into
/// the mirrors. TensorFlow's own variable export (`copy_to_graph_uninitialized`)
/// writes no initializers, so only such mirrors match.
fn keras_mirrors(graph: &Graph, save_op: &Operation) -> Vec<Operation> {
    let is = |op: &Operation, ty: &str| op.op_type().is_ok_and(|t| t == ty);
    let saved: BTreeSet<String> = (0..save_op.num_inputs())
        .map(|i| save_op.input(i).0)
        .filter(|op| is(op, "VarHandleOp"))
        .filter_map(|op| op.name().ok())
        .collect();
    let saved_handle =
        |op: &Operation| is(op, "VarHandleOp") && op.name().is_ok_and(|name| saved.contains(&name));
    graph
        .operation_iter()
        .filter(|op| is(op, "AssignVariableOp") && op.num_inputs() == 2)
        .filter(|assign| {
            let (target, read) = (assign.input(0).0, assign.input(1).0);
            if !saved_handle(&target) || !is(&read, "ReadVariableOp") || read.num_inputs() != 1 {
                return false;
            }
            let source = read.input(0).0;
            saved_handle(&source) && source.name().ok() != target.name().ok()
        })
        .collect()
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

/// Checks `inputs` against the signature and converts them, in the signature's order.
fn check_inputs(signature: &Signature, inputs: &[(&str, &HostTensor)]) -> Result<Vec<TfTensor>> {
    let info = &signature.info;
    let expected = || {
        info.inputs
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut given: BTreeMap<&str, &HostTensor> = BTreeMap::new();
    for (name, tensor) in inputs {
        if info.input(name).is_none() {
            return Err(Error::invalid_argument(
                "inputs",
                format!(
                    "signature `{}` has no input `{name}`; expected inputs: {}",
                    info.name,
                    expected()
                ),
            ));
        }
        if given.insert(name, tensor).is_some() {
            return Err(Error::invalid_argument(
                "inputs",
                format!("input `{name}` of signature `{}` is given twice", info.name),
            ));
        }
    }
    let missing: BTreeSet<&str> = info
        .inputs
        .iter()
        .map(|spec| spec.name.as_str())
        .filter(|name| !given.contains_key(name))
        .collect();
    if !missing.is_empty() {
        return Err(Error::invalid_argument(
            "inputs",
            format!(
                "signature `{}` needs input{} `{}`, not given; expected inputs: {}",
                info.name,
                if missing.len() == 1 { "" } else { "s" },
                missing.into_iter().collect::<Vec<_>>().join("`, `"),
                expected()
            ),
        ));
    }

    let mut feeds = Vec::with_capacity(info.inputs.len());
    for spec in &info.inputs {
        let Some(tensor) = given.get(spec.name.as_str()) else {
            continue; // unreachable: every input was checked present above
        };
        let context = format!("signature `{}` input `{}`", info.name, spec.name);
        match spec.dtype.kiln() {
            Some(dtype) if dtype == tensor.dtype() => {}
            Some(dtype) => {
                return Err(Error::DTypeMismatch {
                    context,
                    expected: dtype,
                    actual: tensor.dtype(),
                })
            }
            None => {
                return Err(Error::unsupported(format!(
                    "{context} has dtype {}, which Kiln cannot feed (Kiln tensors are u8, i32, \
                     i64, f32 or f64)",
                    spec.dtype
                )))
            }
        }
        if !spec.accepts(tensor.dims()) {
            return Err(Error::ShapeMismatch {
                context,
                expected: spec.shape_string(),
                actual: tensor.shape().to_string(),
            });
        }
        feeds.push(TfTensor::from_host(tensor)?);
    }
    Ok(feeds)
}

/// The Kiln dtype of every output, or `Unsupported` for one Kiln cannot hold.
fn fetchable_outputs(signature: &Signature) -> Result<Vec<DType>> {
    signature
        .info
        .outputs
        .iter()
        .map(|spec| {
            spec.dtype.kiln().ok_or_else(|| {
                Error::unsupported(format!(
                    "signature `{}` output `{}` has dtype {}, which Kiln cannot fetch",
                    signature.info.name, spec.name, spec.dtype
                ))
            })
        })
        .collect()
}

fn add_feed<'a>(args: &mut SessionRunArgs<'a>, port: &Port, tensor: &'a TfTensor) {
    let (operation, index) = (&port.operation, port.index);
    match tensor {
        TfTensor::U8(t) => args.add_feed(operation, index, t),
        TfTensor::I32(t) => args.add_feed(operation, index, t),
        TfTensor::I64(t) => args.add_feed(operation, index, t),
        TfTensor::F32(t) => args.add_feed(operation, index, t),
        TfTensor::F64(t) => args.add_feed(operation, index, t),
    }
}

fn loss_not_scalar(signature: &str, output: &str, shape: &str) -> Error {
    Error::ShapeMismatch {
        context: format!("the loss `{output}` of training signature `{signature}`"),
        expected: "a single number ([] or [1])".to_owned(),
        actual: shape.to_owned(),
    }
}
