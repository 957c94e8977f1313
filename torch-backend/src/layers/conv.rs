//! Convolutions on libtorch: `Conv1d`, `Conv2d`, `ConvTranspose2d`.

use kiln_core::{model::Layer, Result};
use tch::Tensor;

use super::script::{ints, ScriptLeaf, Scripted};
use super::{pair, Forward, ForwardResult, Lookup, Tensors};

/// A built convolution; its variants are named after the layers they build.
#[derive(Debug)]
#[allow(clippy::enum_variant_names)]
enum Conv {
    Conv1d {
        weight: usize,
        bias: Option<usize>,
        stride: i64,
        padding: i64,
        dilation: i64,
        groups: i64,
    },
    Conv2d {
        weight: usize,
        bias: Option<usize>,
        stride: [i64; 2],
        padding: [i64; 2],
        dilation: [i64; 2],
        groups: i64,
    },
    ConvTranspose2d {
        weight: usize,
        bias: Option<usize>,
        stride: [i64; 2],
        padding: [i64; 2],
        output_padding: [i64; 2],
        dilation: [i64; 2],
        groups: i64,
    },
}

/// The node of `layer` when it is one of this family's; `None` otherwise.
pub(super) fn build(layer: &Layer, at: &Lookup<'_>) -> Result<Option<Box<dyn Forward>>> {
    let node = match layer {
        Layer::Conv1d(c) => Conv::Conv1d {
            weight: at.need("weight")?,
            bias: at.find("bias"),
            stride: c.stride as i64,
            padding: c.padding as i64,
            dilation: c.dilation as i64,
            groups: c.groups as i64,
        },
        Layer::Conv2d(c) => Conv::Conv2d {
            weight: at.need("weight")?,
            bias: at.find("bias"),
            stride: pair(c.stride),
            padding: pair(c.padding),
            dilation: pair(c.dilation),
            groups: c.groups as i64,
        },
        Layer::ConvTranspose2d(c) => Conv::ConvTranspose2d {
            weight: at.need("weight")?,
            bias: at.find("bias"),
            stride: pair(c.stride),
            padding: pair(c.padding),
            output_padding: pair(c.output_padding),
            dilation: pair(c.dilation),
            groups: c.groups as i64,
        },
        _ => return Ok(None),
    };
    Ok(Some(Box::new(node)))
}

/// The TorchScript of `layer` when it is one of this family's.
pub(super) fn script(layer: &Layer, leaf: &ScriptLeaf<'_>) -> Result<Option<Scripted>> {
    Ok(Some(match layer {
        Layer::Conv1d(c) => Scripted::returning(
            "Conv1d",
            format!(
                "torch.conv1d(x, self.weight, {}, {}, {}, {}, {})",
                leaf.opt("bias"),
                ints(&[c.stride]),
                ints(&[c.padding]),
                ints(&[c.dilation]),
                c.groups
            ),
        ),
        Layer::Conv2d(c) => Scripted::returning(
            "Conv2d",
            format!(
                "torch.conv2d(x, self.weight, {}, {}, {}, {}, {})",
                leaf.opt("bias"),
                ints(&c.stride),
                ints(&c.padding),
                ints(&c.dilation),
                c.groups
            ),
        ),
        Layer::ConvTranspose2d(c) => Scripted::returning(
            "ConvTranspose2d",
            format!(
                "torch.conv_transpose2d(x, self.weight, {}, {}, {}, {}, {}, {})",
                leaf.opt("bias"),
                ints(&c.stride),
                ints(&c.padding),
                ints(&c.output_padding),
                c.groups,
                ints(&c.dilation)
            ),
        ),
        _ => return Ok(None),
    }))
}

impl Forward for Conv {
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, _train: bool) -> ForwardResult {
        Ok(match self {
            Conv::Conv1d {
                weight,
                bias,
                stride,
                padding,
                dilation,
                groups,
            } => x.f_conv1d(
                tensors.tensor(*weight),
                tensors.opt(*bias),
                [*stride],
                [*padding],
                [*dilation],
                *groups,
            ),
            Conv::Conv2d {
                weight,
                bias,
                stride,
                padding,
                dilation,
                groups,
            } => x.f_conv2d(
                tensors.tensor(*weight),
                tensors.opt(*bias),
                stride.as_slice(),
                padding.as_slice(),
                dilation.as_slice(),
                *groups,
            ),
            Conv::ConvTranspose2d {
                weight,
                bias,
                stride,
                padding,
                output_padding,
                dilation,
                groups,
            } => x.f_conv_transpose2d(
                tensors.tensor(*weight),
                tensors.opt(*bias),
                stride.as_slice(),
                padding.as_slice(),
                output_padding.as_slice(),
                *groups,
                dilation.as_slice(),
            ),
        }?)
    }
}
