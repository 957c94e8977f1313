//! Pooling on libtorch: `MaxPool2d`, `AvgPool2d`, `AdaptiveAvgPool2d`.

use kiln_core::{model::Layer, Result};
use tch::Tensor;

use super::script::{ints, ScriptLeaf, Scripted};
use super::{pair, Forward, ForwardResult, Lookup, Tensors};

/// A built pooling layer.
#[derive(Debug)]
enum Pool {
    MaxPool2d {
        kernel: [i64; 2],
        stride: [i64; 2],
        padding: [i64; 2],
    },
    AvgPool2d {
        kernel: [i64; 2],
        stride: [i64; 2],
        padding: [i64; 2],
    },
    AdaptiveAvgPool2d {
        output_size: [i64; 2],
    },
}

/// The node of `layer` when it is one of this family's; `None` otherwise.
pub(super) fn build(layer: &Layer, _at: &Lookup<'_>) -> Result<Option<Box<dyn Forward>>> {
    let node = match layer {
        Layer::MaxPool2d(c) => Pool::MaxPool2d {
            kernel: pair(c.kernel_size),
            stride: pair(c.effective_stride()),
            padding: pair(c.padding),
        },
        Layer::AvgPool2d(c) => Pool::AvgPool2d {
            kernel: pair(c.kernel_size),
            stride: pair(c.effective_stride()),
            padding: pair(c.padding),
        },
        Layer::AdaptiveAvgPool2d { output_size } => Pool::AdaptiveAvgPool2d {
            output_size: pair(*output_size),
        },
        _ => return Ok(None),
    };
    Ok(Some(Box::new(node)))
}

/// The TorchScript of `layer` when it is one of this family's.
pub(super) fn script(layer: &Layer, _leaf: &ScriptLeaf<'_>) -> Result<Option<Scripted>> {
    Ok(Some(match layer {
        Layer::MaxPool2d(c) => Scripted::returning(
            "MaxPool2d",
            format!(
                "torch.max_pool2d(x, {}, {}, {}, [1, 1], False)",
                ints(&c.kernel_size),
                ints(&c.effective_stride()),
                ints(&c.padding)
            ),
        ),
        Layer::AvgPool2d(c) => Scripted::returning(
            "AvgPool2d",
            format!(
                "torch.avg_pool2d(x, {}, {}, {}, False, True, None)",
                ints(&c.kernel_size),
                ints(&c.effective_stride()),
                ints(&c.padding)
            ),
        ),
        Layer::AdaptiveAvgPool2d { output_size } => Scripted::returning(
            "AdaptiveAvgPool2d",
            format!("torch.adaptive_avg_pool2d(x, {})", ints(output_size)),
        ),
        _ => return Ok(None),
    }))
}

impl Forward for Pool {
    fn forward(&self, _tensors: &dyn Tensors, x: &Tensor, _train: bool) -> ForwardResult {
        Ok(match self {
            Pool::MaxPool2d {
                kernel,
                stride,
                padding,
            } => x.f_max_pool2d(
                kernel.as_slice(),
                stride.as_slice(),
                padding.as_slice(),
                [1, 1],
                false,
            ),
            Pool::AvgPool2d {
                kernel,
                stride,
                padding,
            } => x.f_avg_pool2d(
                kernel.as_slice(),
                stride.as_slice(),
                padding.as_slice(),
                false,
                true,
                None,
            ),
            Pool::AdaptiveAvgPool2d { output_size } => {
                x.f_adaptive_avg_pool2d(output_size.as_slice())
            }
        }?)
    }
}
