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

use kiln_core::{model::ParamKind, module::Module, HostTensor};
use tensorflow::DataType;

use crate::backend::TfBackend;
use crate::engine::Var;
use crate::error::tf_error;
use crate::model::TfModel;
use crate::saved_model::load::{files, SERVE_TAG};
use graph::{
    check_layers, check_ops, op_name, standard_ops, tensor_name, ExportGraph, ExportResult,
};
use kiln_core::export::{
    existing_parent, ExportError, ExportFormat, ExportOptions, ATTENTION_MASK_INPUT,
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
/// existing path is [`ExportError::Exists`] unless the options allow
/// overwriting, and even then only a SavedModel directory is replaced
/// ([`ExportError::NotReplaceable`]).
///
/// ```no_run
/// use kiln_core::{export::ExportOptions, model::{Layer, LinearConfig}, Device};
/// use kiln_tf::{SavedModelExport, TfModel};
///
/// let spec = Layer::sequential([LinearConfig::new(4, 8).into(), Layer::Relu]);
/// let model = TfModel::new(&spec, Device::Cpu)?;
/// let options = ExportOptions::new(&[1, 4]).with_overwrite(true);
/// SavedModelExport::new(&model, &options).write("exported/mlp")?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// In Python: `tf.saved_model.load("exported/mlp").signatures["serving_default"](input=x)["output"]`.
#[derive(Debug, Clone)]
pub struct SavedModelExport<'a> {
    model: &'a TfModel,
    options: ExportOptions,
}

/// Exports `model` to the SavedModel directory `dir` with `options`.
pub fn export_saved_model(
    model: &TfModel,
    dir: impl AsRef<Path>,
    options: &ExportOptions,
) -> ExportResult<()> {
    SavedModelExport::new(model, options).write(dir)
}

impl<'a> SavedModelExport<'a> {
    /// An export of `model` with `options`: batches shaped like
    /// `options.input_shape` (batch first), the signature's input and output
    /// keys, and whether an existing SavedModel directory is replaced.
    pub fn new(model: &'a TfModel, options: &ExportOptions) -> Self {
        SavedModelExport {
            model,
            options: options.clone(),
        }
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
        let export = ExportGraph::build(spec, custom_ops, &self.options.input_shape)?;
        let standard = standard_ops();
        check_ops(spec, &export.compiled.engine.b.graph, |t| {
            standard.contains(t)
        })?;
        let state = Module::<TfBackend>::state_dict(self.model)?;

        let staging = parent.join(format!(
            "{}-{}",
            files::temp_name("export"),
            name.to_string_lossy()
        ));
        let result = self
            .fill(export, &state, &staging)
            .and_then(|()| install(&staging, dest, &parent, self.options.overwrite));
        if result.is_err() && staging.exists() {
            if let Err(e) = fs::remove_dir_all(&staging) {
                log::warn!("cannot remove the temporary {}: {e}", staging.display());
            }
        }
        result?;
        log::info!(
            "exported the SavedModel {} (signature `{SERVING_SIGNATURE}`: {} -> {})",
            dest.display(),
            self.options.input_name,
            self.options.output_name
        );
        Ok(())
    }

