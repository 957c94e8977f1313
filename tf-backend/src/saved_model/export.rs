//! [`SavedModelExport`]: a [`TfModel`] written as a TensorFlow SavedModel that
//! Python's `tf.saved_model.load`, TF Serving and Kiln's own [`SavedModel`](super::SavedModel)
//! load.
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
//! messages needed are written by hand ([`super::proto`]).

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kiln_core::{
    model::{Layer, ParamKind, ParamSpec},
    module::Module,
    DType, HostTensor, Shape,
};
use tensorflow::{DataType, Graph, Operation, Output, Status, Tensor};

use super::files;
use super::proto::{
    self, SavedModelDef, SaverNames, SignatureDefSpec, TensorInfoDef, VariableDefSpec,
};
use crate::backend::TfBackend;
use crate::custom_layer::CustomOps;
use crate::engine::{tf_dtype, Engine, Var};
use crate::error::{tf_error, ExportError};
use crate::graph::{out0, Builder};
use crate::model::TfModel;
use crate::step::{self, CompiledGraph, ModelGraph, ProgramKey, ProgramKind, Signature};

/// The signature key TensorFlow Serving and `tf.saved_model.load(..).signatures` use by default.
pub const SERVING_SIGNATURE: &str = "serving_default";
/// The method name of a predict signature.
const PREDICT_METHOD: &str = "tensorflow/serving/predict";
/// The name scope of the saver's ops.
const SAVE_SCOPE: &str = "save";

type ExportResult<T> = std::result::Result<T, ExportError>;

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
            tags: vec![super::SERVE_TAG.to_owned()],
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

/// `op:index`, as signatures and SaverDefs name tensors.
fn tensor_name(output: &Output) -> ExportResult<String> {
    Ok(format!("{}:{}", op_name(&output.operation)?, output.index))
}

fn op_name(op: &Operation) -> ExportResult<String> {
    op.name().map_err(|e| {
        ExportError::Core(kiln_core::Error::backend(
            "tensorflow",
            "naming an exported op",
            e.to_string(),
        ))
    })
}

/// A layer's path as error messages show it.
fn shown(path: &str) -> String {
    if path.is_empty() {
        "<root>".to_owned()
    } else {
        path.to_owned()
    }
}

/// Refuses the layers no export can carry.
fn check_layers(spec: &Layer) -> ExportResult<()> {
    if let Some((path, layer)) = spec.saved_model_layers().first() {
        return Err(ExportError::Unsupported {
            path: shown(path),
            layer: "SavedModel".to_owned(),
            reason: format!(
                "it imports the SavedModel {} as a frozen graph, which the export does not \
                 copy; serve that SavedModel beside this one, or rebuild its layers in Kiln",
                layer.path.display()
            ),
        });
    }
    if let Some((path, layer)) = spec.torchscript_layers().first() {
        return Err(ExportError::Unsupported {
            path: shown(path),
            layer: "TorchScript".to_owned(),
            reason: format!(
                "TorchScript ({}) runs on libtorch only",
                layer.path.display()
            ),
        });
    }
    Ok(())
}

/// TensorFlow's standard op types (every op type the pinned TensorFlow registers in Python),
/// made by `tests/reference/standard_ops.py`.
fn standard_ops() -> &'static std::collections::HashSet<&'static str> {
    static OPS: OnceLock<std::collections::HashSet<&'static str>> = OnceLock::new();
    OPS.get_or_init(|| {
        include_str!("standard_ops.txt")
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .collect()
    })
}

