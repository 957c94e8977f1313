//! The Gemma family: Gemma (`gemma`), Gemma 2 (`gemma2`) and Gemma 3's text
//! model (`gemma3_text`: Gemma 3 270M and 1B). All three scale the token
//! embedding by `sqrt(hidden_size)`, normalise with `1 + weight` RMSNorms in
//! Gemma's float32 order, use a GeGLU MLP and tie the head to the embedding.
//! Gemma is otherwise the LLaMA block. Gemma 2 adds four norms per block
//! (before and after attention and the MLP), scores scaled by
//! `query_pre_attn_scalar ** -0.5` and softcapped
//! (`attn_logit_softcapping`), sliding-window layers alternating with
//! global ones, and softcapped logits (`final_logit_softcapping`). Gemma 3
//! adds `1 + weight` QK-norm and five local layers to one global
//! (`layer_types`, or `sliding_window_pattern`) whose RoPE bases differ
//! (`rope_parameters` per layer type, or the older `rope_theta` with
//! `rope_local_base_freq`).

use kiln_core::model::{
    GatedMlpConfig, Layer, LinearConfig, RmsNormConfig, RopeConfig, SelfAttentionConfig,
    TiedLinearConfig,
};
use serde_json::Value;

use crate::config::HfConfig;
use crate::error::Result;
use crate::family::Family;
use crate::layer_types::{sliding_layers, sliding_windows, Windows};
use crate::llama::{gated_activation, padded_embedding, DecoderSizes};
use crate::names::NameMap;

/// A generation of Gemma.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Generation {
    Gemma,
    Gemma2,
    Gemma3,
}

/// Gemma (`GemmaForCausalLM`).
pub(crate) static GEMMA: Family =
    Family::causal_lm("gemma", "Gemma", |c, _| build(c, Generation::Gemma));
/// Gemma 2 (`Gemma2ForCausalLM`).
pub(crate) static GEMMA2: Family =
    Family::causal_lm("gemma2", "Gemma 2", |c, _| build(c, Generation::Gemma2));
/// Gemma 3's text model (`Gemma3ForCausalLM`).
pub(crate) static GEMMA3_TEXT: Family = Family::causal_lm("gemma3_text", "Gemma 3", |c, _| {
    build(c, Generation::Gemma3)
});

