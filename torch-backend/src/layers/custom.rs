//! `Custom` layers on libtorch: the op registered under the layer's name,
//! called with the input and the layer's parameters.

use std::sync::Arc;

use kiln_core::{
    model::{CustomConfig, Layer},
    Error, Result, Shape,
};
use tch::Tensor;

use super::script::{ScriptLeaf, Scripted};
use super::{Failure, Forward, ForwardResult, Lookup, Tensors};
use crate::custom_layer::{lookup, torchscript_lowering, CustomLayerFn};

/// A registered custom-layer function (shown by its layer's op name).
#[derive(Clone)]
struct OpFn(Arc<CustomLayerFn>);

impl std::fmt::Debug for OpFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OpFn")
    }
}

/// A built [`Layer::Custom`].
#[derive(Debug)]
struct Custom {
    /// The layer's path, for errors.
    path: String,
    op: OpFn,
    params: Vec<usize>,
    config: CustomConfig,
}

/// The node of `layer` when it is one of this family's; `None` otherwise.
pub(super) fn build(layer: &Layer, at: &Lookup<'_>) -> Result<Option<Box<dyn Forward>>> {
    let node = match layer {
        Layer::Custom(c) => Custom {
            path: at.prefix.to_owned(),
            op: OpFn(lookup(at.prefix, &c.op)?),
            params: c
                .params
                .iter()
                .map(|p| at.need(&p.name))
                .collect::<Result<_>>()?,
            config: c.clone(),
        },
        _ => return Ok(None),
    };
    Ok(Some(Box::new(node)))
}

/// The TorchScript of `layer` when it is one of this family's: the lowering
/// its op's crate registered ([`register_torchscript_lowering`](crate::register_torchscript_lowering)),
/// `None` for an op without one (which the exporter refuses, naming it).
pub(super) fn script(layer: &Layer, _leaf: &ScriptLeaf<'_>) -> Result<Option<Scripted>> {
    let Layer::Custom(c) = layer else {
        return Ok(None);
    };
    let Some(lowering) = torchscript_lowering(&c.op) else {
        return Ok(None);
    };
    let lowered = lowering(c)?;
    let body = lowered
        .forward
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| format!("    {line}\n"))
        .collect();
    Ok(Some(Scripted {
        class: lowered.class,
        body,
        children: Vec::new(),
    }))
}

impl Forward for Custom {
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, _train: bool) -> ForwardResult {
        let Custom {
            path,
            op,
            params,
            config,
        } = self;
        let params: Vec<&Tensor> = params.iter().map(|&i| tensors.tensor(i)).collect();
        let y = (op.0)(x, &params, config).map_err(Failure::Layer)?;
        if y.size() != x.size() {
            let dims = |t: &Tensor| {
                Shape::from(t.size().iter().map(|&d| d as usize).collect::<Vec<_>>()).to_string()
            };
            return Err(Failure::Layer(Error::ShapeMismatch {
                context: format!("{path} (Custom {}): op output", config.op),
                expected: dims(x),
                actual: dims(&y),
            }));
        }
        Ok(y)
    }
}
