//! Every layer's forward output, input gradient and parameter gradients against
//! Python PyTorch for the same weights and batch (f32, within 1e-5), plus the
//! running statistics BatchNorm updates in training. The references come from
//! `tests/reference/layer_parity.py`, run through the project virtualenv.

#![allow(clippy::unwrap_used)]

mod common;

use kiln_core::{
    AttentionConfig, BatchNormConfig, Conv1dConfig, Conv2dConfig, ConvTranspose2dConfig, Device,
    EmbeddingConfig, GeluApproximation, GroupNormConfig, Layer, LayerNormConfig, LinearConfig,
    Mode, Module, Pool2dConfig,
};
use kiln_torch::{from_tch, to_tch, TorchBackend, TorchModel};

struct Case {
    name: &'static str,
    layer: Layer,
    input: Vec<usize>,
    /// Indices below this bound for int64 inputs; `None` for float inputs.
    int_high: Option<usize>,
    train: bool,
}

fn case(name: &'static str, layer: impl Into<Layer>, input: &[usize], train: bool) -> Case {
    Case {
        name,
        layer: layer.into(),
        input: input.to_vec(),
        int_high: None,
        train,
    }
}

fn cases() -> Vec<Case> {
    let conv2d = Conv2dConfig::new(4, 6, [3, 3]);
    let mut cases = vec![
        case("linear", LinearConfig::new(7, 5), &[4, 7], true),
        case(
            "linear_3d_no_bias",
            LinearConfig::new(6, 3).with_bias(false),
            &[2, 5, 6],
            true,
        ),
        case(
            "conv1d",
            Conv1dConfig::new(3, 4, 3).with_stride(2).with_padding(1),
            &[2, 3, 11],
            true,
        ),
        case(
            "conv1d_groups_dilation",
            Conv1dConfig::new(4, 6, 3).with_groups(2).with_dilation(2),
            &[2, 4, 12],
            true,
        ),
        case(
            "conv2d",
            conv2d.clone().with_padding([1, 1]),
            &[2, 4, 9, 8],
            true,
        ),
        case(
            "conv2d_stride_dilation_groups",
            conv2d
                .with_stride([2, 1])
                .with_dilation([1, 2])
                .with_groups(2),
            &[2, 4, 10, 11],
            true,
        ),
        case(
            "conv_transpose2d",
            ConvTranspose2dConfig::new(4, 3, [3, 3])
                .with_stride([2, 2])
                .with_padding([1, 1])
                .with_output_padding([1, 1]),
            &[2, 4, 5, 6],
            true,
        ),
        case(
            "max_pool2d",
            Layer::MaxPool2d(Pool2dConfig::new([2, 2])),
            &[2, 3, 8, 9],
            true,
        ),
        case(
            "max_pool2d_stride_padding",
            Layer::MaxPool2d(
                Pool2dConfig::new([3, 3])
                    .with_stride([2, 2])
                    .with_padding([1, 1]),
            ),
            &[2, 3, 9, 9],
            true,
        ),
        case(
            "avg_pool2d_padding",
            Layer::AvgPool2d(
                Pool2dConfig::new([3, 3])
                    .with_stride([2, 2])
                    .with_padding([1, 1]),
            ),
            &[2, 3, 9, 8],
            true,
        ),
        case(
            "adaptive_avg_pool2d",
            Layer::AdaptiveAvgPool2d {
                output_size: [3, 2],
            },
            &[2, 3, 7, 5],
            true,
        ),
        case(
            "batch_norm1d_train",
            Layer::BatchNorm1d(BatchNormConfig::new(5)),
            &[8, 5],
            true,
        ),
        case(
            "batch_norm1d_3d_eval",
            Layer::BatchNorm1d(BatchNormConfig::new(5)),
            &[4, 5, 6],
            false,
        ),
        case(
            "batch_norm2d_train",
            Layer::BatchNorm2d(BatchNormConfig::new(3).with_momentum(0.3)),
            &[4, 3, 5, 5],
            true,
        ),
        case(
            "batch_norm2d_eval",
            Layer::BatchNorm2d(BatchNormConfig::new(3)),
            &[4, 3, 5, 5],
            false,
        ),
        case(
            "batch_norm2d_no_running_stats_eval",
            Layer::BatchNorm2d(
                BatchNormConfig::new(3)
                    .with_track_running_stats(false)
                    .with_affine(false),
            ),
            &[4, 3, 5, 5],
            false,
        ),
        case("layer_norm", LayerNormConfig::new([6]), &[3, 4, 6], true),
        case(
            "layer_norm_2d_no_affine",
            LayerNormConfig::new([4, 6]).with_elementwise_affine(false),
            &[3, 4, 6],
            true,
        ),
        case(
            "group_norm",
            GroupNormConfig::new(2, 6),
            &[3, 6, 4, 5],
            true,
        ),
        case("dropout_eval", Layer::Dropout { p: 0.5 }, &[4, 10], false),
        case(
            "flatten",
            Layer::Flatten {
                start_dim: 1,
                end_dim: -1,
            },
            &[2, 3, 4, 5],
            true,
        ),
        case(
            "flatten_middle",
            Layer::Flatten {
                start_dim: 1,
                end_dim: 2,
            },
            &[2, 3, 4, 5],
            true,
        ),
        case("relu", Layer::Relu, &[4, 9], true),
        case(
            "leaky_relu",
            Layer::LeakyRelu {
                negative_slope: 0.2,
            },
            &[4, 9],
            true,
        ),
        case(
            "gelu",
            Layer::Gelu {
                approximate: GeluApproximation::None,
            },
            &[4, 9],
            true,
        ),
        case(
            "gelu_tanh",
            Layer::Gelu {
                approximate: GeluApproximation::Tanh,
            },
            &[4, 9],
            true,
        ),
        case("silu", Layer::Silu, &[4, 9], true),
        case("tanh", Layer::Tanh, &[4, 9], true),
        case("sigmoid", Layer::Sigmoid, &[4, 9], true),
        case("softmax", Layer::Softmax { dim: -1 }, &[4, 9], true),
        case("softmax_dim1", Layer::Softmax { dim: 1 }, &[2, 5, 3], true),
        case("log_softmax", Layer::LogSoftmax { dim: -1 }, &[4, 9], true),
        case("attention", AttentionConfig::new(16, 4), &[2, 7, 16], true),
        case(
            "attention_causal",
            AttentionConfig::new(16, 2).with_causal(true),
            &[3, 6, 16],
            true,
        ),
        case(
            "attention_eval",
            AttentionConfig::new(8, 2).with_causal(true),
            &[2, 5, 8],
            false,
        ),
        case(
            "cnn",
            Layer::sequential([
                Conv2dConfig::new(1, 8, [3, 3]).with_padding([1, 1]).into(),
                Layer::BatchNorm2d(BatchNormConfig::new(8)),
                Layer::Relu,
                Layer::MaxPool2d(Pool2dConfig::new([2, 2])),
                Conv2dConfig::new(8, 8, [3, 3]).into(),
                Layer::Silu,
                Layer::AdaptiveAvgPool2d {
                    output_size: [2, 2],
                },
                Layer::Flatten {
                    start_dim: 1,
                    end_dim: -1,
                },
                LinearConfig::new(32, 10).into(),
                Layer::LogSoftmax { dim: 1 },
            ]),
            &[4, 1, 10, 10],
            true,
        ),
        case(
            "residual_mlp",
            Layer::sequential([
                LinearConfig::new(12, 12).into(),
                Layer::residual(Layer::sequential([
                    LinearConfig::new(12, 12).into(),
                    Layer::Tanh,
                ])),
                LayerNormConfig::new([12]).into(),
            ]),
            &[5, 12],
            true,
        ),
        case(
            "transformer_block",
            Layer::transformer_encoder_block(16, 4, 32, true, 0.0),
            &[2, 8, 16],
            true,
        ),
    ];
    cases.push(Case {
        name: "embedding",
        layer: EmbeddingConfig::new(11, 6).into(),
        input: vec![3, 5],
        int_high: Some(11),
        train: true,
    });
    cases.push(Case {
        name: "embedding_padding_idx",
        layer: EmbeddingConfig::new(9, 4).with_padding_idx(0).into(),
        input: vec![4, 6],
        int_high: Some(9),
        train: true,
    });
    cases
}