/// The RoPE of Gemma 3's layers of `layer_type`: the nested
/// `rope_parameters` of `transformers` 5, or the older top-level keys
/// (global layers: `rope_theta` and `rope_scaling`; local ones:
/// `rope_local_base_freq`).
fn gemma3_rope(config: &HfConfig, head_dim: usize, layer_type: &str) -> Result<RopeConfig> {
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

/// A softcap key of `config`: `None` when absent or null, else a positive cap.
fn softcap(config: &HfConfig, key: &str) -> Result<Option<f64>> {
    if config.get(key).is_none() {
        return Ok(None);
    }
    let cap = config.f64_or(key, 0.0)?;
    if !(cap.is_finite() && cap > 0.0) {
        return Err(config.unsupported(
            key,
            format!("is {cap}; a softcap is a positive number (or null for none)"),
        ));
    }
    Ok(Some(cap))
}

fn build(config: &HfConfig, generation: Generation) -> Result<(Layer, NameMap)> {
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
    let activation = match generation {
        // transformers reads Gemma's legacy "gelu" as the tanh approximation.
        Generation::Gemma if config.str_or("hidden_act", "gelu_pytorch_tanh")? == "gelu" => {
            kiln_core::model::GatedActivation::GeluTanh
        }
        Generation::Gemma => gated_activation(config, "hidden_act", "gelu_pytorch_tanh")?,
        _ => gated_activation(config, "hidden_activation", "gelu_pytorch_tanh")?,
    };
    let (attention_cap, final_cap) = match generation {
        Generation::Gemma => (None, None),
        _ => (
            softcap(config, "attn_logit_softcapping")?,
            softcap(config, "final_logit_softcapping")?,
        ),
    };
    if config.bool_or("use_bidirectional_attention", false)? {
        return Err(config.unsupported(
            "use_bidirectional_attention",
            "Kiln builds Gemma as a causal language model",
        ));
    }
    let scale = match generation {
        Generation::Gemma => None,
        _ => {
            let scalar = config.f64_or("query_pre_attn_scalar", 256.0)?;
            if !(scalar.is_finite() && scalar > 0.0) {
                return Err(config.unsupported(
                    "query_pre_attn_scalar",
                    "must be a positive number: the scores are scaled by its inverse square root",
                ));
            }
            Some(1.0 / scalar.sqrt())
        }
    };
    let bias = config.bool_or("attention_bias", false)?;
    // Gemma 2 alternates local and global layers, Gemma 3 five to one.
    let (sliding, windows) = match generation {
        Generation::Gemma => (vec![false; layers], vec![None; layers]),
        Generation::Gemma2 if config.get("layer_types").is_none() => {
            let window = sliding_windows(config, layers, Windows::EveryLayer)?
                .first()
                .copied()
                .flatten();
            let sliding: Vec<bool> = (0..layers).map(|i| (i + 1) % 2 != 0).collect();
            let windows = sliding.iter().map(|s| window.filter(|_| *s)).collect();
            (sliding, windows)
        }
        _ => (
            sliding_layers(config, layers, Windows::Pattern)?,
            sliding_windows(config, layers, Windows::Pattern)?,
        ),
    };
    let (global_rope, local_rope) = match generation {
        Generation::Gemma3 => (
            gemma3_rope(config, head_dim, "full_attention")?,
            gemma3_rope(config, head_dim, "sliding_attention")?,
        ),
        _ => {
            let rope = crate::rope::rope(config, head_dim, "full_attention", &[], 10_000.0)?;
            (rope.clone(), rope)
        }
    };

    let norm = || -> Layer {
        RmsNormConfig::new(hidden)
            .with_eps(eps)
            .with_weight_offset(1.0)
            .into()
    };
    let mut attention = SelfAttentionConfig::new(hidden, heads)
        .with_num_kv_heads(kv_heads)
        .with_head_dim(head_dim)
        .with_causal(true)
        .with_qkv_bias(bias)
        .with_out_bias(bias)
        .with_dropout(config.f64_or("attention_dropout", 0.0)?);
    if generation == Generation::Gemma3 {
        attention = attention.with_qk_norm_eps(eps).with_qk_norm_offset(1.0);
    }
    if let Some(scale) = scale {
        attention = attention.with_scale(scale);
    }
    if let Some(cap) = attention_cap {
        attention = attention.with_softcap(cap);
    }
    let mlp: Layer = GatedMlpConfig::new(hidden, intermediate)
        .with_activation(activation)
        .into();
    let embedding = padded_embedding(config, vocab, hidden)?.with_scale((hidden as f64).sqrt());
    // Gemma normalises before each branch; Gemma 2 and 3 after it as well.
    let branch = |inner: Layer| -> Layer {
        match generation {
            Generation::Gemma => Layer::residual(Layer::sequential([norm(), inner])),
            _ => Layer::residual(Layer::sequential([norm(), inner, norm()])),
        }
    };
    let mut stack = vec![Layer::from(embedding)];
    for (slides, window) in sliding.iter().zip(&windows) {
        let rope = if *slides { &local_rope } else { &global_rope };
        let mut attention = attention.clone().with_rope(rope.clone());
        if let Some(w) = window {
            attention = attention.with_sliding_window(*w);
        }
        stack.push(Layer::sequential([
            branch(attention.into()),
            branch(mlp.clone()),
        ]));
    }
    stack.push(norm());
    let head: Layer = if tied {
        TiedLinearConfig::new("0.weight", hidden, vocab).into()
    } else {
        LinearConfig::new(hidden, vocab).with_bias(false).into()
    };
    // The head stays the last layer (what a new head replaces), with the
    // logits' softcap `cap * tanh(logits / cap)` inside it.
    let (head, head_path) = match final_cap {
        None => (head, (layers + 2).to_string()),
        Some(cap) => (
            Layer::sequential([
                head,
                Layer::Scale { factor: 1.0 / cap },
                Layer::Tanh,
                Layer::Scale { factor: cap },
            ]),
            format!("{}.0", layers + 2),
        ),
    };
    stack.push(head);
    let model = Layer::sequential(stack);

    let (mut map, names) = NameMap::for_model(&model)?;
    map.prefix(&names, "0", "model.embed_tokens");
    let blocks: &[(&str, &str)] = match generation {
        Generation::Gemma => &[
            ("0.block.0", "input_layernorm"),
            ("0.block.1", "self_attn"),
            ("1.block.0", "post_attention_layernorm"),
            ("1.block.1", "mlp"),
        ],
        _ => &[
            ("0.block.0", "input_layernorm"),
            ("0.block.1", "self_attn"),
            ("0.block.2", "post_attention_layernorm"),
            ("1.block.0", "pre_feedforward_layernorm"),
            ("1.block.1", "mlp"),
            ("1.block.2", "post_feedforward_layernorm"),
        ],
    };
    for i in 0..layers {
        let k = i + 1;
        let hf = format!("model.layers.{i}");
        for (kiln, name) in blocks {
            map.prefix(&names, &format!("{k}.{kiln}"), &format!("{hf}.{name}"));
        }
    }
    map.prefix(&names, &(layers + 1).to_string(), "model.norm");
    if tied {
        map.ignored.push("lm_head.weight".to_owned());
    } else {
        map.prefix(&names, &head_path, "lm_head");
    }
    map.ignored_suffixes.push(".rotary_emb.inv_freq".to_owned());
    Ok((model, map))
}
