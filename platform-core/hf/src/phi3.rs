//! Phi-3 (`phi3`: Phi-3, Phi-3.5-mini, Phi-4-mini): the LLaMA block with
//! fused `qkv_proj` and `gate_up_proj` tensors, LongRoPE (its older `"su"`
//! and `"yarn"` names too) with partial rotary embeddings, a sliding window
//! on every layer, and dropout on each block's output (`resid_pdrop`).

use kiln_core::model::Layer;

use crate::config::HfConfig;
use crate::error::Result;
use crate::family::Family;
use crate::names::NameMap;

/// Phi-3 (`Phi3ForCausalLM`).
pub(crate) static PHI3: Family = Family::causal_lm("phi3", "Phi-3", build);

fn build(config: &HfConfig, _architectures: &[String]) -> Result<(Layer, NameMap)> {
    let (model, mut map) = crate::llama::build(config, "phi3")?;
    for i in 0..config.usize("num_hidden_layers")? {
        let layer = format!("model.layers.{i}");
        let parts = |block: &str, names: &[&str]| -> Vec<String> {
            names
                .iter()
                .map(|n| format!("{layer}.{block}.{n}.weight"))
                .collect()
        };
        map.fuse(
            &parts("self_attn", &["q_proj", "k_proj", "v_proj"]),
            &format!("{layer}.self_attn.qkv_proj.weight"),
        );
        map.fuse(
            &parts("mlp", &["gate_proj", "up_proj"]),
            &format!("{layer}.mlp.gate_up_proj.weight"),
        );
    }
    Ok((model, map))
}
