//! `Layer` against `torch.nn`: state-dict names, shapes, dtypes and initial
//! distributions, output shapes, and `Init::resolve` against `torch.nn.init`.
//!
//! The layers are defined here with Kiln's API, serialized with serde and
//! rebuilt as torch modules by `tests/reference/model_specs.py`.

use std::collections::BTreeMap;

use kiln_core::model::{
    AttentionConfig, BatchNormConfig, Conv1dConfig, Conv2dConfig, ConvTranspose2dConfig,
    EmbeddingConfig, FanMode, GeluApproximation, GroupNormConfig, Init, InitDistribution, Layer,
    LayerNormConfig, LinearConfig, ModelSummary, Nonlinearity, ParamKind, Pool2dConfig,
};
use serde_json::{json, Value};

fn cnn() -> Layer {
    Layer::sequential([
        Conv2dConfig::new(1, 8, [3, 3]).with_padding([1, 1]).into(),
        Layer::BatchNorm2d(BatchNormConfig::new(8)),
        Layer::Relu,
        Layer::MaxPool2d(Pool2dConfig::new([2, 2])),
        Conv2dConfig::new(8, 16, [3, 5])
            .with_stride([2, 1])
            .with_padding([1, 2])
            .with_dilation([1, 2])
            .with_groups(2)
            .into(),
        GroupNormConfig::new(4, 16).into(),
        Layer::LeakyRelu {
            negative_slope: 0.1,
        },
        ConvTranspose2dConfig::new(16, 8, [3, 3])
            .with_stride([2, 2])
            .with_padding([1, 1])
            .with_output_padding([1, 1])
            .with_groups(2)
            .into(),
        Layer::AvgPool2d(
            Pool2dConfig::new([3, 3])
                .with_stride([2, 2])
                .with_padding([1, 1]),
        ),
        Layer::Dropout { p: 0.25 },
        Layer::AdaptiveAvgPool2d {
            output_size: [2, 3],
        },
        Layer::Flatten {
            start_dim: 1,
            end_dim: -1,
        },
        LinearConfig::new(48, 10).into(),
        Layer::LogSoftmax { dim: -1 },
    ])
}

fn transformer() -> Layer {
    Layer::sequential([
        EmbeddingConfig::new(50, 32).with_padding_idx(3).into(),
        Layer::transformer_encoder_block(32, 4, 64, true, 0.1),
        Layer::transformer_encoder_block(32, 4, 64, false, 0.0),
        LayerNormConfig::new([32]).into(),
        LinearConfig::new(32, 50).with_bias(false).into(),
        Layer::Softmax { dim: -1 },
    ])
}

fn misc() -> Layer {
    Layer::sequential([
        Conv1dConfig::new(4, 6, 3)
            .with_stride(2)
            .with_padding(1)
            .with_dilation(2)
            .with_groups(2)
            .into(),
        Layer::BatchNorm1d(BatchNormConfig::new(6).with_affine(false)),
        Layer::Silu,
        Layer::residual(Layer::sequential([Layer::Tanh, Layer::Sigmoid])),
        Layer::Flatten {
            start_dim: 1,
            end_dim: 2,
        },
        LinearConfig::new(24, 8)
            .with_bias(false)
            .with_weight_init(Init::XavierNormal { gain: 2.0 })
            .into(),
        Layer::BatchNorm1d(
            BatchNormConfig::new(8)
                .with_track_running_stats(false)
                .with_eps(1e-3),
        ),
        Layer::Gelu {
            approximate: GeluApproximation::Tanh,
        },
        LinearConfig::new(8, 3)
            .with_weight_init(Init::KaimingNormal {
                a: 0.0,
                mode: FanMode::FanOut,
                nonlinearity: Nonlinearity::Relu,
            })
            .with_bias_init(Init::Constant { value: 0.1 })
            .into(),
    ])
}

fn attention_and_norms() -> Layer {
    Layer::sequential([
        Layer::residual(AttentionConfig::new(16, 2).with_bias(false).into()),
        LayerNormConfig::new([16]).with_bias(false).into(),
        LayerNormConfig::new([5, 16])
            .with_elementwise_affine(false)
            .into(),
    ])
}

