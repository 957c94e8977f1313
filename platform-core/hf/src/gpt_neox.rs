//! GPT-NeoX (`gpt_neox`: Pythia, GPT-NeoX 20B): LayerNorms with biases,
//! attention from one fused `query_key_value` tensor whose rows go head by
//! head (`[q_0, k_0, v_0, q_1, ...]`, [`RowOrder::PerHead`]), RoPE on the first
//! `rotary_pct` of each head (0.25 by default), a GELU MLP, dropout after
//! each branch (`hidden_dropout`), and the parallel residual
//! `x + attn(ln1(x)) + mlp(ln2(x))` (`use_parallel_residual`, true in every
//! published checkpoint), or the sequential one.

use kiln_core::model::{
    EmbeddingConfig, GeluApproximation, Layer, LayerNormConfig, LinearConfig, SelfAttentionConfig,
    TiedLinearConfig,
};
use serde_json::Value;

use crate::config::HfConfig;
use crate::error::Result;
use crate::family::Family;
use crate::names::{NameMap, RowOrder};

/// GPT-NeoX (`GPTNeoXForCausalLM`).
pub(crate) static GPT_NEOX: Family = Family::causal_lm("gpt_neox", "GPT-NeoX", build);

/// The MLP's activation (`hidden_act`, GELU by default).
fn activation(config: &HfConfig) -> Result<Layer> {
    Ok(match config.str_or("hidden_act", "gelu")? {
        "gelu" => Layer::Gelu {
            approximate: GeluApproximation::None,
        },
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Layer::Gelu {
            approximate: GeluApproximation::Tanh,
        },
        "relu" => Layer::Relu,
        "silu" | "swish" => Layer::Silu,
        _ => {
            return Err(config.unsupported(
                "hidden_act",
                "Kiln's GPT-NeoX MLP takes gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, relu or \
                 silu",
            ))
        }
    })
}

/// `config` with the rotary keys older GPT-NeoX files name their own way
/// (`rotary_pct`, `rotary_emb_base`) under the names [`crate::rope`] reads,
/// with `transformers`' defaults (a quarter of each head, base 10000).
fn with_rope_keys(config: &HfConfig) -> Result<HfConfig> {
    let params = config.get("rope_parameters").and_then(Value::as_object);
    let named =
        |key: &str| config.get(key).is_some() || params.is_some_and(|p| p.contains_key(key));
    let mut config = config.clone();
    if !named("partial_rotary_factor") {
        let pct = config.f64_or("rotary_pct", 0.25)?;
        config.set("partial_rotary_factor", Value::from(pct));
    }
    if !named("rope_theta") {
        let base = config.f64_or("rotary_emb_base", 10_000.0)?;
        config.set("rope_theta", Value::from(base));
    }
    Ok(config)
}

