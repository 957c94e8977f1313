//! The mixtures of experts on the LLaMA block: Mixtral (`mixtral`), Qwen2-MoE
//! (`qwen2_moe`, with its gated shared expert), Qwen3-MoE (`qwen3_moe`) and
//! OLMoE (`olmoe`, QK-norm over each whole projection). Each layer's MLP is a
//! [`SparseMoeConfig`]: the router's softmax and top-k in float32
//! (renormalised where `norm_topk_prob` says, always in Mixtral), each expert
//! on the tokens routed to it. Qwen's `decoder_sparse_step` and
//! `mlp_only_layers` keep some layers dense. With `output_router_logits`,
//! the load-balancing loss times `router_aux_loss_coef` joins the training
//! loss, as in `transformers` ([`kiln_core::model::RouterLosses`]).

use kiln_core::model::{GatedMlpConfig, Layer, SparseMoeConfig};
use serde_json::Value;

use crate::config::HfConfig;
use crate::error::{HfError, Result};
use crate::family::Family;
use crate::llama::{build_with, gated_activation};
use crate::names::NameMap;

/// Mixtral (`MixtralForCausalLM`).
pub(crate) static MIXTRAL: Family =
    Family::causal_lm("mixtral", "Mixtral", |c, _| build(c, "mixtral"));
/// Qwen2-MoE (`Qwen2MoeForCausalLM`).
pub(crate) static QWEN2_MOE: Family =
    Family::causal_lm("qwen2_moe", "Qwen2-MoE", |c, _| build(c, "qwen2_moe"));
/// Qwen3-MoE (`Qwen3MoeForCausalLM`).
pub(crate) static QWEN3_MOE: Family =
    Family::causal_lm("qwen3_moe", "Qwen3-MoE", |c, _| build(c, "qwen3_moe"));
/// OLMoE (`OlmoeForCausalLM`).
pub(crate) static OLMOE: Family = Family::causal_lm("olmoe", "OLMoE", |c, _| build(c, "olmoe"));

/// Whether each of `layers` layers is sparse: Qwen's `mlp_only_layers` and
/// `decoder_sparse_step`; every layer in Mixtral and OLMoE.
fn sparse_layers(config: &HfConfig, layers: usize, model_type: &str) -> Result<Vec<bool>> {
    if !matches!(model_type, "qwen2_moe" | "qwen3_moe") {
        return Ok(vec![true; layers]);
    }
    let step = config.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(config.unsupported(
            "decoder_sparse_step",
            "is 0; every step-th layer is sparse, so it is at least 1",
        ));
    }
    let dense: Vec<usize> = match config.get("mlp_only_layers") {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|i| i as usize)
                    .filter(|i| *i < layers)
                    .ok_or_else(|| HfError::Config {
                        path: config.path().to_owned(),
                        key: "mlp_only_layers".to_owned(),
                        reason: format!(
                            "has {v}; each entry is a layer index below num_hidden_layers = {layers}"
                        ),
                    })
            })
            .collect::<Result<_>>()?,
        Some(other) => {
            return Err(HfError::Config {
                path: config.path().to_owned(),
                key: "mlp_only_layers".to_owned(),
                reason: format!("expected a list of layer indices, got {other}"),
            })
        }
    };
    Ok((0..layers)
        .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
        .collect())
}

/// The experts' block of `config`.
fn experts(config: &HfConfig, model_type: &str) -> Result<SparseMoeConfig> {
    let hidden = config.usize("hidden_size")?;
    let num_experts = match config.get("num_local_experts") {
        Some(_) => config.usize("num_local_experts")?,
        None => config.usize("num_experts")?,
    };
    let top_k = config.usize("num_experts_per_tok")?;
    if top_k == 0 || top_k > num_experts {
        return Err(config.unsupported(
            "num_experts_per_tok",
            format!("is {top_k}; each token goes to between 1 and the {num_experts} experts"),
        ));
    }
    let width = match model_type {
        "qwen2_moe" | "qwen3_moe" => config.usize("moe_intermediate_size")?,
        _ => config.usize("intermediate_size")?,
    };
    let norm = match model_type {
        // Mixtral's router always renormalises its top-k.
        "mixtral" => true,
        _ => config.bool_or("norm_topk_prob", false)?,
    };
    let mut moe = SparseMoeConfig::new(hidden, width, num_experts, top_k)
        .with_norm_topk_prob(norm)
        .with_activation(gated_activation(config, "hidden_act", "silu")?);
    // transformers adds the load-balancing loss, times its weight, when the
    // model outputs its router logits; Kiln logs it either way.
    if config.bool_or("output_router_logits", false)? {
        let default = if model_type == "olmoe" { 0.01 } else { 0.001 };
        let coef = config.f64_or("router_aux_loss_coef", default)?;
        if !(coef.is_finite() && coef >= 0.0) {
            return Err(config.unsupported(
                "router_aux_loss_coef",
                format!("is {coef}; a loss weight is 0 or more"),
            ));
        }
        moe = moe.with_router_aux_loss_coef(coef);
    }
    if model_type == "qwen2_moe" {
        let shared = config.usize("shared_expert_intermediate_size")?;
        if shared > 0 {
            moe = moe.with_shared_expert_dim(shared);
        }
    }
    Ok(moe)
}

