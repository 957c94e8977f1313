//! `SelfAttention`, `GatedMlp`, `PositionEmbedding` and `TiedLinear` as
//! TensorFlow graph ops, with the arithmetic of the Hugging Face modules (and
//! of Kiln's libtorch layers). Sequence lengths are static in the graph, so the
//! rotary tables and the causal mask are constants.

use kiln_core::model::{
    GatedActivation, Layer, PositionEmbeddingConfig, PositionEncoding, SelfAttentionConfig,
};
use kiln_core::Result;
use tensorflow::{DataType, Output};

use super::activation::{gelu, gelu_tanh, silu};
use super::attention::KeysSeen;
use super::{join, Built, Ctx, Val};

/// Builds `layer` on `x` when it is one of this family's; hands `x` back otherwise.
pub(super) fn build(ctx: &mut Ctx<'_>, layer: &Layer, prefix: &str, x: Val) -> Result<Built> {
    let p = |name: &str| join(prefix, name);
    let y = match layer {
        Layer::SelfAttention(c) => ctx.self_attention(x, prefix, c),
        Layer::GatedMlp(c) => {
            let hidden = c.hidden_dim as i64;
            let gate = ctx.linear(
                x.clone(),
                &p("gate_proj.weight"),
                &p("gate_proj.bias"),
                hidden,
            )?;
            let up = ctx.linear(x, &p("up_proj.weight"), &p("up_proj.bias"), hidden)?;
            let act = match c.activation {
                GatedActivation::Silu => silu(ctx.b, &gate.out)?,
                GatedActivation::Gelu => gelu(ctx.b, &gate.out)?,
                GatedActivation::GeluTanh => gelu_tanh(ctx.b, &gate.out)?,
            };
            let h = ctx.b.mul(&act, &up.out)?;
            ctx.linear(
                Val { out: h, ..up },
                &p("down_proj.weight"),
                &p("down_proj.bias"),
                c.dim as i64,
            )
        }
        Layer::PositionEmbedding(c) => ctx.positions(x, prefix, c),
        Layer::TokenTypeEmbedding(c) => {
            let x = ctx.nchw(x)?;
            let table = ctx.param(&p("weight"))?;
            let row = ctx.b.slice(&table, &[0, 0], &[1, c.dim as i32])?;
            let out = ctx.b.add(&x.out, &row)?;
            Ok(Val { out, ..x })
        }
        Layer::ClassToken(_) => {
            let x = ctx.nchw(x)?;
            let token = ctx.param(&p("weight"))?;
            // [batch, 1, dim] of zeros (no gradient to x) plus the token.
            let first = ctx.b.slice(&x.out, &[0, 0, 0], &[-1, 1, -1])?;
            let zeros = ctx.b.unary("ZerosLike", &first)?;
            let tokens = ctx.b.add(&zeros, &token)?;
            let out = ctx.b.concat(&[tokens, x.out.clone()], 1)?;
            let mut dims = x.dims.clone();
            dims[0] += 1;
            Ok(Val {
                out,
                dims,
                nhwc: false,
            })
        }
        Layer::TiedLinear(c) => {
            // No bias: the name below is no variable of the model.
            ctx.linear(x, &c.weight, &p("(no bias)"), c.out_features as i64)
        }
        _ => return Ok(Built::Pass(x)),
    };
    y.map(Built::Out)
}

