//! The layers of today's transformers: `SelfAttention` (grouped-query heads,
//! rotary position embeddings, QK-norm), `GatedMlp` (SwiGLU, GeGLU),
//! `PositionEmbedding` (learned or sinusoidal) and `TiedLinear` (an output
//! projection that shares the token embedding's weight). Their parameter names
//! are those of the Hugging Face modules (`q_proj`, `gate_proj`, ...).

use serde::{Deserialize, Serialize};

use super::builder::config_builder;
use super::context::join;
use super::rope::RopeConfig;
use super::{FieldCheck, LayerSpec, Params, ShapeCheck};
use crate::dtype::DType;
use crate::error::Result;
use crate::model::init::InitDistribution;
use crate::model::ParamKind;

/// Self-attention with the Hugging Face modules' parameters: separate
/// `q_proj`, `k_proj`, `v_proj` and `o_proj` projections, `num_kv_heads` key
/// and value heads shared by groups of query heads (grouped-query attention;
/// multi-query with one), optional rotary position embeddings and per-head
/// RMSNorm of queries and keys (QK-norm, per head as Qwen3 has it, or over each projection as OLMoE). Runs on
/// `[batch, seq, embed_dim]` through `scaled_dot_product_attention`.
///
/// ```
/// use kiln_core::model::{Layer, RopeConfig, SelfAttentionConfig};
///
/// // LLaMA's attention: 8 query heads sharing 2 key/value heads, RoPE, no biases.
/// let attn: Layer = SelfAttentionConfig::new(64, 8)
///     .with_num_kv_heads(2)
///     .with_causal(true)
///     .with_rope(RopeConfig::new(500_000.0))
///     .into();
/// assert_eq!(attn.output_shape(&[2, 10, 64])?, vec![2, 10, 64]);
/// let specs = attn.parameter_specs("")?;
/// assert_eq!(specs[1].name, "k_proj.weight");
/// assert_eq!(specs[1].shape, vec![16, 64]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelfAttentionConfig {
    /// Model width (the input's last dimension).
    pub embed_dim: usize,
    /// Number of query heads.
    pub num_heads: usize,
    /// Number of key and value heads; divides `num_heads` (default `num_heads`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_kv_heads: Option<usize>,
    /// Features per head (default `embed_dim / num_heads`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Whether position `i` may only attend to positions `<= i` (default `false`).
    #[serde(default)]
    pub causal: bool,
    /// Whether `q_proj`, `k_proj` and `v_proj` have biases (default `false`;
    /// Qwen2, GPT-2 and BERT have them).
    #[serde(default)]
    pub qkv_bias: bool,
    /// Whether `o_proj` has a bias (default `false`).
    #[serde(default)]
    pub out_bias: bool,
    /// Rotary position embeddings of queries and keys (default none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope: Option<RopeConfig>,
    /// RMSNorm epsilon of the per-head query and key norms (`q_norm`,
    /// `k_norm`), applied before RoPE; none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qk_norm_eps: Option<f64>,
    /// Added to the query and key norms' weights before they scale (0 by
    /// default; Gemma 3's `1 + weight`, its weights then starting at 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub qk_norm_offset: f64,
    /// Whether the query and key norms normalise each whole projection
    /// (`[heads * head_dim]` weights: OLMoE) rather than each head
    /// (default `false`: Qwen3, Gemma 3).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qk_norm_across_heads: bool,
    /// Whether the query and key norms' weights scale before the cast back
    /// to the input's dtype (OLMo 2's order; see
    /// [`RmsNormConfig::scale_in_float32`](super::RmsNormConfig::scale_in_float32)).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qk_norm_scale_in_float32: bool,
    /// The factor of the attention scores (default `1 / sqrt(head_dim)`;
    /// Gemma's `query_pre_attn_scalar ** -0.5`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<f64>,
    /// Causal attention within a window: position `i` attends to positions
    /// `j` with `i - window < j <= i`, `window` tokens including itself
    /// (Mistral's and Qwen2's `sliding_window`, Gemma's local layers); none
    /// by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// Softcapping of the scaled attention scores, `cap * tanh(scores / cap)`,
    /// before the mask (Gemma 2's `attn_logit_softcapping`); none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub softcap: Option<f64>,
    /// Dropout on the attention weights in training, in `[0, 1)` (default 0).
    #[serde(default)]
    pub dropout: f64,
}

