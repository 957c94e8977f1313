//! OLMo 2 (`olmo2`): the LLaMA block with its norms after each branch
//! instead of before it (`post_attention_layernorm` on the attention's
//! output, `post_feedforward_layernorm` on the MLP's, each before the
//! residual add), QK-norm over each whole projection, and every RMSNorm
//! scaling in float32 before the cast back (`Olmo2RMSNorm`'s order).

use kiln_core::model::{
    GatedMlpConfig, Layer, LinearConfig, RmsNormConfig, SelfAttentionConfig, TiedLinearConfig,
};

use crate::config::HfConfig;
use crate::error::Result;
use crate::family::Family;
use crate::llama::{gated_activation, padded_embedding, DecoderSizes};
use crate::names::NameMap;

/// OLMo 2 (`Olmo2ForCausalLM`).
pub(crate) static OLMO2: Family = Family::causal_lm("olmo2", "OLMo 2", build);

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
    let eps = config.f64_or("rms_norm_eps", 1e-5)?;
    let tied = config.bool_or("tie_word_embeddings", false)?;
    let bias = config.bool_or("attention_bias", false)?;
    let rope = crate::rope::rope(config, head_dim, "full_attention", &[], 10_000.0)?;
    let norm = || -> Layer {
        RmsNormConfig::new(hidden)
            .with_eps(eps)
            .with_scale_in_float32(true)
            .into()
    };
    let attention: Layer = SelfAttentionConfig::new(hidden, heads)
        .with_num_kv_heads(kv_heads)
        .with_head_dim(head_dim)
        .with_causal(true)
        .with_qkv_bias(bias)
        .with_out_bias(bias)
        .with_rope(rope)
        .with_qk_norm_eps(eps)
        .with_qk_norm_across_heads(true)
        .with_qk_norm_scale_in_float32(true)
        .with_dropout(config.f64_or("attention_dropout", 0.0)?)
        .into();
    let mlp: Layer = GatedMlpConfig::new(hidden, intermediate)
        .with_activation(gated_activation(config, "hidden_act", "silu")?)
        .into();
    let mut stack = vec![Layer::from(padded_embedding(config, vocab, hidden)?)];
    for _ in 0..layers {
        stack.push(Layer::sequential([
            Layer::residual(Layer::sequential([attention.clone(), norm()])),
            Layer::residual(Layer::sequential([mlp.clone(), norm()])),
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
        let (k, hf) = (i + 1, format!("model.layers.{i}"));
        for (kiln, name) in [
            ("0.block.0", "self_attn"),
            ("0.block.1", "post_attention_layernorm"),
            ("1.block.0", "mlp"),
            ("1.block.1", "post_feedforward_layernorm"),
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
