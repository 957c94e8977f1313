//! `Embedding` on libtorch.

use kiln_core::{model::Layer, Result};
use tch::Tensor;

use super::script::{float, ScriptLeaf, Scripted};
use super::{Forward, ForwardResult, Lookup, Tensors};

/// A built [`Layer::Embedding`]; `padding_idx` is -1 without a padding row.
#[derive(Debug)]
struct Embedding {
    weight: usize,
    padding_idx: i64,
    scale: Option<f64>,
}

/// The node of `layer` when it is one of this family's; `None` otherwise.
pub(super) fn build(layer: &Layer, at: &Lookup<'_>) -> Result<Option<Box<dyn Forward>>> {
    let node = match layer {
        Layer::Embedding(c) => Embedding {
            weight: at.need("weight")?,
            padding_idx: c.padding_idx.map_or(-1, |i| i as i64),
            scale: c.scale,
        },
        _ => return Ok(None),
    };
    Ok(Some(Box::new(node)))
}

/// The TorchScript of `layer` when it is one of this family's.
pub(super) fn script(layer: &Layer, _leaf: &ScriptLeaf<'_>) -> Result<Option<Scripted>> {
    Ok(match layer {
        Layer::Embedding(c) => {
            let lookup = format!(
                "torch.embedding(self.weight, x, {}, False, False)",
                c.padding_idx.map_or(-1, |i| i as i64)
            );
            Some(Scripted::returning(
                "Embedding",
                match c.scale {
                    // The factor in the weight's dtype, as Gemma's embedding has it.
                    Some(scale) => format!(
                        "{lookup} * torch.tensor({}).to(self.weight.dtype)",
                        float(scale)
                    ),
                    None => lookup,
                },
            ))
        }
        _ => None,
    })
}

impl Forward for Embedding {
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, _train: bool) -> ForwardResult {
        let weight = tensors.tensor(self.weight);
        let y = Tensor::f_embedding(weight, x, self.padding_idx, false, false)?;
        Ok(match self.scale {
            None => y,
            // The factor rounded to the weight's dtype (a float32 scalar cast
            // on the host, nothing crosses to the device), as Gemma's
            // `embed_scale.to(weight.dtype)` is.
            Some(scale) => {
                let rounded = Tensor::from(scale as f32)
                    .f_to_kind(weight.kind())?
                    .f_double_value(&[])?;
                y.f_mul_scalar(rounded)?
            }
        })
    }
}