fn build(config: &HfConfig, _architectures: &[String]) -> Result<(Layer, NameMap)> {
    let config = &with_rope_keys(config)?;
    let vocab = config.usize("vocab_size")?;
    let hidden = config.usize("hidden_size")?;
    let layers = config.usize("num_hidden_layers")?;
    let heads = config.usize("num_attention_heads")?;
    config.check_heads("hidden_size", hidden, "num_attention_heads", heads)?;
    let head_dim = hidden / heads;
    let intermediate = config.usize("intermediate_size")?;
    let eps = config.f64_or("layer_norm_eps", 1e-5)?;
    let bias = config.bool_or("attention_bias", true)?;
    let tied = config.bool_or("tie_word_embeddings", false)?;
    let parallel = config.bool_or("use_parallel_residual", true)?;
    let dropout = config.f64_or("hidden_dropout", 0.0)?;
    let rope = crate::rope::rope(config, head_dim, "full_attention", &[], 10_000.0)?;
    let norm = || -> Layer { LayerNormConfig::new([hidden]).with_eps(eps).into() };
    let attention: Layer = SelfAttentionConfig::new(hidden, heads)
        .with_causal(true)
        .with_qkv_bias(bias)
        .with_out_bias(bias)
        .with_rope(rope)
        .with_dropout(config.f64_or("attention_dropout", 0.0)?)
        .into();
    let attention_branch = Layer::sequential([norm(), attention, Layer::Dropout { p: dropout }]);
    let mlp_branch = Layer::sequential([
        norm(),
        LinearConfig::new(hidden, intermediate).into(),
        activation(config)?,
        LinearConfig::new(intermediate, hidden).into(),
        Layer::Dropout { p: dropout },
    ]);
    let mut stack = vec![
        Layer::from(EmbeddingConfig::new(vocab, hidden)),
        Layer::Dropout { p: dropout },
    ];
    for _ in 0..layers {
        stack.push(if parallel {
            Layer::residual(Layer::parallel([
                attention_branch.clone(),
                mlp_branch.clone(),
            ]))
        } else {
            Layer::sequential([
                Layer::residual(attention_branch.clone()),
                Layer::residual(mlp_branch.clone()),
            ])
        });
    }
    stack.push(norm());
    stack.push(if tied {
        TiedLinearConfig::new("0.weight", hidden, vocab).into()
    } else {
        LinearConfig::new(hidden, vocab).with_bias(false).into()
    });
    let model = Layer::sequential(stack);

    let (mut map, names) = NameMap::for_model(&model)?;
    map.prefix(&names, "0", "gpt_neox.embed_in");
    for i in 0..layers {
        let hf = format!("gpt_neox.layers.{i}");
        let (attn, mlp) = if parallel {
            (format!("{}.block.0", i + 2), format!("{}.block.1", i + 2))
        } else {
            (format!("{}.0.block", i + 2), format!("{}.1.block", i + 2))
        };
        map.prefix(
            &names,
            &format!("{attn}.0"),
            &format!("{hf}.input_layernorm"),
        );
        map.prefix(
            &names,
            &format!("{attn}.1.o_proj"),
            &format!("{hf}.attention.dense"),
        );
        for p in ["q_proj", "k_proj", "v_proj"] {
            map.prefix(
                &names,
                &format!("{attn}.1.{p}"),
                &format!("{hf}.attention.{p}"),
            );
        }
        for part in ["weight", "bias"] {
            let parts: Vec<String> = ["q_proj", "k_proj", "v_proj"]
                .iter()
                .map(|p| format!("{hf}.attention.{p}.{part}"))
                .collect();
            let fused = format!("{hf}.attention.query_key_value.{part}");
            map.fuse(&parts, &fused);
            map.order_rows(&fused, RowOrder::PerHead { heads });
        }
        map.prefix(
            &names,
            &format!("{mlp}.0"),
            &format!("{hf}.post_attention_layernorm"),
        );
        map.prefix(
            &names,
            &format!("{mlp}.1"),
            &format!("{hf}.mlp.dense_h_to_4h"),
        );
        map.prefix(
            &names,
            &format!("{mlp}.3"),
            &format!("{hf}.mlp.dense_4h_to_h"),
        );
    }
    map.prefix(
        &names,
        &(layers + 2).to_string(),
        "gpt_neox.final_layer_norm",
    );
    if tied {
        map.ignored.push("embed_out.weight".to_owned());
    } else {
        map.prefix(&names, &(layers + 3).to_string(), "embed_out");
    }
    // The causal-mask and rotary buffers older checkpoints carry.
    for suffix in [
        ".attention.bias",
        ".attention.masked_bias",
        ".attention.rotary_emb.inv_freq",
        ".rotary_emb.inv_freq",
    ] {
        map.ignored_suffixes.push(suffix.to_owned());
    }
    Ok((model, map))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZES: &str = r#""vocab_size": 64, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 32"#;

    fn rotated(model: &Layer) -> Vec<(usize, f64)> {
        model
            .layers()
            .into_iter()
            .filter_map(|(_, l)| match l {
                Layer::SelfAttention(a) => a.rope.as_ref().map(|r| (r.rotary_dim(8), r.theta)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn pythia_files_rotate_their_rotary_pct_in_a_parallel_residual() {
        let (model, map) = build(
            &HfConfig::test(&format!(
                "{{{SIZES}, \"rotary_pct\": 0.5, \"rotary_emb_base\": 5000}}"
            )),
            &[],
        )
        .unwrap();
        assert_eq!(rotated(&model), [(4, 5000.0)]);
        assert!(matches!(model.layers()[3].1, Layer::Residual { .. }));
        assert!(matches!(model.layers()[4].1, Layer::Parallel { .. }));
        let qkv = map
            .find("gpt_neox.layers.0.attention.query_key_value.weight")
            .unwrap();
        assert_eq!(
            qkv.kiln,
            [
                "2.block.0.1.q_proj.weight",
                "2.block.0.1.k_proj.weight",
                "2.block.0.1.v_proj.weight"
            ]
        );
        assert_eq!(qkv.rows, RowOrder::PerHead { heads: 2 });
        // transformers' defaults: a quarter of each head, base 10000; and the
        // sequential residual when the config turns the parallel one off.
        let (model, _) = build(
            &HfConfig::test(&format!("{{{SIZES}, \"use_parallel_residual\": false}}")),
            &[],
        )
        .unwrap();
        assert_eq!(rotated(&model), [(2, 10_000.0)]);
        assert!(!model
            .layers()
            .iter()
            .any(|(_, l)| matches!(l, Layer::Parallel { .. })));
        let err = build(
            &HfConfig::test(&format!("{{{SIZES}, \"hidden_act\": \"mish\"}}")),
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("hidden_act"), "{err}");
    }
}
