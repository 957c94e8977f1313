//! Gemma 3's text model (`gemma3_text`: Gemma 3 270M and 1B): the token
//! embedding scaled by `sqrt(hidden_size)`, blocks of five sliding-window
//! layers to one global (`layer_types`, or `sliding_window_pattern`) whose
//! RoPE bases differ (`rope_parameters` per layer type, or the older
//! `rope_theta` with `rope_local_base_freq`), four `1 + weight` RMSNorms per
//! block (before and after attention and the MLP), `1 + weight` QK-norm, the
//! scores scaled by `query_pre_attn_scalar ** -0.5`, a GeGLU MLP and the head
//! tied to the embedding.

use kiln_core::model::{
    EmbeddingConfig, GatedMlpConfig, Layer, LinearConfig, RmsNormConfig, RopeConfig,
    SelfAttentionConfig, TiedLinearConfig,
};
use serde_json::Value;

use crate::config::HfConfig;
use crate::error::Result;
use crate::family::{Family, FamilyTask};
use crate::layer_types::{sliding_layers, sliding_windows, Windows};
use crate::llama::{gated_activation, DecoderSizes};
use crate::names::NameMap;

/// Gemma 3's text model (`Gemma3ForCausalLM`).
pub(crate) static GEMMA3_TEXT: Family = Family {
    model_type: "gemma3_text",
    name: "Gemma 3",
    task: FamilyTask::CausalLm,
    architectures: &["ForCausalLM"],
    hidden_size_key: "hidden_size",
    fan_in_fan_out: false,
    build,
};

/// The RoPE of the layers of `layer_type`: the nested `rope_parameters` of
/// `transformers` 5, or the older top-level keys (global layers:
/// `rope_theta` and `rope_scaling`; local ones: `rope_local_base_freq`).
fn rope(config: &HfConfig, head_dim: usize, layer_type: &str) -> Result<RopeConfig> {
    let nested = config
        .get("rope_parameters")
        .and_then(Value::as_object)
        .is_some_and(|m| m.get(layer_type).is_some_and(Value::is_object));
    if nested || layer_type == "full_attention" {
        return crate::rope::rope(config, head_dim, layer_type, &[], 1_000_000.0);
    }
    Ok(RopeConfig::new(
        config.f64_or("rope_local_base_freq", 10_000.0)?,
    ))
}

fn build(config: &HfConfig, _architectures: &[String]) -> Result<(Layer, NameMap)> {
    let DecoderSizes {
        vocab,
        hidden,
        layers,
        heads,
        kv_heads,
        head_dim,
        intermediate,
    } = DecoderSizes::of(config)?;
    let eps = config.f64_or("rms_norm_eps", 1e-6)?;
    let tied = config.bool_or("tie_word_embeddings", true)?;
    let activation = gated_activation(config, "hidden_activation", "gelu_pytorch_tanh")?;
    for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if config.get(key).is_some() {
            return Err(config.unsupported(
                key,
                "Kiln does not softcap logits yet; Gemma 3's checkpoints set it to null",
            ));
        }
    }
    if config.bool_or("use_bidirectional_attention", false)? {
        return Err(config.unsupported(
            "use_bidirectional_attention",
            "Kiln builds Gemma 3 as a causal language model",
        ));
    }
    let scalar = config.f64_or("query_pre_attn_scalar", 256.0)?;
    if !(scalar.is_finite() && scalar > 0.0) {
        return Err(config.unsupported(
            "query_pre_attn_scalar",
            "must be a positive number: the scores are scaled by its inverse square root",
        ));
    }
    let bias = config.bool_or("attention_bias", false)?;
    let sliding = sliding_layers(config, layers, Windows::Pattern)?;
    let windows = sliding_windows(config, layers, Windows::Pattern)?;
    let global_rope = rope(config, head_dim, "full_attention")?;
    let local_rope = rope(config, head_dim, "sliding_attention")?;

    let norm = || -> Layer {
        RmsNormConfig::new(hidden)
            .with_eps(eps)
            .with_weight_offset(1.0)
            .into()
    };
    let attention = SelfAttentionConfig::new(hidden, heads)
        .with_num_kv_heads(kv_heads)
        .with_head_dim(head_dim)
        .with_causal(true)
        .with_qkv_bias(bias)
        .with_out_bias(bias)
        .with_qk_norm_eps(eps)
        .with_qk_norm_offset(1.0)
        .with_scale(1.0 / scalar.sqrt())
        .with_dropout(config.f64_or("attention_dropout", 0.0)?);
    let mlp: Layer = GatedMlpConfig::new(hidden, intermediate)
        .with_activation(activation)
        .into();
    let mut embedding = EmbeddingConfig::new(vocab, hidden).with_scale((hidden as f64).sqrt());
    if let Some(pad) = config.opt_usize("pad_token_id")?.filter(|p| *p < vocab) {
        // `nn.Embedding(..., padding_idx)`: the padding row gets no gradient.
        embedding = embedding.with_padding_idx(pad);
    }
    let mut stack = vec![Layer::from(embedding)];
    for (slides, window) in sliding.iter().zip(&windows) {
        let rope = if *slides { &local_rope } else { &global_rope };
        let mut attention = attention.clone().with_rope(rope.clone());
        if let Some(w) = window {
            attention = attention.with_sliding_window(*w);
        }
        stack.push(Layer::sequential([
            Layer::residual(Layer::sequential([norm(), attention.into(), norm()])),
            Layer::residual(Layer::sequential([norm(), mlp.clone(), norm()])),
        ]));
    }
    stack.push(norm());
    stack.push(if tied {
        TiedLinearConfig::new("0.weight", hidden, vocab).into()
    } else {
        LinearConfig::new(hidden, vocab).with_bias(false).into()
    });
    let model = Layer::sequential(stack);

    let (mut map, names) = NameMap::for_model(&model)?;
    map.prefix(&names, "0", "model.embed_tokens");
    for i in 0..layers {
        let k = i + 1;
        let hf = format!("model.layers.{i}");
        for (kiln, name) in [
            ("0.block.0", "input_layernorm"),
            ("0.block.1", "self_attn"),
            ("0.block.2", "post_attention_layernorm"),
            ("1.block.0", "pre_feedforward_layernorm"),
            ("1.block.1", "mlp"),
            ("1.block.2", "post_feedforward_layernorm"),
        ] {
            map.prefix(&names, &format!("{k}.{kiln}"), &format!("{hf}.{name}"));
        }
    }
    map.prefix(&names, &(layers + 1).to_string(), "model.norm");
    if tied {
        map.ignored.push("lm_head.weight".to_owned());
    } else {
        map.prefix(&names, &(layers + 2).to_string(), "lm_head");
    }
    map.ignored_suffixes.push(".rotary_emb.inv_freq".to_owned());
    Ok((model, map))
}
