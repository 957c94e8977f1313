//! SGD with momentum, dampening, Nesterov and weight decay (`torch.optim.SGD`).

use kiln_core::optim::{GroupHyper, SgdConfig};
use tch::{TchError, Tensor};

use super::{state_tensor, with_weight_decay, ParamSlot};

pub(crate) fn update(
    slot: &mut ParamSlot,
    grad: &Tensor,
    config: &SgdConfig,
    hyper: &GroupHyper,
) -> Result<(), TchError> {
    let mut d_p = with_weight_decay(grad, &slot.tensor, hyper.weight_decay)?;
    if config.momentum != 0.0 {
        let first = !slot.state.contains_key("momentum_buffer");
        if first && slot.on_device.is_some() && config.dampening != 0.0 {
            // The first step copies the gradient; the others dampen it: a captured
            // step can be only one of them.
            return Err(TchError::Kind(
                "SGD with dampening must take its first step before it is captured".into(),
            ));
        }
        let buf = state_tensor(slot, "momentum_buffer", |_| d_p.f_detach_copy())?;
        if !first {
            // buf = momentum * buf + (1 - dampening) * d_p
            let _ = buf.f_mul_scalar_(config.momentum)?;
            let _ = buf.f_add_(&d_p.f_mul_scalar(1.0 - config.dampening)?)?;
        }
        d_p = if config.nesterov {
            d_p.f_add(&buf.f_mul_scalar(config.momentum)?)?
        } else {
            buf.shallow_clone()
        };
    }
    match &slot.on_device {
        Some(scalars) => {
            let _ = slot.tensor.f_addcmul_(&d_p, &scalars.lr.f_neg()?)?;
        }
        None => {
            let _ = slot.tensor.f_add_(&d_p.f_mul_scalar(-hyper.lr)?)?;
        }
    }
    Ok(())
}
