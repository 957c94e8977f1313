//! RMSprop, centred or not, with momentum (`torch.optim.RMSprop`).

use kiln_core::optim::{GroupHyper, RmsPropConfig};
use tch::{TchError, Tensor};

use super::{state_tensor, with_weight_decay, ParamSlot};

pub(crate) fn update(
    slot: &mut ParamSlot,
    grad: &Tensor,
    config: &RmsPropConfig,
    hyper: &GroupHyper,
) -> Result<(), TchError> {
    let grad = with_weight_decay(grad, &slot.tensor, hyper.weight_decay)?;
    let zeros = |p: &Tensor| p.f_zeros_like();
    let alpha = config.alpha;
    // square_avg = alpha * square_avg + (1 - alpha) * grad * grad
    let square_avg = state_tensor(slot, "square_avg", zeros)?;
    let _ = square_avg.f_mul_scalar_(alpha)?;
    let _ = square_avg.f_add_(&grad.f_mul_scalar(1.0 - alpha)?.f_mul(&grad)?)?;
    let square_avg = square_avg.shallow_clone();

    let avg = if config.centered {
        let grad_avg = state_tensor(slot, "grad_avg", zeros)?;
        let _ = grad_avg.f_lerp_(&grad, 1.0 - alpha)?;
        // sqrt(square_avg - grad_avg^2)
        square_avg
            .f_add(&grad_avg.f_mul_scalar(-1.0)?.f_mul(grad_avg)?)?
            .f_sqrt()?
    } else {
        square_avg.f_sqrt()?
    }
    .f_add_scalar(config.eps)?;

    if config.momentum > 0.0 {
        let buf = state_tensor(slot, "momentum_buffer", zeros)?;
        let _ = buf.f_mul_scalar_(config.momentum)?;
        let _ = buf.f_add_(&grad.f_div(&avg)?)?;
        let step = buf.f_mul_scalar(-hyper.lr)?;
        let _ = slot.tensor.f_add_(&step)?;
    } else {
        let _ = slot
            .tensor
            .f_add_(&grad.f_div(&avg)?.f_mul_scalar(-hyper.lr)?)?;
    }
    Ok(())
}