fn build(config: &HfConfig, model_type: &str) -> Result<(Layer, NameMap)> {
    if config.f64_or("router_jitter_noise", 0.0)? != 0.0 {
        return Err(config.unsupported(
            "router_jitter_noise",
            "Kiln's router takes no jitter noise; set it to 0 (Mixtral's checkpoints do)",
        ));
    }
    if config.get("clip_qkv").is_some() {
        return Err(config.unsupported(
            "clip_qkv",
            "Kiln does not clamp the query, key and value projections; OLMoE's checkpoints \
             set it to null",
        ));
    }
    let layers = config.usize("num_hidden_layers")?;
    let sparse = sparse_layers(config, layers, model_type)?;
    let moe = experts(config, model_type)?;
    let dense = GatedMlpConfig::new(
        config.usize("hidden_size")?,
        config.usize("intermediate_size")?,
    )
    .with_activation(moe.activation);
    let module = match model_type {
        "mixtral" => "block_sparse_moe",
        _ => "mlp",
    };
    let feed_forward = |i: usize| -> Result<Option<(Layer, &'static str)>> {
        Ok(Some(if sparse[i] {
            (moe.clone().into(), module)
        } else {
            (dense.clone().into(), "mlp")
        }))
    };
    let (model, mut map) = build_with(config, model_type, &feed_forward)?;
    if model_type == "mixtral" {
        // Mixtral's experts name their projections w1 (gate), w3 (up) and w2 (down).
        for m in &mut map.mappings {
            if m.hf.contains(".block_sparse_moe.experts.") {
                m.hf =
                    m.hf.replace(".gate_proj.", ".w1.")
                        .replace(".up_proj.", ".w3.")
                        .replace(".down_proj.", ".w2.");
            }
        }
    }
    Ok((model, map))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> HfConfig {
        HfConfig::test(json)
    }

    #[test]
    fn qwen_keeps_the_layers_it_names_dense_and_every_family_checks_its_router() {
        let c = config(r#"{"decoder_sparse_step": 2, "mlp_only_layers": [3]}"#);
        assert_eq!(
            sparse_layers(&c, 6, "qwen3_moe").unwrap(),
            [false, true, false, false, false, true]
        );
        assert_eq!(sparse_layers(&c, 3, "mixtral").unwrap(), [true; 3]);
        for (json, needle) in [
            (r#"{"mlp_only_layers": [9]}"#, "below num_hidden_layers = 6"),
            (r#"{"mlp_only_layers": 1}"#, "expected a list"),
            (r#"{"decoder_sparse_step": 0}"#, "at least 1"),
        ] {
            let err = sparse_layers(&config(json), 6, "qwen2_moe")
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{json}: {err}");
        }
        let base = r#""hidden_size": 8, "intermediate_size": 16, "moe_intermediate_size": 4"#;
        let err = experts(
            &config(&format!(
                r#"{{{base}, "num_experts": 4, "num_experts_per_tok": 5}}"#
            )),
            "qwen3_moe",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("num_experts_per_tok"), "{err}");
        let moe = experts(
            &config(&format!(
                r#"{{{base}, "num_local_experts": 8, "num_experts_per_tok": 2}}"#
            )),
            "mixtral",
        )
        .unwrap();
        assert!(moe.norm_topk_prob);
        assert_eq!((moe.num_experts, moe.hidden_dim), (8, 16));
        assert_eq!(
            moe.router_aux_loss_coef, 0.0,
            "off without output_router_logits"
        );
    }

    #[test]
    fn output_router_logits_weighs_the_load_balancing_loss_with_the_familys_default() {
        let base = r#""hidden_size": 8, "intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "output_router_logits": true"#;
        let coef = |json: &str, family: &str| {
            experts(&config(&format!("{{{base}{json}}}")), family).map(|m| m.router_aux_loss_coef)
        };
        assert_eq!(coef("", "olmoe").unwrap(), 0.01);
        assert_eq!(coef("", "mixtral").unwrap(), 0.001);
        assert_eq!(
            coef(r#", "router_aux_loss_coef": 0.02"#, "mixtral").unwrap(),
            0.02
        );
        let err = coef(r#", "router_aux_loss_coef": -1"#, "olmoe")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("router_aux_loss_coef") && err.contains("0 or more"),
            "{err}"
        );
    }
}
