//! The LLaMA family (`llama`, `mistral`, `qwen2`, `qwen3`, `smollm3` with
//! its NoPE layers, and the block of `phi3`, `granite` with its multipliers
//! and `stablelm` with its LayerNorms): a token embedding,
//! pre-norm decoder blocks of RMSNorm, grouped-query self-attention with RoPE
//! (every scaling, [`crate::rope`]) within a sliding window where the family
//! has one ([`crate::layer_types`]) and a SwiGLU MLP, a final RMSNorm and the
//! language-model head.

use kiln_core::model::{
    EmbeddingConfig, GatedActivation, GatedMlpConfig, Layer, LayerNormConfig, LinearConfig,
    RmsNormConfig, SelfAttentionConfig, TiedLinearConfig,
};

use crate::config::HfConfig;
use crate::error::Result;
use crate::family::{Family, FamilyTask};
use crate::layer_types::{sliding_windows, Windows};
use crate::names::NameMap;

/// A row of the LLaMA block's families.
pub(crate) const fn decoder(
    model_type: &'static str,
    name: &'static str,
    build: crate::family::Build,
) -> Family {
    Family {
        model_type,
        name,
        task: FamilyTask::CausalLm,
        architectures: &["ForCausalLM", "LMHeadModel"],
        hidden_size_key: "hidden_size",
        fan_in_fan_out: false,
        build,
    }
}

/// LLaMA (`LlamaForCausalLM`).
pub(crate) static LLAMA: Family = decoder("llama", "LLaMA", |c, _| build(c, "llama"));
/// Mistral (`MistralForCausalLM`).
pub(crate) static MISTRAL: Family = decoder("mistral", "Mistral", |c, _| build(c, "mistral"));
/// Qwen2 (`Qwen2ForCausalLM`): biases on q, k and v.
pub(crate) static QWEN2: Family = decoder("qwen2", "Qwen2", |c, _| build(c, "qwen2"));
/// Qwen3 (`Qwen3ForCausalLM`): RMSNorm on q and k.
pub(crate) static QWEN3: Family = decoder("qwen3", "Qwen3", |c, _| build(c, "qwen3"));
/// Granite (`GraniteForCausalLM`): the LLaMA block with multipliers of the
/// embedding, the scores, the residual branches and the logits.
pub(crate) static GRANITE: Family = decoder("granite", "Granite", |c, _| build(c, "granite"));
/// SmolLM3 (`SmolLM3ForCausalLM`): every `no_rope_layer_interval`-th layer
/// (or those `no_rope_layers` marks 0) attends without RoPE.
pub(crate) static SMOLLM3: Family = decoder("smollm3", "SmolLM3", |c, _| build(c, "smollm3"));

/// Whether each of `layers` layers rotates its queries and keys: SmolLM3's
/// `no_rope_layers` (1 where a layer uses RoPE), by default all but every
/// `no_rope_layer_interval`-th; every layer in the other families.
fn rope_layers(config: &HfConfig, layers: usize, model_type: &str) -> Result<Vec<bool>> {
    if model_type != "smollm3" {
        return Ok(vec![true; layers]);
    }
    let wrong = |reason: String| crate::HfError::Config {
        path: config.path().to_owned(),
        key: "no_rope_layers".to_owned(),
        reason,
    };
    match config.get("no_rope_layers").filter(|v| !v.is_null()) {
        Some(list) => {
            let Some(list) = list.as_array() else {
                return Err(wrong(format!("expected a list of 0 and 1, got {list}")));
            };
            if list.len() != layers {
                return Err(wrong(format!(
                    "has {} entries for num_hidden_layers = {layers}; one per layer",
                    list.len()
                )));
            }
            list.iter()
                .map(|v| match v.as_u64() {
                    Some(0) => Ok(false),
                    Some(1) => Ok(true),
                    _ => Err(wrong(format!(
                        "has {v}; each entry is 1 (the layer uses RoPE) or 0 (NoPE)"
                    ))),
                })
                .collect()
        }
        None => {
            let interval = config.opt_usize("no_rope_layer_interval")?.unwrap_or(4);
            if interval == 0 {
                return Err(config.unsupported(
                    "no_rope_layer_interval",
                    "is 0; every interval-th layer is a NoPE layer, so it is at least 1",
                ));
            }
            Ok((0..layers).map(|i| (i + 1) % interval != 0).collect())
        }
    }
}

