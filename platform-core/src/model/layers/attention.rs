//! `MultiHeadSelfAttention`: multi-head self-attention with
//! `nn.MultiheadAttention`'s parameters.

use serde::{Deserialize, Serialize};

use super::builder::config_builder;
use super::defaults::yes;
use super::{FieldCheck, LayerSpec, Params, ShapeCheck};
use crate::dtype::DType;
use crate::error::Result;
use crate::model::init::Init;
use crate::model::ParamKind;

/// Multi-head self-attention on `[batch, seq, embed_dim]`, with the
/// parameters of `nn.MultiheadAttention(embed_dim, num_heads, dropout, bias,
/// batch_first=True)` and query = key = value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionConfig {
    /// Model width; must be divisible by `num_heads`.
    pub embed_dim: usize,
    /// Number of parallel heads.
    pub num_heads: usize,
    /// Whether position `i` may only attend to positions `<= i` (default `false`).
    #[serde(default)]
    pub causal: bool,
    /// Dropout on the attention weights, in `[0, 1)` (default 0).
    #[serde(default)]
    pub dropout: f64,
    /// Whether the input and output projections have biases (default `true`).
    #[serde(default = "yes")]
    pub bias: bool,
}

config_builder! {
    AttentionConfig {
        /// Non-causal attention without dropout, with biases.
        new(embed_dim: usize, num_heads: usize) {
            embed_dim,
            num_heads,
            causal: false,
            dropout: 0.0,
            bias: true,
        }
        /// Sets whether the attention is causal.
        with_causal(causal: bool);
        /// Sets the attention dropout.
        with_dropout(dropout: f64);
        /// Sets whether the projections have biases.
        with_bias(bias: bool);
    }
}

impl LayerSpec for AttentionConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        let c = self;
        check.positive("embed_dim", c.embed_dim)?;
        check.positive("num_heads", c.num_heads)?;
        check.divisible("num_heads", "embed_dim", c.embed_dim, c.num_heads)?;
        check.probability("dropout", c.dropout)
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        match *input {
            [_, _, e] if e == self.embed_dim => Ok(input.to_vec()),
            _ => Err(at.mismatch(format!("[batch, seq, {}]", self.embed_dim))),
        }
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        let c = self;
        let e = c.embed_dim;
        let e3 = e.saturating_mul(3);
        let in_proj = vec![e3, e];
        let xavier = params.resolve(
            "in_proj_weight",
            &Init::XavierUniform { gain: 1.0 },
            &in_proj,
        )?;
        params.push(
            "in_proj_weight",
            in_proj,
            DType::F32,
            ParamKind::Parameter,
            xavier,
        );
        if c.bias {
            params.constant("in_proj_bias", vec![e3], 0.0, ParamKind::Parameter);
        }
        let out_proj = vec![e, e];
        let default =
            params.resolve("out_proj.weight", &Init::torch_default_weight(), &out_proj)?;
        params.push(
            "out_proj.weight",
            out_proj,
            DType::F32,
            ParamKind::Parameter,
            default,
        );
        if c.bias {
            params.constant("out_proj.bias", vec![e], 0.0, ParamKind::Parameter);
        }
        Ok(())
    }
}