/// Refuses a graph holding an op type that is not `standard` (one only this
/// process registered, from a custom op library), naming the custom layer that
/// added it.
fn check_ops(spec: &Layer, graph: &Graph, standard: impl Fn(&str) -> bool) -> ExportResult<()> {
    for op in graph.operation_iter() {
        let op_type = op.op_type().map_err(|e| {
            kiln_core::Error::backend("tensorflow", "reading an op type", e.to_string())
        })?;
        if standard(&op_type) {
            continue;
        }
        let node = op_name(&op)?;
        let (path, layer) = spec
            .layers()
            .into_iter()
            .find_map(|(path, layer)| match layer {
                Layer::Custom(c) => {
                    let scope = path.replace('.', "/");
                    let stem = c.op.replace("::", "_");
                    let inside = if scope.is_empty() {
                        node.starts_with(&stem)
                    } else {
                        node.starts_with(&format!("{scope}/{stem}"))
                    };
                    inside.then(|| (shown(&path), format!("Custom {}", c.op)))
                }
                _ => None,
            })
            .unwrap_or_else(|| ("<graph>".to_owned(), "op".to_owned()));
        return Err(ExportError::NonStandardOp {
            path,
            layer,
            op_type,
            node,
        });
    }
    Ok(())
}

/// The saver's ops in the export graph.
struct SaverOps {
    /// The string placeholder fed with the checkpoint prefix.
    filename: Output,
    /// The filename again, after `SaveV2` ran (TF1's `save/control_dependency`).
    save: Output,
    /// The no-op after every variable was restored.
    restore: Operation,
}

/// The export graph: the variables, the eval-mode forward pass, the saver.
struct ExportGraph {
    compiled: CompiledGraph,
    vars: Vec<Var>,
    input: Output,
    input_dtype: DataType,
    input_dims: Vec<i64>,
    output: Output,
    output_dims: Vec<i64>,
    saver: Option<SaverOps>,
}

impl ExportGraph {
    fn build(spec: &Layer, custom_ops: CustomOps, input_shape: &[usize]) -> ExportResult<Self> {
        let specs: Vec<ParamSpec> = spec.parameter_specs("")?;
        let mut engine = Engine::new();
        engine.custom_ops = custom_ops;
        let vars = specs
            .iter()
            .map(|p| engine.add_var("model", &p.name, p.dtype, &p.shape, p.kind))
            .collect::<kiln_core::Result<Vec<_>>>()?;
        let mut compiled = CompiledGraph::new(engine);
        let dtype = step::input_dtype(spec).unwrap_or(DType::F32);
        let mut dims: Vec<i64> = input_shape.iter().map(|&d| d as i64).collect();
        if let Some(first) = dims.first_mut() {
            *first = -1;
        }
        let key = ProgramKey {
            kind: ProgramKind::Forward,
            train: false,
            input: Some(Signature {
                dims: dims.clone(),
                dtype,
            }),
            target: None,
        };
        let model = ModelGraph {
            spec,
            vars: &vars,
            batch_dims: input_shape,
        };
        let program = step::program(&mut compiled, &key, Some(model), None)?;
        let missing = |what: &str| {
            kiln_core::Error::backend("tensorflow", "building the export graph", what.to_owned())
        };
        let forward = program.forward.ok_or_else(|| missing("no forward pass"))?;
        let mut output_dims = vec![-1i64];
        output_dims.extend(&forward.output_dims);
        let saver = if vars.is_empty() {
            None
        } else {
            Some(add_saver(&mut compiled.engine.b, &vars)?)
        };
        Ok(ExportGraph {
            compiled,
            vars,
            input: forward.input,
            input_dtype: tf_dtype(dtype)?,
            input_dims: dims,
            output: forward.output,
            output_dims,
            saver,
        })
    }
}

/// A string constant, built by hand (cloning a string tensor in the `tensorflow`
/// crate crashes, so it cannot go through [`Builder::op`]'s closure).
fn strings(b: &mut Builder, values: &[String]) -> ExportResult<Output> {
    let tensor = Tensor::<String>::new(&[values.len() as u64])
        .with_values(values)
        .map_err(|s| tf_error("building a string constant", s))?;
    let name = b.name("Const");
    let build = |graph: &mut Graph| -> Result<Operation, Status> {
        let mut nd = graph.new_operation("Const", &name)?;
        nd.set_attr_type("dtype", DataType::String)?;
        nd.set_attr_tensor("value", tensor)?;
        nd.finish()
    };
    Ok(out0(
        &build(&mut b.graph).map_err(|s| tf_error("adding TensorFlow op Const", s))?,
    ))
}