/// SmolLM3's sliding layers without `layer_types`: the NoPE layers, when
/// `use_sliding_window` and `sliding_window` are set (its config's default).
fn smollm3_windows(config: &HfConfig, ropes: &[bool]) -> Result<Option<Vec<Option<usize>>>> {
    if config.get("layer_types").is_some_and(|v| !v.is_null()) {
        return Ok(None);
    }
    let window = if config.bool_or("use_sliding_window", false)? {
        config.opt_usize("sliding_window")?
    } else {
        None
    };
    Ok(Some(
        ropes.iter().map(|rope| window.filter(|_| !rope)).collect(),
    ))
}

/// The sizes every decoder's `config.json` gives, checked.
pub(crate) struct DecoderSizes {
    pub(crate) vocab: usize,
    pub(crate) hidden: usize,
    pub(crate) layers: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) intermediate: usize,
}

impl DecoderSizes {
    /// The sizes of `config`: its heads dividing its width (or a
    /// `head_dim`), its key/value heads dividing its query heads.
    pub(crate) fn of(config: &HfConfig) -> Result<Self> {
        let hidden = config.usize("hidden_size")?;
        let heads = config.usize("num_attention_heads")?;
        config.check_heads("hidden_size", hidden, "num_attention_heads", heads)?;
        let kv_heads = config.opt_usize("num_key_value_heads")?.unwrap_or(heads);
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(crate::HfError::Config {
                path: config.path().to_owned(),
                key: "num_key_value_heads".to_owned(),
                reason: format!(
                    "is {kv_heads}, which does not divide num_attention_heads = {heads}: each \
                     key/value head serves a whole group of query heads"
                ),
            });
        }
        Ok(DecoderSizes {
            vocab: config.usize("vocab_size")?,
            hidden,
            layers: config.usize("num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim: config
                .opt_usize("head_dim")?
                .unwrap_or(hidden / heads.max(1)),
            intermediate: config.usize("intermediate_size")?,
        })
    }
}

/// The token embedding, with `pad_token_id` as its `padding_idx` when the
/// config names one in the vocabulary (`nn.Embedding(..., padding_idx)`, as
/// every decoder of `transformers` builds it: the padding row gets no gradient).
pub(crate) fn padded_embedding(
    config: &HfConfig,
    vocab: usize,
    hidden: usize,
) -> Result<EmbeddingConfig> {
    let embedding = EmbeddingConfig::new(vocab, hidden);
    Ok(
        match config.opt_usize("pad_token_id")?.filter(|p| *p < vocab) {
            Some(pad) => embedding.with_padding_idx(pad),
            None => embedding,
        },
    )
}

/// The gated MLP's activation that `key` names (`hidden_act`, Gemma's
/// `hidden_activation`), `default` when absent.
pub(crate) fn gated_activation(
    config: &HfConfig,
    key: &str,
    default: &str,
) -> Result<GatedActivation> {
    Ok(match config.str_or(key, default)? {
        "silu" | "swish" => GatedActivation::Silu,
        "gelu" => GatedActivation::Gelu,
        "gelu_pytorch_tanh" | "gelu_new" => GatedActivation::GeluTanh,
        _ => {
            return Err(config.unsupported(
                key,
                "Kiln's gated MLP takes silu, gelu or gelu_pytorch_tanh",
            ))
        }
    })
}

