//! `SparseMoe`: a mixture of gated experts with top-k routing (Mixtral,
//! Qwen2-MoE with its shared expert, Qwen3-MoE, OLMoE).

use serde::{Deserialize, Serialize};

use super::builder::config_builder;
use super::transformer::{linear_params, GatedActivation};
use super::{FieldCheck, LayerSpec, Params, ShapeCheck};
use crate::error::Result;

/// A sparse mixture of experts on `[*, dim]`, with the parameters of the
/// Hugging Face MoE blocks (`gate.weight` the router, `experts.{j}.gate_proj`,
/// `up_proj` and `down_proj` each expert's gated MLP):
///
/// ```text
/// p = softmax(gate(x))                        (float32)
/// w, j = topk(p, top_k)                       (w / sum(w) with norm_topk_prob)
/// y = sum_k w_k * expert_{j_k}(x)             (+ sigmoid(shared_expert_gate(x)) * shared_expert(x))
/// ```
///
/// Each expert runs on the tokens routed to it only (gathered, then added
/// back at their rows), not on every token.
///
/// ```
/// use kiln_core::model::{Layer, SparseMoeConfig};
///
/// let moe: Layer = SparseMoeConfig::new(64, 32, 8, 2).with_norm_topk_prob(true).into();
/// assert_eq!(moe.output_shape(&[2, 10, 64])?, vec![2, 10, 64]);
/// assert_eq!(moe.num_parameters()?, 8 * 64 + 8 * 3 * 64 * 32);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SparseMoeConfig {
    /// Model width (the input's and output's last dimension).
    pub dim: usize,
    /// Width of each expert's gated hidden layer (`moe_intermediate_size`).
    pub hidden_dim: usize,
    /// Number of experts (`num_experts`, Mixtral's `num_local_experts`).
    pub num_experts: usize,
    /// Experts per token (`num_experts_per_tok`), at most `num_experts`.
    pub top_k: usize,
    /// Whether the chosen experts' probabilities are renormalised to sum to
    /// 1 (`norm_topk_prob`; Mixtral always does); default `false`.
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// The experts' gate activation (default SiLU).
    #[serde(default)]
    pub activation: GatedActivation,
    /// Width of a shared expert every token goes through, scaled by
    /// `sigmoid(shared_expert_gate(x))` (Qwen2-MoE's
    /// `shared_expert_intermediate_size`); none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_expert_dim: Option<usize>,
}

config_builder! {
    SparseMoeConfig {
        /// `num_experts` SwiGLU experts of width `hidden_dim`, `top_k` per
        /// token, probabilities not renormalised, no shared expert.
        new(dim: usize, hidden_dim: usize, num_experts: usize, top_k: usize) {
            dim,
            hidden_dim,
            num_experts,
            top_k,
            norm_topk_prob: false,
            activation: GatedActivation::Silu,
            shared_expert_dim: None,
        }
        /// Sets whether the top-k probabilities are renormalised.
        with_norm_topk_prob(norm_topk_prob: bool);
        /// Sets the experts' activation.
        with_activation(activation: GatedActivation);
        /// Adds a gated shared expert of this width.
        with_shared_expert_dim(shared_expert_dim: Some(usize));
    }
}

impl LayerSpec for SparseMoeConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        check.positive("dim", self.dim)?;
        check.positive("hidden_dim", self.hidden_dim)?;
        check.positive("num_experts", self.num_experts)?;
        check.positive("top_k", self.top_k)?;
        if self.top_k > self.num_experts {
            return Err(check.invalid(
                "top_k",
                format!(
                    "is {}, more than the {} experts there are to choose from",
                    self.top_k, self.num_experts
                ),
            ));
        }
        if let Some(d) = self.shared_expert_dim {
            check.positive("shared_expert_dim", d)?;
        }
        Ok(())
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        at.same_with_last(input, self.dim)
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        let (d, h) = (self.dim, self.hidden_dim);
        linear_params(params, "gate", self.num_experts, d, false)?;
        for j in 0..self.num_experts {
            linear_params(params, &format!("experts.{j}.gate_proj"), h, d, false)?;
            linear_params(params, &format!("experts.{j}.up_proj"), h, d, false)?;
            linear_params(params, &format!("experts.{j}.down_proj"), d, h, false)?;
        }
        if let Some(s) = self.shared_expert_dim {
            linear_params(params, "shared_expert.gate_proj", s, d, false)?;
            linear_params(params, "shared_expert.up_proj", s, d, false)?;
            linear_params(params, "shared_expert.down_proj", d, s, false)?;
            linear_params(params, "shared_expert_gate", 1, d, false)?;
        }
        Ok(())
    }
}
