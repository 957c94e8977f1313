//! Adam and AdamW (`torch.optim.Adam`, `torch.optim.AdamW`), with AMSGrad.

use kiln_core::{optim::GroupHyper, Result};
use tensorflow::{DataType, Operation};

use super::ParamUpdate;
use crate::graph::Builder;

/// How Adam and AdamW differ, and what they share.
#[derive(Debug, Clone, Copy)]
pub(super) struct AdamRule {
    pub(super) betas: (f64, f64),
    pub(super) eps: f64,
    pub(super) amsgrad: bool,
    /// Adam's L2 penalty added to the gradient (`true`), or AdamW's decoupled
    /// decay of the parameter (`false`).
    pub(super) coupled: bool,
}

impl AdamRule {
    /// A group's two coefficients at step `t`: the step size
    /// `lr / (1 - beta1^t)` and AdamW's decay factor `1 - lr * weight_decay`.
    pub(super) fn group_coefficients(&self, group: &GroupHyper, t: i32) -> [f64; 2] {
        let bc1 = 1.0 - self.betas.0.powi(t);
        [group.lr / bc1, 1.0 - group.lr * group.weight_decay]
    }

    /// The step's coefficients at step `t`: `beta1^t`, `beta2^t`,
    /// `eps * sqrt(1 - beta2^t)` and `sqrt(1 - beta2^t)`.
    pub(super) fn global_coefficients(&self, t: i32) -> [f32; 4] {
        let bc2 = 1.0 - self.betas.1.powi(t);
        [
            self.betas.0.powi(t) as f32,
            self.betas.1.powi(t) as f32,
            (self.eps * bc2.sqrt()) as f32,
            bc2.sqrt() as f32,
        ]
    }

    /// One parameter's update. Without AMSGrad this is TensorFlow's
    /// `ResourceApplyAdam` fed `epsilon * sqrt(1 - beta2^t)`, which makes its
    /// update PyTorch's `lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + epsilon)`.
    pub(super) fn update(&self, b: &mut Builder, u: &ParamUpdate<'_>) -> Result<Vec<Operation>> {
        let [lr, _, step_size, decay_factor] = &u.group;
        let [beta1_power, beta2_power, eps_hat, bc2_sqrt] = &u.global;
        let p = u.handle();
        let mut ops = Vec::new();
        let mut deps: Vec<Operation> = u.after.iter().map(|o| (*o).clone()).collect();
        let g = if self.coupled {
            u.coupled(b)?
        } else {
            u.grad.clone()
        };
        // AdamW: param *= 1 - lr * weight_decay, before the Adam update.
        let base = if self.coupled {
            u.param.clone()
        } else {
            let decayed = b.mul(&u.param, decay_factor)?;
            if !self.amsgrad {
                let dep_refs: Vec<&Operation> = deps.iter().collect();
                let assign = b.assign(p, &decayed, DataType::Float, &dep_refs)?;
                deps.push(assign.clone());
                ops.push(assign);
            }
            decayed
        };
        let dep_refs: Vec<&Operation> = deps.iter().collect();
        let m = u.state("exp_avg")?;
        let v = u.state("exp_avg_sq")?;
        if !self.amsgrad {
            let b1 = b.scalar(self.betas.0 as f32)?;
            let b2 = b.scalar(self.betas.1 as f32)?;
            ops.push(b.op_with(
                "ResourceApplyAdam",
                &[
                    p,
                    &m,
                    &v,
                    beta1_power,
                    beta2_power,
                    lr,
                    &b1,
                    &b2,
                    eps_hat,
                    &g,
                ],
                &dep_refs,
                &|nd| {
                    nd.set_attr_type("T", DataType::Float)?;
                    nd.set_attr_bool("use_locking", false)?;
                    nd.set_attr_bool("use_nesterov", false)?;
                    Ok(())
                },
            )?);
            return Ok(ops);
        }
        // AMSGrad, composed: TensorFlow has no apply op for it.
        let (beta1, beta2) = self.betas;
        let m_old = b.read_after(&m, DataType::Float, &dep_refs)?;
        let diff = b.sub(&g, &m_old)?;
        let step = b.mul_scalar(&diff, (1.0 - beta1) as f32)?;
        let m_new = b.add(&m_old, &step)?;
        let v_old = b.read_after(&v, DataType::Float, &dep_refs)?;
        let kept = b.mul_scalar(&v_old, beta2 as f32)?;
        let g2 = b.mul_scalar(&g, (1.0 - beta2) as f32)?;
        let g2 = b.mul(&g2, &g)?;
        let v_new = b.add(&kept, &g2)?;
        let vmax_h = u.state("max_exp_avg_sq")?;
        let vmax = b.read_after(&vmax_h, DataType::Float, &dep_refs)?;
        let vmax_new = b.maximum(&vmax, &v_new)?;
        let denom = b.unary("Sqrt", &vmax_new)?;
        let denom = b.div(&denom, bc2_sqrt)?;
        let denom = b.add_scalar(&denom, self.eps as f32)?;
        let ratio = b.div(&m_new, &denom)?;
        let neg = b.mul_scalar(step_size, -1.0)?;
        let delta = b.mul(&ratio, &neg)?;
        let p_new = b.add(&base, &delta)?;
        for (h, value) in [
            (&m, &m_new),
            (&v, &v_new),
            (&vmax_h, &vmax_new),
            (p, &p_new),
        ] {
            ops.push(b.assign(h, value, DataType::Float, &dep_refs)?);
        }
        Ok(ops)
    }
}