config_builder! {
    SelfAttentionConfig {
        /// Multi-head (not grouped) non-causal attention without biases, RoPE or QK-norm.
        new(embed_dim: usize, num_heads: usize) {
            embed_dim,
            num_heads,
            num_kv_heads: None,
            head_dim: None,
            causal: false,
            qkv_bias: false,
            out_bias: false,
            rope: None,
            qk_norm_eps: None,
            qk_norm_offset: 0.0,
            qk_norm_across_heads: false,
            qk_norm_scale_in_float32: false,
            scale: None,
            sliding_window: None,
            softcap: None,
            dropout: 0.0,
        }
        /// Sets the number of key and value heads (grouped-query attention).
        with_num_kv_heads(num_kv_heads: Some(usize));
        /// Sets the features per head.
        with_head_dim(head_dim: Some(usize));
        /// Sets whether the attention is causal.
        with_causal(causal: bool);
        /// Sets whether the query, key and value projections have biases.
        with_qkv_bias(qkv_bias: bool);
        /// Sets whether the output projection has a bias.
        with_out_bias(out_bias: bool);
        /// Applies rotary position embeddings to queries and keys.
        with_rope(rope: Some(RopeConfig));
        /// Normalises each query and key head with an RMSNorm of this epsilon.
        with_qk_norm_eps(qk_norm_eps: Some(f64));
        /// Sets the query and key norms' weight offset (1 for Gemma 3).
        with_qk_norm_offset(qk_norm_offset: f64);
        /// Normalises the whole query and key projections, not each head.
        with_qk_norm_across_heads(qk_norm_across_heads: bool);
        /// Sets whether the query and key norms scale before the cast back.
        with_qk_norm_scale_in_float32(qk_norm_scale_in_float32: bool);
        /// Sets the factor of the attention scores.
        with_scale(scale: Some(f64));
        /// Restricts causal attention to a window of this many tokens.
        with_sliding_window(sliding_window: Some(usize));
        /// Softcaps the attention scores at this value.
        with_softcap(softcap: Some(f64));
        /// Sets the attention dropout.
        with_dropout(dropout: f64);
    }
}

/// Whether `v` is 0 (serde's test for a default offset).
fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

impl SelfAttentionConfig {
    /// The factor of the attention scores: [`scale`](Self::scale), or
    /// `1 / sqrt(head_dim)`.
    pub fn score_scale(&self) -> f64 {
        self.scale
            .unwrap_or_else(|| 1.0 / (self.head_dim() as f64).sqrt())
    }

    /// Whether key `key` is visible to query `query` (indices in the
    /// sequence, cache included): `key <= query` when causal, and within
    /// the sliding window when there is one.
    pub fn sees(&self, query: usize, key: usize) -> bool {
        if !self.causal {
            return true;
        }
        key <= query && self.sliding_window.is_none_or(|w| key + w > query)
    }

    /// Features per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.embed_dim / self.num_heads.max(1))
    }

    /// Key and value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_kv_heads.unwrap_or(self.num_heads)
    }
}

