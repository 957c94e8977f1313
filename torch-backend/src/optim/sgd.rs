//! SGD with momentum, dampening, Nesterov and weight decay (`torch.optim.SGD`).

use kiln_core::{GroupHyper, SgdConfig};
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
    let _ = slot.tensor.f_add_(&d_p.f_mul_scalar(-hyper.lr)?)?;
    Ok(())
}
