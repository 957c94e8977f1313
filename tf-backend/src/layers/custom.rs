//! `Custom` layers as TensorFlow graph ops: the registered function adds them.

use kiln_core::{model::Layer, Error, Result};

use super::{dims_text, join, Built, Ctx, Val};

/// Builds `layer` on `x` when it is one of this family's; hands `x` back otherwise.
pub(super) fn build(ctx: &mut Ctx<'_>, layer: &Layer, prefix: &str, x: Val) -> Result<Built> {
    let y = match layer {
        Layer::Custom(c) => ctx.custom(x, prefix, c),
        _ => return Ok(Built::Pass(x)),
    };
    y.map(Built::Out)
}

impl Ctx<'_> {
    /// A [`Layer::Custom`]: the registered function adds its ops on the
    /// logical (`NCHW`) input and the layer's parameters.
    fn custom(&mut self, x: Val, prefix: &str, c: &kiln_core::model::CustomConfig) -> Result<Val> {
        let f = self.custom_ops.get(&c.op)?;
        let x = self.nchw(x)?;
        let params = c
            .params
            .iter()
            .map(|p| self.param(&join(prefix, &p.name)))
            .collect::<Result<Vec<_>>>()?;
        let name = self.b.name(&c.op.replace("::", "_"));
        let y = f(&mut self.b.graph, &name, x.out.clone(), &params, c)?;
        // The output must keep the input's shape where the graph knows it.
        let path = if prefix.is_empty() { "Custom" } else { prefix };
        let mismatch = |got: String| Error::ShapeMismatch {
            context: format!("{path} (Custom {}): op output", c.op),
            expected: dims_text(&x.dims),
            actual: got,
        };
        let shape = self
            .b
            .graph
            .tensor_shape(y.clone())
            .map_err(|s| crate::error::tf_error(&format!("shape of {}", c.op), s))?;
        if let Some(rank) = shape.dims() {
            let known: Vec<Option<i64>> = (0..rank).map(|i| shape[i]).collect();
            let fits = rank == x.dims.len() + 1
                && known[1..]
                    .iter()
                    .zip(&x.dims)
                    .all(|(got, want)| got.is_none_or(|g| g == *want));
            if !fits {
                let text: Vec<String> = known
                    .iter()
                    .map(|d| d.map_or_else(|| "?".to_owned(), |d| d.to_string()))
                    .collect();
                return Err(mismatch(format!("[{}]", text.join(", "))));
            }
        }
        Ok(Val {
            out: y,
            dims: x.dims,
            nhwc: false,
        })
    }
}
