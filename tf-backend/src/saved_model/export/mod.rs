//! The `export` room. [`SavedModelExport`]: a [`TfModel`] written as a TensorFlow
//! SavedModel that Python's `tf.saved_model.load`, TF Serving and Kiln's own
//! [`SavedModel`](crate::SavedModel) load.
//!
//! The export is a TF1-style SavedModel, as `tf.compat.v1.saved_model.Builder`
//! writes one: `saved_model.pb` holds one MetaGraphDef (tag `serve`) with the
//! inference graph (a placeholder with an open batch dimension, the eval-mode
//! forward pass over resource variables), a `SaverDef` whose `SaveV2` /
//! `RestoreV2` ops are in that graph, and the `serving_default` signature;
//! `variables/variables.{index,data-00000-of-00001}` is the tensor bundle that
//! running the graph's own `SaveV2` op wrote, keyed by the state-dict names.
//! Python's TensorFlow 2 loads such a model through its TF1 path
//! (`load_v1_in_v2`) and exposes the signature.
//!
//! The `tensorflow` crate's `SavedModelBuilder` does not fit: it saves only
//! `tensorflow::Variable`s of its `Scope` API (reference variables assigned with
//! `Assign`), writes no save tensor in its SaverDef (which Kiln's loader and TF
//! Serving's re-savers need) and keeps its protobuf types private. The four
//! messages needed are written by hand ([`proto`]).
//!
//! `mod.rs` holds the export's steps and its files (settings, destination,
//! variables, `saved_model.pb`, the rename into place); `graph.rs` the graph it
//! writes and the checks on what a graph may hold; `proto.rs` the protobuf writer.
//! The room imports from `load` only (its file helpers and the serving tag).

mod graph;
mod proto;

use std::fs;
use std::path::{Path, PathBuf};

use kiln_core::{model::ParamKind, module::Module, HostTensor, Shape};
use tensorflow::DataType;

use crate::backend::TfBackend;
use crate::engine::Var;
use crate::error::{tf_error, ExportError};
use crate::model::TfModel;
use crate::saved_model::load::{files, SERVE_TAG};
use graph::{
    check_layers, check_ops, op_name, standard_ops, tensor_name, ExportGraph, ExportResult,
};
use proto::{SavedModelDef, SaverNames, SignatureDefSpec, TensorInfoDef, VariableDefSpec};

/// The signature key TensorFlow Serving and `tf.saved_model.load(..).signatures` use by default.
pub const SERVING_SIGNATURE: &str = "serving_default";
/// The method name of a predict signature.
const PREDICT_METHOD: &str = "tensorflow/serving/predict";

/// Writes a [`TfModel`] as a TensorFlow SavedModel directory.
///
/// The graph computes the model's eval-mode forward pass (dropout off, batch
/// norm with its running statistics) whatever mode the model is in, for any
/// batch size: `input_shape` is one batch's shape (batch first), and its batch
/// dimension is exported as `-1`. The signature is `serving_default` with one
/// input and one output (keys `input` and `output` unless renamed); the
/// variables are saved under their state-dict names (`0.weight`).
///
/// Everything is checked before anything is written (the path, the settings,
/// the graph for the input shape and that every op is a standard TensorFlow op,
/// a custom layer being built with its portable builder where it has one:
/// [`register_portable_custom_layer`](crate::register_portable_custom_layer));
/// the directory is assembled next to the target and renamed into place. An
/// existing path is [`ExportError::Exists`] unless
/// [`overwrite`](Self::overwrite) is set, and even then only a SavedModel
/// directory is replaced ([`ExportError::NotASavedModel`]).
///
/// ```no_run
/// use kiln_core::{model::{Layer, LinearConfig}, Device};
/// use kiln_tf::{SavedModelExport, TfModel};
///
/// let spec = Layer::sequential([LinearConfig::new(4, 8).into(), Layer::Relu]);
/// let model = TfModel::new(&spec, Device::Cpu)?;
/// SavedModelExport::new(&model, &[1, 4]).overwrite(true).write("exported/mlp")?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// In Python: `tf.saved_model.load("exported/mlp").signatures["serving_default"](input=x)["output"]`.
#[derive(Debug, Clone)]
pub struct SavedModelExport<'a> {
    model: &'a TfModel,
    input_shape: Vec<usize>,
    input_name: String,
    output_name: String,
    overwrite: bool,
}

/// Exports `model` to `dir` with the default settings of [`SavedModelExport`].
pub fn export_saved_model(
    model: &TfModel,
    input_shape: &[usize],
    dir: impl AsRef<Path>,
) -> ExportResult<()> {
    SavedModelExport::new(model, input_shape).write(dir)
}

impl<'a> SavedModelExport<'a> {
    /// An export of `model` for batches shaped like `input_shape` (batch first).
    pub fn new(model: &'a TfModel, input_shape: &[usize]) -> Self {
        SavedModelExport {
            model,
            input_shape: input_shape.to_vec(),
            input_name: "input".to_owned(),
            output_name: "output".to_owned(),
            overwrite: false,
        }
    }

