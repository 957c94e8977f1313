//! The export graph: the layers and ops an export can carry, and the graph itself
//! (the variables, the eval-mode forward pass from [`crate::step`], TF1's saver ops).

use std::sync::OnceLock;

use kiln_core::{
    model::{Layer, ParamSpec},
    DType,
};
use tensorflow::{DataType, Graph, Operation, Output, Status, Tensor};

use crate::custom_layer::CustomOps;
use crate::engine::{tf_dtype, Engine, Var};
use crate::error::tf_error;
use crate::graph::{out0, Builder};
use crate::step::{self, CompiledGraph, ModelGraph, ProgramKey, ProgramKind, Signature};
use kiln_core::export::{ExportError, ExportFormat};

/// The name scope of the saver's ops.
const SAVE_SCOPE: &str = "save";

/// What the export's steps return.
pub(super) type ExportResult<T> = std::result::Result<T, ExportError>;

/// `op:index`, as signatures and SaverDefs name tensors.
pub(super) fn tensor_name(output: &Output) -> ExportResult<String> {
    Ok(format!("{}:{}", op_name(&output.operation)?, output.index))
}

pub(super) fn op_name(op: &Operation) -> ExportResult<String> {
    op.name().map_err(|e| {
        ExportError::Core(kiln_core::Error::backend(
            "tensorflow",
            "naming an exported op",
            e.to_string(),
        ))
    })
}

/// A layer's path as error messages show it.
use kiln_core::export::shown_path as shown;

/// Refuses the layers no export can carry.
pub(super) fn check_layers(spec: &Layer) -> ExportResult<()> {
    if let Some((path, layer)) = spec.saved_model_layers().first() {
        return Err(ExportError::Unsupported {
            format: ExportFormat::SavedModel,
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
            format: ExportFormat::SavedModel,
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
pub(super) fn standard_ops() -> &'static std::collections::HashSet<&'static str> {
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
pub(super) fn check_ops(
    spec: &Layer,
    graph: &Graph,
    standard: impl Fn(&str) -> bool,
) -> ExportResult<()> {
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
            format: ExportFormat::SavedModel,
            path,
            layer,
            op: op_type,
            node,
        });
    }
    Ok(())
}

/// The saver's ops in the export graph.
pub(super) struct SaverOps {
    /// The string placeholder fed with the checkpoint prefix.
    pub(super) filename: Output,
    /// The filename again, after `SaveV2` ran (TF1's `save/control_dependency`).
    pub(super) save: Output,
    /// The no-op after every variable was restored.
    pub(super) restore: Operation,
}

/// The export graph: the variables, the eval-mode forward pass, the saver.
pub(super) struct ExportGraph {
    pub(super) compiled: CompiledGraph,
    pub(super) vars: Vec<Var>,
    pub(super) input: Output,
    /// The attention mask's placeholder, of a model that reads one.
    pub(super) mask_input: Option<Output>,
    pub(super) input_dtype: DataType,
    pub(super) input_dims: Vec<i64>,
    pub(super) output: Output,
    pub(super) output_dims: Vec<i64>,
    pub(super) saver: Option<SaverOps>,
}

impl ExportGraph {
    pub(super) fn build(
        spec: &Layer,
        custom_ops: CustomOps,
        input_shape: &[usize],
    ) -> ExportResult<Self> {
        let specs: Vec<ParamSpec> = spec.parameter_specs("")?;
        let mut engine = Engine::new();
        engine.custom_ops = custom_ops;
        let vars = specs
            .iter()
            .map(|p| engine.add_var("model", &p.name, p.dtype, &p.shape, p.kind))
            .collect::<kiln_core::Result<Vec<_>>>()?;
        let mut compiled = CompiledGraph::new(engine);
        let dtype = spec.input_dtype().unwrap_or(DType::F32);
        // A model reading an attention mask is built for its stacked
        // `[batch, 2, seq]` batch, read from the ids' and the mask's own
        // placeholders.
        let separate_mask = spec.takes_attention_mask();
        let stacked;
        let input_shape = match spec.token_ids_dims(input_shape).as_slice() {
            [batch, seq] if separate_mask => {
                stacked = [*batch, 2, *seq];
                &stacked[..]
            }
            _ => input_shape,
        };
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
            separate_mask,
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
        // The ids' (and the mask's) placeholder is `[batch, seq]`.
        if forward.mask_input.is_some() {
            dims.remove(1);
        }
        Ok(ExportGraph {
            compiled,
            vars,
            input: forward.input,
            mask_input: forward.mask_input,
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
                path, layer, op, ..
            } => {
                assert_eq!(path, "1.block.1");
                assert_eq!(layer, "Custom test::square");
                assert_eq!(op, "Square");
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
