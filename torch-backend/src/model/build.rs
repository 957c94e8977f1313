//! Building a [`TorchModel`]'s tensors and nodes from its [`Layer`] definition.

use std::collections::HashMap;
use std::sync::Mutex;

use kiln_core::{
    model::{InitDistribution, Layer, ParamKind, ParamSpec},
    module::Module,
    DType, Device, Error, Result,
};
use tch::{Kind, TchError, Tensor};

use super::{Entry, Node};
use crate::backend::TorchBackend;
use crate::convert::is_float_kind;
use crate::error::torch_error;
use crate::freeze::Freeze;
use crate::layers::{self, join, Lookup};
use crate::script::ScriptModule;

pub(super) fn init_tensor(
    spec: &ParamSpec,
    device: tch::Device,
) -> std::result::Result<Tensor, TchError> {
    let kind = match spec.dtype {
        DType::I64 => Kind::Int64,
        DType::F64 => Kind::Double,
        _ => Kind::Float,
    };
    let dims: Vec<i64> = spec.shape.iter().map(|&d| d as i64).collect();
    let mut t = Tensor::f_empty(dims.as_slice(), (kind, device))?;
    match spec.init {
        InitDistribution::Constant { value } => {
            let _ = t.f_fill_(value)?;
        }
        InitDistribution::Uniform { low, high } => {
            let _ = t.f_uniform_(low, high)?;
        }
        InitDistribution::Normal { mean, std } => {
            let _ = t.f_normal_(mean, std)?;
        }
    }
    if let Some(row) = spec.zero_row {
        let _ = t.f_get(row as i64)?.f_zero_()?;
    }
    if spec.kind == ParamKind::Parameter {
        t = t.f_set_requires_grad(true)?;
    }
    Ok(t)
}

/// Creates the tensors of `layer` at `prefix` in state-dict order: initialised
/// from the definition, or loaded from a TorchScript file (kept in `scripts`
/// by path). Sets `float` when one is floating-point.
pub(super) fn collect_entries(
    layer: &Layer,
    prefix: &str,
    device: Device,
    target: tch::Device,
    entries: &mut Vec<Entry>,
    scripts: &mut HashMap<String, ScriptModule>,
    float: &mut bool,
) -> Result<()> {
    match layer {
        Layer::Sequential { layers } | Layer::Parallel { branches: layers } => {
            for (i, child) in layers.iter().enumerate() {
                collect_entries(
                    child,
                    &join(prefix, &i.to_string()),
                    device,
                    target,
                    entries,
                    scripts,
                    float,
                )?;
            }
        }
        Layer::Residual { block } => {
            collect_entries(
                block,
                &join(prefix, "block"),
                device,
                target,
                entries,
                scripts,
                float,
            )?;
        }
        Layer::TorchScript(config) => {
            // Its errors name the file: Io when missing, Data when not TorchScript.
            let mut module = ScriptModule::load(&config.path, device)?;
            if !config.trainable {
                module
                    .freeze(&["*"])
                    .or_else(|e| match module.num_parameters() {
                        Ok(0) => Ok(Vec::new()), // nothing to freeze
                        _ => Err(e),
                    })?;
            }
            for (name, tensor) in Module::<TorchBackend>::named_parameters(&module)? {
                *float |= is_float_kind(tensor.kind());
                entries.push(Entry {
                    name: join(prefix, &name),
                    kind: ParamKind::Parameter,
                    tensor,
                });
            }
            for (name, tensor) in Module::<TorchBackend>::named_buffers(&module)? {
                *float |= is_float_kind(tensor.kind());
                entries.push(Entry {
                    name: join(prefix, &name),
                    kind: ParamKind::Buffer,
                    tensor,
                });
            }
            scripts.insert(prefix.to_owned(), module);
        }
        leaf => {
            for p in leaf.parameter_specs(prefix)? {
                *float |= p.dtype.is_float();
                let tensor = init_tensor(&p, target)
                    .map_err(|e| torch_error(&format!("initialising {}", p.name), e))?;
                entries.push(Entry {
                    name: p.name,
                    kind: p.kind,
                    tensor,
                });
            }
        }
    }
    Ok(())
}

/// Builds the node for `layer` at `prefix`, finding its tensors by name and
/// taking its TorchScript module from `scripts`.
pub(super) fn build(
    layer: &Layer,
    prefix: &str,
    index: &HashMap<&str, usize>,
    lora: Option<(f64, f64)>,
    scripts: &mut HashMap<String, ScriptModule>,
) -> Result<Node> {
    Ok(match layer {
        Layer::Sequential { layers } => Node::Sequential(
            layers
                .iter()
                .enumerate()
                .map(|(i, l)| build(l, &join(prefix, &i.to_string()), index, lora, scripts))
                .collect::<Result<_>>()?,
        ),
        Layer::Parallel { branches } => Node::Parallel(
            branches
                .iter()
                .enumerate()
                .map(|(i, l)| build(l, &join(prefix, &i.to_string()), index, lora, scripts))
                .collect::<Result<_>>()?,
        ),
        Layer::Residual { block } => Node::Residual(Box::new(build(
            block,
            &join(prefix, "block"),
            index,
            lora,
            scripts,
        )?)),
        Layer::TorchScript(_) => Node::Script {
            module: Mutex::new(scripts.remove(prefix).ok_or_else(|| {
                Error::backend(
                    "torch",
                    "building a torchscript layer",
                    "its module was not loaded",
                )
            })?),
            path: prefix.to_owned(),
        },
        leaf => Node::Leaf {
            layer: layers::build(
                leaf,
                &Lookup {
                    prefix,
                    index,
                    lora,
                },
            )?,
            path: prefix.to_owned(),
            batch_norm: matches!(leaf, Layer::BatchNorm1d(_) | Layer::BatchNorm2d(_)),
            eval: false,
        },
    })
}