#[test]
fn every_layer_matches_pytorch_forward_and_gradients() {
    let Some(python) = common::python("every_layer_matches_pytorch_forward_and_gradients") else {
        return;
    };
    let dir = common::scratch_dir("layer-parity");
    let cases = cases();
    let request: Vec<serde_json::Value> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            serde_json::json!({
                "name": c.name,
                "layer": c.layer,
                "input": c.input,
                "input_dtype": if c.int_high.is_some() { "int64" } else { "float32" },
                "high": c.int_high.unwrap_or(0),
                "train": c.train,
                "seed": 1000 + i,
            })
        })
        .collect();
    let request_path = common::write_json(&dir, "cases.json", &request);
    common::run_reference(&python, "layer_parity.py", &[&request_path, &dir]);

    for (device, tol) in common::devices() {
        for case in &cases {
            check_case(case, &dir, device, tol);
        }
    }
}

fn check_case(case: &Case, dir: &std::path::Path, device: Device, tol: f64) {
    {
        let reference = common::load(&dir.join(format!("{}.safetensors", case.name)));
        let mut model = TorchModel::new(&case.layer, device).unwrap();
        model
            .load_state_dict(&common::strip(&reference, "state."))
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        model.set_mode(if case.train { Mode::Train } else { Mode::Eval });

        let input_host = reference.get("input").unwrap();
        let mut input = to_tch(input_host, device).unwrap();
        if case.int_high.is_none() {
            input = input.set_requires_grad(true);
        }
        let output = model
            .forward(&input)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let what = |part: &str| format!("{} on {device}: {part}", case.name);
        common::assert_close(
            &what("output"),
            &from_tch(&output).unwrap(),
            reference.get("output").unwrap(),
            tol,
        );

        let w = to_tch(reference.get("weight").unwrap(), device).unwrap();
        let loss = (&output * &w).sum(tch::Kind::Float);
        <TorchBackend as kiln_core::Backend>::backward(&loss).unwrap();
        if case.int_high.is_none() {
            common::assert_close(
                &what("grad input"),
                &from_tch(&input.grad()).unwrap(),
                reference.get("grad.input").unwrap(),
                tol,
            );
        }
        let params = model.named_parameters();
        let expected_grads = common::strip(&reference, "grad.");
        let param_grads = expected_grads.keys().filter(|k| *k != "input").count();
        assert_eq!(
            params.len(),
            param_grads,
            "{}: parameters with gradients",
            case.name
        );
        for (name, param) in params {
            let expected = expected_grads
                .get(&name)
                .unwrap_or_else(|| panic!("{}: PyTorch has no gradient for {name}", case.name));
            common::assert_close(
                &what(&format!("grad {name}")),
                &from_tch(&param.grad()).unwrap(),
                expected,
                tol,
            );
        }
        let after = common::strip(&reference, "after.");
        let state = model.state_dict().unwrap();
        assert_eq!(
            state.len(),
            after.len(),
            "{}: state dict entries",
            case.name
        );
        for (name, expected) in after.iter() {
            let actual = state
                .get(name)
                .unwrap_or_else(|| panic!("{}: no {name}", case.name));
            assert_eq!(
                actual.dtype(),
                expected.dtype(),
                "{}: dtype of {name}",
                case.name
            );
            common::assert_close(
                &what(&format!("{name} after forward")),
                actual,
                expected,
                tol,
            );
        }
    }
}

#[test]
fn dropout_in_training_zeroes_about_p_and_scales_the_rest() {
    let mut model = TorchModel::new(&Layer::Dropout { p: 0.3 }, Device::Cpu).unwrap();
    model.set_mode(Mode::Train);
    let x = tch::Tensor::ones([100_000], (tch::Kind::Float, tch::Device::Cpu));
    let y = from_tch(&model.forward(&x).unwrap()).unwrap().to_f64_vec();
    let zeros = y.iter().filter(|v| **v == 0.0).count() as f64 / y.len() as f64;
    assert!((zeros - 0.3).abs() < 0.01, "fraction zeroed {zeros}");
    let kept: Vec<f64> = y.into_iter().filter(|v| *v != 0.0).collect();
    assert!(
        kept.iter().all(|v| (v - 1.0 / 0.7).abs() < 1e-6),
        "kept values are scaled by 1/(1-p)"
    );
}
