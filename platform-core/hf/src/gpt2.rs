//! GPT-2: token and learned position embeddings, pre-norm blocks of LayerNorm,
//! causal self-attention (its fused `c_attn` split into q, k and v) and a GELU
//! MLP, a final LayerNorm and the head tied to the token embedding. The
//! checkpoint's `Conv1D` weights are `[in, out]`: transposed on the way in and out.

use kiln_core::model::{
    EmbeddingConfig, GeluApproximation, Layer, LayerNormConfig, LinearConfig,
    PositionEmbeddingConfig, SelfAttentionConfig, TiedLinearConfig,
};

use crate::config::HfConfig;
use crate::error::Result;
use crate::family::{Family, FamilyTask};
use crate::names::{Mapping, NameMap, RowOrder};

/// GPT-2 (`GPT2LMHeadModel`).
pub(crate) static GPT2: Family = Family {
    model_type: "gpt2",
    name: "GPT-2",
    task: FamilyTask::CausalLm,
    architectures: &["ForCausalLM", "LMHeadModel"],
    hidden_size_key: "n_embd",
    fan_in_fan_out: true,
    build: |c, _| build(c),
};

/// The model of `config` and the names of its tensors in the checkpoint.
pub(crate) fn build(config: &HfConfig) -> Result<(Layer, NameMap)> {
    let vocab = config.usize("vocab_size")?;
    let embed = config.usize("n_embd")?;
    let layers = config.usize("n_layer")?;
    let heads = config.usize("n_head")?;
    config.check_heads("n_embd", embed, "n_head", heads)?;
    let positions = config.usize("n_positions")?;
    let inner = config.opt_usize("n_inner")?.unwrap_or(4 * embed);
    let eps = config.f64_or("layer_norm_epsilon", 1e-5)?;
    let activation = match config.str_or("activation_function", "gelu_new")? {
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Layer::Gelu {
            approximate: GeluApproximation::Tanh,
        },
        "gelu" => Layer::Gelu {
            approximate: GeluApproximation::None,
        },
        "relu" => Layer::Relu,
        _ => {
            return Err(config.unsupported(
                "activation_function",
                "Kiln builds gelu_new, gelu_pytorch_tanh, gelu or relu",
            ))
        }
    };
    if !config.bool_or("scale_attn_weights", true)? {
        return Err(config.unsupported(
            "scale_attn_weights",
            "Kiln scales scores by 1/sqrt(head_dim)",
        ));
    }
    config.refuse_unless(
        "scale_attn_by_inverse_layer_idx",
        |v| v == &serde_json::Value::Bool(false),
        "per-layer score scaling is not implemented",
    )?;
    config.refuse_unless(
        "add_cross_attention",
        |v| v == &serde_json::Value::Bool(false),
        "GPT-2 with cross-attention is an encoder-decoder model; Kiln builds the decoder alone",
    )?;
    if !config.bool_or("tie_word_embeddings", true)? {
        return Err(config.unsupported(
            "tie_word_embeddings",
            "GPT-2 checkpoints tie the head to `wte`; an untied head is not built",
        ));
    }
    let resid = config.f64_or("resid_pdrop", 0.1)?;
    let attention = SelfAttentionConfig::new(embed, heads)
        .with_causal(true)
        .with_qkv_bias(true)
        .with_out_bias(true)
        .with_dropout(config.f64_or("attn_pdrop", 0.1)?);
    let mut stack = vec![
        Layer::from(EmbeddingConfig::new(vocab, embed)),
        PositionEmbeddingConfig::new(positions, embed).into(),
        Layer::Dropout {
            p: config.f64_or("embd_pdrop", 0.1)?,
        },
    ];
    for _ in 0..layers {
        stack.push(Layer::sequential([
            Layer::residual(Layer::sequential([
                LayerNormConfig::new([embed]).with_eps(eps).into(),
                attention.clone().into(),
                Layer::Dropout { p: resid },
            ])),
            Layer::residual(Layer::sequential([
                LayerNormConfig::new([embed]).with_eps(eps).into(),
                LinearConfig::new(embed, inner).into(),
                activation.clone(),
                LinearConfig::new(inner, embed).into(),
                Layer::Dropout { p: resid },
            ])),
        ]));
    }
    stack.push(LayerNormConfig::new([embed]).with_eps(eps).into());
    stack.push(TiedLinearConfig::new("0.weight", embed, vocab).into());
    let model = Layer::sequential(stack);

    let (mut map, names) = NameMap::for_model(&model)?;
    map.prefix(&names, "0", "transformer.wte");
    map.prefix(&names, "1", "transformer.wpe");
    for i in 0..layers {
        let k = i + 3;
        let hf = format!("transformer.h.{i}");
        map.prefix(&names, &format!("{k}.0.block.0"), &format!("{hf}.ln_1"));
        for part in ["weight", "bias"] {
            map.mappings.push(Mapping {
                hf: format!("{hf}.attn.c_attn.{part}"),
                kiln: ["q_proj", "k_proj", "v_proj"]
                    .iter()
                    .map(|p| format!("{k}.0.block.1.{p}.{part}"))
                    .collect(),
                transposed: part == "weight",
                hf_shape: None,
                rows: RowOrder::Concatenated,
            });
        }
        map.prefix_with(
            &names,
            &format!("{k}.0.block.1.o_proj"),
            &format!("{hf}.attn.c_proj"),
            true,
        );
        map.prefix(&names, &format!("{k}.1.block.0"), &format!("{hf}.ln_2"));
        map.prefix_with(
            &names,
            &format!("{k}.1.block.1"),
            &format!("{hf}.mlp.c_fc"),
            true,
        );
        map.prefix_with(
            &names,
            &format!("{k}.1.block.3"),
            &format!("{hf}.mlp.c_proj"),
            true,
        );
    }
    map.prefix(&names, &(layers + 3).to_string(), "transformer.ln_f");
    map.ignored.push("lm_head.weight".to_owned());
    // The causal-mask buffers older checkpoints carry.
    map.ignored_suffixes.push(".attn.bias".to_owned());
    map.ignored_suffixes.push(".attn.masked_bias".to_owned());
    Ok((model, map))
}
