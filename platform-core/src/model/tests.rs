//! Hand-derived shapes, names and validation errors of every layer type.

use super::*;
use crate::error::Error;

fn shape(layer: impl Into<Layer>, input: &[usize]) -> Vec<usize> {
    let layer = layer.into();
    match layer.output_shape(input) {
        Ok(s) => s,
        Err(e) => panic!("{layer:?} on {input:?}: {e}"),
    }
}

fn shape_err(layer: impl Into<Layer>, input: &[usize]) -> String {
    let layer = layer.into();
    match layer.output_shape(input) {
        Ok(s) => panic!("{layer:?} on {input:?} should fail, got {s:?}"),
        Err(e) => e.to_string(),
    }
}

fn invalid(layer: impl Into<Layer>) -> String {
    let layer = layer.into();
    match layer.validate() {
        Ok(()) => panic!("{layer:?} should be invalid"),
        Err(e) => {
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
            e.to_string()
        }
    }
}

#[test]
fn linear_shapes() {
    assert_eq!(shape(LinearConfig::new(4, 3), &[2, 4]), [2, 3]);
    assert_eq!(shape(LinearConfig::new(4, 3), &[5, 7, 4]), [5, 7, 3]);
    assert_eq!(shape(LinearConfig::new(4, 3), &[4]), [3]);
    assert_eq!(
        shape_err(LinearConfig::new(4, 3), &[2, 5]),
        "Linear: expected shape [*, 4], got [2, 5]"
    );
    assert_eq!(
        shape_err(LinearConfig::new(4, 3), &[]),
        "Linear: expected shape [*, 4], got []"
    );
}

#[test]
fn conv1d_shapes() {
    // (10 + 2*1 - 2*(3-1) - 1) / 2 + 1 = 4
    let c = Conv1dConfig::new(2, 6, 3)
        .with_stride(2)
        .with_padding(1)
        .with_dilation(2);
    assert_eq!(shape(c.clone(), &[8, 2, 10]), [8, 6, 4]);
    assert_eq!(shape(Conv1dConfig::new(2, 6, 3), &[1, 2, 3]), [1, 6, 1]);
    let msg = shape_err(Conv1dConfig::new(2, 6, 3), &[1, 2, 2]);
    assert!(
        msg.starts_with("Conv1d: expected shape [N, 2, L] with"),
        "{msg}"
    );
    assert_eq!(
        shape_err(c, &[8, 3, 10]),
        "Conv1d: expected shape [N, 2, L], got [8, 3, 10]"
    );
}

#[test]
fn conv2d_shapes() {
    let c = Conv2dConfig::new(3, 16, [3, 3]).with_padding([1, 1]);
    assert_eq!(shape(c, &[4, 3, 28, 28]), [4, 16, 28, 28]);
    // H: (32 + 0 - 4 - 1) / 2 + 1 = 14 (kernel 5), W: (20 + 2 - 2*2 - 1) / 3 + 1 = 6
    let c = Conv2dConfig::new(4, 8, [5, 3])
        .with_stride([2, 3])
        .with_padding([0, 1])
        .with_dilation([1, 2])
        .with_groups(2);
    assert_eq!(shape(c.clone(), &[2, 4, 32, 20]), [2, 8, 14, 6]);
    let msg = shape_err(c.clone(), &[2, 4, 4, 20]);
    assert!(msg.contains("got [2, 4, 4, 20]"), "{msg}");
    assert_eq!(
        shape_err(c, &[2, 4, 32]),
        "Conv2d: expected shape [N, 4, H, W], got [2, 4, 32]"
    );
}