impl LayerSpec for SelfAttentionConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        let c = self;
        check.positive("embed_dim", c.embed_dim)?;
        check.positive("num_heads", c.num_heads)?;
        match c.head_dim {
            Some(d) => check.positive("head_dim", d)?,
            None => check.divisible("num_heads", "embed_dim", c.embed_dim, c.num_heads)?,
        }
        let kv = c.kv_heads();
        check.positive("num_kv_heads", kv)?;
        if !c.num_heads.is_multiple_of(kv) {
            return Err(check.invalid(
                "num_kv_heads",
                format!(
                    "must divide num_heads ({}) so that each key/value head serves a group \
                     of query heads, got {kv}",
                    c.num_heads
                ),
            ));
        }
        if let Some(rope) = &c.rope {
            rope.validate(c.head_dim(), check)?;
        }
        if let Some(window) = c.sliding_window {
            check.positive("sliding_window", window)?;
            if !c.causal {
                return Err(check.invalid(
                    "sliding_window",
                    "a sliding window restricts causal attention; set causal = true",
                ));
            }
        }
        for (key, value) in [("scale", c.scale), ("softcap", c.softcap)] {
            if let Some(v) = value.filter(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(check.invalid(key, format!("must be finite and above 0, got {v}")));
            }
        }
        if !c.qk_norm_offset.is_finite() {
            return Err(check.invalid(
                "qk_norm_offset",
                format!("must be finite, got {}", c.qk_norm_offset),
            ));
        }
        if let Some(eps) = c.qk_norm_eps {
            check.non_negative("qk_norm_eps", eps)?;
        }
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
        let (e, d) = (c.embed_dim, c.head_dim());
        let q = c.num_heads * d;
        let kv = c.kv_heads() * d;
        for (name, out, inp, bias) in [
            ("q_proj", q, e, c.qkv_bias),
            ("k_proj", kv, e, c.qkv_bias),
            ("v_proj", kv, e, c.qkv_bias),
            ("o_proj", e, q, c.out_bias),
        ] {
            linear_params(params, name, out, inp, bias)?;
        }
        if c.qk_norm_eps.is_some() {
            // Norms start as the identity: weight + offset = 1.
            let one = 1.0 - c.qk_norm_offset;
            let (qd, kd) = if c.qk_norm_across_heads {
                (q, kv)
            } else {
                (d, d)
            };
            params.constant("q_norm.weight", vec![qd], one, ParamKind::Parameter);
            params.constant("k_norm.weight", vec![kd], one, ParamKind::Parameter);
        }
        Ok(())
    }
}

/// The `weight` (and `bias`) of an `nn.Linear(inp, out)` child named `name`,
/// with PyTorch's default initialisation.
pub(super) fn linear_params(
    params: &mut Params<'_>,
    name: &str,
    out: usize,
    inp: usize,
    bias: bool,
) -> Result<()> {
    let path = join(params.path, name);
    Params {
        path: &path,
        kind: params.kind,
        out: params.out,
    }
    .weight_and_bias(vec![out, inp], bias.then_some(out), None, None)
}

/// The activation of a [`GatedMlpConfig`]'s gate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GatedActivation {
    /// SiLU (SwiGLU: LLaMA, Mistral, Qwen; `hidden_act = "silu"`).
    #[default]
    Silu,
    /// Exact GELU (GeGLU).
    Gelu,
    /// Tanh-approximated GELU (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// A gated feed-forward block with the Hugging Face LLaMA MLP's parameters:
///
/// ```text
/// y = down_proj(act(gate_proj(x)) * up_proj(x))
/// ```
///
/// SwiGLU with [`GatedActivation::Silu`], GeGLU with a GELU.
///
/// ```
/// use kiln_core::model::{GatedMlpConfig, Layer};
///
/// let mlp: Layer = GatedMlpConfig::new(64, 172).into();
/// assert_eq!(mlp.output_shape(&[2, 10, 64])?, vec![2, 10, 64]);
/// assert_eq!(mlp.num_parameters()?, 3 * 64 * 172);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatedMlpConfig {
    /// Model width (the input's and output's last dimension).
    pub dim: usize,
    /// Width of the gated hidden layer (`intermediate_size`).
    pub hidden_dim: usize,
    /// The gate's activation (default SiLU).
    #[serde(default)]
    pub activation: GatedActivation,
    /// Whether the three projections have biases (default `false`).
    #[serde(default)]
    pub bias: bool,
}