impl Ctx<'_> {
    /// `x / sqrt(mean(x², last axis) + eps) * weight` (weight `None`: unscaled).
    pub(super) fn rms_norm(
        &mut self,
        x: &Output,
        weight: Option<&Output>,
        eps: f64,
    ) -> Result<Output> {
        let sq = self.b.unary("Square", x)?;
        let ms = self.b.reduce("Mean", &sq, &[-1], true)?;
        let ms = self.b.add_scalar(&ms, eps as f32)?;
        let inv = self.b.unary("Rsqrt", &ms)?;
        let y = self.b.mul(x, &inv)?;
        match weight {
            Some(w) => self.b.mul(w, &y),
            None => Ok(y),
        }
    }

    fn self_attention(&mut self, x: Val, prefix: &str, c: &SelfAttentionConfig) -> Result<Val> {
        let p = |name: &str| join(prefix, name);
        let x = self.nchw(x)?;
        let seq = x.dims[0];
        let (h, kv, d) = (c.num_heads as i64, c.kv_heads() as i64, c.head_dim() as i64);
        let group = h / kv;
        let mut q = self.linear(x.clone(), &p("q_proj.weight"), &p("q_proj.bias"), h * d)?;
        let mut k = self.linear(x.clone(), &p("k_proj.weight"), &p("k_proj.bias"), kv * d)?;
        let norms = match c.qk_norm_eps {
            Some(eps) => {
                let mut qw = self.param(&p("q_norm.weight"))?;
                let mut kw = self.param(&p("k_norm.weight"))?;
                if c.qk_norm_offset != 0.0 {
                    qw = self.b.add_scalar(&qw, c.qk_norm_offset as f32)?;
                    kw = self.b.add_scalar(&kw, c.qk_norm_offset as f32)?;
                }
                Some((qw, kw, eps))
            }
            None => None,
        };
        // OLMoE's norms take each whole projection, before the heads split.
        if let (Some((qw, kw, eps)), true) = (&norms, c.qk_norm_across_heads) {
            q.out = self.rms_norm(&q.out, Some(qw), *eps)?;
            k.out = self.rms_norm(&k.out, Some(kw), *eps)?;
        }
        let v = self.linear(x, &p("v_proj.weight"), &p("v_proj.bias"), kv * d)?;
        let mut q = self.b.reshape(
            &q.out,
            &[-1, seq as i32, h as i32, d as i32],
            DataType::Float,
        )?;
        let mut k = self.b.reshape(
            &k.out,
            &[-1, seq as i32, kv as i32, d as i32],
            DataType::Float,
        )?;
        let v = self.b.reshape(
            &v.out,
            &[-1, seq as i32, kv as i32, d as i32],
            DataType::Float,
        )?;
        if let (Some((qw, kw, eps)), false) = (&norms, c.qk_norm_across_heads) {
            q = self.rms_norm(&q, Some(qw), *eps)?;
            k = self.rms_norm(&k, Some(kw), *eps)?;
        }
        if let Some(rope) = &c.rope {
            let rot = rope.rotary_dim(d as usize);
            // [seq, 1, rot]: broadcast over batch and heads of [b, seq, heads, d].
            // The graph is built for `seq` positions: frequencies that depend
            // on the length (dynamic NTK, LongRoPE) are those of `seq`.
            let (cos, sin) = rope.tables(d as usize, seq as usize);
            let dims = [seq as u64, 1, rot as u64];
            let cos = self.b.constant(&cos, &dims)?;
            let sin = self.b.constant(&sin, &dims)?;
            q = self.rope(&q, &cos, &sin, rot as i32, d as i32, h as i32)?;
            k = self.rope(&k, &cos, &sin, rot as i32, d as i32, kv as i32)?;
        }
        // Queries grouped by the key/value head they share: [b, seq, kv, group, d].
        let q = self.b.reshape(
            &q,
            &[-1, seq as i32, kv as i32, group as i32, d as i32],
            DataType::Float,
        )?;
        let scores = self.b.einsum("bqngd,bknd->bngqk", &q, &k)?;
        let scores = self.scaled_scores(
            &scores,
            c.score_scale(),
            c.softcap,
            &KeysSeen {
                seq,
                causal: c.causal,
                window: c.sliding_window,
                rank: 5,
            },
        )?;
        let weights = self.b.softmax(&scores)?;
        let weights = self
            .dropout(
                Val {
                    out: weights,
                    dims: vec![kv, group, seq, seq],
                    nhwc: false,
                },
                c.dropout,
            )?
            .out;
        let attended = self.b.einsum("bngqk,bknd->bqngd", &weights, &v)?;
        let merged = self.b.reshape(
            &attended,
            &[-1, seq as i32, (h * d) as i32],
            DataType::Float,
        )?;
        self.linear(
            Val {
                out: merged,
                dims: vec![seq, h * d],
                nhwc: false,
            },
            &p("o_proj.weight"),
            &p("o_proj.bias"),
            c.embed_dim as i64,
        )
    }

    /// Rotates the first `rot` features of each head of `x` (`[b, seq, heads, d]`).
    fn rope(
        &mut self,
        x: &Output,
        cos: &Output,
        sin: &Output,
        rot: i32,
        d: i32,
        heads: i32,
    ) -> Result<Output> {
        let half = rot / 2;
        let first = self.b.slice(x, &[0, 0, 0, 0], &[-1, -1, heads, half])?;
        let second = self.b.slice(x, &[0, 0, 0, half], &[-1, -1, heads, half])?;
        let xr = if rot == d {
            x.clone()
        } else {
            self.b.slice(x, &[0, 0, 0, 0], &[-1, -1, heads, rot])?
        };
        let neg = self.b.unary("Neg", &second)?;
        let rotated = self.b.concat(&[neg, first], 3)?;
        let a = self.b.mul(&xr, cos)?;
        let b = self.b.mul(&rotated, sin)?;
        let out = self.b.add(&a, &b)?;
        if rot == d {
            return Ok(out);
        }
        let pass = self
            .b
            .slice(x, &[0, 0, 0, rot], &[-1, -1, heads, d - rot])?;
        self.b.concat(&[out, pass], 3)
    }

    fn positions(&mut self, x: Val, prefix: &str, c: &PositionEmbeddingConfig) -> Result<Val> {
        let x = self.nchw(x)?;
        let (seq, dim) = (x.dims[0], x.dims[1]);
        let rows = match c.encoding {
            PositionEncoding::Learned => {
                let w = self.param(&join(prefix, "weight"))?;
                self.b.slice(&w, &[0, 0], &[seq as i32, dim as i32])?
            }
            PositionEncoding::Sinusoidal => {
                let table = c.sinusoidal_table();
                let rows = &table[..(seq * dim) as usize];
                self.b.constant(rows, &[seq as u64, dim as u64])?
            }
        };
        let out = self.b.add(&x.out, &rows)?;
        Ok(Val { out, ..x })
    }
}
