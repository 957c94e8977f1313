//! Activation checkpointing (`TorchModel::checkpoint_activations`): training
//! with checkpointed residual blocks (dropout inside) gives an ordinary run's
//! losses and weights, in float32 and under bf16 autocast; the activations held
//! between the forward and backward passes shrink; evaluation is unchanged;
//! parts that cannot be checkpointed are refused, and nothing changes.

#![allow(clippy::unwrap_used)]

use kiln_core::{
    backend::{Backend, StepPlan, Trainable},
    loss::Loss,
    model::{BatchNormConfig, Layer, LayerNormConfig, LinearConfig, SparseMoeConfig},
    module::Module,
    optim::{AdamConfig, GradClip, Optimizer, OptimizerConfig},
    precision::FloatPrecision,
    Device, Error,
};
use kiln_torch::{TorchBackend, TorchModel};
use tch::{Kind, Tensor};

/// libtorch's generator and this process's memory are shared by the tests,
/// which take turns.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Input, a linear layer, `blocks` residual blocks (layer norm, linear, GELU,
/// dropout, linear), a head.
fn spec(width: usize, blocks: usize) -> Layer {
    let block = Layer::Residual {
        block: Box::new(Layer::sequential([
            Layer::LayerNorm(LayerNormConfig::new([width])),
            LinearConfig::new(width, width).into(),
            Layer::Gelu {
                approximate: Default::default(),
            },
            Layer::Dropout { p: 0.2 },
            LinearConfig::new(width, width).into(),
        ])),
    };
    let mut layers = vec![LinearConfig::new(12, width).into()];
    layers.extend(std::iter::repeat_n(block, blocks));
    layers.push(LinearConfig::new(width, 5).into());
    Layer::sequential(layers)
}

fn flat(model: &TorchModel) -> Vec<f64> {
    model
        .named_parameters()
        .unwrap()
        .iter()
        .flat_map(|(_, t)| Vec::<f64>::try_from(t.to_kind(Kind::Double).flatten(0, -1)).unwrap())
        .collect()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Six steps of Adam with clipping; returns the losses and the weights.
fn train(precision: FloatPrecision, checkpoint: &[&str]) -> (Vec<f64>, Vec<f64>) {
    TorchBackend::manual_seed(11);
    let mut model = TorchModel::new(&spec(32, 3), Device::Cpu).unwrap();
    model.set_precision(precision).unwrap();
    if !checkpoint.is_empty() {
        model.checkpoint_activations(checkpoint).unwrap();
    }
    let mut opt = model
        .build_optimizer(&OptimizerConfig::Adam(AdamConfig::new(1e-2)), &[])
        .unwrap();
    let loss = Loss::cross_entropy();
    let clip = GradClip::norm(1.0);
    tch::manual_seed(5);
    let batches: Vec<(Tensor, Tensor)> = (0..6)
        .map(|_| {
            (
                Tensor::randn([16, 12], (Kind::Float, tch::Device::Cpu)),
                Tensor::randint(5, [16], (Kind::Int64, tch::Device::Cpu)),
            )
        })
        .collect();
    let mut losses = Vec::new();
    for (x, y) in &batches {
        opt.zero_grad().unwrap();
        let plan = StepPlan {
            loss: &loss,
            scale: 1.0,
            apply: true,
            clip: Some(&clip),
        };
        losses.push(model.train_step(&mut opt, x, y, &plan).unwrap());
    }
    (losses, flat(&model))
}

#[test]
fn checkpointed_training_equals_an_ordinary_run() {
    let _turn = one_at_a_time();
    for precision in [FloatPrecision::F32, FloatPrecision::Bf16Mixed] {
        let (plain_losses, plain_weights) = train(precision, &[]);
        for patterns in [&["1", "2", "3"][..], &["*"], &["2.block.*"]] {
            let (losses, weights) = train(precision, patterns);
            let (dl, dw) = (
                max_diff(&losses, &plain_losses),
                max_diff(&weights, &plain_weights),
            );
            println!("{precision}, {patterns:?}: losses within {dl:e}, weights within {dw:e}");
            assert!(
                dl <= 1e-7,
                "{precision} {patterns:?}: losses differ by {dl}"
            );
            assert!(
                dw <= 1e-7,
                "{precision} {patterns:?}: weights differ by {dw}"
            );
        }
    }
}

/// Bytes this process holds now (resident set).
fn resident() -> i64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: i64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// What the graph of one training forward pass holds until its backward pass:
/// with every block checkpointed, only the blocks' inputs.
#[test]
fn checkpointed_blocks_hold_only_their_inputs() {
    let _turn = one_at_a_time();
    if !std::path::Path::new("/proc/self/statm").exists() {
        kiln_testkit::skip(
            "checkpointed_blocks_hold_only_their_inputs",
            "no /proc/self/statm to read the resident set from",
        );
        return;
    }
    let held = |checkpoint: bool| -> i64 {
        TorchBackend::manual_seed(1);
        let mut model = TorchModel::new(&spec(1024, 4), Device::Cpu).unwrap();
        if checkpoint {
            model.checkpoint_activations(&["1", "2", "3", "4"]).unwrap();
        }
        let x = Tensor::randn([1024, 12], (Kind::Float, tch::Device::Cpu));
        let before = resident();
        let y = model.forward(&x).unwrap();
        let after = resident();
        y.sum(Kind::Float).backward();
        after - before
    };
    // Each block's activation is 4 MiB (1024 x 1024 float32).
    let (plain, checkpointed) = (held(false), held(true));
    println!(
        "held by the graph: {} MiB plain, {} MiB checkpointed",
        plain >> 20,
        checkpointed >> 20
    );
    assert!(plain > 40 << 20, "the plain graph holds {plain} bytes");
    assert!(
        checkpointed * 3 < plain,
        "checkpointed {checkpointed} bytes, plain {plain}"
    );
}

#[test]
fn evaluation_and_refusals() {
    let _turn = one_at_a_time();
    TorchBackend::manual_seed(2);
    let mut model = TorchModel::new(&spec(16, 2), Device::Cpu).unwrap();
    model.set_mode(kiln_core::backend::Mode::Eval);
    let x = Tensor::randn([4, 12], (Kind::Float, tch::Device::Cpu));
    let plain = model.forward(&x).unwrap();
    // A pattern that matches no layer names the key and the layers there are.
    let err = model.checkpoint_activations(&["9"]).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { .. })
            && err.to_string().contains("activation_checkpointing")
            && err.to_string().contains("`9` matches no layer"),
        "{err}"
    );
    assert_eq!(model.checkpoint_activations(&["1"]).unwrap(), ["1"]);
    assert!(model.forward(&x).unwrap().equal(&plain));

    let with_bn = Layer::sequential([
        LinearConfig::new(12, 8).into(),
        Layer::sequential([
            Layer::BatchNorm1d(BatchNormConfig::new(8)),
            LinearConfig::new(8, 3).into(),
        ]),
    ]);
    let mut model = TorchModel::new(&with_bn, Device::Cpu).unwrap();
    let err = model.checkpoint_activations(&["0", "1"]).unwrap_err();
    assert!(
        matches!(&err, Error::Unsupported { .. }) && err.to_string().contains("`1.0`"),
        "{err}"
    );
    // Nothing changed: "0" alone still wraps.
    assert_eq!(model.checkpoint_activations(&["0"]).unwrap(), ["0"]);
}

