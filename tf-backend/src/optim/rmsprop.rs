//! RMSprop (`torch.optim.RMSprop`): centered, momentum, coupled weight decay.

use kiln_core::{optim::RmsPropConfig, Result};
use tensorflow::{DataType, Operation};

use super::{apply_attrs, ParamUpdate};
use crate::graph::Builder;

/// One parameter's update.
pub(super) fn update(
    b: &mut Builder,
    u: &ParamUpdate<'_>,
    config: &RmsPropConfig,
) -> Result<Vec<Operation>> {
    let [lr, ..] = &u.group;
    let mut ops = Vec::new();
    let g = u.coupled(b)?;
    let sa_h = u.state("square_avg")?;
    let sa = b.read_after(&sa_h, DataType::Float, u.after)?;
    let kept = b.mul_scalar(&sa, config.alpha as f32)?;
    let g2 = b.mul_scalar(&g, (1.0 - config.alpha) as f32)?;
    let g2 = b.mul(&g2, &g)?;
    let sa_new = b.add(&kept, &g2)?;
    ops.push(b.assign(&sa_h, &sa_new, DataType::Float, u.after)?);
    let avg = if config.centered {
        let ga_h = u.state("grad_avg")?;
        let ga = b.read_after(&ga_h, DataType::Float, u.after)?;
        let diff = b.sub(&g, &ga)?;
        let step = b.mul_scalar(&diff, (1.0 - config.alpha) as f32)?;
        let ga_new = b.add(&ga, &step)?;
        ops.push(b.assign(&ga_h, &ga_new, DataType::Float, u.after)?);
        let neg = b.mul_scalar(&ga_new, -1.0)?;
        let sq = b.mul(&neg, &ga_new)?;
        let var = b.add(&sa_new, &sq)?;
        b.unary("Sqrt", &var)?
    } else {
        b.unary("Sqrt", &sa_new)?
    };
    let avg = b.add_scalar(&avg, config.eps as f32)?;
    let ratio = b.div(&g, &avg)?;
    let update = if config.momentum > 0.0 {
        let buf_h = u.state("momentum_buffer")?;
        let buf = b.read_after(&buf_h, DataType::Float, u.after)?;
        let kept = b.mul_scalar(&buf, config.momentum as f32)?;
        let buf_new = b.add(&kept, &ratio)?;
        ops.push(b.assign(&buf_h, &buf_new, DataType::Float, u.after)?);
        buf_new
    } else {
        ratio
    };
    ops.push(b.op_with(
        "ResourceApplyGradientDescent",
        &[u.handle(), lr, &update],
        u.after,
        &apply_attrs,
    )?);
    Ok(ops)
}
