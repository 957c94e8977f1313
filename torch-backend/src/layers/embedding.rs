//! `Embedding` on libtorch.

use kiln_core::{model::Layer, Result};
use tch::Tensor;

use super::script::{ScriptLeaf, Scripted};
use super::{Forward, ForwardResult, Lookup, Tensors};

/// A built [`Layer::Embedding`]; `padding_idx` is -1 without a padding row.
#[derive(Debug)]
struct Embedding {
    weight: usize,
    padding_idx: i64,
}

/// The node of `layer` when it is one of this family's; `None` otherwise.
pub(super) fn build(layer: &Layer, at: &Lookup<'_>) -> Result<Option<Box<dyn Forward>>> {
    let node = match layer {
        Layer::Embedding(c) => Embedding {
            weight: at.need("weight")?,
            padding_idx: c.padding_idx.map_or(-1, |i| i as i64),
        },
        _ => return Ok(None),
    };
    Ok(Some(Box::new(node)))
}

/// The TorchScript of `layer` when it is one of this family's.
pub(super) fn script(layer: &Layer, _leaf: &ScriptLeaf<'_>) -> Result<Option<Scripted>> {
    Ok(match layer {
        Layer::Embedding(c) => Some(Scripted::returning(
            "Embedding",
            format!(
                "torch.embedding(self.weight, x, {}, False, False)",
                c.padding_idx.map_or(-1, |i| i as i64)
            ),
        )),
        _ => None,
    })
}

impl Forward for Embedding {
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, _train: bool) -> ForwardResult {
        Ok(Tensor::f_embedding(
            tensors.tensor(self.weight),
            x,
            self.padding_idx,
            false,
            false,
        )?)
    }
}