#[test]
fn conv_transpose2d_shapes() {
    // (7 - 1) * 2 - 2 * 1 + 1 * (3 - 1) + 1 + 1 = 14
    let c = ConvTranspose2dConfig::new(8, 4, [3, 3])
        .with_stride([2, 2])
        .with_padding([1, 1])
        .with_output_padding([1, 1]);
    assert_eq!(shape(c, &[1, 8, 7, 7]), [1, 4, 14, 14]);
    // H: (5-1)*1 - 0 + 2*(2-1) + 1 + 1 = 8; W: (3-1)*3 - 2*2 + 1*(4-1) + 2 + 1 = 8
    let c = ConvTranspose2dConfig::new(6, 9, [2, 4])
        .with_stride([1, 3])
        .with_padding([0, 2])
        .with_output_padding([1, 2])
        .with_dilation([2, 1])
        .with_groups(3);
    assert_eq!(shape(c, &[3, 6, 5, 3]), [3, 9, 8, 8]);
    // (1 - 1) * 1 - 2 * 2 + 0 + 0 + 1 < 1
    let c = ConvTranspose2dConfig::new(1, 1, [1, 1]).with_padding([2, 2]);
    let msg = shape_err(c, &[1, 1, 1, 1]);
    assert!(msg.starts_with("ConvTranspose2d: expected shape"), "{msg}");
}

#[test]
fn pooling_shapes() {
    let max = Layer::MaxPool2d(Pool2dConfig::new([2, 2]));
    assert_eq!(shape(max.clone(), &[1, 3, 7, 8]), [1, 3, 3, 4]);
    // (9 + 2 - 3) / 2 + 1 = 5
    let avg = Layer::AvgPool2d(
        Pool2dConfig::new([3, 3])
            .with_stride([2, 2])
            .with_padding([1, 1]),
    );
    assert_eq!(shape(avg, &[2, 5, 9, 9]), [2, 5, 5, 5]);
    let msg = shape_err(max.clone(), &[1, 3, 1, 8]);
    assert!(msg.starts_with("MaxPool2d: expected shape"), "{msg}");
    assert_eq!(
        shape_err(max, &[3, 7, 8]),
        "MaxPool2d: expected shape [N, C, H, W], got [3, 7, 8]"
    );
    let adaptive = Layer::AdaptiveAvgPool2d {
        output_size: [1, 2],
    };
    assert_eq!(shape(adaptive.clone(), &[4, 16, 5, 5]), [4, 16, 1, 2]);
    assert!(adaptive.output_shape(&[4, 16, 5]).is_err());
}

#[test]
fn normalization_shapes() {
    let bn1 = Layer::BatchNorm1d(BatchNormConfig::new(6));
    assert_eq!(shape(bn1.clone(), &[4, 6]), [4, 6]);
    assert_eq!(shape(bn1.clone(), &[4, 6, 11]), [4, 6, 11]);
    assert_eq!(
        shape_err(bn1, &[4, 5]),
        "BatchNorm1d: expected shape [N, 6] or [N, 6, L], got [4, 5]"
    );
    let bn2 = Layer::BatchNorm2d(BatchNormConfig::new(3));
    assert_eq!(shape(bn2.clone(), &[2, 3, 4, 4]), [2, 3, 4, 4]);
    assert!(bn2.output_shape(&[2, 3, 4]).is_err());

    let ln = LayerNormConfig::new([4, 5]);
    assert_eq!(shape(ln.clone(), &[2, 3, 4, 5]), [2, 3, 4, 5]);
    assert_eq!(
        shape_err(ln, &[2, 5, 4]),
        "LayerNorm: expected shape [*, 4, 5], got [2, 5, 4]"
    );
    let gn = GroupNormConfig::new(2, 6);
    assert_eq!(shape(gn.clone(), &[3, 6]), [3, 6]);
    assert_eq!(shape(gn.clone(), &[3, 6, 2, 2, 2]), [3, 6, 2, 2, 2]);
    assert_eq!(
        shape_err(gn, &[3, 4, 2]),
        "GroupNorm: expected shape [N, 6, *], got [3, 4, 2]"
    );
}