    fn check_settings(&self) -> ExportResult<()> {
        self.options.check(ExportFormat::SavedModel)?;
        for (what, name) in [
            ("input name", &self.options.input_name),
            ("output name", &self.options.output_name),
        ] {
            if name == ATTENTION_MASK_INPUT && self.model.spec().takes_attention_mask() {
                return Err(ExportError::invalid(
                    what,
                    format!(
                        "`{name}` is the name of the signature's second input, the attention \
                         mask beside the token ids; choose another"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The target's parent and name, after refusing what may not be replaced.
    fn check_destination(&self, dest: &Path) -> ExportResult<(PathBuf, std::ffi::OsString)> {
        let Some(name) = dest.file_name() else {
            return Err(ExportError::invalid(
                "output path",
                format!("{} does not name a directory to create", dest.display()),
            ));
        };
        let parent = existing_parent(dest)?;
        replaces(dest, self.options.overwrite)?;
        if dest.to_str().is_none() {
            return Err(ExportError::invalid(
                "output path",
                format!(
                    "{} is not valid UTF-8, which TensorFlow needs for a checkpoint path",
                    dest.display()
                ),
            ));
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
            let prefix = prefix.to_str().ok_or_else(|| {
                ExportError::invalid(
                    "output path",
                    format!("{} is not valid UTF-8", prefix.display()),
                )
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
            inputs: {
                let mut inputs = vec![(
                    self.options.input_name.clone(),
                    TensorInfoDef {
                        name: tensor_name(&export.input)?,
                        dtype: export.input_dtype,
                        dims: export.input_dims.clone(),
                    },
                )];
                if let Some(mask) = &export.mask_input {
                    inputs.push((
                        ATTENTION_MASK_INPUT.to_owned(),
                        TensorInfoDef {
                            name: tensor_name(mask)?,
                            dtype: DataType::Int64,
                            dims: export.input_dims.clone(),
                        },
                    ));
                }
                inputs
            },
            outputs: vec![(
                self.options.output_name.clone(),
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
/// and [`ExportError::NotReplaceable`] with it.
fn replaces(dest: &Path, overwrite: bool) -> ExportResult<bool> {
    match fs::symlink_metadata(dest) {
        Ok(meta) => {
            if !overwrite {
                return Err(ExportError::Exists {
                    path: dest.to_path_buf(),
                });
            }
            if meta.file_type().is_symlink() {
                let target = fs::read_link(dest).unwrap_or_default();
                return Err(ExportError::NotReplaceable {
                    path: dest.to_path_buf(),
                    reason: format!(
                        "is a symbolic link (to {}): an export never replaces a link or writes \
                         through one; give the directory itself, or another path",
                        target.display()
                    ),
                });
            }
            if !meta.is_dir() || !dest.join("saved_model.pb").is_file() {
                return Err(ExportError::NotReplaceable {
                    path: dest.to_path_buf(),
                    reason: "exists and is not a SavedModel directory (no saved_model.pb): an \
                             export replaces only a SavedModel; remove it yourself or choose \
                             another path"
                        .to_owned(),
                });
            }
            if let Some(foreign) = foreign_entry(dest)? {
                return Err(ExportError::NotReplaceable {
                    path: dest.to_path_buf(),
                    reason: format!(
                        "holds {}, which is not part of a SavedModel: replacing the directory \
                         would delete it; move it out, or choose another path",
                        foreign.display()
                    ),
                });
            }
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(ExportError::io("reading", dest, e)),
    }
}

/// The first entry of the SavedModel directory `dir` that is not one of a
/// SavedModel's own: `saved_model.pb` (or `.pbtxt`), `fingerprint.pb`,
/// `keras_metadata.pb`, the `assets/` and `assets.extra/` directories, and
/// `variables/` holding `variables.index` and `variables.data-*` shards.
/// A link anywhere there is foreign.
fn foreign_entry(dir: &Path) -> ExportResult<Option<PathBuf>> {
    let entries = |dir: &Path| -> ExportResult<Vec<(String, fs::FileType, PathBuf)>> {
        let mut out = Vec::new();
        for entry in fs::read_dir(dir).map_err(|e| ExportError::io("reading", dir, e))? {
            let entry = entry.map_err(|e| ExportError::io("reading", dir, e))?;
            let kind = entry
                .file_type()
                .map_err(|e| ExportError::io("reading", entry.path(), e))?;
            out.push((
                entry.file_name().to_string_lossy().into_owned(),
                kind,
                entry.path(),
            ));
        }
        Ok(out)
    };
    for (name, kind, path) in entries(dir)? {
        let own = match name.as_str() {
            "saved_model.pb" | "saved_model.pbtxt" | "fingerprint.pb" | "keras_metadata.pb" => {
                kind.is_file()
            }
            "assets" | "assets.extra" => kind.is_dir(),
            "variables" if kind.is_dir() => {
                if let Some((_, _, inner)) = entries(&path)?.into_iter().find(|(n, k, _)| {
                    !(k.is_file() && (n == "variables.index" || n.starts_with("variables.data-")))
                }) {
                    return Ok(Some(inner));
                }
                true
            }
            _ => false,
        };
        if !own {
            return Ok(Some(path));
        }
    }
    Ok(None)
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