/// A mixture of experts whose router losses are weighed into the loss cannot
/// be checkpointed (their gradient would not reach its router), and nothing
/// changes; with the weights at 0 it can, and its logged router losses are
/// an ordinary forward pass's.
#[test]
fn a_weighted_router_is_refused_and_an_unweighted_one_still_logs() {
    let _turn = one_at_a_time();
    let spec = |coef: f64| {
        Layer::sequential([
            LinearConfig::new(12, 8).into(),
            Layer::sequential([SparseMoeConfig::new(8, 16, 4, 2)
                .with_router_aux_loss_coef(coef)
                .into()]),
            LinearConfig::new(8, 3).into(),
        ])
    };
    TorchBackend::manual_seed(5);
    let mut weighted = TorchModel::new(&spec(0.1), Device::Cpu).unwrap();
    let err = weighted.checkpoint_activations(&["1"]).unwrap_err();
    assert!(
        matches!(&err, Error::Unsupported { .. })
            && err.to_string().contains("`1.0`")
            && err.to_string().contains("router_aux_loss_coef"),
        "{err}"
    );
    assert_eq!(weighted.checkpoint_activations(&["0"]).unwrap(), ["0"]);

    let x = Tensor::randn([6, 12], (Kind::Float, tch::Device::Cpu));
    let logged = |model: &TorchModel| -> Vec<f64> {
        let out = model.forward(&x).unwrap();
        let with = model.add_auxiliary_losses(out.sum(Kind::Float)).unwrap();
        with.values.iter().map(|v| v.double_value(&[])).collect()
    };
    TorchBackend::manual_seed(5);
    let plain = TorchModel::new(&spec(0.0), Device::Cpu).unwrap();
    TorchBackend::manual_seed(5);
    let mut checkpointed = TorchModel::new(&spec(0.0), Device::Cpu).unwrap();
    assert_eq!(checkpointed.checkpoint_activations(&["1"]).unwrap(), ["1"]);
    let (a, b) = (logged(&plain), logged(&checkpointed));
    assert_eq!(a.len(), 2);
    assert!(a[0] > 0.0 && a[1] > 0.0, "{a:?}");
    assert_eq!(a, b, "the checkpointed part records its router logits");
    // Each forward pass's losses are taken once.
    let err = plain
        .add_auxiliary_losses(Tensor::from(0.0f32))
        .unwrap_err();
    assert!(err.to_string().contains("forward pass"), "{err}");
}