/// What a family on the LLaMA block puts in place of layer `i`'s MLP: the
/// layer, and its module's name in the checkpoint (`mlp`, Mixtral's
/// `block_sparse_moe`); `None` keeps the dense MLP.
pub(crate) type FeedForward<'a> = &'a dyn Fn(usize) -> Result<Option<(Layer, &'static str)>>;

/// The model of `config` and the names of its tensors in the checkpoint.
pub(crate) fn build(config: &HfConfig, model_type: &str) -> Result<(Layer, NameMap)> {
    build_with(config, model_type, &|_| Ok(None))
}

/// [`build`] with each layer's feed-forward block chosen by `feed_forward`
/// (the mixtures of experts).
pub(crate) fn build_with(
    config: &HfConfig,
    model_type: &str,
    feed_forward: FeedForward<'_>,
) -> Result<(Layer, NameMap)> {
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
    // StableLM's norms are LayerNorms with a bias; every other family's RMSNorms.
    let norm: Layer = match model_type {
        "stablelm" => LayerNormConfig::new([hidden])
            .with_eps(config.f64_or("layer_norm_eps", 1e-5)?)
            .into(),
        _ => RmsNormConfig::new(hidden).with_eps(eps).into(),
    };
    let tied = config.bool_or("tie_word_embeddings", model_type == "smollm3")?;
    let activation = gated_activation(config, "hidden_act", "silu")?;
    let (qkv_bias, out_bias) = match model_type {
        // Qwen2 has biases on q, k and v only.
        "qwen2" => (true, false),
        "qwen2_moe" => (config.bool_or("qkv_bias", true)?, false),
        "stablelm" => (config.bool_or("use_qkv_bias", false)?, false),
        "mixtral" => (false, false),
        _ => {
            let b = config.bool_or("attention_bias", false)?;
            (b, b)
        }
    };
    let mlp_bias = config.bool_or("mlp_bias", false)?;
    // Qwen3 normalises each query and key head; OLMoE each whole projection.
    let qk_norm = matches!(model_type, "qwen3" | "qwen3_moe" | "olmoe").then_some(eps);
    // Phi-3 reads its older "su" and "yarn" rope_types as LongRoPE.
    let aliases: &[(&str, &str)] = match model_type {
        "phi3" => &[("su", "longrope"), ("yarn", "longrope")],
        _ => &[],
    };
    let rope = crate::rope::rope(config, head_dim, "full_attention", aliases, 10_000.0)?;
    let rule = match model_type {
        // Qwen3-MoE's attention reads `sliding_window` whatever `use_sliding_window` says.
        "mistral" | "phi3" | "mixtral" | "qwen3_moe" => Windows::EveryLayer,
        "qwen2" | "qwen3" | "smollm3" | "qwen2_moe" => Windows::LayerTypes,
        _ => Windows::Never,
    };
    let ropes = rope_layers(config, layers, model_type)?;
    let windows = match model_type {
        "smollm3" => smollm3_windows(config, &ropes)?,
        _ => None,
    };
    let windows = match windows {
        Some(windows) => windows,
        None => sliding_windows(config, layers, rule)?,
    };
    let attention = SelfAttentionConfig::new(hidden, heads)
        .with_num_kv_heads(kv_heads)
        .with_head_dim(head_dim)
        .with_causal(true)
        .with_qkv_bias(qkv_bias)
        .with_out_bias(out_bias)
        .with_dropout(config.f64_or("attention_dropout", 0.0)?);
    let attention = match qk_norm {
        Some(eps) => attention
            .with_qk_norm_eps(eps)
            .with_qk_norm_across_heads(model_type == "olmoe"),
        None => attention,
    };
    let mlp = GatedMlpConfig::new(hidden, intermediate)
        .with_activation(activation)
        .with_bias(mlp_bias);
    // The dropout of each block's output before its residual add: Phi-3's
    // of both, StableLM's of the MLP's only.
    let (attention_dropout, mlp_dropout) = match model_type {
        "phi3" => {
            let p = config.f64_or("resid_pdrop", 0.0)?;
            (p, p)
        }
        "stablelm" => (0.0, config.f64_or("hidden_dropout", 0.0)?),
        _ => (0.0, 0.0),
    };
    // Granite's multipliers: of the embedding, the scores, each block's
    // output before its residual add, and (a divisor) the logits.
    let multiplier = |key: &str| -> Result<f64> {
        match model_type {
            "granite" => config.f64_or(key, 1.0),
            _ => Ok(1.0),
        }
    };
    let (embedding_multiplier, residual_multiplier, logits_scaling) = (
        multiplier("embedding_multiplier")?,
        multiplier("residual_multiplier")?,
        multiplier("logits_scaling")?,
    );
    if logits_scaling == 0.0 {
        return Err(config.unsupported("logits_scaling", "the logits are divided by it: not 0"));
    }
    let attention = match model_type {
        "granite" => attention.with_scale(config.f64_or("attention_multiplier", 1.0)?),
        _ => attention,
    };
    let mut embedding = padded_embedding(config, vocab, hidden)?;
    if embedding_multiplier != 1.0 {
        embedding = embedding.with_scale(embedding_multiplier);
    }
    let mut stack = vec![Layer::from(embedding)];
    let mut ffn_names = Vec::with_capacity(layers);
    for (i, (window, rotates)) in windows.iter().zip(&ropes).enumerate() {
        let (ffn, ffn_name) = match feed_forward(i)? {
            Some(chosen) => chosen,
            None => (mlp.clone().into(), "mlp"),
        };
        ffn_names.push(ffn_name);
        let mut attention = attention.clone();
        if *rotates {
            attention = attention.with_rope(rope.clone());
        }
        if let Some(w) = window {
            attention = attention.with_sliding_window(*w);
        }
        let residual = |block: Layer, dropout: f64| {
            let mut layers = vec![norm.clone(), block];
            if dropout > 0.0 {
                layers.push(Layer::Dropout { p: dropout });
            }
            if residual_multiplier != 1.0 {
                layers.push(Layer::Scale {
                    factor: residual_multiplier,
                });
            }
            Layer::residual(Layer::sequential(layers))
        };
        stack.push(Layer::sequential([
            residual(attention.into(), attention_dropout),
            residual(ffn, mlp_dropout),
        ]));
    }
    stack.push(norm.clone());
    let head: Layer = if tied {
        TiedLinearConfig::new("0.weight", hidden, vocab).into()
    } else {
        LinearConfig::new(hidden, vocab).with_bias(false).into()
    };
    // The head stays the last layer (what a new head replaces), its logits
    // scaling inside it.
    let (head, head_path) = if logits_scaling == 1.0 {
        (head, (layers + 2).to_string())
    } else {
        let scale = Layer::Scale {
            factor: 1.0 / logits_scaling,
        };
        (
            Layer::sequential([head, scale]),
            format!("{}.0", layers + 2),
        )
    };
    stack.push(head);
    let model = Layer::sequential(stack);

    let (mut map, names) = NameMap::for_model(&model)?;
    map.prefix(&names, "0", "model.embed_tokens");
    for (i, ffn_name) in ffn_names.iter().enumerate() {
        let k = i + 1;
        let hf = format!("model.layers.{i}");
        map.prefix(
            &names,
            &format!("{k}.0.block.0"),
            &format!("{hf}.input_layernorm"),
        );
        map.prefix(
            &names,
            &format!("{k}.0.block.1"),
            &format!("{hf}.self_attn"),
        );
        map.prefix(
            &names,
            &format!("{k}.1.block.0"),
            &format!("{hf}.post_attention_layernorm"),
        );
        map.prefix(
            &names,
            &format!("{k}.1.block.1"),
            &format!("{hf}.{ffn_name}"),
        );
    }
    map.prefix(&names, &(layers + 1).to_string(), "model.norm");
    if tied {
        // Some writers store the tied head anyway: the same tensor, dropped.
        map.ignored.push("lm_head.weight".to_owned());
    } else {
        map.prefix(&names, &head_path, "lm_head");
    }
    map.ignored_suffixes.push(".rotary_emb.inv_freq".to_owned());
    Ok((model, map))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> HfConfig {
        HfConfig::test(json)
    }

    #[test]
    fn smollm3_drops_rope_every_interval_and_slides_its_nope_layers_by_default() {
        let c = config(
            r#"{"no_rope_layer_interval": 3, "use_sliding_window": true, "sliding_window": 5}"#,
        );
        let ropes = rope_layers(&c, 6, "smollm3").unwrap();
        assert_eq!(ropes, [true, true, false, true, true, false]);
        assert_eq!(
            smollm3_windows(&c, &ropes).unwrap().unwrap(),
            [None, None, Some(5), None, None, Some(5)]
        );
        // The default interval is 4; other families always rotate.
        let c = config("{}");
        assert_eq!(
            rope_layers(&c, 4, "smollm3").unwrap(),
            [true, true, true, false]
        );
        assert_eq!(
            smollm3_windows(&c, &[true, false]).unwrap().unwrap(),
            [None, None]
        );
        assert_eq!(rope_layers(&c, 4, "llama").unwrap(), [true; 4]);
        // An explicit list wins, and layer_types then decide the windows.
        let c = config(
            r#"{"no_rope_layers": [0, 1], "layer_types": ["full_attention", "full_attention"]}"#,
        );
        assert_eq!(rope_layers(&c, 2, "smollm3").unwrap(), [false, true]);
        assert!(smollm3_windows(&c, &[false, true]).unwrap().is_none());
        for (json, needle) in [
            (
                r#"{"no_rope_layers": [1]}"#,
                "has 1 entries for num_hidden_layers = 2",
            ),
            (r#"{"no_rope_layers": [1, 2]}"#, "each entry is 1"),
            (r#"{"no_rope_layers": "all"}"#, "expected a list"),
            (r#"{"no_rope_layer_interval": 0}"#, "at least 1"),
        ] {
            let err = rope_layers(&config(json), 2, "smollm3")
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{json}: {err}");
        }
    }
}