#[test]
fn elementwise_and_misc_shapes() {
    for layer in [
        Layer::Relu,
        Layer::LeakyRelu {
            negative_slope: 0.2,
        },
        Layer::Gelu {
            approximate: GeluApproximation::Tanh,
        },
        Layer::Silu,
        Layer::Tanh,
        Layer::Sigmoid,
        Layer::Dropout { p: 0.3 },
        Layer::Softmax { dim: -1 },
        Layer::LogSoftmax { dim: 1 },
    ] {
        assert_eq!(shape(layer, &[2, 3, 4]), [2, 3, 4]);
    }
    assert_eq!(
        shape_err(Layer::Softmax { dim: 3 }, &[2, 3, 4]),
        "Softmax: expected shape a tensor with dimension 3, got [2, 3, 4]"
    );
    assert!(Layer::LogSoftmax { dim: -4 }
        .output_shape(&[2, 3, 4])
        .is_err());

    let emb = EmbeddingConfig::new(100, 16);
    assert_eq!(shape(emb.clone(), &[4, 9]), [4, 9, 16]);
    assert_eq!(shape(emb, &[]), [16]);

    let flat = Layer::Flatten {
        start_dim: 1,
        end_dim: -1,
    };
    assert_eq!(shape(flat.clone(), &[8, 3, 4, 5]), [8, 60]);
    // Like torch.flatten(x, 1): dimension 1 does not exist in a 1-d tensor.
    assert!(flat.output_shape(&[8]).is_err());
    assert!(flat.output_shape(&[]).is_err());
    let flat = Layer::Flatten {
        start_dim: 0,
        end_dim: 1,
    };
    assert_eq!(shape(flat.clone(), &[2, 3, 4]), [6, 4]);
    assert!(flat.output_shape(&[]).is_err());
    let all = Layer::Flatten {
        start_dim: 0,
        end_dim: -1,
    };
    assert_eq!(shape(all.clone(), &[2, 3, 4]), [24]);
    // torch.flatten turns a scalar into a 1-element vector.
    assert_eq!(shape(all, &[]), [1]);
    let backwards = Layer::Flatten {
        start_dim: -1,
        end_dim: 0,
    };
    assert!(backwards.output_shape(&[2, 3]).is_err());

    let attn = AttentionConfig::new(32, 4).with_causal(true);
    assert_eq!(shape(attn.clone(), &[2, 7, 32]), [2, 7, 32]);
    assert_eq!(
        shape_err(attn, &[2, 32]),
        "MultiHeadSelfAttention: expected shape [batch, seq, 32], got [2, 32]"
    );
}

#[test]
fn composite_shapes_and_error_paths() {
    let net = Layer::sequential([
        Conv2dConfig::new(1, 4, [3, 3]).into(),
        Layer::Relu,
        Layer::residual(Layer::sequential([
            Conv2dConfig::new(4, 4, [3, 3]).with_padding([1, 1]).into(),
            Layer::BatchNorm2d(BatchNormConfig::new(4)),
        ])),
        Layer::AdaptiveAvgPool2d {
            output_size: [1, 1],
        },
        Layer::Flatten {
            start_dim: 1,
            end_dim: -1,
        },
        LinearConfig::new(4, 2).into(),
    ]);
    assert_eq!(shape(net.clone(), &[5, 1, 10, 10]), [5, 2]);
    assert_eq!(
        shape_err(net, &[5, 2, 10, 10]),
        "0 (Conv2d): expected shape [N, 1, H, W], got [5, 2, 10, 10]"
    );

    let bad_residual = Layer::sequential([Layer::residual(LinearConfig::new(4, 5).into())]);
    assert_eq!(
        shape_err(bad_residual, &[3, 4]),
        "0 (Residual): block output, added to the input: expected shape [3, 4], got [3, 5]"
    );

    let bad_parallel = Layer::parallel([
        LinearConfig::new(4, 4).into(),
        LinearConfig::new(4, 5).into(),
    ]);
    assert_eq!(
        shape_err(bad_parallel, &[3, 4]),
        "Parallel: branch 1's output, added to branch 0's: expected shape [3, 4], got [3, 5]"
    );
    let empty = Layer::parallel([]).validate().unwrap_err().to_string();
    assert!(
        empty.contains("`branches`") && empty.contains("no branch"),
        "{empty}"
    );
    let json = serde_json::json!({"type": "parallel", "branches": [
        {"type": "linear", "in_features": 4, "out_features": 2},
        {"type": "relu"},
    ]});
    assert_eq!(
        serde_json::from_value::<Layer>(json).unwrap(),
        Layer::parallel([LinearConfig::new(4, 2).into(), Layer::Relu])
    );

    let nested = Layer::sequential([
        Layer::Relu,
        Layer::Relu,
        Layer::residual(Layer::sequential([LinearConfig::new(7, 8).into()])),
    ]);
    assert_eq!(
        shape_err(nested, &[2, 8]),
        "2.block.0 (Linear): expected shape [*, 7], got [2, 8]"
    );
    assert_eq!(shape(Layer::sequential([]), &[3, 9]), [3, 9]);
}

