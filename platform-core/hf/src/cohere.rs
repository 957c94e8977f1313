//! Cohere (`cohere`: Command R): one LayerNorm without a bias per block
//! feeding the attention and the SwiGLU MLP side by side, in a parallel
//! residual `x + attn(ln(x)) + mlp(ln(x))`; grouped-query attention whose
//! RoPE rotates interleaved pairs of dimensions (`2 i` with `2 i + 1`),
//! which Kiln computes exactly by holding the rows of `q_proj` and `k_proj`
//! in its own order ([`RowOrder::RotaryPairs`], reordered as they load and
//! save); the head tied to the embedding by default and its logits scaled by
//! `logit_scale`. Command R+'s per-head QK LayerNorms (`use_qk_norm`) are
//! refused by name.

use kiln_core::model::{
    GatedMlpConfig, Layer, LayerNormConfig, LinearConfig, SelfAttentionConfig, TiedLinearConfig,
};

use crate::config::HfConfig;
use crate::error::Result;
use crate::family::Family;
use crate::llama::{gated_activation, padded_embedding, DecoderSizes};
use crate::names::{NameMap, RowOrder};

/// Cohere (`CohereForCausalLM`).
pub(crate) static COHERE: Family = Family::causal_lm("cohere", "Cohere", build);

fn build(config: &HfConfig, _architectures: &[String]) -> Result<(Layer, NameMap)> {
    if config.bool_or("use_qk_norm", false)? {
        return Err(config.unsupported(
            "use_qk_norm",
            "normalises each query and key head with a LayerNorm of its own (Command R+), \
             which Kiln does not build",
        ));
    }
    let DecoderSizes {
        vocab,
        hidden,
        layers,
        heads,
        kv_heads,
        head_dim,
        intermediate,
    } = DecoderSizes::of(config)?;
    let eps = config.f64_or("layer_norm_eps", 1e-5)?;
    let tied = config.bool_or("tie_word_embeddings", true)?;
    let bias = config.bool_or("attention_bias", false)?;
    let logit_scale = config.f64_or("logit_scale", 0.0625)?;
    let rope = crate::rope::rope(config, head_dim, "full_attention", &[], 500_000.0)?;
    if rope.rotary_dim(head_dim) != head_dim {
        return Err(config.unsupported(
            "partial_rotary_factor",
            "Cohere rotates every dimension of each head; a partial rotation of its interleaved \
             pairs is not built",
        ));
    }
    let norm = || -> Layer {
        LayerNormConfig::new([hidden])
            .with_eps(eps)
            .with_bias(false)
            .into()
    };
    let attention: Layer = SelfAttentionConfig::new(hidden, heads)
        .with_num_kv_heads(kv_heads)
        .with_head_dim(head_dim)
        .with_causal(true)
        .with_qkv_bias(bias)
        .with_out_bias(bias)
        .with_rope(rope)
        .with_dropout(config.f64_or("attention_dropout", 0.0)?)
        .into();
    let mlp: Layer = GatedMlpConfig::new(hidden, intermediate)
        .with_activation(gated_activation(config, "hidden_act", "silu")?)
        .into();
    let mut stack = vec![Layer::from(padded_embedding(config, vocab, hidden)?)];
    for _ in 0..layers {
        stack.push(Layer::residual(Layer::sequential([
            norm(),
            Layer::parallel([attention.clone(), mlp.clone()]),
        ])));
    }
    stack.push(norm());
    // The scale is part of the head, which a classifier's replaces.
    stack.push(Layer::sequential([
        if tied {
            TiedLinearConfig::new("0.weight", hidden, vocab).into()
        } else {
            LinearConfig::new(hidden, vocab).with_bias(false).into()
        },
        Layer::Scale {
            factor: logit_scale,
        },
    ]));
    let model = Layer::sequential(stack);

    let (mut map, names) = NameMap::for_model(&model)?;
    map.prefix(&names, "0", "model.embed_tokens");
    for i in 0..layers {
        let (k, hf) = (i + 1, format!("model.layers.{i}"));
        map.prefix(
            &names,
            &format!("{k}.block.0"),
            &format!("{hf}.input_layernorm"),
        );
        map.prefix(
            &names,
            &format!("{k}.block.1.0"),
            &format!("{hf}.self_attn"),
        );
        map.prefix(&names, &format!("{k}.block.1.1"), &format!("{hf}.mlp"));
        for proj in ["q_proj", "k_proj"] {
            for part in ["weight", "bias"] {
                map.order_rows(
                    &format!("{hf}.self_attn.{proj}.{part}"),
                    RowOrder::RotaryPairs { head_dim },
                );
            }
        }
    }
    map.prefix(&names, &(layers + 1).to_string(), "model.norm");
    if tied {
        map.ignored.push("lm_head.weight".to_owned());
    } else {
        map.prefix(&names, &format!("{}.0", layers + 2), "lm_head");
    }
    map.ignored_suffixes.push(".rotary_emb.inv_freq".to_owned());
    Ok((model, map))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZES: &str = r#""vocab_size": 64, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32"#;

    #[test]
    fn cohere_reorders_its_rotary_rows_and_refuses_command_r_plus_qk_norms() {
        let (model, map) = build(&HfConfig::test(&format!("{{{SIZES}}}")), &[]).unwrap();
        for proj in ["q_proj", "k_proj"] {
            let m = map
                .find(&format!("model.layers.0.self_attn.{proj}.weight"))
                .unwrap();
            assert_eq!(m.rows, RowOrder::RotaryPairs { head_dim: 8 }, "{proj}");
        }
        let v = map.find("model.layers.0.self_attn.v_proj.weight").unwrap();
        assert_eq!(v.rows, RowOrder::Concatenated);
        let scale = model.layers().into_iter().find_map(|(_, l)| match l {
            Layer::Scale { factor } => Some(*factor),
            _ => None,
        });
        assert_eq!(scale, Some(0.0625), "transformers' default logit_scale");
        for (key, value) in [("use_qk_norm", "true"), ("partial_rotary_factor", "0.5")] {
            let err = build(
                &HfConfig::test(&format!("{{{SIZES}, \"{key}\": {value}}}")),
                &[],
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains(key), "{err}");
        }
    }
}