config_builder! {
    GatedMlpConfig {
        /// SwiGLU without biases.
        new(dim: usize, hidden_dim: usize) {
            dim,
            hidden_dim,
            activation: GatedActivation::Silu,
            bias: false,
        }
        /// Sets the gate's activation.
        with_activation(activation: GatedActivation);
        /// Sets whether the projections have biases.
        with_bias(bias: bool);
    }
}

impl LayerSpec for GatedMlpConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        check.positive("dim", self.dim)?;
        check.positive("hidden_dim", self.hidden_dim)
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        at.same_with_last(input, self.dim)
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        let (d, h, b) = (self.dim, self.hidden_dim, self.bias);
        linear_params(params, "gate_proj", h, d, b)?;
        linear_params(params, "up_proj", h, d, b)?;
        linear_params(params, "down_proj", d, h, b)
    }
}

/// How a [`PositionEmbeddingConfig`] encodes positions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PositionEncoding {
    /// A learned table `weight` of `[max_positions, dim]` (GPT-2's `wpe`,
    /// BERT's `position_embeddings`), starting from `N(0, 1)`.
    #[default]
    Learned,
    /// The fixed sines and cosines of "Attention Is All You Need", no parameters:
    /// `pe[p, 2i] = sin(p / 10000^(2i / dim))`, `pe[p, 2i + 1] = cos(p / 10000^(2i / dim))`.
    Sinusoidal,
}

/// Adds a position embedding to `[batch, seq, dim]`: row `offset + t` to
/// position `t`, where `offset` is 0 in training and the number of cached
/// positions when decoding with a cache.
///
/// ```
/// use kiln_core::model::{Layer, PositionEmbeddingConfig, PositionEncoding};
///
/// let wpe: Layer = PositionEmbeddingConfig::new(1024, 64).into();
/// assert_eq!(wpe.parameter_specs("")?[0].shape, vec![1024, 64]);
/// let fixed: Layer = PositionEmbeddingConfig::new(1024, 64)
///     .with_encoding(PositionEncoding::Sinusoidal)
///     .into();
/// assert_eq!(fixed.num_parameters()?, 0);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PositionEmbeddingConfig {
    /// The longest sequence (GPT-2's `n_positions`).
    pub max_positions: usize,
    /// Model width.
    pub dim: usize,
    /// Learned or sinusoidal (default learned).
    #[serde(default)]
    pub encoding: PositionEncoding,
}

config_builder! {
    PositionEmbeddingConfig {
        /// A learned position embedding.
        new(max_positions: usize, dim: usize) {
            max_positions,
            dim,
            encoding: PositionEncoding::Learned,
        }
        /// Sets learned or sinusoidal positions.
        with_encoding(encoding: PositionEncoding);
    }
}

impl PositionEmbeddingConfig {
    /// The sinusoidal table `[max_positions, dim]`, row-major, computed in float64.
    pub fn sinusoidal_table(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.max_positions * self.dim);
        for p in 0..self.max_positions {
            for j in 0..self.dim {
                let i2 = (j - j % 2) as f64;
                let angle = p as f64 / 10_000f64.powf(i2 / self.dim as f64);
                out.push(if j % 2 == 0 { angle.sin() } else { angle.cos() } as f32);
            }
        }
        out
    }
}

impl LayerSpec for PositionEmbeddingConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        check.positive("max_positions", self.max_positions)?;
        check.positive("dim", self.dim)
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        match *input {
            [_, s, d] if d == self.dim && s <= self.max_positions => Ok(input.to_vec()),
            _ => Err(at.mismatch(format!(
                "[batch, seq <= {} (max_positions), {}]",
                self.max_positions, self.dim
            ))),
        }
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        if self.encoding == PositionEncoding::Learned {
            params.push(
                "weight",
                vec![self.max_positions, self.dim],
                DType::F32,
                ParamKind::Parameter,
                InitDistribution::Normal {
                    mean: 0.0,
                    std: 1.0,
                },
            );
        }
        Ok(())
    }
}