#[test]
fn validation_names_the_field() {
    assert_eq!(
        invalid(Conv2dConfig::new(6, 16, [3, 3]).with_groups(4)),
        "invalid argument `groups`: Conv2d: in_channels (6) must be divisible by groups (4)"
    );
    assert_eq!(
        invalid(Conv1dConfig::new(4, 6, 3).with_groups(4)),
        "invalid argument `groups`: Conv1d: out_channels (6) must be divisible by groups (4)"
    );
    assert_eq!(
        invalid(Layer::sequential([
            Layer::Relu,
            Layer::residual(Layer::Dropout { p: 1.0 })
        ])),
        "invalid argument `1.block.p`: Dropout: must be in [0, 1), got 1"
    );
    assert_eq!(
        invalid(LinearConfig::new(0, 3)),
        "invalid argument `in_features`: Linear: must be at least 1, got 0"
    );
    assert_eq!(
        invalid(Conv2dConfig::new(1, 1, [3, 0])),
        "invalid argument `kernel_size`: Conv2d: every size must be at least 1, got [3, 0]"
    );
    assert!(invalid(Conv2dConfig::new(1, 1, [3, 3]).with_stride([0, 1])).contains("`stride`"));
    assert!(invalid(AttentionConfig::new(32, 4).with_dropout(-0.1)).contains("`dropout`"));
    assert!(invalid(AttentionConfig::new(32, 0)).contains("`num_heads`"));
    assert!(invalid(GroupNormConfig::new(4, 6)).contains("`num_groups`"));
    assert!(invalid(EmbeddingConfig::new(10, 4).with_padding_idx(10)).contains("`padding_idx`"));
    assert!(invalid(LayerNormConfig::new(Vec::new())).contains("`normalized_shape`"));
    assert!(invalid(LayerNormConfig::new([4]).with_eps(-1.0)).contains("`eps`"));
    assert!(invalid(Layer::BatchNorm1d(BatchNormConfig::new(0))).contains("`num_features`"));
    assert!(invalid(Layer::AdaptiveAvgPool2d {
        output_size: [0, 1]
    })
    .contains("`output_size`"));
    assert!(invalid(Layer::MaxPool2d(
        Pool2dConfig::new([2, 2]).with_padding([2, 0])
    ))
    .contains("`padding`"));
    assert!(invalid(
        ConvTranspose2dConfig::new(2, 2, [3, 3])
            .with_stride([2, 2])
            .with_output_padding([2, 0])
    )
    .contains("`output_padding`"));
    assert_eq!(
        invalid(LinearConfig::new(3, 2).with_bias_init(Init::XavierNormal { gain: 1.0 })),
        "invalid argument `bias_init`: Linear: shape: fan in and fan out cannot be computed for \
         a tensor with fewer than 2 dimensions, got shape [2]"
    );
    // output_shape validates too, so a zero stride cannot divide by zero.
    let err = Layer::MaxPool2d(Pool2dConfig::new([2, 2]).with_stride([0, 0]))
        .output_shape(&[1, 1, 4, 4])
        .expect_err("zero stride");
    assert!(matches!(err, Error::InvalidArgument { .. }));
    Layer::transformer_encoder_block(64, 8, 256, true, 0.1)
        .validate()
        .expect("valid block");
}

