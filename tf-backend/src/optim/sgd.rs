//! SGD (`torch.optim.SGD`): momentum, dampening, Nesterov, coupled weight decay.

use kiln_core::{optim::SgdConfig, Result};
use tensorflow::Operation;

use super::{apply_attrs, ParamUpdate};
use crate::graph::Builder;

/// The step's coefficients: `buf = m_eff * buf + d_eff * d_p`, where the first
/// step copies `d_p` (`m_eff = 0`, `d_eff = 1`).
pub(super) fn coefficients(config: &SgdConfig, step: u64) -> [f32; 4] {
    let (m_eff, d_eff) = if step == 0 {
        (0.0, 1.0)
    } else {
        (config.momentum, 1.0 - config.dampening)
    };
    [m_eff as f32, d_eff as f32, 0.0, 0.0]
}

/// One parameter's update.
pub(super) fn update(
    b: &mut Builder,
    u: &ParamUpdate<'_>,
    config: &SgdConfig,
) -> Result<Vec<Operation>> {
    let [lr, ..] = &u.group;
    let [m_eff, d_eff, ..] = &u.global;
    let p = u.handle();
    let d_p = u.coupled(b)?;
    let mut ops = Vec::new();
    if config.momentum == 0.0 {
        ops.push(b.op_with(
            "ResourceApplyGradientDescent",
            &[p, lr, &d_p],
            u.after,
            &apply_attrs,
        )?);
    } else if config.dampening == 0.0 {
        // TensorFlow's momentum update is PyTorch's when dampening is 0
        // (its first step also leaves buf = d_p).
        let buf = u.state("momentum_buffer")?;
        let m = b.scalar(config.momentum as f32)?;
        let nesterov = config.nesterov;
        ops.push(b.op_with(
            "ResourceApplyMomentum",
            &[p, &buf, lr, &d_p, &m],
            u.after,
            &|nd| {
                apply_attrs(nd)?;
                nd.set_attr_bool("use_nesterov", nesterov)?;
                Ok(())
            },
        )?);
    } else {
        let buf_h = u.state("momentum_buffer")?;
        let buf = b.read_after(&buf_h, tensorflow::DataType::Float, u.after)?;
        let kept = b.mul(&buf, m_eff)?;
        let fresh = b.mul(&d_p, d_eff)?;
        let buf_new = b.add(&kept, &fresh)?;
        ops.push(b.assign(&buf_h, &buf_new, tensorflow::DataType::Float, u.after)?);
        let update = if config.nesterov {
            let m = b.mul_scalar(&buf_new, config.momentum as f32)?;
            b.add(&d_p, &m)?
        } else {
            buf_new
        };
        ops.push(b.op_with(
            "ResourceApplyGradientDescent",
            &[p, lr, &update],
            u.after,
            &apply_attrs,
        )?);
    }
    Ok(ops)
}
