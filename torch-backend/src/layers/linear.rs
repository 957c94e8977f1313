//! `Linear` on libtorch.

use kiln_core::{model::Layer, Result};
use tch::Tensor;

use super::script::{ScriptLeaf, Scripted};
use super::{Forward, ForwardResult, Lookup, Projection, Tensors};

/// A built [`Layer::Linear`], with its LoRA adapter when it has one.
#[derive(Debug)]
struct Linear(Projection);

/// The node of `layer` when it is one of this family's; `None` otherwise.
pub(super) fn build(layer: &Layer, at: &Lookup<'_>) -> Result<Option<Box<dyn Forward>>> {
    let node = match layer {
        Layer::Linear(_) => Linear(at.projection(None)?),
        _ => return Ok(None),
    };
    Ok(Some(Box::new(node)))
}

/// The TorchScript of `layer` when it is one of this family's.
pub(super) fn script(layer: &Layer, leaf: &ScriptLeaf<'_>) -> Result<Option<Scripted>> {
    Ok(match layer {
        Layer::Linear(_) => Some(Scripted::returning(
            "Linear",
            format!("torch.linear(x, self.weight, {})", leaf.opt("bias")),
        )),
        _ => None,
    })
}

impl Forward for Linear {
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, train: bool) -> ForwardResult {
        self.0.forward(tensors, x, train)
    }
}