/// An output projection without bias whose weight is another layer's
/// parameter: `y = x W^T` with `W` the `[out_features, in_features]` tensor
/// named `weight` in the model's state dict. This is how a language model's
/// head is tied to its token embedding (`tie_word_embeddings`): both read, and
/// train, the one tensor.
///
/// ```
/// use kiln_core::model::{EmbeddingConfig, Layer, TiedLinearConfig};
///
/// let lm = Layer::sequential([
///     EmbeddingConfig::new(100, 16).into(),
///     TiedLinearConfig::new("0.weight", 16, 100).into(),
/// ]);
/// assert_eq!(lm.output_shape(&[2, 7])?, vec![2, 7, 100]);
/// assert_eq!(lm.num_parameters()?, 1600);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TiedLinearConfig {
    /// The full state-dict name of the shared weight (`"0.weight"`).
    pub weight: String,
    /// Size of the input's last dimension.
    pub in_features: usize,
    /// Size of the output's last dimension.
    pub out_features: usize,
}

impl TiedLinearConfig {
    /// `y = x W^T` with `W` the `[out_features, in_features]` tensor named `weight`.
    pub fn new(weight: impl Into<String>, in_features: usize, out_features: usize) -> Self {
        TiedLinearConfig {
            weight: weight.into(),
            in_features,
            out_features,
        }
    }
}

impl LayerSpec for TiedLinearConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        check.positive("in_features", self.in_features)?;
        check.positive("out_features", self.out_features)?;
        if self.weight.is_empty() {
            return Err(check.invalid("weight", "must name a tensor of the model"));
        }
        Ok(())
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        match input.split_last() {
            Some((&last, rest)) if last == self.in_features => {
                let mut out = rest.to_vec();
                out.push(self.out_features);
                Ok(out)
            }
            _ => Err(at.mismatch(format!("[*, {}]", self.in_features))),
        }
    }
}

/// BERT's token-type (segment) embedding for inputs of one segment: adds row 0
/// of a learned `[num_types, dim]` table (`token_type_embeddings`) to
/// `[batch, seq, dim]`. The other rows are kept (and saved) for checkpoints
/// that have them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenTypeEmbeddingConfig {
    /// Rows of the table (`type_vocab_size`, 2 for BERT).
    pub num_types: usize,
    /// Model width.
    pub dim: usize,
}

impl TokenTypeEmbeddingConfig {
    /// A `[num_types, dim]` table starting from `N(0, 1)`.
    pub fn new(num_types: usize, dim: usize) -> Self {
        TokenTypeEmbeddingConfig { num_types, dim }
    }
}

impl LayerSpec for TokenTypeEmbeddingConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        check.positive("num_types", self.num_types)?;
        check.positive("dim", self.dim)
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        match input.last() {
            Some(&d) if d == self.dim && input.len() >= 2 => Ok(input.to_vec()),
            _ => Err(at.mismatch(format!("[batch, *, {}]", self.dim))),
        }
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        params.push(
            "weight",
            vec![self.num_types, self.dim],
            DType::F32,
            ParamKind::Parameter,
            InitDistribution::Normal {
                mean: 0.0,
                std: 1.0,
            },
        );
        Ok(())
    }
}

/// Prepends a learned token to `[batch, seq, dim]` (ViT's `[CLS]`), giving
/// `[batch, seq + 1, dim]`; its `weight` is `[1, 1, dim]`, as `cls_token` is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassTokenConfig {
    /// Model width.
    pub dim: usize,
}

impl ClassTokenConfig {
    /// A class token of width `dim`, starting from `N(0, 1)`.
    pub fn new(dim: usize) -> Self {
        ClassTokenConfig { dim }
    }
}

impl LayerSpec for ClassTokenConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        check.positive("dim", self.dim)
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        match *input {
            [b, s, d] if d == self.dim => Ok(vec![b, s + 1, d]),
            _ => Err(at.mismatch(format!("[batch, seq, {}]", self.dim))),
        }
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        params.push(
            "weight",
            vec![1, 1, self.dim],
            DType::F32,
            ParamKind::Parameter,
            InitDistribution::Normal {
                mean: 0.0,
                std: 1.0,
            },
        );
        Ok(())
    }
}