fn names_and_shapes(specs: &[ParamSpec]) -> Vec<(String, Vec<usize>)> {
    specs
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone()))
        .collect()
}

#[test]
fn parameter_names_shapes_and_default_inits() -> Result<()> {
    let net = Layer::sequential([
        Conv2dConfig::new(2, 4, [3, 3]).with_groups(2).into(),
        Layer::BatchNorm2d(BatchNormConfig::new(4)),
        ConvTranspose2dConfig::new(4, 6, [2, 2])
            .with_groups(2)
            .with_bias(false)
            .into(),
        Layer::Relu,
        EmbeddingConfig::new(5, 3).with_padding_idx(0).into(),
    ]);
    let specs = net.parameter_specs("net")?;
    let expected: Vec<(String, Vec<usize>)> = [
        ("net.0.weight", vec![4, 1, 3, 3]),
        ("net.0.bias", vec![4]),
        ("net.1.weight", vec![4]),
        ("net.1.bias", vec![4]),
        ("net.1.running_mean", vec![4]),
        ("net.1.running_var", vec![4]),
        ("net.1.num_batches_tracked", vec![]),
        ("net.2.weight", vec![4, 3, 2, 2]),
        ("net.4.weight", vec![5, 3]),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_owned(), s))
    .collect();
    assert_eq!(names_and_shapes(&specs), expected);

    // Conv weight [4, 1, 3, 3]: fan_in 9, bound 1/3 for weight and bias.
    let third = 1.0 / 3.0;
    match specs[0].init {
        InitDistribution::Uniform { low, high } => {
            assert!((high - third).abs() < 1e-15 && low == -high)
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        specs[1].init,
        InitDistribution::Uniform {
            low: -third,
            high: third
        }
    );
    assert_eq!(specs[5].init, InitDistribution::Constant { value: 1.0 });
    assert_eq!(specs[6].dtype, DType::I64);
    assert_eq!(specs[6].kind, ParamKind::Buffer);
    assert_eq!(specs[4].kind, ParamKind::Buffer);
    assert_eq!(specs[3].kind, ParamKind::Parameter);
    // ConvTranspose weight [4, 3, 2, 2]: fan_in = 3 * 4 = 12.
    match specs[7].init {
        InitDistribution::Uniform { high, .. } => {
            assert!((high - 1.0 / 12f64.sqrt()).abs() < 1e-15, "{high}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        specs[8].init,
        InitDistribution::Normal {
            mean: 0.0,
            std: 1.0
        }
    );
    assert_eq!(specs[8].zero_row, Some(0));
    assert!(specs.iter().take(8).all(|s| s.zero_row.is_none()));
    Ok(())
}

#[test]
fn batch_norm_and_attention_options_drop_entries() -> Result<()> {
    let bn = Layer::BatchNorm1d(
        BatchNormConfig::new(3)
            .with_affine(false)
            .with_track_running_stats(true),
    );
    let names: Vec<String> = bn
        .parameter_specs("")?
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(
        names,
        ["running_mean", "running_var", "num_batches_tracked"]
    );
    let bn = Layer::BatchNorm1d(BatchNormConfig::new(3).with_track_running_stats(false));
    let names: Vec<String> = bn
        .parameter_specs("")?
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["weight", "bias"]);

    let attn = Layer::from(AttentionConfig::new(8, 2).with_bias(false));
    let specs = attn.parameter_specs("attn")?;
    assert_eq!(
        names_and_shapes(&specs),
        [
            ("attn.in_proj_weight".to_owned(), vec![24, 8]),
            ("attn.out_proj.weight".to_owned(), vec![8, 8]),
        ]
    );
    // xavier_uniform on [24, 8]: sqrt(3) * sqrt(2 / 32)
    match specs[0].init {
        InitDistribution::Uniform { high, .. } => {
            assert!((high - (6.0f64 / 32.0).sqrt()).abs() < 1e-15, "{high}")
        }
        other => panic!("{other:?}"),
    }
    let ln = Layer::from(LayerNormConfig::new([4]).with_bias(false));
    let names: Vec<String> = ln
        .parameter_specs("")?
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["weight"]);
    Ok(())
}