/// A LLaMA-style decoder: grouped-query attention with RoPE, a gated MLP,
/// RMSNorm and a head tied to the embedding.
fn decoder() -> Layer {
    use kiln_core::model::{
        GatedMlpConfig, RmsNormConfig, RopeConfig, SelfAttentionConfig, TiedLinearConfig,
    };
    let norm = || {
        Layer::RmsNorm(RmsNormConfig {
            dim: 16,
            eps: 1e-6,
            weight_offset: 0.0,
            scale_in_float32: false,
        })
    };
    Layer::sequential([
        EmbeddingConfig::new(40, 16).into(),
        Layer::residual(Layer::sequential([
            norm(),
            SelfAttentionConfig::new(16, 4)
                .with_num_kv_heads(2)
                .with_causal(true)
                .with_rope(RopeConfig::new(10_000.0))
                .into(),
        ])),
        Layer::residual(Layer::sequential([
            norm(),
            Layer::GatedMlp(GatedMlpConfig::new(16, 24)),
        ])),
        norm(),
        Layer::TiedLinear(TiedLinearConfig::new("0.weight", 16, 40)),
    ])
}

fn embedding_and_custom_inits() -> Layer {
    Layer::sequential([
        EmbeddingConfig::new(10, 4)
            .with_weight_init(Init::Uniform {
                low: -0.5,
                high: 0.5,
            })
            .with_padding_idx(0)
            .into(),
        Conv2dConfig::new(2, 4, [1, 1])
            .with_bias_init(Init::Zeros)
            .with_weight_init(Init::Ones)
            .into(),
    ])
}

/// Single layers on inputs that PyTorch accepts or rejects, for shape inference.
fn shape_cases() -> Vec<(String, Layer, Vec<usize>)> {
    let mut cases = Vec::new();
    let mut add = |layer: Layer, input: &[usize]| {
        let name = format!("{:03} {} {input:?}", cases.len(), layer.kind());
        cases.push((name, layer, input.to_vec()));
    };
    for (k, s, p, d) in [
        (3, 1, 0, 1),
        (3, 2, 1, 1),
        (5, 3, 2, 2),
        (2, 2, 0, 3),
        (4, 1, 1, 1),
    ] {
        for len in [1, 2, 4, 5, 9, 10, 17] {
            add(
                Conv1dConfig::new(2, 4, k)
                    .with_stride(s)
                    .with_padding(p)
                    .with_dilation(d)
                    .into(),
                &[2, 2, len],
            );
            add(
                Conv2dConfig::new(2, 4, [k, 2])
                    .with_stride([s, 1])
                    .with_padding([p, 1])
                    .with_dilation([d, 1])
                    .into(),
                &[1, 2, len, len + 1],
            );
            add(
                ConvTranspose2dConfig::new(2, 4, [k, 2])
                    .with_stride([s, 2])
                    .with_padding([p, 1])
                    .with_output_padding([s - 1, 1])
                    .with_dilation([d, 1])
                    .into(),
                &[1, 2, len, len],
            );
        }
    }
    for (k, s, p) in [
        (2, None, 0),
        (3, Some(2), 1),
        (3, Some(1), 0),
        (5, Some(3), 2),
    ] {
        for len in [1, 2, 3, 6, 7, 11] {
            let mut cfg = Pool2dConfig::new([k, 2]).with_padding([p, 0]);
            if let Some(s) = s {
                cfg = cfg.with_stride([s, 1]);
            }
            add(Layer::MaxPool2d(cfg.clone()), &[2, 3, len, len + 2]);
            add(Layer::AvgPool2d(cfg), &[2, 3, len + 1, len]);
        }
    }
    for input in [&[2usize, 3, 4, 5][..], &[2, 3], &[7], &[2, 1, 1, 1, 6]] {
        for (start_dim, end_dim) in [(1, -1), (0, -1), (0, 1), (-2, -1), (2, 3), (1, 0)] {
            add(Layer::Flatten { start_dim, end_dim }, input);
        }
        for dim in [-5, -1, 0, 2, 4] {
            add(Layer::Softmax { dim }, input);
        }
    }
    add(LinearConfig::new(4, 3).into(), &[2, 5]);
    add(Conv2dConfig::new(3, 4, [3, 3]).into(), &[2, 2, 5, 5]);
    add(Layer::BatchNorm1d(BatchNormConfig::new(3)), &[2, 3, 4]);
    add(Layer::BatchNorm1d(BatchNormConfig::new(3)), &[2, 4]);
    add(LayerNormConfig::new([3, 4]).into(), &[2, 4, 3]);
    add(GroupNormConfig::new(2, 4).into(), &[2, 4, 3, 3]);
    add(
        Layer::AdaptiveAvgPool2d {
            output_size: [3, 2],
        },
        &[1, 2, 2, 7],
    );
    add(
        AttentionConfig::new(8, 2).with_causal(true).into(),
        &[2, 5, 8],
    );
    add(AttentionConfig::new(8, 2).into(), &[2, 5, 6]);
    cases
}

