//! ViT (`ViTForImageClassification`): the image cut into patches by a strided
//! convolution, a class token prepended, learned position embeddings, pre-norm
//! encoder blocks, a final LayerNorm and the classifier on the class token.
//! It takes `[batch, channels, height, width]` float images, normalised as
//! the model's image processor says.

use kiln_core::model::{
    ClassTokenConfig, Conv2dConfig, GeluApproximation, Layer, LayerNormConfig, LinearConfig,
    PositionEmbeddingConfig, SelfAttentionConfig,
};

use crate::bert::num_labels;
use crate::config::HfConfig;
use crate::error::Result;
use crate::family::{Family, FamilyTask};
use crate::names::{Mapping, NameMap, RowOrder};

/// ViT (`ViTForImageClassification`).
pub(crate) static VIT: Family = Family {
    model_type: "vit",
    name: "ViT",
    task: FamilyTask::Encoder,
    architectures: &["ForImageClassification"],
    hidden_size_key: "hidden_size",
    fan_in_fan_out: false,
    build: |c, _| build(c),
};

/// The model of `config` and the names of its tensors in the checkpoint.
pub(crate) fn build(config: &HfConfig) -> Result<(Layer, NameMap)> {
    let hidden = config.usize("hidden_size")?;
    let layers = config.usize("num_hidden_layers")?;
    let heads = config.usize("num_attention_heads")?;
    config.check_heads("hidden_size", hidden, "num_attention_heads", heads)?;
    let intermediate = config.usize("intermediate_size")?;
    let image = config.usize("image_size")?;
    let patch = config.usize("patch_size")?;
    let channels = config.opt_usize("num_channels")?.unwrap_or(3);
    let eps = config.f64_or("layer_norm_eps", 1e-12)?;
    let dropout = config.f64_or("hidden_dropout_prob", 0.0)?;
    let activation = match config.str_or("hidden_act", "gelu")? {
        "gelu" => GeluApproximation::None,
        "gelu_new" | "gelu_pytorch_tanh" => GeluApproximation::Tanh,
        _ => return Err(config.unsupported("hidden_act", "Kiln builds ViT with gelu or gelu_new")),
    };
    if patch == 0 || image % patch != 0 {
        return Err(config.unsupported(
            "patch_size",
            format!("the patches must tile the {image}x{image} image"),
        ));
    }
    let n = (image / patch) * (image / patch);
    let attention = SelfAttentionConfig::new(hidden, heads)
        .with_qkv_bias(config.bool_or("qkv_bias", true)?)
        .with_out_bias(true)
        .with_dropout(config.f64_or("attention_probs_dropout_prob", 0.0)?);
    let mut stack = vec![
        Conv2dConfig::new(channels, hidden, [patch, patch])
            .with_stride([patch, patch])
            .into(),
        Layer::Flatten {
            start_dim: 2,
            end_dim: -1,
        },
        Layer::Transpose { dim0: 1, dim1: 2 },
        ClassTokenConfig::new(hidden).into(),
        PositionEmbeddingConfig::new(n + 1, hidden).into(),
        Layer::Dropout { p: dropout },
    ];
    for _ in 0..layers {
        stack.push(Layer::sequential([
            Layer::residual(Layer::sequential([
                LayerNormConfig::new([hidden]).with_eps(eps).into(),
                attention.clone().into(),
                Layer::Dropout { p: dropout },
            ])),
            Layer::residual(Layer::sequential([
                LayerNormConfig::new([hidden]).with_eps(eps).into(),
                LinearConfig::new(hidden, intermediate).into(),
                Layer::Gelu {
                    approximate: activation,
                },
                LinearConfig::new(intermediate, hidden).into(),
                Layer::Dropout { p: dropout },
            ])),
        ]));
    }
    let body = stack.len();
    stack.extend([
        LayerNormConfig::new([hidden]).with_eps(eps).into(),
        Layer::Select { dim: 1, index: 0 },
        LinearConfig::new(hidden, num_labels(config)?).into(),
    ]);
    let model = Layer::sequential(stack);

    let (mut map, names) = NameMap::for_model(&model)?;
    map.prefix(&names, "0", "vit.embeddings.patch_embeddings.projection");
    map.mappings.push(Mapping {
        hf: "vit.embeddings.cls_token".to_owned(),
        kiln: vec!["3.weight".to_owned()],
        transposed: false,
        hf_shape: None,
        rows: RowOrder::Concatenated,
    });
    map.mappings.push(Mapping {
        hf: "vit.embeddings.position_embeddings".to_owned(),
        kiln: vec!["4.weight".to_owned()],
        transposed: false,
        hf_shape: Some(vec![1, n + 1, hidden]),
        rows: RowOrder::Concatenated,
    });
    for i in 0..layers {
        let k = i + 6;
        let hf = format!("vit.encoder.layer.{i}");
        map.prefix(
            &names,
            &format!("{k}.0.block.0"),
            &format!("{hf}.layernorm_before"),
        );
        for (kiln, theirs) in [
            ("q_proj", "attention.attention.query"),
            ("k_proj", "attention.attention.key"),
            ("v_proj", "attention.attention.value"),
            ("o_proj", "attention.output.dense"),
        ] {
            map.prefix(
                &names,
                &format!("{k}.0.block.1.{kiln}"),
                &format!("{hf}.{theirs}"),
            );
        }
        map.prefix(
            &names,
            &format!("{k}.1.block.0"),
            &format!("{hf}.layernorm_after"),
        );
        map.prefix(
            &names,
            &format!("{k}.1.block.1"),
            &format!("{hf}.intermediate.dense"),
        );
        map.prefix(
            &names,
            &format!("{k}.1.block.3"),
            &format!("{hf}.output.dense"),
        );
    }
    map.prefix(&names, &body.to_string(), "vit.layernorm");
    map.prefix(&names, &(body + 2).to_string(), "classifier");
    Ok((model, map))
}