#[test]
fn transformer_block_layout() -> Result<()> {
    let block = Layer::transformer_encoder_block(16, 4, 64, false, 0.1);
    let specs = block.parameter_specs("")?;
    let expected: Vec<(String, Vec<usize>)> = [
        ("0.block.0.weight", vec![16]),
        ("0.block.0.bias", vec![16]),
        ("0.block.1.in_proj_weight", vec![48, 16]),
        ("0.block.1.in_proj_bias", vec![48]),
        ("0.block.1.out_proj.weight", vec![16, 16]),
        ("0.block.1.out_proj.bias", vec![16]),
        ("1.block.0.weight", vec![16]),
        ("1.block.0.bias", vec![16]),
        ("1.block.1.weight", vec![64, 16]),
        ("1.block.1.bias", vec![64]),
        ("1.block.3.weight", vec![16, 64]),
        ("1.block.3.bias", vec![16]),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_owned(), s))
    .collect();
    assert_eq!(names_and_shapes(&specs), expected);
    // (2*16 + 48*16 + 48 + 16*16 + 16) + (2*16 + 64*16 + 64 + 16*64 + 16) = 1120 + 2160
    assert_eq!(block.num_parameters()?, 3280);
    assert_eq!(block.output_shape(&[3, 5, 16])?, [3, 5, 16]);
    Ok(())
}

