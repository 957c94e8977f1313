//! `Embedding` as TensorFlow graph ops.

use kiln_core::{model::Layer, Result};
use tensorflow::DataType;

use super::{join, Built, Ctx, Val};

/// Builds `layer` on `x` when it is one of this family's; hands `x` back otherwise.
pub(super) fn build(ctx: &mut Ctx<'_>, layer: &Layer, prefix: &str, x: Val) -> Result<Built> {
    let p = |name: &str| join(prefix, name);
    let y = match layer {
        Layer::Embedding(c) => {
            let x = ctx.nchw(x)?;
            let weight = ctx.param(&p("weight"))?;
            let table = match c.padding_idx {
                // The padding row gets no gradient: w * keep + stop_gradient(w) * (1 - keep).
                Some(row) => {
                    let keep: Vec<f32> = (0..c.num_embeddings)
                        .map(|i| if i == row { 0.0 } else { 1.0 })
                        .collect();
                    let keep = ctx.b.constant(&keep, &[c.num_embeddings as u64, 1])?;
                    let drop: Vec<f32> = (0..c.num_embeddings)
                        .map(|i| if i == row { 1.0 } else { 0.0 })
                        .collect();
                    let drop = ctx.b.constant(&drop, &[c.num_embeddings as u64, 1])?;
                    let live = ctx.b.mul(&weight, &keep)?;
                    let frozen = ctx.b.stop_gradient(&weight)?;
                    let frozen = ctx.b.mul(&frozen, &drop)?;
                    ctx.b.add(&live, &frozen)?
                }
                None => weight,
            };
            let mut y = ctx.b.gather(&table, &x.out, DataType::Int64)?;
            if let Some(scale) = c.scale {
                // Float32 weights: the factor rounded to float32.
                y = ctx.b.mul_scalar(&y, scale as f32)?;
            }
            let mut dims = x.dims.clone();
            dims.push(c.embedding_dim as i64);
            Ok(Val {
                out: y,
                dims,
                nhwc: false,
            })
        }
        _ => return Ok(Built::Pass(x)),
    };
    y.map(Built::Out)
}
