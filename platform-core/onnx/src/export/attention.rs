//! Multi-head self-attention with `nn.MultiheadAttention`'s parameters
//! (`in_proj_weight`, `in_proj_bias`, `out_proj.*`): the packed projection
//! (`MatMul` + `Add`), `Split` into q, k, v, heads by `Reshape` + `Transpose`,
//! `softmax(q k^T / sqrt(head_dim) [+ causal mask]) v`, and the output
//! projection. The causal mask is an additive constant: 0 on and below the
//! diagonal, -inf above.

use kiln_core::model::{AttentionConfig, Layer};

use super::graph::attr;
use super::Result;
use super::{Emitter, Value};

/// The additive causal mask of `seq` positions, row-major: 0 where key `j`
/// is at or before query `i`, -inf after.
pub(crate) fn causal_mask(seq: usize) -> Vec<f64> {
    (0..seq)
        .flat_map(|i| (0..seq).map(move |j| if j <= i { 0.0 } else { f64::NEG_INFINITY }))
        .collect()
}

impl Emitter<'_> {
    /// `x @ weight^T (+ bias)` on the last axis.
    pub(crate) fn project(
        &mut self,
        path: &str,
        layer: &Layer,
        x: &str,
        weight: &str,
        bias: Option<&str>,
    ) -> Result<String> {
        let w = self.param(path, layer, weight)?;
        let wt = self
            .g
            .op(path, "Transpose", &[&w], vec![attr::ints("perm", &[1, 0])]);
        let y = self.g.op(path, "MatMul", &[x, &wt], vec![]);
        match bias {
            Some(name) => {
                let b = self.param(path, layer, name)?;
                Ok(self.g.op(path, "Add", &[&y, &b], vec![]))
            }
            None => Ok(y),
        }
    }

    pub(crate) fn attention(
        &mut self,
        path: &str,
        layer: &Layer,
        c: &AttentionConfig,
        x: &Value,
    ) -> Result<String> {
        let (embed, heads) = (c.embed_dim, c.num_heads);
        let head_dim = embed / heads;
        let seq = x.shape[1];
        let qkv = self.project(
            path,
            layer,
            &x.name,
            "in_proj_weight",
            c.bias.then_some("in_proj_bias"),
        )?;
        let e = embed as i64;
        let split = self.g.ints(path, "split", &[e, e, e])?;
        let parts = self.g.op_n(
            path,
            "Split",
            &[&qkv, &split],
            vec![attr::int("axis", 2)],
            3,
        );
        // [batch, seq, embed] -> [batch, seq, heads, head_dim]
        let by_head = self
            .g
            .ints(path, "heads_shape", &[0, 0, heads as i64, head_dim as i64])?;
        let mut split_heads = |name: &str, perm: &[i64]| {
            let r = self.g.op(path, "Reshape", &[name, &by_head], vec![]);
            self.g
                .op(path, "Transpose", &[&r], vec![attr::ints("perm", perm)])
        };
        let q = split_heads(&parts[0], &[0, 2, 1, 3]); // [b, h, s, d]
        let kt = split_heads(&parts[1], &[0, 2, 3, 1]); // [b, h, d, s]
        let v = split_heads(&parts[2], &[0, 2, 1, 3]); // [b, h, s, d]
        let scores = self.g.op(path, "MatMul", &[&q, &kt], vec![]);
        let scale = self
            .g
            .scalar(path, "scale", 1.0 / (head_dim as f64).sqrt())?;
        let mut scores = self.g.op(path, "Mul", &[&scores, &scale], vec![]);
        if c.causal {
            let mask = self
                .g
                .floats(path, "causal_mask", &causal_mask(seq), &[seq, seq])?;
            scores = self.g.op(path, "Add", &[&scores, &mask], vec![]);
        }
        let weights = self
            .g
            .op(path, "Softmax", &[&scores], vec![attr::int("axis", -1)]);
        let attended = self.g.op(path, "MatMul", &[&weights, &v], vec![]);
        let merged = self.g.op(
            path,
            "Transpose",
            &[&attended],
            vec![attr::ints("perm", &[0, 2, 1, 3])],
        );
        let flat = self.g.ints(path, "merged_shape", &[0, 0, e])?;
        let merged = self.g.op(path, "Reshape", &[&merged, &flat], vec![]);
        self.project(
            path,
            layer,
            &merged,
            "out_proj.weight",
            c.bias.then_some("out_proj.bias"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::causal_mask;

    #[test]
    fn the_causal_mask_hides_later_keys() {
        let inf = f64::NEG_INFINITY;
        assert_eq!(
            causal_mask(3),
            [0.0, inf, inf, 0.0, 0.0, inf, 0.0, 0.0, 0.0]
        );
    }
}