/// TF1's `Saver` ops (format V2): `SaveV2` of every variable's value under its
/// state-dict name, and `RestoreV2` assigned back to every variable.
fn add_saver(b: &mut Builder, vars: &[Var]) -> ExportResult<SaverOps> {
    let saved = b.set_scope(SAVE_SCOPE);
    let result = (|| -> ExportResult<SaverOps> {
        let dtypes = vars
            .iter()
            .map(|v| tf_dtype(v.dtype))
            .collect::<kiln_core::Result<Vec<_>>>()?;
        let filename = b.placeholder(DataType::String, Some(&[]))?;
        let names: Vec<String> = vars.iter().map(|v| v.name.clone()).collect();
        let slices = vec![String::new(); vars.len()];
        let reads = vars
            .iter()
            .zip(&dtypes)
            .map(|(v, &dt)| b.read(&v.handle, dt))
            .collect::<kiln_core::Result<Vec<_>>>()?;
        let (name_const, slice_const) = (strings(b, &names)?, strings(b, &slices)?);
        let save_name = b.name("SaveV2");
        let build_save = |graph: &mut Graph| -> Result<Operation, Status> {
            let mut nd = graph.new_operation("SaveV2", &save_name)?;
            nd.add_input(filename.clone());
            nd.add_input(name_const.clone());
            nd.add_input(slice_const.clone());
            nd.add_input_list(&reads);
            nd.set_attr_type_list("dtypes", &dtypes)?;
            nd.finish()
        };
        let save_op =
            build_save(&mut b.graph).map_err(|s| tf_error("adding TensorFlow op SaveV2", s))?;
        let save = out0(&b.op_with("Identity", &[&filename], &[&save_op], &|nd| {
            Ok(nd.set_attr_type("T", DataType::String)?)
        })?);
        let restore_name = b.name("RestoreV2");
        let build_restore = |graph: &mut Graph| -> Result<Operation, Status> {
            let mut nd = graph.new_operation("RestoreV2", &restore_name)?;
            nd.add_input(filename.clone());
            nd.add_input(name_const.clone());
            nd.add_input(slice_const.clone());
            nd.set_attr_type_list("dtypes", &dtypes)?;
            nd.finish()
        };
        let restore_op = build_restore(&mut b.graph)
            .map_err(|s| tf_error("adding TensorFlow op RestoreV2", s))?;
        let assigns = vars
            .iter()
            .zip(&dtypes)
            .enumerate()
            .map(|(i, (v, &dt))| {
                let value = Output {
                    operation: restore_op.clone(),
                    index: i as i32,
                };
                b.assign(&v.handle, &value, dt, &[])
            })
            .collect::<kiln_core::Result<Vec<_>>>()?;
        let control: Vec<&Operation> = assigns.iter().collect();
        let restore = b.op_with("NoOp", &[], &control, &|_| Ok(()))?;
        Ok(SaverOps {
            filename,
            save,
            restore,
        })
    })();
    b.set_scope(&saved);
    result
}

#[cfg(test)]
mod tests {
    //! The op check names the custom layer behind an op Python cannot load.

    use kiln_core::model::{CustomConfig, Layer, LinearConfig};
    use tensorflow::{DataType, Graph, Operation, Output, Status};

    use super::{check_ops, standard_ops, CustomOps, ExportError, ExportGraph};

    #[test]
    fn the_standard_list_holds_what_kiln_builds_and_not_kilns_ops() {
        let ops = standard_ops();
        for op in [
            "VarHandleOp",
            "SaveV2",
            "RestoreV2",
            "Einsum",
            "Conv2D",
            "MatMul",
        ] {
            assert!(ops.contains(op), "{op}");
        }
        assert!(!ops.contains("KilnBiasGelu") && !ops.contains("KilnSwish"));
    }