#[test]
fn serde_round_trip_and_hand_written_defaults() -> Result<()> {
    let to_err = |e: serde_json::Error| Error::invalid_argument("json", e.to_string());
    let block = Layer::transformer_encoder_block(16, 4, 64, true, 0.1);
    let json = serde_json::to_string(&block).map_err(to_err)?;
    let back: Layer = serde_json::from_str(&json).map_err(to_err)?;
    assert_eq!(back, block);

    let layer: Layer = serde_json::from_str(
        r#"{"type": "conv_transpose2d", "in_channels": 4, "out_channels": 2,
            "kernel_size": [3, 2], "stride": 2, "output_padding": 1}"#,
    )
    .map_err(to_err)?;
    assert_eq!(
        layer,
        Layer::ConvTranspose2d(
            ConvTranspose2dConfig::new(4, 2, [3, 2])
                .with_stride([2, 2])
                .with_output_padding([1, 1])
        )
    );
    let layer: Layer = serde_json::from_str(r#"{"type": "dropout"}"#).map_err(to_err)?;
    assert_eq!(layer, Layer::Dropout { p: 0.5 });
    let layer: Layer =
        serde_json::from_str(r#"{"type": "flatten", "start_dim": 0}"#).map_err(to_err)?;
    assert_eq!(
        layer,
        Layer::Flatten {
            start_dim: 0,
            end_dim: -1
        }
    );
    let layer: Layer =
        serde_json::from_str(r#"{"type": "gelu", "approximate": "tanh"}"#).map_err(to_err)?;
    assert_eq!(
        layer,
        Layer::Gelu {
            approximate: GeluApproximation::Tanh
        }
    );
    let layer: Layer =
        serde_json::from_str(r#"{"type": "max_pool2d", "kernel_size": 3, "stride": [1, 2]}"#)
            .map_err(to_err)?;
    assert_eq!(
        layer,
        Layer::MaxPool2d(Pool2dConfig::new([3, 3]).with_stride([1, 2]))
    );
    let layer: Layer = serde_json::from_str(
        r#"{"type": "linear", "in_features": 3, "out_features": 2, "bias": false,
            "weight_init": {"type": "normal", "std": 0.02}}"#,
    )
    .map_err(to_err)?;
    assert_eq!(
        layer,
        Layer::Linear(
            LinearConfig::new(3, 2)
                .with_bias(false)
                .with_weight_init(Init::Normal {
                    mean: 0.0,
                    std: 0.02
                })
        )
    );

    // Typos are errors, not silently ignored.
    let err =
        serde_json::from_str::<Layer>(r#"{"type": "linear", "in_features": 3, "out_feature": 2}"#)
            .expect_err("typo");
    assert!(err.to_string().contains("out_feature"), "{err}");
    let err = serde_json::from_str::<Layer>(r#"{"type": "dropout", "P": 0.1}"#).expect_err("typo");
    assert!(err.to_string().contains('P'), "{err}");
    let err = serde_json::from_str::<Layer>(r#"{"type": "convolution"}"#).expect_err("unknown");
    assert!(err.to_string().contains("convolution"), "{err}");
    Ok(())
}

#[test]
fn custom_layers_declare_their_parameters_and_keep_the_shape() {
    let layer: Layer = CustomConfig::new("kiln::bias_gelu")
        .with_param("bias", [16], Init::Zeros)
        .with_attr("slope", 0.5)
        .into();
    let net = Layer::sequential([LinearConfig::new(4, 16).into(), layer]);
    assert_eq!(net.output_shape(&[3, 4]).unwrap(), vec![3, 16]);
    let specs = net.parameter_specs("").unwrap();
    let last = specs.last().unwrap();
    assert_eq!(last.name, "1.bias");
    assert_eq!(last.shape, vec![16]);
    assert_eq!(last.kind, ParamKind::Parameter);
    assert_eq!(last.init, InitDistribution::Constant { value: 0.0 });
    assert_eq!(net.num_parameters().unwrap(), 4 * 16 + 16 + 16);
}

#[test]
fn custom_layers_reject_bad_declarations() {
    let err = |c: CustomConfig| {
        Layer::sequential([c.into()])
            .validate()
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        err(CustomConfig::new("swish")),
        "invalid argument `0.op`: Custom: expected `namespace::name`, got \"swish\""
    );
    assert_eq!(
        err(CustomConfig::new("a::b")
            .with_param("w", [2], Init::Zeros)
            .with_param("w", [2], Init::Zeros)),
        "invalid argument `0.params`: Custom: parameter \"w\" declared twice"
    );
    assert_eq!(
        err(CustomConfig::new("a::b").with_param("w.x", [2], Init::Zeros)),
        "invalid argument `0.params`: Custom: parameter name \"w.x\" must be non-empty without dots"
    );
    assert_eq!(
        err(CustomConfig::new("a::b").with_attr("eps", f64::NAN)),
        "invalid argument `0.attrs.eps`: Custom: must be finite, got NaN"
    );
    // Xavier needs two dimensions: the error names the parameter.
    let msg =
        err(CustomConfig::new("a::b").with_param("beta", [1], Init::XavierUniform { gain: 1.0 }));
    assert!(msg.starts_with("invalid argument `0.params.beta`"), "{msg}");
}

#[test]
fn custom_layers_read_from_json() {
    let json = serde_json::json!({"type": "custom", "op": "example::squared_relu"});
    let layer: Layer = serde_json::from_value(json).unwrap();
    assert_eq!(
        layer,
        Layer::Custom(CustomConfig::new("example::squared_relu"))
    );
    let bad = serde_json::json!({"type": "custom", "op": "a::b", "parms": []});
    let msg = serde_json::from_value::<Layer>(bad)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("unknown field `parms`"), "{msg}");
}
