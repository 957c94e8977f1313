//! Finding and checking a SavedModel's signatures, tensors and variables
//! for [`SavedModelModule`](crate::SavedModelModule).

use std::collections::{BTreeMap, BTreeSet};

use kiln_core::{DType, Error, Result};
use tensorflow::{DataType, Operation, Output};

use super::variable::{BoundTensor, Variable, VariableRole};
use crate::convert::TfTensor;
use crate::engine::{run_session, tf_dtype};
use crate::error::tf_error;
use crate::saved_model::load::{
    loss_not_scalar, SavedModel, Signature, TensorDType, TensorSpec, LOSS_OUTPUT,
};

/// The optimizer names Kiln's [`OptimizerConfig`](kiln_core::optim::OptimizerConfig)
/// knows, which are also the name prefixes of Keras 3's optimizer variables
/// (`adam/iteration`).
const KNOWN_OPTIMIZERS: [&str; 5] = ["sgd", "adam", "adamw", "rmsprop", "adagrad"];

pub(super) fn signature<'a>(
    model: &'a SavedModel,
    setting: &str,
    name: &str,
    what: &str,
) -> Result<&'a Signature> {
    model.resolved_signatures().get(name).ok_or_else(|| {
        Error::invalid_argument(
            setting,
            format!(
                "the SavedModel {} has no {what} signature `{name}`; its signatures: {}; \
                 name the {what} signature with .{setting}(...)",
                model.dir().display(),
                if model.resolved_signatures().is_empty() {
                    "(none)".to_owned()
                } else {
                    model
                        .resolved_signatures()
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ),
        )
    })
}

pub(super) fn names_of(specs: &[TensorSpec]) -> String {
    if specs.is_empty() {
        return "nothing".to_owned();
    }
    specs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The name of the one input or output of `sig`.
pub(super) fn only(
    sig: &Signature,
    setting: &str,
    specs: &[TensorSpec],
    what: &str,
) -> Result<String> {
    match specs {
        [only] => Ok(only.name.clone()),
        _ => Err(Error::invalid_argument(
            setting,
            format!(
                "serving signature `{}` has {} {what} ({}); name the one to use with \
                 .{setting}(...)",
                sig.info.name,
                specs.len(),
                names_of(specs)
            ),
        )),
    }
}

/// The input (or output) `name` of `sig`.
pub(super) fn tensor(
    sig: &Signature,
    setting: &str,
    name: &str,
    input: bool,
) -> Result<BoundTensor> {
    let (specs, ports, what) = if input {
        (&sig.info.inputs, &sig.inputs, "input")
    } else {
        (&sig.info.outputs, &sig.outputs, "output")
    };
    let found = specs.iter().zip(ports).find(|(spec, _)| spec.name == name);
    match found {
        Some((spec, port)) => Ok(BoundTensor {
            spec: spec.clone(),
            port: Output {
                operation: port.operation.clone(),
                index: port.index,
            },
        }),
        None => Err(Error::invalid_argument(
            setting,
            format!(
                "signature `{}` has no {what} `{name}`; its {what}s: {}",
                sig.info.name,
                names_of(specs)
            ),
        )),
    }
}

/// The training signature's `loss` output, checked to be a float scalar.
pub(super) fn loss_output(sig: &Signature) -> Result<BoundTensor> {
    let name = &sig.info.name;
    let loss = tensor(sig, "train", LOSS_OUTPUT, false).map_err(|_| {
        Error::invalid_argument(
            "train",
            format!(
                "training signature `{name}` has no output `{LOSS_OUTPUT}` (its outputs: {}); \
                 return {{\"{LOSS_OUTPUT}\": loss}} from the exported function",
                names_of(&sig.info.outputs)
            ),
        )
    })?;
    if let Some(dims) = &loss.spec.shape {
        if dims.iter().any(|d| *d != Some(1)) {
            return Err(loss_not_scalar(
                name,
                LOSS_OUTPUT,
                &loss.spec.shape_string(),
            ));
        }
    }
    match loss.spec.dtype.kiln() {
        Some(DType::F32 | DType::F64) => Ok(loss),
        Some(other) => Err(Error::DTypeMismatch {
            context: format!("the loss `{LOSS_OUTPUT}` of training signature `{name}`"),
            expected: DType::F32,
            actual: other,
        }),
        None => Err(Error::unsupported(format!(
            "the loss `{LOSS_OUTPUT}` of training signature `{name}` has dtype {}; expected \
             a float32 or float64 scalar",
            loss.spec.dtype
        ))),
    }
}

/// Checks a fed tensor's dtype and shape against `spec` (before anything runs).
pub(super) fn check_feed(signature: &str, spec: &TensorSpec, tensor: &TfTensor) -> Result<()> {
    let context = format!("signature `{signature}` input `{}`", spec.name);
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
                "{context} has dtype {}, which Kiln cannot feed",
                spec.dtype
            )))
        }
    }
    let shape = tensor.shape();
    if !spec.accepts(shape.dims()) {
        return Err(Error::ShapeMismatch {
            context,
            expected: spec.shape_string(),
            actual: shape.to_string(),
        });
    }
    Ok(())
}

