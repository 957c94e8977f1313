//! Adagrad with learning-rate decay (`torch.optim.Adagrad`).

use kiln_core::optim::{AdagradConfig, GroupHyper};
use tch::{TchError, Tensor};

use super::{state_tensor, with_weight_decay, ParamSlot};

pub(crate) fn update(
    slot: &mut ParamSlot,
    grad: &Tensor,
    config: &AdagradConfig,
    hyper: &GroupHyper,
) -> Result<(), TchError> {
    let grad = with_weight_decay(grad, &slot.tensor, hyper.weight_decay)?;
    let clr = hyper.lr / (1.0 + (slot.step as f64 - 1.0) * config.lr_decay);
    let initial = config.initial_accumulator_value;
    let sum = state_tensor(slot, "sum", |p| p.f_full_like(initial))?;
    let _ = sum.f_add_(&grad.f_mul(&grad)?)?;
    let std = sum.f_sqrt()?.f_add_scalar(config.eps)?;
    let _ = slot.tensor.f_add_(&grad.f_div(&std)?.f_mul_scalar(-clr)?)?;
    Ok(())
}
