//! `MultiHeadSelfAttention` as TensorFlow graph ops.

use kiln_core::{model::Layer, Result};
use tensorflow::{DataType, Output};

use super::{join, Built, Ctx, Val};

/// Builds `layer` on `x` when it is one of this family's; hands `x` back otherwise.
pub(super) fn build(ctx: &mut Ctx<'_>, layer: &Layer, prefix: &str, x: Val) -> Result<Built> {
    let y = match layer {
        Layer::MultiHeadSelfAttention(c) => ctx.attention(x, prefix, c),
        _ => return Ok(Built::Pass(x)),
    };
    y.map(Built::Out)
}

/// Which keys each query of an attention layer sees ([`Ctx::scaled_scores`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct KeysSeen {
    /// The sequence's length.
    pub(super) seq: i64,
    /// Only keys at or before the query.
    pub(super) causal: bool,
    /// Only the last `window` keys (with `causal`).
    pub(super) window: Option<usize>,
    /// The scores' rank, `[batch, ..., seq, seq]`.
    pub(super) rank: usize,
}

impl KeysSeen {
    /// Whether query `i` sees key `j` by position: every key, or, when
    /// causal, `j <= i` within the window.
    fn sees(&self, i: i64, j: i64) -> bool {
        !self.causal || (j <= i && self.window.is_none_or(|w| j + w as i64 > i))
    }
}

impl Ctx<'_> {
    fn attention(
        &mut self,
        x: Val,
        prefix: &str,
        c: &kiln_core::model::AttentionConfig,
    ) -> Result<Val> {
        let p = |name: &str| join(prefix, name);
        let x = self.nchw(x)?;
        let (seq, embed) = (x.dims[0], x.dims[1]);
        let heads = c.num_heads as i64;
        let head_dim = embed / heads;
        let qkv = self.linear(
            x.clone(),
            &p("in_proj_weight"),
            &p("in_proj_bias"),
            3 * embed,
        )?;
        let parts = self.b.split(&qkv.out, 2, 3)?;
        // [batch, seq, heads, head_dim] views; the einsums below read the heads
        // from there (as Keras's MultiHeadAttention does), no transposes around them.
        let mut split = |t: &Output| -> Result<Output> {
            self.b.reshape(
                t,
                &[-1, seq as i32, heads as i32, head_dim as i32],
                DataType::Float,
            )
        };
        let (q, k, v) = (split(&parts[0])?, split(&parts[1])?, split(&parts[2])?);
        let scores = self.b.einsum("bqhd,bkhd->bhqk", &q, &k)?;
        let scores = self.scaled_scores(
            &scores,
            1.0 / (head_dim as f64).sqrt(),
            None,
            &KeysSeen {
                seq,
                causal: c.causal,
                window: None,
                rank: 4,
            },
        )?;
        let weights = self.b.softmax(&scores)?;
        let weights = self
            .dropout(
                Val {
                    out: weights,
                    dims: vec![heads, seq, seq],
                    nhwc: false,
                },
                c.dropout,
            )?
            .out;
        let attended = self.b.einsum("bhqk,bkhd->bqhd", &weights, &v)?;
        let merged = self
            .b
            .reshape(&attended, &[-1, seq as i32, embed as i32], DataType::Float)?;
        self.linear(
            Val {
                out: merged,
                dims: vec![seq, embed],
                nhwc: false,
            },
            &p("out_proj.weight"),
            &p("out_proj.bias"),
            embed,
        )
    }

    /// `scores * scale` (of `keys.rank` dimensions, `[batch, ..., seq, seq]`),
    /// softcapped (`cap * tanh(scores / cap)`) when `softcap` is set, with
    /// -inf where a causal query does not see a key (above the diagonal of
    /// the last two dimensions, and outside the sliding window) and, in a
    /// padded batch, where the key is padding.
    pub(super) fn scaled_scores(
        &mut self,
        scores: &Output,
        scale: f64,
        softcap: Option<f64>,
        keys: &KeysSeen,
    ) -> Result<Output> {
        let seq = keys.seq;
        let mut scores = self.b.mul_scalar(scores, scale as f32)?;
        if let Some(cap) = softcap {
            let cap_value = self.b.scalar(cap as f32)?;
            let divided = self.b.div(&scores, &cap_value)?;
            let tanh = self.b.unary("Tanh", &divided)?;
            scores = self.b.mul_scalar(&tanh, cap as f32)?;
        }
        if let Some(padding) = self.padding.as_ref().map(|p| p.mask.clone()) {
            return self.padded_scores(&scores, &padding, keys);
        }
        if !keys.causal {
            return Ok(scores);
        }
        let mut mask = vec![0f32; (seq * seq) as usize];
        for i in 0..seq {
            for j in 0..seq {
                if !keys.sees(i, j) {
                    mask[(i * seq + j) as usize] = f32::NEG_INFINITY;
                }
            }
        }
        let mask = self.b.constant(&mask, &[seq as u64, seq as u64])?;
        self.b.add(&scores, &mask)
    }

    /// `scores` (`[batch, ..., seq, seq]`) with -inf where a query does not
    /// see a key of a padded batch: keys that are padding (`padding`,
    /// `[batch, seq]`, 1 on the tokens), and, for a causal layer, keys after
    /// the query or outside its window; a query always sees itself, so that
    /// a padding query that would see nothing (left padding under a causal
    /// mask) gives no NaN, as on libtorch. Only padding queries see more
    /// than `transformers` lets them, and their outputs are never read.
    fn padded_scores(
        &mut self,
        scores: &Output,
        padding: &Output,
        keys: &KeysSeen,
    ) -> Result<Output> {
        let (seq, rank) = (keys.seq, keys.rank);
        let (mut band, mut itself) = (
            vec![0f32; (seq * seq) as usize],
            vec![0f32; (seq * seq) as usize],
        );
        for i in 0..seq {
            for j in 0..seq {
                band[(i * seq + j) as usize] = f32::from(u8::from(keys.sees(i, j)));
                itself[(i * seq + j) as usize] = f32::from(u8::from(i == j));
            }
        }
        let dims = [seq as u64, seq as u64];
        let band = self.b.constant(&band, &dims)?;
        let itself = self.b.constant(&itself, &dims)?;
        // [batch, 1, ..., 1, seq]: each row's keys, broadcast over the
        // heads and the queries.
        let mut shape = vec![-1i32];
        shape.extend(std::iter::repeat_n(1, rank.saturating_sub(2)));
        shape.push(seq as i32);
        let keys = self.b.reshape(padding, &shape, DataType::Float)?;
        let seen = self.b.mul(&keys, &band)?;
        let seen = self.b.maximum(&seen, &itself)?;
        // log(1) = 0 where a key is seen, log(0) = -inf where it is not.
        let mask = self.b.unary("Log", &seen)?;
        let mask = self.b.stop_gradient(&mask)?;
        self.b.add(scores, &mask)
    }
}