/// The TensorFlow dtype to fetch an output of `spec` as.
pub(super) fn fetch_dtype(signature: &str, spec: &TensorSpec) -> Result<DataType> {
    match spec.dtype.kiln() {
        Some(dtype) => tf_dtype(dtype),
        None => Err(Error::unsupported(format!(
            "signature `{signature}` output `{}` has dtype {}, which Kiln cannot fetch",
            spec.name, spec.dtype
        ))),
    }
}

// ----- variables -----

fn is(op: &Operation, ty: &str) -> bool {
    op.op_type().is_ok_and(|t| t == ty)
}

/// A handle's variable name: its `shared_name`, or the op's name without one.
fn shared_name(op: &Operation) -> String {
    match op.get_attr_string("shared_name") {
        Ok(name) if !name.is_empty() => name,
        _ => op.name().unwrap_or_default(),
    }
}

/// The `VarHandleOp`s that `roots` depend on, in depth-first order of the
/// inputs (the order the functions capture them in: a model's definition order).
fn reachable_handles(roots: &[Operation]) -> Vec<Operation> {
    let mut seen = BTreeSet::new();
    let mut found = Vec::new();
    let mut stack: Vec<Operation> = roots.iter().rev().cloned().collect();
    while let Some(op) = stack.pop() {
        let Ok(name) = op.name() else { continue };
        if !seen.insert(name) {
            continue;
        }
        if is(&op, "VarHandleOp") {
            found.push(op.clone());
        }
        for i in (0..op.num_inputs()).rev() {
            stack.push(op.input(i).0);
        }
        for control in op.control_inputs().into_iter().rev() {
            stack.push(control);
        }
    }
    found
}

/// The readable name of each handle (see [`SavedModelModule`]'s "Variables"): the
/// shared name, less a `_<n>` suffix where the graph also holds a handle of the
/// bare name that is not saved (Keras's traced copy), unless names would collide.
///
/// [`SavedModelModule`]: crate::SavedModelModule
fn variable_names(handles: &[Operation], graph_handles: &BTreeSet<String>) -> Vec<String> {
    let raw: Vec<String> = handles.iter().map(shared_name).collect();
    let saved: BTreeSet<&str> = raw.iter().map(String::as_str).collect();
    let cleaned: Vec<String> = raw
        .iter()
        .map(|name| {
            let bare = name.rsplit_once('_').and_then(|(bare, n)| {
                (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).then_some(bare)
            });
            match bare {
                Some(bare) if graph_handles.contains(bare) && !saved.contains(bare) => {
                    bare.to_owned()
                }
                _ => name.clone(),
            }
        })
        .collect();
    let mut counts = BTreeMap::new();
    for name in &cleaned {
        *counts.entry(name.as_str()).or_insert(0usize) += 1;
    }
    cleaned
        .iter()
        .zip(&raw)
        .map(|(clean, raw)| {
            if counts.get(clean.as_str()) == Some(&1) {
                clean.clone()
            } else {
                raw.clone()
            }
        })
        .collect()
}

