//! `Flatten` on libtorch (the containers, `Sequential` and `Residual`, are
//! the model's tree: `model.rs` builds and walks them).

use kiln_core::{model::Layer, Result};
use tch::Tensor;

use super::script::{ScriptLeaf, Scripted};
use super::{Forward, ForwardResult, Lookup, Tensors};

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
}

/// The TorchScript of `layer` when it is one of this family's.
pub(super) fn script(layer: &Layer, _leaf: &ScriptLeaf<'_>) -> Result<Option<Scripted>> {
    Ok(match layer {
        Layer::Flatten { start_dim, end_dim } => Some(Scripted::returning(
            "Flatten",
            format!("torch.flatten(x, {start_dim}, {end_dim})"),
        )),
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