fn init_cases() -> Vec<(String, Init, Vec<usize>)> {
    let mut cases = Vec::new();
    let shapes: [&[usize]; 5] = [&[10, 4], &[16, 3, 5, 5], &[8, 4, 3, 3], &[6, 2, 7], &[7]];
    let nonlinearities = [
        Nonlinearity::Linear,
        Nonlinearity::Conv1d,
        Nonlinearity::Conv2d,
        Nonlinearity::Conv3d,
        Nonlinearity::ConvTranspose1d,
        Nonlinearity::ConvTranspose2d,
        Nonlinearity::ConvTranspose3d,
        Nonlinearity::Sigmoid,
        Nonlinearity::Tanh,
        Nonlinearity::Relu,
        Nonlinearity::LeakyRelu,
        Nonlinearity::Selu,
    ];
    for shape in shapes {
        let mut inits = vec![
            Init::Zeros,
            Init::Ones,
            Init::Constant { value: -0.25 },
            Init::Uniform {
                low: -0.3,
                high: 0.7,
            },
            Init::Normal {
                mean: 0.5,
                std: 0.02,
            },
            Init::XavierUniform { gain: 1.0 },
            Init::XavierUniform { gain: 5.0 / 3.0 },
            Init::XavierNormal { gain: 0.5 },
            Init::torch_default_weight(),
        ];
        for nonlinearity in nonlinearities {
            for (a, mode) in [(0.0, FanMode::FanIn), (0.2, FanMode::FanOut)] {
                inits.push(Init::KaimingUniform {
                    a,
                    mode,
                    nonlinearity,
                });
                inits.push(Init::KaimingNormal {
                    a,
                    mode,
                    nonlinearity,
                });
            }
        }
        for init in inits {
            let name = format!("{:04} {init:?} {shape:?}", cases.len());
            cases.push((name, init, shape.to_vec()));
        }
    }
    cases
}

fn to_json<T: serde::Serialize>(value: &T) -> Value {
    serde_json::to_value(value).expect("serializable")
}

fn assert_dist_close(context: &str, ours: &InitDistribution, theirs: &Value) {
    let ours = to_json(ours);
    assert_eq!(
        ours["type"], theirs["type"],
        "{context}: {ours} vs torch {theirs}"
    );
    let ours = ours.as_object().expect("object");
    for (key, value) in ours {
        if key == "type" {
            continue;
        }
        let a = value.as_f64().expect("number");
        let b = theirs[key].as_f64().unwrap_or(f64::NAN);
        assert!(
            kiln_testkit::close(a, b, 1e-12),
            "{context}: {key} is {a} in Kiln, {b} in torch"
        );
    }
}

