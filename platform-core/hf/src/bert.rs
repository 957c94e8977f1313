//! BERT (`BertForSequenceClassification`, or the bare `BertModel`): word,
//! position and token-type embeddings (one segment) with LayerNorm, post-norm
//! encoder blocks of self-attention and a GELU MLP, then the pooler (the
//! first token through a dense layer and tanh) and the classifier.

use kiln_core::model::{
    EmbeddingConfig, GeluApproximation, Layer, LayerNormConfig, LinearConfig,
    PositionEmbeddingConfig, SelfAttentionConfig, TokenTypeEmbeddingConfig,
};

use crate::config::HfConfig;
use crate::error::Result;
use crate::family::{Family, FamilyTask};
use crate::names::NameMap;

/// BERT (`BertForSequenceClassification`, or the bare `BertModel`).
pub(crate) static BERT: Family = Family {
    model_type: "bert",
    name: "BERT",
    task: FamilyTask::Encoder,
    architectures: &["ForSequenceClassification", "BertModel"],
    hidden_size_key: "hidden_size",
    fan_in_fan_out: false,
    build: |c, archs| build(c, !archs.iter().any(|a| a == "BertModel")),
};

/// The model of `config` and the names of its tensors in the checkpoint;
/// `classifier` builds `BertForSequenceClassification`, else `BertModel`.
pub(crate) fn build(config: &HfConfig, classifier: bool) -> Result<(Layer, NameMap)> {
    let vocab = config.usize("vocab_size")?;
    let hidden = config.usize("hidden_size")?;
    let layers = config.usize("num_hidden_layers")?;
    let heads = config.usize("num_attention_heads")?;
    config.check_heads("hidden_size", hidden, "num_attention_heads", heads)?;
    let intermediate = config.usize("intermediate_size")?;
    let positions = config.usize("max_position_embeddings")?;
    let types = config.opt_usize("type_vocab_size")?.unwrap_or(2);
    let eps = config.f64_or("layer_norm_eps", 1e-12)?;
    let dropout = config.f64_or("hidden_dropout_prob", 0.1)?;
    let activation = match config.str_or("hidden_act", "gelu")? {
        "gelu" => GeluApproximation::None,
        "gelu_new" | "gelu_pytorch_tanh" => GeluApproximation::Tanh,
        _ => return Err(config.unsupported("hidden_act", "Kiln builds BERT with gelu or gelu_new")),
    };
    config.refuse_unless(
        "position_embedding_type",
        |v| v.as_str() == Some("absolute"),
        "relative position embeddings are not implemented",
    )?;
    config.refuse_unless(
        "is_decoder",
        |v| v == &serde_json::Value::Bool(false),
        "Kiln builds BERT as an encoder",
    )?;
    let mut word = EmbeddingConfig::new(vocab, hidden);
    if let Some(pad) = config.opt_usize("pad_token_id")? {
        word = word.with_padding_idx(pad);
    }
    let attention = SelfAttentionConfig::new(hidden, heads)
        .with_qkv_bias(true)
        .with_out_bias(true)
        .with_dropout(config.f64_or("attention_probs_dropout_prob", 0.1)?);
    let mut stack = vec![
        Layer::from(word),
        PositionEmbeddingConfig::new(positions, hidden).into(),
        TokenTypeEmbeddingConfig::new(types, hidden).into(),
        LayerNormConfig::new([hidden]).with_eps(eps).into(),
        Layer::Dropout { p: dropout },
    ];
    for _ in 0..layers {
        stack.push(Layer::sequential([
            Layer::residual(Layer::sequential([
                attention.clone().into(),
                Layer::Dropout { p: dropout },
            ])),
            LayerNormConfig::new([hidden]).with_eps(eps).into(),
            Layer::residual(Layer::sequential([
                LinearConfig::new(hidden, intermediate).into(),
                Layer::Gelu {
                    approximate: activation,
                },
                LinearConfig::new(intermediate, hidden).into(),
                Layer::Dropout { p: dropout },
            ])),
            LayerNormConfig::new([hidden]).with_eps(eps).into(),
        ]));
    }
    let body = stack.len();
    let labels = num_labels(config)?;
    if classifier {
        let classifier_dropout = config.f64_or("classifier_dropout", dropout)?;
        stack.extend([
            Layer::Select { dim: 1, index: 0 },
            LinearConfig::new(hidden, hidden).into(),
            Layer::Tanh,
            Layer::Dropout {
                p: classifier_dropout,
            },
            LinearConfig::new(hidden, labels).into(),
        ]);
    }
    let model = Layer::sequential(stack);

    let root = if classifier { "bert." } else { "" };
    let (mut map, names) = NameMap::for_model(&model)?;
    let emb = format!("{root}embeddings");
    map.prefix(&names, "0", &format!("{emb}.word_embeddings"));
    map.prefix(&names, "1", &format!("{emb}.position_embeddings"));
    map.prefix(&names, "2", &format!("{emb}.token_type_embeddings"));
    map.prefix(&names, "3", &format!("{emb}.LayerNorm"));
    for i in 0..layers {
        let k = i + 5;
        let hf = format!("{root}encoder.layer.{i}");
        let attn = format!("{k}.0.block.0");
        for (kiln, theirs) in [
            ("q_proj", "attention.self.query"),
            ("k_proj", "attention.self.key"),
            ("v_proj", "attention.self.value"),
            ("o_proj", "attention.output.dense"),
        ] {
            map.prefix(&names, &format!("{attn}.{kiln}"), &format!("{hf}.{theirs}"));
        }
        map.prefix(
            &names,
            &format!("{k}.1"),
            &format!("{hf}.attention.output.LayerNorm"),
        );
        map.prefix(
            &names,
            &format!("{k}.2.block.0"),
            &format!("{hf}.intermediate.dense"),
        );
        map.prefix(
            &names,
            &format!("{k}.2.block.2"),
            &format!("{hf}.output.dense"),
        );
        map.prefix(&names, &format!("{k}.3"), &format!("{hf}.output.LayerNorm"));
    }
    if classifier {
        map.prefix(&names, &(body + 1).to_string(), "bert.pooler.dense");
        map.prefix(&names, &(body + 4).to_string(), "classifier");
    } else {
        // BertModel's pooler, which its last hidden state does not use.
        map.ignored.push("pooler.dense.weight".to_owned());
        map.ignored.push("pooler.dense.bias".to_owned());
    }
    // Buffers older checkpoints carry.
    map.ignored_suffixes
        .push("embeddings.position_ids".to_owned());
    map.ignored_suffixes
        .push("embeddings.token_type_ids".to_owned());
    Ok((model, map))
}

/// The classifier's outputs: `num_labels`, else the size of `id2label`, else 2.
pub(crate) fn num_labels(config: &HfConfig) -> Result<usize> {
    if let Some(n) = config.opt_usize("num_labels")? {
        return Ok(n);
    }
    Ok(config
        .get("id2label")
        .and_then(|v| v.as_object())
        .map_or(2, serde_json::Map::len))
}