    /// The signature's input key (default `input`).
    pub fn input_name(mut self, name: impl Into<String>) -> Self {
        self.input_name = name.into();
        self
    }

    /// The signature's output key (default `output`).
    pub fn output_name(mut self, name: impl Into<String>) -> Self {
        self.output_name = name.into();
        self
    }

    /// Whether an existing SavedModel directory at the target is replaced (default: no).
    pub fn overwrite(mut self, overwrite: bool) -> Self {
        self.overwrite = overwrite;
        self
    }

    /// Writes the SavedModel directory `dir`.
    pub fn write(&self, dir: impl AsRef<Path>) -> ExportResult<()> {
        let dest = dir.as_ref();
        self.check_settings()?;
        let (parent, name) = self.check_destination(dest)?;
        let spec = self.model.spec();
        check_layers(spec)?;
        // The model's own custom-layer functions, with the portable builder of
        // each op that has one (its fused kernel's standard-op decomposition).
        let custom_ops = crate::model::lock(&self.model.graph)?
            .engine
            .custom_ops
            .portable()?;
        let export = ExportGraph::build(spec, custom_ops, &self.input_shape)?;
        let standard = standard_ops();
        check_ops(spec, &export.compiled.engine.b.graph, |t| {
            standard.contains(t)
        })?;
        let state = Module::<TfBackend>::state_dict(self.model)?;

        fs::create_dir_all(&parent).map_err(|e| ExportError::io("creating", &parent, e))?;
        let staging = parent.join(format!(
            "{}-{}",
            files::temp_name("export"),
            name.to_string_lossy()
        ));
        let result = self
            .fill(export, &state, &staging)
            .and_then(|()| install(&staging, dest, &parent, self.overwrite));
        if result.is_err() && staging.exists() {
            if let Err(e) = fs::remove_dir_all(&staging) {
                log::warn!("cannot remove the temporary {}: {e}", staging.display());
            }
        }
        result?;
        log::info!(
            "exported the SavedModel {} (signature `{SERVING_SIGNATURE}`: {} -> {})",
            dest.display(),
            self.input_name,
            self.output_name
        );
        Ok(())
    }

    fn check_settings(&self) -> ExportResult<()> {
        for (name, value) in [
            ("input_name", &self.input_name),
            ("output_name", &self.output_name),
        ] {
            if value.is_empty() {
                return Err(ExportError::InvalidArgument {
                    name,
                    reason: "an empty name; give the signature key, e.g. `input`".to_owned(),
                });
            }
        }
        if self.input_name == self.output_name {
            return Err(ExportError::InvalidArgument {
                name: "output_name",
                reason: format!(
                    "`{}` is also the input's name; the signature's keys must differ",
                    self.output_name
                ),
            });
        }
        if self.input_shape.is_empty() || self.input_shape.contains(&0) {
            return Err(ExportError::InvalidArgument {
                name: "input_shape",
                reason: format!(
                    "expected one batch's shape, batch first, with no zero dimension \
                     (e.g. [1, 3, 32, 32]), got {}",
                    Shape::new(self.input_shape.clone())
                ),
            });
        }
        Ok(())
    }

    /// The target's parent and name, after refusing what may not be replaced.
    fn check_destination(&self, dest: &Path) -> ExportResult<(PathBuf, std::ffi::OsString)> {
        let Some(name) = dest.file_name() else {
            return Err(ExportError::InvalidArgument {
                name: "dir",
                reason: format!("{} does not name a directory to create", dest.display()),
            });
        };
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        replaces(dest, self.overwrite)?;
        if dest.to_str().is_none() {
            return Err(ExportError::InvalidArgument {
                name: "dir",
                reason: format!(
                    "{} is not valid UTF-8, which TensorFlow needs for a checkpoint path",
                    dest.display()
                ),
            });
        }
        Ok((parent, name.to_owned()))
    }