#[test]
fn layers_match_torch_nn() {
    let Some(python) = kiln_testkit::python("layers_match_torch_nn") else {
        return;
    };
    let models: Vec<(&str, Layer, Vec<usize>, &str)> = vec![
        ("cnn", cnn(), vec![2, 1, 28, 28], "float32"),
        ("transformer", transformer(), vec![2, 7], "int64"),
        ("decoder", decoder(), vec![2, 6], "int64"),
        (
            "mixture_of_experts",
            Layer::sequential([
                kiln_core::model::SparseMoeConfig::new(16, 12, 6, 2)
                    .with_shared_expert_dim(20)
                    .into(),
                kiln_core::model::SparseMoeConfig::new(16, 8, 4, 3)
                    .with_norm_topk_prob(true)
                    .into(),
            ]),
            vec![2, 5, 16],
            "float32",
        ),
        ("misc", misc(), vec![3, 4, 10], "float32"),
        (
            "attention_and_norms",
            attention_and_norms(),
            vec![2, 5, 16],
            "float32",
        ),
        (
            "embedding_and_custom_inits",
            embedding_and_custom_inits(),
            vec![3, 2, 5],
            "int64",
        ),
    ];
    let shapes = shape_cases();
    let inits = init_cases();
    let request = json!({
        "models": models.iter().map(|(name, layer, input, dtype)| json!({
            "name": name, "layer": to_json(layer), "input": input, "input_dtype": dtype,
        })).collect::<Vec<_>>(),
        "shapes": shapes.iter().map(|(name, layer, input)| json!({
            "name": name, "layer": to_json(layer), "input": input,
        })).collect::<Vec<_>>(),
        "inits": inits.iter().map(|(name, init, shape)| json!({
            "name": name, "init": to_json(init), "shape": shape,
        })).collect::<Vec<_>>(),
    });
    let dir = kiln_testkit::TempDir::new("model-specs");
    let request_path = dir.path().join("request.json");
    std::fs::write(&request_path, request.to_string()).expect("write request");
    let stdout =
        kiln_testkit::run_reference_script!(&python, "model_specs.py", &[request_path.as_os_str()]);
    let reply: Value = serde_json::from_str(&stdout).expect("script prints JSON");

    for (name, layer, input, _) in &models {
        let theirs = &reply["models"][*name];
        let specs = layer
            .parameter_specs("")
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let state = theirs["state"].as_array().expect("state list");
        let ours: Vec<(String, Vec<usize>)> = specs
            .iter()
            .map(|s| (s.name.clone(), s.shape.clone()))
            .collect();
        let torch: Vec<(String, Vec<usize>)> = state
            .iter()
            .map(|e| {
                (
                    e["name"].as_str().expect("name").to_owned(),
                    serde_json::from_value(e["shape"].clone()).expect("shape"),
                )
            })
            .collect();
        assert_eq!(ours, torch, "{name}: state_dict names and shapes");
        for (spec, entry) in specs.iter().zip(state) {
            let context = format!("{name}: {}", spec.name);
            assert_eq!(
                spec.dtype.name(),
                entry["dtype"].as_str().expect("dtype"),
                "{context}"
            );
            assert_dist_close(&context, &spec.init, &entry["init"]);
            let zero_rows: Vec<usize> =
                serde_json::from_value(entry["zero_rows"].clone()).expect("rows");
            assert_eq!(
                spec.zero_row.into_iter().collect::<Vec<_>>(),
                zero_rows,
                "{context}"
            );
            let is_buffer = spec.name.contains("running_") || spec.name.contains("num_batches");
            assert_eq!(spec.kind == ParamKind::Buffer, is_buffer, "{context}");
        }
        let ours = layer
            .output_shape(input)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let torch: Vec<usize> = serde_json::from_value(theirs["output"].clone())
            .unwrap_or_else(|_| panic!("{name}: torch failed: {}", theirs["error"]));
        assert_eq!(ours, torch, "{name}: output shape for input {input:?}");

        // The model summary of one sample: shapes, parameters and mult-adds as
        // torch's hooks and FlopCounterMode see them.
        let params: Vec<(String, usize)> = specs
            .iter()
            .filter(|s| s.kind == ParamKind::Parameter)
            .map(|s| (s.name.clone(), s.shape.iter().product()))
            .collect();
        let summary = ModelSummary::new(layer, &input[1..], &params, &[])
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let torch = &theirs["summary"];
        for row in summary.layers() {
            let context = format!("{name}: summary of `{}` ({})", row.path, row.kind);
            let shape: Vec<usize> = serde_json::from_value(torch["shapes"][&row.path].clone())
                .unwrap_or_else(|_| panic!("{context}: no torch module output"));
            assert_eq!(row.output_shape, shape, "{context}");
            assert_eq!(
                Some(row.params as u64),
                torch["params"][&row.path].as_u64(),
                "{context}"
            );
            assert_eq!(row.trainable, row.params, "{context}");
        }
        let flops = torch["flops"].as_u64().expect("flops");
        assert!(flops > 0, "{name}");
        assert_eq!(summary.total_macs(), Some(flops / 2), "{name}: mult-adds");
    }

    let mut agreed_errors = 0;
    for (name, layer, input) in &shapes {
        let theirs = &reply["shapes"][name.as_str()];
        match (layer.output_shape(input), theirs["output"].as_array()) {
            (Ok(ours), Some(_)) => {
                let torch: Vec<usize> =
                    serde_json::from_value(theirs["output"].clone()).expect("dims");
                assert_eq!(ours, torch, "{name}");
            }
            (Err(_), None) => agreed_errors += 1,
            (Ok(ours), None) => panic!(
                "{name}: Kiln says {ours:?}, torch fails: {}",
                theirs["error"]
            ),
            (Err(e), Some(torch)) => panic!("{name}: Kiln fails ({e}), torch gives {torch:?}"),
        }
    }
    // The cases include inputs both reject (too small, wrong channels, bad dims).
    assert!(agreed_errors >= 20, "only {agreed_errors} rejected inputs");

    let mut compared = BTreeMap::new();
    for (name, init, shape) in &inits {
        let theirs = &reply["inits"][name.as_str()];
        match (init.resolve(shape), theirs["init"].is_object()) {
            (Ok(dist), true) => assert_dist_close(name, &dist, &theirs["init"]),
            (Err(_), false) => {}
            (Ok(dist), false) => panic!(
                "{name}: Kiln gives {dist:?}, torch fails: {}",
                theirs["error"]
            ),
            (Err(e), true) => panic!("{name}: Kiln fails ({e}), torch gives {}", theirs["init"]),
        }
        *compared.entry(shape.len()).or_insert(0) += 1;
    }
    assert_eq!(compared.values().sum::<usize>(), inits.len());
}