    #[test]
    fn an_op_outside_the_list_names_its_custom_layer() {
        crate::register_custom_layer("test::square", |graph, name, x, _params, _config| {
            let build = |graph: &mut Graph| -> Result<Operation, Status> {
                let mut nd = graph.new_operation("Square", name)?;
                nd.add_input(x);
                nd.set_attr_type("T", DataType::Float)?;
                nd.finish()
            };
            let operation = build(graph).map_err(|s| crate::tf_error(name, s))?;
            Ok(Output {
                operation,
                index: 0,
            })
        });
        let spec = Layer::sequential([
            LinearConfig::new(3, 4).into(),
            Layer::residual(Layer::sequential([
                Layer::Relu,
                CustomConfig::new("test::square").into(),
            ])),
        ]);
        let ops = CustomOps::resolve(&spec).expect("registered");
        let export = ExportGraph::build(&spec, ops, &[2, 3]).expect("builds");
        let graph = &export.compiled.engine.b.graph;
        check_ops(&spec, graph, |t| standard_ops().contains(t)).expect("Square is standard");
        let err = check_ops(&spec, graph, |t| t != "Square").expect_err("Square refused");
        match &err {
            ExportError::NonStandardOp {
                path,
                layer,
                op_type,
                ..
            } => {
                assert_eq!(path, "1.block.1");
                assert_eq!(layer, "Custom test::square");
                assert_eq!(op_type, "Square");
            }
            other => panic!("{other:?}"),
        }
        assert!(
            err.to_string().contains("not a standard TensorFlow op"),
            "{err}"
        );
    }

    /// Adds `op_type(x, x)` (or `op_type(x)` when `binary` is false) named `name`.
    fn op_on_x(graph: &mut Graph, op_type: &str, name: &str, x: Output, binary: bool) -> Output {
        let mut nd = graph.new_operation(op_type, name).expect("new op");
        nd.add_input(x.clone());
        if binary {
            nd.add_input(x);
        }
        nd.set_attr_type("T", DataType::Float).expect("T");
        Output::from(nd.finish().expect("op"))
    }

    #[test]
    fn a_portable_builder_replaces_the_layers_function_in_the_export_only() {
        // The layer's own function adds `Square`; its portable builder `Mul(x, x)`.
        crate::register_custom_layer("test::squared", |graph, name, x, _params, _config| {
            Ok(op_on_x(graph, "Square", name, x, false))
        });
        assert!(!crate::portable_custom_layer_registered("test::squared"));
        crate::register_portable_custom_layer(
            "test::squared",
            |graph, name, x, _params, _config| Ok(op_on_x(graph, "Mul", name, x, true)),
        );
        assert!(crate::portable_custom_layer_registered("test::squared"));
        let spec = Layer::sequential([
            LinearConfig::new(3, 4).into(),
            CustomConfig::new("test::squared").into(),
        ]);
        let ops = CustomOps::resolve(&spec).expect("registered");
        let types = |ops: CustomOps| -> Vec<String> {
            let export = ExportGraph::build(&spec, ops, &[2, 3]).expect("builds");
            export
                .compiled
                .engine
                .b
                .graph
                .operation_iter()
                .map(|op| op.op_type().expect("type"))
                .collect()
        };
        let own = types(ops.clone());
        assert!(own.iter().any(|t| t == "Square"), "{own:?}");
        let portable = types(ops.portable().expect("portable"));
        assert!(!portable.iter().any(|t| t == "Square"), "{portable:?}");
        assert!(portable.iter().any(|t| t == "Mul"), "{portable:?}");
        // The model itself keeps running the layer's own function.
        let model = crate::TfModel::new(&spec, kiln_core::Device::Cpu).expect("model");
        let x = kiln_core::HostTensor::new(vec![0.5f32; 6], [2, 3]).expect("x");
        kiln_core::module::Module::<crate::TfBackend>::forward(
            &model,
            &crate::TfTensor::from_host(&x).expect("tensor"),
        )
        .expect("forward");
        let guard = crate::model::lock(&model.graph).expect("lock");
        let square = guard
            .engine
            .b
            .graph
            .operation_iter()
            .any(|op| op.op_type().expect("type") == "Square");
        assert!(square, "the model's forward uses the layer's own function");
    }
}
