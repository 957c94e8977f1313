//! Adam and AdamW (`torch.optim.Adam`, `torch.optim.AdamW`), with AMSGrad: the
//! per-parameter step. In capturable mode the optimizer runs libtorch's fused
//! kernels instead (`fused.rs`).

use kiln_core::optim::{AdamConfig, AdamWConfig, GroupHyper};
use tch::{TchError, Tensor};

use super::{state_tensor, with_weight_decay, ParamSlot};

/// Adam with PyTorch's coupled weight decay (added to the gradient).
pub(crate) fn update_adam(
    slot: &mut ParamSlot,
    grad: &Tensor,
    config: &AdamConfig,
    hyper: &GroupHyper,
) -> Result<(), TchError> {
    let grad = with_weight_decay(grad, &slot.tensor, hyper.weight_decay)?;
    adam_step(
        slot,
        &grad,
        config.betas,
        config.eps,
        config.amsgrad,
        hyper.lr,
    )
}

/// AdamW: decoupled weight decay, `param *= 1 - lr * weight_decay`, then Adam.
pub(crate) fn update_adamw(
    slot: &mut ParamSlot,
    grad: &Tensor,
    config: &AdamWConfig,
    hyper: &GroupHyper,
) -> Result<(), TchError> {
    if hyper.weight_decay != 0.0 {
        let _ = slot
            .tensor
            .f_mul_scalar_(1.0 - hyper.lr * hyper.weight_decay)?;
    }
    adam_step(
        slot,
        grad,
        config.betas,
        config.eps,
        config.amsgrad,
        hyper.lr,
    )
}

fn adam_step(
    slot: &mut ParamSlot,
    grad: &Tensor,
    (beta1, beta2): (f64, f64),
    eps: f64,
    amsgrad: bool,
    lr: f64,
) -> Result<(), TchError> {
    let zeros = |p: &Tensor| p.f_zeros_like();
    // PyTorch's single-tensor Adam in 7 passes over the parameter's size (libtorch's
    // own C++ Adam makes 8) and 2 temporaries. tch's addcdiv_ takes no scale, so the
    // step's scale is folded into the denominator instead.
    // exp_avg = lerp(exp_avg, grad, 1 - beta1)
    let _ = state_tensor(slot, "exp_avg", zeros)?.f_lerp_(grad, 1.0 - beta1)?;
    // exp_avg_sq = lerp(exp_avg_sq, grad * grad, 1 - beta2)
    //            = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    let mut exp_avg_sq = state_tensor(slot, "exp_avg_sq", zeros)?.shallow_clone();
    let _ = exp_avg_sq.f_lerp_(&grad.f_mul(grad)?, 1.0 - beta2)?;

    let second_moment = if amsgrad {
        let max = state_tensor(slot, "max_exp_avg_sq", zeros)?;
        let updated = max.f_maximum(&exp_avg_sq)?;
        max.f_copy_(&updated)?;
        updated
    } else {
        exp_avg_sq
    };
    let exp_avg = slot
        .state
        .get("exp_avg")
        .map(Tensor::shallow_clone)
        .ok_or_else(|| TchError::Kind("exp_avg missing".into()))?;
    let mut denom = second_moment.f_sqrt()?;
    let step = slot.step as i32;
    let bias_correction1 = 1.0 - beta1.powi(step);
    let bias_correction2_sqrt = (1.0 - beta2.powi(step)).sqrt();
    let step_size = lr / bias_correction1;
    let (scale, shift) = (-1.0 / (step_size * bias_correction2_sqrt), -eps / step_size);
    if scale.is_finite() && shift.is_finite() {
        // denom = (sqrt(v) / sqrt(bias_correction2) + eps) / -step_size, so that
        // param += exp_avg / denom is param -= step_size * exp_avg / (sqrt(v_hat) + eps).
        let _ = denom.f_mul_scalar_(scale)?;
        let _ = denom.f_add_scalar_(shift)?;
        let _ = slot.tensor.f_addcdiv_(&exp_avg, &denom)?;
    } else {
        // A learning rate of 0 (a warm-up's first step) or too small to invert.
        let _ = denom.f_div_scalar_(bias_correction2_sqrt)?;
        let _ = denom.f_add_scalar_(eps)?;
        let _ = exp_avg.f_div_out(&denom, &denom)?;
        let _ = denom.f_mul_scalar_(-step_size)?;
        let _ = slot.tensor.f_add_(&denom)?;
    }
    Ok(())
}
