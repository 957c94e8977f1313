//! Kiln [`Loss`] definitions computed with libtorch's loss functions.

use kiln_core::{
    loss::{Loss, Reduction},
    DType, Error, Result,
};
use tch::{Kind, Tensor};

use crate::convert::{dtype_from_kind, is_float_kind};
use crate::error::torch_error;

/// PyTorch's default `ignore_index`.
const NO_IGNORE: i64 = -100;

fn reduction(r: Reduction) -> tch::Reduction {
    match r {
        Reduction::Sum => tch::Reduction::Sum,
        Reduction::None => tch::Reduction::None,
        _ => tch::Reduction::Mean,
    }
}

fn weights(values: &Option<Vec<f64>>, like: &Tensor) -> Result<Option<Tensor>> {
    values
        .as_ref()
        .map(|w| {
            Tensor::f_from_slice(w)
                .and_then(|t| t.f_to_kind(like.kind()))
                .and_then(|t| t.f_to_device(like.device()))
                .map_err(|e| torch_error("building loss weights", e))
        })
        .transpose()
}

/// Checks that class-index targets are int64 and match the batch size.
fn check_class_targets(name: &str, input: &Tensor, target: &Tensor) -> Result<()> {
    let kind = target.kind();
    if !is_float_kind(kind) && kind != Kind::Int64 {
        return Err(Error::DTypeMismatch {
            context: format!("{name} class-index targets"),
            expected: DType::I64,
            actual: dtype_from_kind(kind)?,
        });
    }
    let (input_size, target_size) = (input.size(), target.size());
    if input_size.first() != target_size.first() {
        return Err(Error::ShapeMismatch {
            context: format!("{name} targets"),
            expected: format!("batch size {:?} (input {input_size:?})", input_size.first()),
            actual: format!("{target_size:?}"),
        });
    }
    Ok(())
}

fn check_same_shape(name: &str, input: &Tensor, target: &Tensor) -> Result<()> {
    if input.size() != target.size() {
        return Err(Error::ShapeMismatch {
            context: format!("{name} target"),
            expected: format!("{:?} (the input's shape)", input.size()),
            actual: format!("{:?}", target.size()),
        });
    }
    Ok(())
}

/// Computes `loss(input, target)` with PyTorch's semantics (`torch.nn.functional`).
///
/// `CrossEntropy` takes logits `[N, C, ...]` and either int64 class indices
/// `[N, ...]` or class probabilities of the input's shape; `Nll` takes
/// log-probabilities and class indices; the regression losses take equal shapes.
/// Floating-point targets are compared in the input's dtype (float32 labels
/// against a bfloat16 model's output, as Lightning's `bf16-true` casts them).
pub fn compute_loss(loss: &Loss, input: &Tensor, target: &Tensor) -> Result<Tensor> {
    loss.validate()?;
    let same_kind;
    let target = if is_float_kind(target.kind())
        && is_float_kind(input.kind())
        && target.kind() != input.kind()
    {
        same_kind = target
            .f_to_kind(input.kind())
            .map_err(|e| torch_error("casting the targets to the input's dtype", e))?;
        &same_kind
    } else {
        target
    };
    let result = match loss {
        Loss::CrossEntropy(c) => {
            if is_float_kind(target.kind()) {
                check_same_shape("cross_entropy", input, target)?;
            } else {
                check_class_targets("cross_entropy", input, target)?;
            }
            input.f_cross_entropy_loss(
                target,
                weights(&c.weight, input)?,
                reduction(c.reduction),
                c.ignore_index.unwrap_or(NO_IGNORE),
                c.label_smoothing,
            )
        }
        Loss::Nll(c) => {
            check_class_targets("nll", input, target)?;
            input.f_nll_loss(
                target,
                weights(&c.weight, input)?,
                reduction(c.reduction),
                c.ignore_index.unwrap_or(NO_IGNORE),
            )
        }
        Loss::Mse { reduction: r } => {
            check_same_shape("mse", input, target)?;
            input.f_mse_loss(target, reduction(*r))
        }
        Loss::L1 { reduction: r } => {
            check_same_shape("l1", input, target)?;
            input.f_l1_loss(target, reduction(*r))
        }
        Loss::SmoothL1(c) => {
            check_same_shape("smooth_l1", input, target)?;
            input.f_smooth_l1_loss(target, reduction(c.reduction), c.beta)
        }
        Loss::BceWithLogits(c) => {
            check_same_shape("bce_with_logits", input, target)?;
            input.f_binary_cross_entropy_with_logits(
                target,
                None::<Tensor>,
                weights(&c.pos_weight, input)?,
                reduction(c.reduction),
            )
        }
        other => return Err(Error::unsupported(format!("loss {other:?} on libtorch"))),
    };
    result.map_err(|e| torch_error("computing the loss", e))
}
