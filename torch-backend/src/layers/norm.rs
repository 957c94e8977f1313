//! Normalisation on libtorch: `BatchNorm1d`, `BatchNorm2d`, `LayerNorm`,
//! `GroupNorm`, `RmsNorm`.

use kiln_core::{model::Layer, Result};
use tch::Tensor;

use super::script::{float, ints, ret, ScriptLeaf, Scripted};
use super::{Forward, ForwardResult, Lookup, Tensors};

/// A built normalisation layer; its variants are named after the layers they
/// build (both batch norms are `BatchNorm`).
#[derive(Debug)]
#[allow(clippy::enum_variant_names)]
enum Norm {
    BatchNorm {
        weight: Option<usize>,
        bias: Option<usize>,
        running_mean: Option<usize>,
        running_var: Option<usize>,
        num_batches_tracked: Option<usize>,
        momentum: f64,
        eps: f64,
    },
    LayerNorm {
        shape: Vec<i64>,
        weight: Option<usize>,
        bias: Option<usize>,
        eps: f64,
    },
    GroupNorm {
        groups: i64,
        weight: Option<usize>,
        bias: Option<usize>,
        eps: f64,
    },
    RmsNorm {
        weight: usize,
        eps: f64,
        offset: f64,
        /// The weight scales before the cast back (OLMo 2's order).
        in_float32: bool,
    },
}

/// The node of `layer` when it is one of this family's; `None` otherwise.
pub(super) fn build(layer: &Layer, at: &Lookup<'_>) -> Result<Option<Box<dyn Forward>>> {
    let node = match layer {
        Layer::BatchNorm1d(c) | Layer::BatchNorm2d(c) => Norm::BatchNorm {
            weight: at.find("weight"),
            bias: at.find("bias"),
            running_mean: at.find("running_mean"),
            running_var: at.find("running_var"),
            num_batches_tracked: at.find("num_batches_tracked"),
            momentum: c.momentum,
            eps: c.eps,
        },
        Layer::LayerNorm(c) => Norm::LayerNorm {
            shape: c.normalized_shape.iter().map(|&d| d as i64).collect(),
            weight: at.find("weight"),
            bias: at.find("bias"),
            eps: c.eps,
        },
        Layer::GroupNorm(c) => Norm::GroupNorm {
            groups: c.num_groups as i64,
            weight: at.find("weight"),
            bias: at.find("bias"),
            eps: c.eps,
        },
        Layer::RmsNorm(c) => Norm::RmsNorm {
            weight: at.need("weight")?,
            eps: c.eps,
            offset: c.weight_offset,
            in_float32: c.scale_in_float32,
        },
        _ => return Ok(None),
    };
    Ok(Some(Box::new(node)))
}

/// The TorchScript of `layer` when it is one of this family's. A batch norm
/// follows the module's `training` flag as `nn.BatchNorm` does (batch
/// statistics, running-statistics update, `num_batches_tracked`), unless it is
/// pinned to eval behaviour.
pub(super) fn script(layer: &Layer, leaf: &ScriptLeaf<'_>) -> Result<Option<Scripted>> {
    let has = leaf.has;
    Ok(Some(match layer {
        Layer::BatchNorm1d(c) | Layer::BatchNorm2d(c) => {
            let class = if matches!(layer, Layer::BatchNorm1d(_)) {
                "BatchNorm1d"
            } else {
                "BatchNorm2d"
            };
            let tracks = has("running_mean");
            let training = if leaf.pinned {
                "False"
            } else {
                "self.training"
            };
            let mut body = String::new();
            if tracks && has("num_batches_tracked") && !leaf.pinned {
                // nn.BatchNorm counts the training batches it normalises.
                body.push_str("    if self.training:\n");
                body.push_str("        self.num_batches_tracked.add_(1)\n");
            }
            // Batch statistics in training, or always without running statistics.
            let batch_stats = if tracks { training } else { "True" };
            body.push_str(&ret(format!(
                "torch.batch_norm(x, {}, {}, {}, {}, {batch_stats}, {}, {}, False)",
                leaf.opt("weight"),
                leaf.opt("bias"),
                leaf.opt("running_mean"),
                leaf.opt("running_var"),
                float(c.momentum),
                float(c.eps)
            )));
            Scripted {
                class: class.to_owned(),
                body,
                children: Vec::new(),
            }
        }
        Layer::LayerNorm(c) => Scripted::returning(
            "LayerNorm",
            format!(
                "torch.layer_norm(x, {}, {}, {}, {}, False)",
                ints(&c.normalized_shape),
                leaf.opt("weight"),
                leaf.opt("bias"),
                float(c.eps)
            ),
        ),
        Layer::GroupNorm(c) => Scripted::returning(
            "GroupNorm",
            format!(
                "torch.group_norm(x, {}, {}, {}, {}, False)",
                c.num_groups,
                leaf.opt("weight"),
                leaf.opt("bias"),
                float(c.eps)
            ),
        ),
        Layer::RmsNorm(c) => Scripted {
            class: "RMSNorm".to_owned(),
            body: super::transformer_script::rms_norm_script(
                c.eps,
                c.weight_offset,
                c.scale_in_float32,
            ),
            children: Vec::new(),
        },
        _ => return Ok(None),
    }))
}

impl Forward for Norm {
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, train: bool) -> ForwardResult {
        Ok(match self {
            Norm::BatchNorm {
                weight,
                bias,
                running_mean,
                running_var,
                num_batches_tracked,
                momentum,
                eps,
            } => {
                let tracks = running_mean.is_some();
                // PyTorch: batch statistics in training, or always without running stats.
                let use_batch_stats = train || !tracks;
                if train && tracks {
                    if let Some(n) = num_batches_tracked {
                        let mut count = tensors.tensor(*n).shallow_clone();
                        let _ = tch::no_grad(|| count.f_add_scalar_(1))?;
                    }
                }
                x.f_batch_norm(
                    tensors.opt(*weight),
                    tensors.opt(*bias),
                    tensors.opt(*running_mean),
                    tensors.opt(*running_var),
                    use_batch_stats,
                    *momentum,
                    *eps,
                    false,
                )
            }
            Norm::LayerNorm {
                shape,
                weight,
                bias,
                eps,
            } => x.f_layer_norm(
                shape.as_slice(),
                tensors.opt(*weight),
                tensors.opt(*bias),
                *eps,
                false,
            ),
            Norm::GroupNorm {
                groups,
                weight,
                bias,
                eps,
            } => x.f_group_norm(
                *groups,
                tensors.opt(*weight),
                tensors.opt(*bias),
                *eps,
                false,
            ),
            Norm::RmsNorm {
                weight,
                eps,
                offset,
                in_float32,
            } => {
                let weight = tensors.tensor(*weight);
                return if *offset == 0.0 && !*in_float32 {
                    super::transformer::rms_norm(x, weight, *eps)
                } else {
                    super::transformer::offset_rms_norm(x, weight, *eps, *offset)
                };
            }
        }?)
    }
}
