//! `Linear` as TensorFlow graph ops.

use kiln_core::{model::Layer, Result};
use tensorflow::DataType;

use super::{batched, join, Built, Ctx, Val};

/// Builds `layer` on `x` when it is one of this family's; hands `x` back otherwise.
pub(super) fn build(ctx: &mut Ctx<'_>, layer: &Layer, prefix: &str, x: Val) -> Result<Built> {
    let p = |name: &str| join(prefix, name);
    let y = match layer {
        Layer::Linear(c) => ctx.linear(x, &p("weight"), &p("bias"), c.out_features as i64),
        _ => return Ok(Built::Pass(x)),
    };
    y.map(Built::Out)
}

impl Ctx<'_> {
    /// `x @ weight^T + bias` on the last dimension.
    pub(super) fn linear(
        &mut self,
        x: Val,
        weight: &str,
        bias: &str,
        out_features: i64,
    ) -> Result<Val> {
        let x = self.nchw(x)?;
        let w = self.param(weight)?;
        let in_features = x.dims.last().copied().unwrap_or(1);
        let flat = if x.dims.len() == 1 {
            x.out.clone()
        } else {
            self.b
                .reshape(&x.out, &[-1, in_features as i32], DataType::Float)?
        };
        let mut y = self.b.matmul(&flat, &w, false, true)?;
        if let Some(bias) = self.opt_param(bias)? {
            y = self.b.bias_add(&y, &bias)?;
        }
        let mut dims = x.dims.clone();
        if let Some(last) = dims.last_mut() {
            *last = out_features;
        }
        if x.dims.len() > 1 {
            y = self.b.reshape(&y, &batched(&dims), DataType::Float)?;
        }
        Ok(Val {
            out: y,
            dims,
            nhwc: false,
        })
    }
}
