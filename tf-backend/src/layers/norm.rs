//! Normalisation as TensorFlow graph ops: `BatchNorm1d`, `BatchNorm2d`
//! (with their running-statistics updates), `LayerNorm`, `GroupNorm`, `RmsNorm`.

use kiln_core::{model::Layer, Error, Result};
use tensorflow::{DataType, Output};

use super::{batched, join, Built, Ctx, Update, Val};

/// Builds `layer` on `x` when it is one of this family's; hands `x` back otherwise.
pub(super) fn build(ctx: &mut Ctx<'_>, layer: &Layer, prefix: &str, x: Val) -> Result<Built> {
    let p = |name: &str| join(prefix, name);
    let y = match layer {
        Layer::BatchNorm1d(c) | Layer::BatchNorm2d(c) => ctx.batch_norm(x, prefix, c),
        Layer::LayerNorm(c) => {
            let x = ctx.nchw(x)?;
            let k = c.normalized_shape.len();
            let rank = x.dims.len() + 1;
            let axes: Vec<i32> = ((rank - k) as i32..rank as i32).collect();
            // Mean(Square(x - mean)) rather than Mean(SquaredDifference(x, mean)):
            // TensorFlow's oneDNN remapper fuses the latter pattern into a
            // layer-norm kernel whose results differ from PyTorch's by ~1e-2.
            let mean = ctx.b.reduce("Mean", &x.out, &axes, true)?;
            let centred = ctx.b.sub(&x.out, &mean)?;
            let var_terms = ctx.b.unary("Square", &centred)?;
            let var = ctx.b.reduce("Mean", &var_terms, &axes, true)?;
            let var_eps = ctx.b.add_scalar(&var, c.eps as f32)?;
            let inv = ctx.b.unary("Rsqrt", &var_eps)?;
            let mut y = ctx.b.mul(&centred, &inv)?;
            if let Some(weight) = ctx.opt_param(&p("weight"))? {
                y = ctx.b.mul(&y, &weight)?;
            }
            if let Some(bias) = ctx.opt_param(&p("bias"))? {
                y = ctx.b.add(&y, &bias)?;
            }
            Ok(Val {
                out: y,
                dims: x.dims,
                nhwc: false,
            })
        }
        Layer::GroupNorm(c) => {
            let x = ctx.nchw(x)?;
            let ch = x.dims[0];
            let per_group: i64 = x.dims.iter().product::<i64>() / c.num_groups as i64;
            let grouped = ctx.b.reshape(
                &x.out,
                &[-1, c.num_groups as i32, per_group as i32],
                DataType::Float,
            )?;
            let mean = ctx.b.reduce("Mean", &grouped, &[2], true)?;
            let var_terms = ctx.b.squared_difference(&grouped, &mean)?;
            let var = ctx.b.reduce("Mean", &var_terms, &[2], true)?;
            let centred = ctx.b.sub(&grouped, &mean)?;
            let var_eps = ctx.b.add_scalar(&var, c.eps as f32)?;
            let inv = ctx.b.unary("Rsqrt", &var_eps)?;
            let normed = ctx.b.mul(&centred, &inv)?;
            let mut y = ctx.b.reshape(&normed, &batched(&x.dims), DataType::Float)?;
            let mut bshape = vec![ch as i32];
            bshape.extend(std::iter::repeat_n(1, x.dims.len() - 1));
            if let Some(weight) = ctx.opt_param(&p("weight"))? {
                let w = ctx.b.reshape(&weight, &bshape, DataType::Float)?;
                y = ctx.b.mul(&y, &w)?;
            }
            if let Some(bias) = ctx.opt_param(&p("bias"))? {
                let b = ctx.b.reshape(&bias, &bshape, DataType::Float)?;
                y = ctx.b.add(&y, &b)?;
            }
            Ok(Val {
                out: y,
                dims: x.dims,
                nhwc: false,
            })
        }
        Layer::RmsNorm(c) => {
            let x = ctx.nchw(x)?;
            let mut weight = ctx.param(&p("weight"))?;
            if c.weight_offset != 0.0 {
                weight = ctx.b.add_scalar(&weight, c.weight_offset as f32)?;
            }
            let out = ctx.rms_norm(&x.out, Some(&weight), c.eps)?;
            Ok(Val { out, ..x })
        }
        _ => return Ok(Built::Pass(x)),
    };
    y.map(Built::Out)
}

