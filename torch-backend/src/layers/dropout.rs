//! `Dropout` on libtorch.

use kiln_core::{model::Layer, Result};
use tch::Tensor;

use super::script::{float, ScriptLeaf, Scripted};
use super::{Forward, ForwardResult, Lookup, Tensors};

/// A built [`Layer::Dropout`].
#[derive(Debug)]
struct Dropout {
    p: f64,
}

/// The node of `layer` when it is one of this family's; `None` otherwise.
pub(super) fn build(layer: &Layer, _at: &Lookup<'_>) -> Result<Option<Box<dyn Forward>>> {
    let node = match layer {
        Layer::Dropout { p } => Dropout { p: *p },
        _ => return Ok(None),
    };
    Ok(Some(Box::new(node)))
}

/// The TorchScript of `layer` when it is one of this family's.
pub(super) fn script(layer: &Layer, _leaf: &ScriptLeaf<'_>) -> Result<Option<Scripted>> {
    Ok(match layer {
        Layer::Dropout { p } => Some(Scripted::returning(
            "Dropout",
            format!("torch.dropout(x, {}, self.training)", float(*p)),
        )),
        _ => None,
    })
}

impl Forward for Dropout {
    fn forward(&self, _tensors: &dyn Tensors, x: &Tensor, train: bool) -> ForwardResult {
        Ok(x.f_dropout(self.p, train)?)
    }
}
