//! `Custom` layers on libtorch: the op registered under the layer's name,
//! called with the input and the layer's parameters.

use std::sync::Arc;

use kiln_core::{
    model::{CustomConfig, Layer},
    Error, Result, Shape,
};
use tch::Tensor;

use super::{Failure, Forward, ForwardResult, Lookup};
use crate::custom_layer::{lookup, CustomLayerFn};
use crate::model::TorchModel;

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

impl Forward for Custom {
    fn forward(&self, model: &TorchModel, x: &Tensor, _train: bool) -> ForwardResult {
        let Custom {
            path,
            op,
            params,
            config,
        } = self;
        let params: Vec<&Tensor> = params.iter().map(|&i| model.tensor(i)).collect();
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