pub(super) type Found = (Vec<Variable>, Option<usize>, Option<&'static str>);

/// Finds the saved variables, classifies them and adds their read and write ops.
pub(super) fn variables(model: &SavedModel, serve: &Signature, train: &Signature) -> Result<Found> {
    let saver = model.saver()?;
    let dir = model.dir().display().to_string();
    let mut mirror_of = BTreeMap::new();
    for assign in &saver.mirrors {
        let (mirror, read) = (assign.input(0).0, assign.input(1).0);
        if let (Ok(source), Ok(_)) = (read.input(0).0.name(), mirror.name()) {
            mirror_of.insert(source, mirror);
        }
    }
    let mirrors: BTreeSet<String> = mirror_of.values().filter_map(|m| m.name().ok()).collect();
    let save_op = &saver.save.operation;
    let saved: BTreeSet<String> = (0..save_op.num_inputs())
        .map(|i| save_op.input(i).0)
        .filter(|op| is(op, "VarHandleOp"))
        .filter_map(|op| op.name().ok())
        .filter(|name| !mirrors.contains(name))
        .collect();
    let outputs = |sig: &Signature| -> Vec<Operation> {
        sig.outputs.iter().map(|p| p.operation.clone()).collect()
    };
    let served: BTreeSet<String> = reachable_handles(&outputs(serve))
        .iter()
        .filter_map(|op| op.name().ok())
        .collect();
    let mut roots = outputs(serve);
    roots.extend(outputs(train));
    roots.push(save_op.clone());
    let handles: Vec<Operation> = reachable_handles(&roots)
        .into_iter()
        .filter(|op| op.name().is_ok_and(|n| saved.contains(&n)))
        .collect();

    let mut b = model.graph()?;
    let graph_handles: BTreeSet<String> = b
        .graph
        .operation_iter()
        .filter(|op| is(op, "VarHandleOp"))
        .map(|op| shared_name(&op))
        .collect();
    let names = variable_names(&handles, &graph_handles);

    // Read every variable once: its dtype and shape as restored.
    let mut reads = Vec::with_capacity(handles.len());
    for (handle, name) in handles.iter().zip(&names) {
        let data_type = handle
            .get_attr_type("dtype")
            .map_err(|s| tf_error(&format!("reading the dtype of variable `{name}`"), s))?;
        let dtype = TensorDType::from_tf(data_type);
        let Some(dtype) = dtype.kiln() else {
            return Err(Error::unsupported(format!(
                "variable `{name}` of the SavedModel {dir} has dtype {dtype}, which Kiln \
                 cannot hold (Kiln tensors are u8, i32, i64, f32 or f64)"
            )));
        };
        let handle_out = Output {
            operation: handle.clone(),
            index: 0,
        };
        reads.push((
            b.read(&handle_out, data_type)?,
            dtype,
            data_type,
            handle_out,
        ));
    }
    let fetches: Vec<(&Output, DataType)> = reads.iter().map(|r| (&r.0, r.2)).collect();
    let values = if fetches.is_empty() {
        Vec::new()
    } else {
        run_session(
            model.session(),
            &[],
            &fetches,
            &[],
            &format!("reading the variables of the SavedModel {dir}"),
        )?
    };

    let objects = model.objects();
    let mut variables = Vec::with_capacity(handles.len());
    for (((handle, name), (read, dtype, data_type, handle_out)), value) in
        handles.iter().zip(names).zip(reads).zip(values)
    {
        let dims = value.shape().dims().to_vec();
        let idims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let feed = b.placeholder(data_type, Some(&idims))?;
        let mut write = vec![b.assign(&handle_out, &feed, data_type, &[])?];
        let handle_name = handle.name().unwrap_or_default();
        if let Some(mirror) = mirror_of.get(&handle_name) {
            let mirror = Output {
                operation: mirror.clone(),
                index: 0,
            };
            write.push(b.assign(&mirror, &feed, data_type, &[])?);
        }
        let role = if objects.optimizer_variables.contains(&name) {
            VariableRole::Optimizer
        } else if served.contains(&handle_name) {
            match objects.trainable.get(&name) {
                Some(Some(false)) => VariableRole::Buffer,
                _ => VariableRole::Parameter,
            }
        } else {
            VariableRole::Optimizer
        };
        variables.push(Variable {
            name,
            role,
            dtype,
            dims,
            read,
            feed,
            write,
        });
    }
    drop(b);

    let optimizer: Vec<&Variable> = variables
        .iter()
        .filter(|v| v.role == VariableRole::Optimizer)
        .collect();
    let rates: Vec<usize> = variables
        .iter()
        .enumerate()
        .filter(|(_, v)| {
            v.role == VariableRole::Optimizer
                && v.dims.is_empty()
                && matches!(v.dtype, DType::F32 | DType::F64)
                && v.name.rsplit('/').next() == Some("learning_rate")
        })
        .map(|(i, _)| i)
        .collect();
    let learning_rate = match rates.as_slice() {
        [only] => Some(*only),
        _ => None,
    };
    let prefixes: BTreeSet<&str> = optimizer
        .iter()
        .filter_map(|v| v.name.split_once('/').map(|(p, _)| p))
        .collect();
    let kind = match prefixes.iter().collect::<Vec<_>>().as_slice() {
        [prefix] => KNOWN_OPTIMIZERS.iter().copied().find(|k| k == *prefix),
        _ => None,
    };
    Ok((variables, learning_rate, kind))
}
