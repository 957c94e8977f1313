//! `Flatten` on libtorch (the containers, `Sequential`, `Residual` and
//! `Parallel`, are the model's tree: `model.rs` builds and walks them).

use kiln_core::{model::Layer, Result};
use tch::{Kind, Tensor};

use super::script::{ScriptLeaf, Scripted};
use super::{Forward, ForwardResult, Lookup, Pass, Tensors};

/// A built [`Layer::Flatten`].
#[derive(Debug)]
struct Flatten {
    start: i64,
    end: i64,
}

/// A built [`Layer::Select`].
#[derive(Debug)]
struct Select {
    dim: i64,
    index: i64,
}

/// The node of `layer` when it is one of this family's; `None` otherwise.
pub(super) fn build(layer: &Layer, _at: &Lookup<'_>) -> Result<Option<Box<dyn Forward>>> {
    Ok(Some(match layer {
        Layer::Flatten { start_dim, end_dim } => Box::new(Flatten {
            start: *start_dim as i64,
            end: *end_dim as i64,
        }),
        Layer::Select { dim, index } => Box::new(Select {
            dim: *dim as i64,
            index: *index as i64,
        }),
        Layer::Transpose { dim0, dim1 } => Box::new(Transpose(*dim0 as i64, *dim1 as i64)),
        _ => return Ok(None),
    }))
}

/// A built [`Layer::Transpose`].
#[derive(Debug)]
struct Transpose(i64, i64);

impl Forward for Transpose {
    fn forward(&self, _tensors: &dyn Tensors, x: &Tensor, _train: bool) -> ForwardResult {
        Ok(x.f_transpose(self.0, self.1)?)
    }
}

impl Forward for Select {
    fn forward(&self, _tensors: &dyn Tensors, x: &Tensor, _train: bool) -> ForwardResult {
        Ok(x.f_select(self.dim, self.index)?)
    }

    /// Over a padded batch's sequence, a negative index counts back from
    /// each row's last token (`transformers`' `last_non_pad_token`:
    /// the argmax of the positions times the mask).
    fn forward_pass(&self, tensors: &dyn Tensors, x: &Tensor, pass: &Pass) -> ForwardResult {
        match &pass.padding {
            Some(mask)
                if self.dim == 1
                    && self.index < 0
                    && x.dim() >= 2
                    && mask.size()[1] == x.size()[1] =>
            {
                let (batch, seq) = (x.size()[0], x.size()[1]);
                let positions = Tensor::f_arange(seq, (Kind::Int64, x.device()))?;
                let last = positions
                    .f_unsqueeze(0)?
                    .f_mul(&mask.f_to_kind(Kind::Int64)?)?
                    .f_argmax(1, false)?;
                let at = last.f_add_scalar(self.index + 1)?.f_clamp_min(0)?;
                let rows = Tensor::f_arange(batch, (Kind::Int64, x.device()))?;
                Ok(x.f_index(&[Some(rows), Some(at)])?)
            }
            _ => self.forward(tensors, x, pass.train),
        }
    }
}

/// The TorchScript of `layer` when it is one of this family's.
pub(super) fn script(layer: &Layer, _leaf: &ScriptLeaf<'_>) -> Result<Option<Scripted>> {
    Ok(match layer {
        Layer::Flatten { start_dim, end_dim } => Some(Scripted::returning(
            "Flatten",
            format!("torch.flatten(x, {start_dim}, {end_dim})"),
        )),
        // Over a padded batch's sequence (the module's `attention_mask`), a
        // negative index counts back from each row's last token, as
        // `Select::forward_pass` does.
        Layer::Select { dim: 1, index } if *index < 0 => Some(Scripted {
            class: "Select".to_owned(),
            body: format!(
                "    if attention_mask is not None:\n        \
                 if x.dim() >= 2 and attention_mask.size(1) == x.size(1):\n            \
                 positions = torch.unsqueeze(torch.arange(x.size(1), device=x.device), 0)\n            \
                 last = torch.argmax(positions * (attention_mask != 0).long(), 1)\n            \
                 at = torch.clamp_min(last + {}, 0)\n            \
                 return x[torch.arange(x.size(0), device=x.device), at]\n    \
                 return torch.select(x, 1, {index})\n",
                index + 1
            ),
            children: Vec::new(),
        }),
        Layer::Select { dim, index } => Some(Scripted::returning(
            "Select",
            format!("torch.select(x, {dim}, {index})"),
        )),
        Layer::Transpose { dim0, dim1 } => Some(Scripted::returning(
            "Transpose",
            format!("torch.transpose(x, {dim0}, {dim1})"),
        )),
        _ => None,
    })
}

impl Forward for Flatten {
    fn forward(&self, _tensors: &dyn Tensors, x: &Tensor, _train: bool) -> ForwardResult {
        Ok(x.f_flatten(self.start, self.end)?)
    }
}
