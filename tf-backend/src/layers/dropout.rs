//! `Dropout` as TensorFlow graph ops (also the attention weights' dropout).

use kiln_core::{model::Layer, Result};
use tensorflow::DataType;

use super::{Built, Ctx, Val};

/// Builds `layer` on `x` when it is one of this family's; hands `x` back otherwise.
pub(super) fn build(ctx: &mut Ctx<'_>, layer: &Layer, _prefix: &str, x: Val) -> Result<Built> {
    let y = match layer {
        Layer::Dropout { p: prob } => ctx.dropout(x, *prob),
        _ => return Ok(Built::Pass(x)),
    };
    y.map(Built::Out)
}

impl Ctx<'_> {
    pub(super) fn dropout(&mut self, x: Val, p: f64) -> Result<Val> {
        if !self.train || p == 0.0 {
            return Ok(x);
        }
        let seed = self.seed()?;
        self.random_ops += 1;
        let offset = self.b.constant(&[0i64, self.random_ops], &[2])?;
        let seed = self.b.op("AddV2", &[&seed, &offset], &|nd| {
            nd.set_attr_type("T", DataType::Int64)?;
            Ok(())
        })?;
        let shape = self.b.shape_of(&x.out, DataType::Float)?;
        let u = self.b.stateless_uniform(&shape, &seed)?;
        let p_t = self.b.scalar(p as f32)?;
        let keep = self.b.compare("GreaterEqual", &u, &p_t)?;
        let keep = self.b.cast(&keep, DataType::Bool, DataType::Float)?;
        let keep = self.b.mul_scalar(&keep, (1.0 / (1.0 - p)) as f32)?;
        let out = self.b.mul(&x.out, &keep)?;
        Ok(Val { out, ..x })
    }
}