impl Ctx<'_> {
    fn batch_norm(
        &mut self,
        x: Val,
        prefix: &str,
        c: &kiln_core::model::BatchNormConfig,
    ) -> Result<Val> {
        let p = |name: &str| join(prefix, name);
        // Channels last: [N, C] as is, [N, C, L] -> [N, L, C], 4-d as NHWC.
        let rank = x.dims.len() + 1;
        let (x, channels_last) = match rank {
            2 => (x, None),
            3 => {
                let t = self.b.transpose(&x.out, &[0, 2, 1])?;
                (
                    Val {
                        out: t,
                        dims: x.dims.clone(),
                        nhwc: false,
                    },
                    Some(vec![0, 2, 1]),
                )
            }
            _ => (self.nhwc(x)?, None),
        };
        let axes: Vec<i32> = (0..rank as i32 - 1).collect();
        let tracks = c.track_running_stats;
        let use_batch = self.train || !tracks;
        let (mean, var) = if use_batch {
            let mean = self.b.reduce("Mean", &x.out, &axes, false)?;
            let terms = self.b.squared_difference(&x.out, &mean)?;
            let var = self.b.reduce("Mean", &terms, &axes, false)?;
            if self.train && tracks {
                self.running_stat_updates(prefix, c, &x.out, &mean, &var)?;
            }
            (mean, var)
        } else {
            (
                self.param(&p("running_mean"))?,
                self.param(&p("running_var"))?,
            )
        };
        let centred = self.b.sub(&x.out, &mean)?;
        let var_eps = self.b.add_scalar(&var, c.eps as f32)?;
        let inv = self.b.unary("Rsqrt", &var_eps)?;
        let mut y = self.b.mul(&centred, &inv)?;
        if let Some(weight) = self.opt_param(&p("weight"))? {
            y = self.b.mul(&y, &weight)?;
        }
        if let Some(bias) = self.opt_param(&p("bias"))? {
            y = self.b.add(&y, &bias)?;
        }
        if let Some(perm) = channels_last {
            y = self.b.transpose(&y, &perm)?;
        }
        Ok(Val {
            out: y,
            dims: x.dims,
            nhwc: x.nhwc,
        })
    }

    /// `running = (1 - m) running + m batch` (unbiased variance) and
    /// `num_batches_tracked += 1`, as assignments run with the training step.
    fn running_stat_updates(
        &mut self,
        prefix: &str,
        c: &kiln_core::model::BatchNormConfig,
        x: &Output,
        mean: &Output,
        var: &Output,
    ) -> Result<()> {
        let p = |name: &str| join(prefix, name);
        let m = c.momentum as f32;
        let mean = self.b.stop_gradient(mean)?;
        let var = self.b.stop_gradient(var)?;
        // n / (n - 1), n = elements per channel (the batch size is only known at run time).
        let size = self.b.op("Size", &[x], &|nd| {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_type("out_type", DataType::Int32)?;
            Ok(())
        })?;
        let size = self.b.cast(&size, DataType::Int32, DataType::Float)?;
        let n = self.b.mul_scalar(&size, 1.0 / c.num_features as f32)?;
        let n_minus_1 = self.b.add_scalar(&n, -1.0)?;
        let correction = self.b.div(&n, &n_minus_1)?;
        let unbiased = self.b.mul(&var, &correction)?;
        for (name, batch) in [("running_mean", mean), ("running_var", unbiased)] {
            let (handle, _) = self.handles.get(&p(name)).cloned().ok_or_else(|| {
                Error::backend(
                    "tensorflow",
                    "building batch norm",
                    format!("no variable `{}`", p(name)),
                )
            })?;
            let old = self.b.read(&handle, DataType::Float)?;
            let keep = self.b.mul_scalar(&old, 1.0 - m)?;
            let new = self.b.mul_scalar(&batch, m)?;
            let updated = self.b.add(&keep, &new)?;
            self.updates.push(Update {
                handle,
                value: updated,
                dtype: DataType::Float,
                add: false,
            });
        }
        if let Some((handle, _)) = self.handles.get(&p("num_batches_tracked")).cloned() {
            let one = self.b.constant(&[1i64], &[])?;
            self.updates.push(Update {
                handle,
                value: one,
                dtype: DataType::Int64,
                add: true,
            });
        }
        Ok(())
    }
}
