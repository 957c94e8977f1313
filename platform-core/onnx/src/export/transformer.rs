//! The transformer layers in standard operators: `RmsNorm` as `x /
//! sqrt(ReduceMean(x²) + eps) * weight`; `SelfAttention` with its four
//! projections, per-head RMSNorm (QK-norm), rotary embeddings from constant
//! cosine and sine tables (`Slice`, `Neg`, `Concat`), key/value heads repeated
//! for grouped queries (`Unsqueeze`, `Expand`, `Reshape`) and the causal mask
//! as an additive constant; `GatedMlp`; `PositionEmbedding` (a `Slice` of the
//! learned table, or the sinusoidal table as a constant) and `TiedLinear`
//! (`MatMul` with the shared initializer, transposed).

use kiln_core::model::{Layer, PositionEncoding, SelfAttentionConfig};

use super::graph::attr;
use super::Result;
use super::{wrong_family, Emitter, Error, Value};

impl Emitter<'_> {
    pub(crate) fn transformer(&mut self, path: &str, layer: &Layer, x: &Value) -> Result<String> {
        match layer {
            Layer::RmsNorm(c) => {
                let weight = self.param(path, layer, "weight")?;
                let weight = if c.weight_offset == 0.0 {
                    weight
                } else {
                    let offset = self.g.scalar(path, "weight_offset", c.weight_offset)?;
                    self.g.op(path, "Add", &[&weight, &offset], vec![])
                };
                self.rms(path, &x.name, &weight, c.eps)
            }
            Layer::SelfAttention(c) => self.self_attention(path, layer, c, x),
            Layer::GatedMlp(c) => self.gated_mlp(path, layer, &x.name, "", c.activation, c.bias),
            Layer::PositionEmbedding(c) => {
                let seq = x.shape[1];
                let rows = match c.encoding {
                    PositionEncoding::Learned => {
                        let table = self.param(path, layer, "weight")?;
                        let starts = self.g.ints(path, "starts", &[0])?;
                        let ends = self.g.ints(path, "ends", &[seq as i64])?;
                        let axes = self.g.ints(path, "axes", &[0])?;
                        self.g
                            .op(path, "Slice", &[&table, &starts, &ends, &axes], vec![])
                    }
                    PositionEncoding::Sinusoidal => {
                        let table: Vec<f64> = c.sinusoidal_table()[..seq * c.dim]
                            .iter()
                            .map(|&v| f64::from(v))
                            .collect();
                        self.g.floats(path, "positions", &table, &[seq, c.dim])?
                    }
                };
                Ok(self.g.op(path, "Add", &[&x.name, &rows], vec![]))
            }
            Layer::TokenTypeEmbedding(_) => {
                let table = self.param(path, layer, "weight")?;
                let zero =
                    self.g
                        .constant(path, "segment", &kiln_core::HostTensor::scalar(0i64))?;
                let row = self
                    .g
                    .op(path, "Gather", &[&table, &zero], vec![attr::int("axis", 0)]);
                Ok(self.g.op(path, "Add", &[&x.name, &row], vec![]))
            }
            Layer::ClassToken(c) => {
                let token = self.param(path, layer, "weight")?;
                // [batch, 1, dim]: the token expanded to the input's batch.
                let shape = self.g.op(path, "Shape", &[&x.name], vec![]);
                let starts = self.g.ints(path, "starts", &[0])?;
                let ends = self.g.ints(path, "ends", &[1])?;
                let batch = self.g.op(path, "Slice", &[&shape, &starts, &ends], vec![]);
                let rest = self.g.ints(path, "token_shape", &[1, c.dim as i64])?;
                let target =
                    self.g
                        .op(path, "Concat", &[&batch, &rest], vec![attr::int("axis", 0)]);
                let tokens = self.g.op(path, "Expand", &[&token, &target], vec![]);
                Ok(self.g.op(
                    path,
                    "Concat",
                    &[&tokens, &x.name],
                    vec![attr::int("axis", 1)],
                ))
            }
            Layer::TiedLinear(c) => {
                let tensor = self.state.get(&c.weight).ok_or_else(|| Error::Weight {
                    path: super::shown(path),
                    layer: super::kind_of(layer),
                    key: c.weight.clone(),
                    reason: "(the tied weight) is missing".to_owned(),
                })?;
                let w = self.g.weight(&c.weight, tensor)?;
                let wt = self
                    .g
                    .op(path, "Transpose", &[&w], vec![attr::ints("perm", &[1, 0])]);
                Ok(self.g.op(path, "MatMul", &[&x.name, &wt], vec![]))
            }
            _ => Err(wrong_family(path, layer)),
        }
    }

    /// `x / sqrt(mean(x², last axis) + eps) * weight`.
    fn rms(&mut self, path: &str, x: &str, weight: &str, eps: f64) -> Result<String> {
        let axes = self.g.ints(path, "axes", &[-1])?;
        let squared = self.g.op(path, "Mul", &[x, x], vec![]);
        let mean = self.g.op(
            path,
            "ReduceMean",
            &[&squared, &axes],
            vec![attr::int("keepdims", 1)],
        );
        let eps = self.g.scalar(path, "eps", eps)?;
        let shifted = self.g.op(path, "Add", &[&mean, &eps], vec![]);
        let root = self.g.op(path, "Sqrt", &[&shifted], vec![]);
        let normed = self.g.op(path, "Div", &[x, &root], vec![]);
        Ok(self.g.op(path, "Mul", &[&normed, weight], vec![]))
    }

    /// `x[..., start:end]` on the last axis of a rank-4 value.
    fn last_axis(&mut self, path: &str, x: &str, start: usize, end: usize) -> Result<String> {
        let starts = self.g.ints(path, "starts", &[start as i64])?;
        let ends = self.g.ints(path, "ends", &[end as i64])?;
        let axes = self.g.ints(path, "axes", &[3])?;
        Ok(self
            .g
            .op(path, "Slice", &[x, &starts, &ends, &axes], vec![]))
    }

    /// Rotates the first `rot` of `d` features of `x` (`[b, heads, s, d]`).
    fn rotate(
        &mut self,
        path: &str,
        x: &str,
        cos: &str,
        sin: &str,
        rot: usize,
        d: usize,
    ) -> Result<String> {
        let half = rot / 2;
        let r = if rot == d {
            x.to_owned()
        } else {
            self.last_axis(path, x, 0, rot)?
        };
        let first = self.last_axis(path, &r, 0, half)?;
        let second = self.last_axis(path, &r, half, rot)?;
        let neg = self.g.op(path, "Neg", &[&second], vec![]);
        let rotated = self
            .g
            .op(path, "Concat", &[&neg, &first], vec![attr::int("axis", 3)]);
        let a = self.g.op(path, "Mul", &[&r, cos], vec![]);
        let b = self.g.op(path, "Mul", &[&rotated, sin], vec![]);
        let out = self.g.op(path, "Add", &[&a, &b], vec![]);
        if rot == d {
            return Ok(out);
        }
        let pass = self.last_axis(path, x, rot, d)?;
        Ok(self
            .g
            .op(path, "Concat", &[&out, &pass], vec![attr::int("axis", 3)]))
    }

    fn self_attention(
        &mut self,
        path: &str,
        layer: &Layer,
        c: &SelfAttentionConfig,
        x: &Value,
    ) -> Result<String> {
        let seq = x.shape[1];
        let (h, kv, d) = (c.num_heads, c.kv_heads(), c.head_dim());
        let bias = |name: &'static str| c.qkv_bias.then_some(name);
        let mut q = self.project(path, layer, &x.name, "q_proj.weight", bias("q_proj.bias"))?;
        let mut k = self.project(path, layer, &x.name, "k_proj.weight", bias("k_proj.bias"))?;
        let norms = match c.qk_norm_eps {
            Some(eps) => {
                let mut qw = self.param(path, layer, "q_norm.weight")?;
                let mut kw = self.param(path, layer, "k_norm.weight")?;
                if c.qk_norm_offset != 0.0 {
                    let offset = self.g.scalar(path, "qk_norm_offset", c.qk_norm_offset)?;
                    qw = self.g.op(path, "Add", &[&qw, &offset], vec![]);
                    kw = self.g.op(path, "Add", &[&kw, &offset], vec![]);
                }
                Some((qw, kw, eps))
            }
            None => None,
        };
        // OLMoE's norms take each whole projection, before the heads split.
        if let (Some((qw, kw, eps)), true) = (&norms, c.qk_norm_across_heads) {
            q = self.rms(path, &q, qw, *eps)?;
            k = self.rms(path, &k, kw, *eps)?;
        }
        let v = self.project(path, layer, &x.name, "v_proj.weight", bias("v_proj.bias"))?;
        let q_heads = self.g.ints(path, "q_heads", &[0, 0, h as i64, d as i64])?;
        let kv_heads = self
            .g
            .ints(path, "kv_heads", &[0, 0, kv as i64, d as i64])?;
        let mut q = self.g.op(path, "Reshape", &[&q, &q_heads], vec![]);
        let mut k = self.g.op(path, "Reshape", &[&k, &kv_heads], vec![]);
        let v = self.g.op(path, "Reshape", &[&v, &kv_heads], vec![]);
        if let (Some((qw, kw, eps)), false) = (&norms, c.qk_norm_across_heads) {
            q = self.rms(path, &q, qw, *eps)?;
            k = self.rms(path, &k, kw, *eps)?;
        }
        let heads_first = || vec![attr::ints("perm", &[0, 2, 1, 3])];
        let mut q = self.g.op(path, "Transpose", &[&q], heads_first());
        let mut k = self.g.op(path, "Transpose", &[&k], heads_first());
        let mut v = self.g.op(path, "Transpose", &[&v], heads_first());
        if let Some(rope) = &c.rope {
            let rot = rope.rotary_dim(d);
            // The graph is built for `seq` positions (as frequencies that
            // depend on the length are).
            let (cos, sin) = rope.tables(d, seq);
            let cos: Vec<f64> = cos.into_iter().map(f64::from).collect();
            let sin: Vec<f64> = sin.into_iter().map(f64::from).collect();
            let cos = self.g.floats(path, "rope_cos", &cos, &[seq, rot])?;
            let sin = self.g.floats(path, "rope_sin", &sin, &[seq, rot])?;
            q = self.rotate(path, &q, &cos, &sin, rot, d)?;
            k = self.rotate(path, &k, &cos, &sin, rot, d)?;
        }
        if kv != h {
            // Each key/value head serves `h / kv` consecutive query heads.
            let axis = self.g.ints(path, "group_axis", &[2])?;
            let expand = self.g.ints(path, "group", &[1, 1, (h / kv) as i64, 1, 1])?;
            let merged = self
                .g
                .ints(path, "merged_heads", &[0, h as i64, seq as i64, d as i64])?;
            let mut repeat = |t: &str| {
                let u = self.g.op(path, "Unsqueeze", &[t, &axis], vec![]);
                let e = self.g.op(path, "Expand", &[&u, &expand], vec![]);
                self.g.op(path, "Reshape", &[&e, &merged], vec![])
            };
            k = repeat(&k);
            v = repeat(&v);
        }
        let kt = self.g.op(
            path,
            "Transpose",
            &[&k],
            vec![attr::ints("perm", &[0, 1, 3, 2])],
        );
        let scores = self.g.op(path, "MatMul", &[&q, &kt], vec![]);
        let scale = self.g.scalar(path, "scale", c.score_scale())?;
        let mut scores = self.g.op(path, "Mul", &[&scores, &scale], vec![]);
        if let Some(cap) = c.softcap {
            // Softcapped: cap * tanh(scores / cap), before the mask.
            let cap = self.g.scalar(path, "softcap", cap)?;
            let divided = self.g.op(path, "Div", &[&scores, &cap], vec![]);
            let tanh = self.g.op(path, "Tanh", &[&divided], vec![]);
            scores = self.g.op(path, "Mul", &[&tanh, &cap], vec![]);
        }
        match (&self.padding, c.causal) {
            (None, true) => {
                // Causal, within the sliding window when there is one.
                let mask: Vec<f64> = (0..seq)
                    .flat_map(|i| {
                        (0..seq).map(move |j| if c.sees(i, j) { 0.0 } else { f64::NEG_INFINITY })
                    })
                    .collect();
                let mask = self.g.floats(path, "causal_mask", &mask, &[seq, seq])?;
                scores = self.g.op(path, "Add", &[&scores, &mask], vec![]);
            }
            (None, false) => {}
            (Some(padding), _) => {
                // The keys that are tokens, within the causal band (and
                // window) when there is one, and always the query itself, as
                // Kiln's forward pass sees them over a padded batch.
                let keys = padding.keys.clone();
                let band: Vec<f64> = (0..seq)
                    .flat_map(|i| {
                        (0..seq).map(move |j| f64::from(u8::from(!c.causal || c.sees(i, j))))
                    })
                    .collect();
                let itself: Vec<f64> = (0..seq)
                    .flat_map(|i| (0..seq).map(move |j| f64::from(u8::from(i == j))))
                    .collect();
                let to_bool = || vec![attr::int("to", 9)];
                let band = self.g.floats(path, "band", &band, &[seq, seq])?;
                let band = self.g.op(path, "Cast", &[&band], to_bool());
                let itself = self.g.floats(path, "itself", &itself, &[seq, seq])?;
                let itself = self.g.op(path, "Cast", &[&itself], to_bool());
                let seen = self.g.op(path, "And", &[&keys, &band], vec![]);
                let seen = self.g.op(path, "Or", &[&seen, &itself], vec![]);
                let zero = self.g.scalar(path, "zero", 0.0)?;
                let hidden = self.g.scalar(path, "hidden", f64::NEG_INFINITY)?;
                let mask = self.g.op(path, "Where", &[&seen, &zero, &hidden], vec![]);
                scores = self.g.op(path, "Add", &[&scores, &mask], vec![]);
            }
        }
        let weights = self
            .g
            .op(path, "Softmax", &[&scores], vec![attr::int("axis", -1)]);
        let attended = self.g.op(path, "MatMul", &[&weights, &v], vec![]);
        let merged = self.g.op(path, "Transpose", &[&attended], heads_first());
        let flat = self.g.ints(path, "merged_shape", &[0, 0, (h * d) as i64])?;
        let merged = self.g.op(path, "Reshape", &[&merged, &flat], vec![]);
        self.project(
            path,
            layer,
            &merged,
            "o_proj.weight",
            c.out_bias.then_some("o_proj.bias"),
        )
    }
}
