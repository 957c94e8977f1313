//! StableLM (`stablelm`, StableLM 2 and StableLM-Zephyr): the LLaMA block
//! with LayerNorms (with biases) in place of RMSNorms, rotary embeddings on
//! the first `partial_rotary_factor` (default 0.25) of each head, optional
//! biases on q, k and v (`use_qkv_bias`), and dropout of the MLP's output
//! (`hidden_dropout`). The 12B model's parallel residual and per-head
//! LayerNorms on q and k are refused by name.

use kiln_core::model::Layer;

use crate::config::HfConfig;
use crate::error::Result;
use crate::family::Family;
use crate::llama::{build_with, decoder};
use crate::names::NameMap;

/// StableLM (`StableLmForCausalLM`).
pub(crate) static STABLELM: Family = decoder("stablelm", "StableLM", |c, _| build(c));

fn build(config: &HfConfig) -> Result<(Layer, NameMap)> {
    if config.bool_or("use_parallel_residual", false)? {
        return Err(config.unsupported(
            "use_parallel_residual",
            "adds the attention and the MLP of the same normalised input in one residual; \
             Kiln's StableLM blocks run them one after the other (the StableLM 2 1.6B and \
             Zephyr checkpoints do)",
        ));
    }
    if config.bool_or("qk_layernorm", false)? {
        return Err(config.unsupported(
            "qk_layernorm",
            "normalises each query and key head with a LayerNorm of its own, which Kiln does \
             not build",
        ));
    }
    // transformers' default when neither the config nor its rope_parameters
    // name the rotated share.
    let named = config.get("partial_rotary_factor").is_some()
        || config
            .get("rope_parameters")
            .and_then(|p| p.get("partial_rotary_factor"))
            .is_some();
    if named {
        return build_with(config, "stablelm", &|_| Ok(None));
    }
    let mut config = config.clone();
    config.set("partial_rotary_factor", serde_json::Value::from(0.25));
    build_with(&config, "stablelm", &|_| Ok(None))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZES: &str = r#""vocab_size": 64, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 32"#;

    #[test]
    fn stablelm_rotates_a_quarter_of_each_head_by_default_and_refuses_the_12b_block() {
        let (model, _) = build(&HfConfig::test(&format!("{{{SIZES}}}"))).unwrap();
        let rotated: Vec<usize> = model
            .layers()
            .into_iter()
            .filter_map(|(_, l)| match l {
                Layer::SelfAttention(a) => a.rope.as_ref().map(|r| r.rotary_dim(8)),
                _ => None,
            })
            .collect();
        assert_eq!(rotated, [2], "a quarter of head_dim 8");
        assert!(model
            .layers()
            .iter()
            .any(|(_, l)| matches!(l, Layer::LayerNorm(_))));
        for key in ["use_parallel_residual", "qk_layernorm"] {
            let err = build(&HfConfig::test(&format!("{{{SIZES}, \"{key}\": true}}")))
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{err}");
        }
    }
}
