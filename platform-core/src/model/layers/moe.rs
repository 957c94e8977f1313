//! `SparseMoe`: a mixture of gated experts with top-k routing (Mixtral,
//! Qwen2-MoE with its shared expert, Qwen3-MoE, OLMoE).

use serde::{Deserialize, Serialize};

use super::builder::config_builder;
use super::transformer::{linear_params, GatedActivation};
use super::{FieldCheck, LayerSpec, Params, ShapeCheck};
use crate::error::Result;
use crate::model::Layer;

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
    /// Weight of the load-balancing loss added to the training loss
    /// (`router_aux_loss_coef` of a checkpoint with `output_router_logits`):
    /// `num_experts * sum_e f_e * P_e` over every MoE layer's tokens, with
    /// `f_e` the share of assignments expert `e` gets and `P_e` its mean router
    /// probability (Switch Transformer, as `transformers`' MoE models compute
    /// it). 0 (the default) logs it as the metric `aux_loss` without adding it.
    /// Every MoE layer of a model gives the same weights.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub router_aux_loss_coef: f64,
    /// Weight of the router z-loss added to the training loss: the mean over
    /// tokens and MoE layers of `logsumexp(router logits)^2` (ST-MoE), which
    /// keeps the router's logits small. 0 (the default) logs it as the metric
    /// `router_z_loss` without adding it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub router_z_loss_coef: f64,
}

/// Whether `v` is 0 (serde's test for an unset coefficient).
fn is_zero(v: &f64) -> bool {
    *v == 0.0
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
            router_aux_loss_coef: 0.0,
            router_z_loss_coef: 0.0,
        }
        /// Sets whether the top-k probabilities are renormalised.
        with_norm_topk_prob(norm_topk_prob: bool);
        /// Sets the experts' activation.
        with_activation(activation: GatedActivation);
        /// Adds a gated shared expert of this width.
        with_shared_expert_dim(shared_expert_dim: Some(usize));
        /// Sets the weight of the load-balancing loss in the training loss.
        with_router_aux_loss_coef(router_aux_loss_coef: f64);
        /// Sets the weight of the router z-loss in the training loss.
        with_router_z_loss_coef(router_z_loss_coef: f64);
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
        for (field, v) in [
            ("router_aux_loss_coef", self.router_aux_loss_coef),
            ("router_z_loss_coef", self.router_z_loss_coef),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(check.invalid(field, format!("is {v}; a loss weight is 0 or more")));
            }
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

/// The router losses of a model's mixture-of-experts layers, which every
/// engine computes over all of them together, as `transformers`'
/// `load_balancing_loss_func` does over the router logits of every layer:
///
/// ```text
/// aux_loss      = num_experts * sum_e (n_e / T) * (sum_t p_te / T)
/// router_z_loss = sum_t logsumexp(logits_t)^2 / T
/// ```
///
/// over the `T` rows (tokens times MoE layers), with `p_t = softmax(logits_t)`
/// and `n_e` the number of rows whose top-k holds expert `e`. The training
/// loss gains `router_aux_loss_coef * aux_loss + router_z_loss_coef *
/// router_z_loss`, and both are logged as metrics.
///
/// ```
/// use kiln_core::model::{Layer, RouterLosses, SparseMoeConfig};
///
/// let moe = SparseMoeConfig::new(8, 16, 4, 2).with_router_aux_loss_coef(0.01);
/// let model = Layer::sequential([moe.clone().into(), moe.into()]);
/// let losses = RouterLosses::of(&model)?.expect("two MoE layers");
/// assert_eq!((losses.num_experts, losses.top_k, losses.adds_to_loss()), (4, 2, true));
/// assert_eq!(RouterLosses::NAMES, ["aux_loss", "router_z_loss"]);
///
/// // Layers that would pool rows of different meanings are refused.
/// let other = SparseMoeConfig::new(8, 16, 6, 2);
/// let mixed = Layer::sequential([SparseMoeConfig::new(8, 16, 4, 2).into(), other.into()]);
/// assert!(RouterLosses::of(&mixed).unwrap_err().to_string().contains("`0` and `1` differ"));
/// assert!(RouterLosses::of(&Layer::Relu)?.is_none());
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct RouterLosses {
    /// Experts per layer.
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// The load-balancing loss's weight in the training loss.
    pub aux_loss_coef: f64,
    /// The z-loss's weight in the training loss.
    pub z_loss_coef: f64,
}

impl RouterLosses {
    /// The metrics' names, in the order engines report them.
    pub const NAMES: [&'static str; 2] = ["aux_loss", "router_z_loss"];

    /// The router losses of `model`: `None` when it has no
    /// [`Layer::SparseMoe`], an error naming the layers when two of them
    /// differ in their experts, top-k or loss weights (the losses pool every
    /// layer's rows, so they must agree).
    pub fn of(model: &Layer) -> Result<Option<Self>> {
        let mut found: Option<(String, Self)> = None;
        for (path, layer) in model.layers() {
            let Layer::SparseMoe(c) = layer else {
                continue;
            };
            let this = Self {
                num_experts: c.num_experts,
                top_k: c.top_k,
                aux_loss_coef: c.router_aux_loss_coef,
                z_loss_coef: c.router_z_loss_coef,
            };
            match &found {
                None => found = Some((path, this)),
                Some((first, that)) if *that != this => {
                    return Err(crate::Error::invalid_argument(
                        "model",
                        format!(
                            "the mixture-of-experts layers `{first}` and `{path}` differ in \
                             num_experts, top_k, router_aux_loss_coef or router_z_loss_coef \
                             ({that:?} against {this:?}); the router losses pool every MoE \
                             layer, so they must agree"
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(found.map(|(_, l)| l))
    }

    /// Whether either loss has a weight: then its gradient is part of the
    /// training step (and a part of the model that runs again in the
    /// backward pass cannot hold a router).
    pub fn adds_to_loss(&self) -> bool {
        self.aux_loss_coef > 0.0 || self.z_loss_coef > 0.0
    }

    /// The metrics' names, as [`Module::auxiliary_loss_names`](crate::module::Module::auxiliary_loss_names) gives them.
    pub fn names() -> Vec<String> {
        Self::NAMES.iter().map(|n| (*n).to_owned()).collect()
    }
}