    /// Writes the variables and `saved_model.pb` into the new directory `dir`.
    fn fill(
        &self,
        mut export: ExportGraph,
        state: &kiln_core::state_dict::StateDict,
        dir: &Path,
    ) -> ExportResult<()> {
        let variables = dir.join(files::VARIABLES_STEM);
        fs::create_dir_all(&variables).map_err(|e| ExportError::io("creating", &variables, e))?;
        if let Some(saver) = &export.saver {
            let values = export
                .vars
                .iter()
                .map(|v| {
                    state
                        .get(&v.name)
                        .map(|h| h.to_dtype(v.dtype))
                        .ok_or_else(|| kiln_core::Error::MissingKey {
                            key: v.name.clone(),
                            available: state.len(),
                        })
                })
                .collect::<Result<Vec<HostTensor>, _>>()?;
            let vars: Vec<&Var> = export.vars.iter().collect();
            let refs: Vec<&HostTensor> = values.iter().collect();
            let engine = &mut export.compiled.engine;
            engine.write_vars(&vars, &refs)?;
            let prefix = variables.join(files::VARIABLES_STEM);
            let prefix = prefix
                .to_str()
                .ok_or_else(|| ExportError::InvalidArgument {
                    name: "dir",
                    reason: format!("{} is not valid UTF-8", prefix.display()),
                })?;
            engine.run_with_string(
                &saver.filename,
                prefix,
                &[&saver.save.operation],
                "writing the exported variables (SaveV2)",
            )?;
        }
        let graph_def = export
            .compiled
            .engine
            .b
            .graph
            .graph_def()
            .map_err(|s| tf_error("serializing the export graph", s))?;
        let saver = match &export.saver {
            Some(s) => Some(SaverNames {
                filename_tensor: tensor_name(&s.filename)?,
                save_tensor: tensor_name(&s.save)?,
                restore_op: op_name(&s.restore)?,
            }),
            None => None,
        };
        let variable_defs = export
            .vars
            .iter()
            .map(|v| {
                Ok(VariableDefSpec {
                    handle: tensor_name(&v.handle)?,
                    initializer: op_name(&v.load)?,
                    snapshot: tensor_name(&v.read)?,
                    trainable: v.kind == ParamKind::Parameter,
                })
            })
            .collect::<ExportResult<Vec<_>>>()?;
        let signature = SignatureDefSpec {
            key: SERVING_SIGNATURE.to_owned(),
            method_name: PREDICT_METHOD.to_owned(),
            inputs: vec![(
                self.input_name.clone(),
                TensorInfoDef {
                    name: tensor_name(&export.input)?,
                    dtype: export.input_dtype,
                    dims: export.input_dims.clone(),
                },
            )],
            outputs: vec![(
                self.output_name.clone(),
                TensorInfoDef {
                    name: tensor_name(&export.output)?,
                    dtype: DataType::Float,
                    dims: export.output_dims.clone(),
                },
            )],
        };
        let bytes = proto::saved_model_bytes(&SavedModelDef {
            tags: vec![SERVE_TAG.to_owned()],
            tensorflow_version: crate::runtime::runtime_version()?,
            graph_def: &graph_def,
            saver,
            variables: variable_defs,
            signatures: vec![signature],
        });
        let pb = dir.join("saved_model.pb");
        fs::write(&pb, bytes).map_err(|e| ExportError::io("writing", &pb, e))?;
        files::sync_file(&pb)?;
        for entry in
            fs::read_dir(&variables).map_err(|e| ExportError::io("reading", &variables, e))?
        {
            let entry = entry.map_err(|e| ExportError::io("reading", &variables, e))?;
            files::sync_file(&entry.path())?;
        }
        files::sync_dir(&variables)?;
        files::sync_dir(dir)?;
        Ok(())
    }
}

/// Whether `dest` holds a SavedModel directory to replace (`false`: nothing is
/// there); anything else there is [`ExportError::Exists`] without `overwrite`
/// and [`ExportError::NotASavedModel`] with it.
fn replaces(dest: &Path, overwrite: bool) -> ExportResult<bool> {
    match fs::symlink_metadata(dest) {
        Ok(meta) => {
            if !overwrite {
                return Err(ExportError::Exists {
                    path: dest.to_path_buf(),
                });
            }
            if !meta.is_dir() || !dest.join("saved_model.pb").is_file() {
                return Err(ExportError::NotASavedModel {
                    path: dest.to_path_buf(),
                });
            }
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(ExportError::io("reading", dest, e)),
    }
}

/// Moves the complete `staging` directory to `dest`, replacing the SavedModel
/// directory there (checked before) by way of a temporary name, so `dest` is
/// always either the old or the new SavedModel.
fn install(staging: &Path, dest: &Path, parent: &Path, overwrite: bool) -> ExportResult<()> {
    // Checked again: something may have appeared there while the export ran.
    if replaces(dest, overwrite)? {
        let old = parent.join(format!("{}-old", files::temp_name("export")));
        fs::rename(dest, &old).map_err(|e| ExportError::io("moving aside", dest, e))?;
        if let Err(e) = fs::rename(staging, dest) {
            if let Err(back) = fs::rename(&old, dest) {
                log::error!(
                    "cannot move {} back to {}: {back}",
                    old.display(),
                    dest.display()
                );
            }
            return Err(ExportError::io("renaming into place", dest, e));
        }
        if let Err(e) = fs::remove_dir_all(&old) {
            log::warn!("cannot remove the replaced {}: {e}", old.display());
        }
    } else {
        fs::rename(staging, dest).map_err(|e| ExportError::io("renaming into place", dest, e))?;
    }
    files::sync_dir(parent)?;
    Ok(())
}
