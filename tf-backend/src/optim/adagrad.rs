//! Adagrad (`torch.optim.Adagrad`): learning-rate decay, initial accumulator,
//! coupled weight decay.

use kiln_core::{
    optim::{AdagradConfig, GroupHyper},
    Result,
};
use tensorflow::Operation;

use super::{apply_attrs, ParamUpdate};
use crate::graph::Builder;

/// A group's third coefficient: `lr / (1 + (t - 1) * lr_decay)` at step `t`.
pub(super) fn step_size(config: &AdagradConfig, group: &GroupHyper, t: i32) -> f64 {
    group.lr / (1.0 + (f64::from(t) - 1.0) * config.lr_decay)
}

/// One parameter's update (TensorFlow's `ResourceApplyAdagradV2` is PyTorch's rule).
pub(super) fn update(
    b: &mut Builder,
    u: &ParamUpdate<'_>,
    config: &AdagradConfig,
) -> Result<Vec<Operation>> {
    let [_, _, step_size, _] = &u.group;
    let g = u.coupled(b)?;
    let sum = u.state("sum")?;
    let eps = b.scalar(config.eps as f32)?;
    Ok(vec![b.op_with(
        "ResourceApplyAdagradV2",
        &[u.handle(), &sum, step_size, &eps, &g],
        u.after,
        &|nd| {
            apply_attrs(nd)?;
            nd.set_attr_bool("update_slots", true)?;
            Ok(())
        },
    )?])
}
