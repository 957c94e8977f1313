//! The two engines agree: the same definition, weights and batches give the same
//! forward outputs and gradients (1e-5) on libtorch and on TensorFlow, and the same
//! losses after 50 steps of SGD and of Adam (1e-4), for an MLP, a CNN with batch
//! norm and a transformer block. Checkpoints move between the backends mid-run.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln::core::{
    backend::{Backend, StepPlan, TrainBackend},
    loss::{CrossEntropyConfig, Loss, Reduction},
    model::{BatchNormConfig, Conv2dConfig, Layer, LinearConfig, Pool2dConfig},
    module::Module,
    optim::{AdamConfig, Optimizer, OptimizerConfig, SgdConfig},
    state_dict::StateDict,
};
use kiln::prelude::*;
use kiln::tf::{TfBackend, TfModel};
use kiln::torch::TorchBackend;
use kiln::train::Checkpoint;
use kiln_testkit::noise;

/// Both generators are global: tests in this binary run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

struct Case {
    name: &'static str,
    spec: Layer,
    input: Vec<usize>,
    loss: Loss,
    /// Regression target dims (after the batch), or `None` for class indices.
    target: Option<Vec<usize>>,
    classes: usize,
}

fn cases() -> Vec<Case> {
    let ce = Loss::CrossEntropy(CrossEntropyConfig::default());
    vec![
        Case {
            name: "mlp",
            spec: Layer::sequential([
                LinearConfig::new(20, 32).into(),
                Layer::Relu,
                LinearConfig::new(32, 32).into(),
                Layer::Tanh,
                LinearConfig::new(32, 5).into(),
            ]),
            input: vec![16, 20],
            loss: ce.clone(),
            target: None,
            classes: 5,
        },
        Case {
            name: "cnn_batchnorm",
            spec: Layer::sequential([
                Conv2dConfig::new(1, 8, [3, 3]).with_padding([1, 1]).into(),
                Layer::BatchNorm2d(BatchNormConfig::new(8)),
                Layer::Relu,
                Layer::MaxPool2d(Pool2dConfig::new([2, 2])),
                Conv2dConfig::new(8, 8, [3, 3]).into(),
                Layer::BatchNorm2d(BatchNormConfig::new(8)),
                Layer::Relu,
                Layer::Flatten {
                    start_dim: 1,
                    end_dim: -1,
                },
                LinearConfig::new(8 * 2 * 2, 10).into(),
            ]),
            input: vec![16, 1, 8, 8],
            loss: ce,
            target: None,
            classes: 10,
        },
        Case {
            name: "transformer_block",
            spec: Layer::transformer_encoder_block(32, 4, 64, false, 0.0),
            input: vec![4, 6, 32],
            loss: Loss::Mse {
                reduction: Reduction::Mean,
            },
            target: Some(vec![6, 32]),
            classes: 0,
        },
    ]
}

fn batch(case: &Case, seed: u64) -> (HostTensor, HostTensor) {
    let n: usize = case.input.iter().product();
    let x = HostTensor::new(noise(n, seed), case.input.clone()).unwrap();
    let rows = case.input[0];
    let y = match &case.target {
        Some(dims) => {
            let mut shape = vec![rows];
            shape.extend(dims);
            let m: usize = shape.iter().product();
            HostTensor::new(noise(m, seed + 1000), shape).unwrap()
        }
        None => {
            let labels: Vec<i64> = noise(rows, seed + 1000)
                .iter()
                .map(|v| ((v + 1.0) * 0.5 * case.classes as f32) as i64 % case.classes as i64)
                .collect();
            HostTensor::new(labels, [rows]).unwrap()
        }
    };
    (x, y)
}

fn max_diff(a: &HostTensor, b: &HostTensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    a.to_f64_vec()
        .iter()
        .zip(b.to_f64_vec())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Torch gradients of every parameter, by name, after one backward.
fn torch_gradients(
    model: &kiln::torch::TorchModel,
    loss: &Loss,
    x: &HostTensor,
    y: &HostTensor,
) -> (f64, StateDict) {
    let out = model
        .forward(&TorchBackend::from_host(x, Device::Cpu).unwrap())
        .unwrap();
    let target = TorchBackend::from_host(y, Device::Cpu).unwrap();
    let l = TorchBackend::loss(loss, &out, &target).unwrap();
    let value = TorchBackend::item(&l).unwrap();
    TorchBackend::backward(&l).unwrap();
    let mut grads = StateDict::new();
    for (name, p) in Module::<TorchBackend>::named_parameters(model).unwrap() {
        grads.insert(name, kiln::torch::from_tch(&p.grad()).unwrap());
    }
    (value, grads)
}

/// A torch model and a TensorFlow model with the torch model's initial weights.
fn pair(case: &Case) -> (kiln::torch::TorchModel, TfModel) {
    TorchBackend::manual_seed(7);
    let torch = TorchBackend::build_model(&case.spec, Device::Cpu).unwrap();
    let mut tf = TfBackend::build_model(&case.spec, Device::Cpu).unwrap();
    tf.load_state_dict(&torch.state_dict().unwrap()).unwrap();
    (torch, tf)
}

/// Every layer kind of the torch layer-parity suite (`tests/fixtures/layer_cases.json`):
/// forward output and every parameter gradient of `sum(output * probe)` agree.
#[test]
fn every_layer_agrees_forward_and_gradients() {
    let _serial = serial();
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/layer_cases.json"
    ))
    .unwrap();
    let values: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    let mut failures = Vec::new();
    for v in values {
        let name = v["name"].as_str().unwrap().to_owned();
        let spec: Layer = serde_json::from_value(v["layer"].clone()).unwrap();
        let input: Vec<usize> = serde_json::from_value(v["input"].clone()).unwrap();
        let int_high: Option<usize> = serde_json::from_value(v["int_high"].clone()).unwrap();
        let train = v["train"].as_bool().unwrap();
        TorchBackend::manual_seed(3);
        let mut torch = TorchBackend::build_model(&spec, Device::Cpu).unwrap();
        let mut tf = TfBackend::build_model(&spec, Device::Cpu).unwrap();
        tf.load_state_dict(&torch.state_dict().unwrap()).unwrap();
        let mode = if train { Mode::Train } else { Mode::Eval };
        torch.set_mode(mode);
        tf.set_mode(mode);
        let n: usize = input.iter().product();
        let x = match int_high {
            Some(high) => HostTensor::new(
                noise(n, 5)
                    .iter()
                    .map(|v| ((v + 1.0) * 0.5 * high as f32) as i64 % high as i64)
                    .collect::<Vec<_>>(),
                input.clone(),
            )
            .unwrap(),
            None => HostTensor::new(noise(n, 5), input.clone()).unwrap(),
        };
        let t_out = TorchBackend::to_host(
            &torch
                .forward(&TorchBackend::from_host(&x, Device::Cpu).unwrap())
                .unwrap(),
        )
        .unwrap();
        // A probe target makes MSE's gradient a fixed linear function of the output.
        let probe = HostTensor::new(noise(t_out.numel(), 9), t_out.dims().to_vec()).unwrap();
        let loss = Loss::Mse {
            reduction: Reduction::Sum,
        };
        let has_parameters = !Module::<TorchBackend>::named_parameters(&torch)
            .unwrap()
            .is_empty();
        let t_grads = if has_parameters {
            torch_gradients(&torch, &loss, &x, &probe).1
        } else {
            StateDict::new()
        };
        let f_out = tf
            .forward(&TfBackend::from_host(&x, Device::Cpu).unwrap())
            .unwrap()
            .to_host()
            .unwrap();
        let f_grads = tf.gradients(
            &loss,
            &TfBackend::from_host(&x, Device::Cpu).unwrap(),
            &TfBackend::from_host(&probe, Device::Cpu).unwrap(),
        );
        let f_grads = match f_grads {
            Ok((_, g)) => g,
            Err(e) => {
                failures.push(format!("{name}: {e}"));
                continue;
            }
        };
        let mut worst = max_diff(&t_out, &f_out);
        let forward = worst;
        for (key, t) in t_grads.iter() {
            match f_grads.get(key) {
                Some(f) => {
                    worst = worst.max(
                        max_diff(t, f)
                            / (1.0 + t.to_f64_vec().iter().fold(0.0f64, |m, v| m.max(v.abs()))),
                    )
                }
                None => failures.push(format!("{name}: no TensorFlow gradient for {key}")),
            }
        }
        eprintln!(
            "{name:<28} forward {forward:.1e}  worst (grads relative to 1 + max|grad|) {worst:.1e}"
        );
        if worst > 1e-5 {
            failures.push(format!("{name}: differs by {worst:.2e}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn forward_and_gradients_agree_within_1e5() {
    let _serial = serial();
    for case in cases() {
        let (mut torch, mut tf) = pair(&case);
        let (x, y) = batch(&case, 1);
        for mode in [Mode::Train, Mode::Eval] {
            torch.set_mode(mode);
            tf.set_mode(mode);
            let t_out = TorchBackend::to_host(
                &torch
                    .forward(&TorchBackend::from_host(&x, Device::Cpu).unwrap())
                    .unwrap(),
            )
            .unwrap();
            let f_out = tf
                .forward(&TfBackend::from_host(&x, Device::Cpu).unwrap())
                .unwrap()
                .to_host()
                .unwrap();
            let d = max_diff(&t_out, &f_out);
            eprintln!("{} {mode:?}: forward max |diff| {d:.2e}", case.name);
            assert!(d < 1e-5, "{} {mode:?} forward differs by {d}", case.name);
        }
        // Batch norm's running statistics moved in both train-mode forwards: still equal.
        let (ts, fs) = (torch.state_dict().unwrap(), tf.state_dict().unwrap());
        for (key, t) in ts.iter() {
            let d = max_diff(t, fs.get(key).unwrap());
            assert!(
                d < 1e-5,
                "{}: {key} differs by {d} after forward",
                case.name
            );
        }
        torch.set_mode(Mode::Train);
        tf.set_mode(Mode::Train);
        let (t_loss, t_grads) = torch_gradients(&torch, &case.loss, &x, &y);
        let (f_loss, f_grads) = tf
            .gradients(
                &case.loss,
                &TfBackend::from_host(&x, Device::Cpu).unwrap(),
                &TfBackend::from_host(&y, Device::Cpu).unwrap(),
            )
            .unwrap();
        assert!(
            (t_loss - f_loss).abs() < 1e-5,
            "{}: loss {t_loss} vs {f_loss}",
            case.name
        );
        assert_eq!(
            t_grads.keys().collect::<Vec<_>>(),
            f_grads.keys().collect::<Vec<_>>(),
            "{}: the same parameters get gradients",
            case.name
        );
        let mut worst = 0.0f64;
        for (key, t) in t_grads.iter() {
            let d = max_diff(t, f_grads.get(key).unwrap());
            worst = worst.max(d);
            assert!(d < 1e-5, "{}: gradient of {key} differs by {d}", case.name);
        }
        eprintln!(
            "{}: loss {t_loss:.6}, gradients max |diff| {worst:.2e}",
            case.name
        );
    }
}

/// Losses of `steps` training steps through `Trainable::train_step` on fixed batches.
fn train<B: TrainBackend>(
    model: &mut B::Model,
    optimizer: &mut B::Optim,
    case: &Case,
    steps: u64,
    first_batch: u64,
) -> Vec<f64> {
    (0..steps)
        .map(|i| {
            let (x, y) = batch(case, (first_batch + i) % 5 + 1);
            optimizer.zero_grad().unwrap();
            let plan = StepPlan {
                loss: &case.loss,
                scale: 1.0,
                apply: true,
                clip: None,
            };
            model
                .train_step(
                    optimizer,
                    &B::from_host(&x, Device::Cpu).unwrap(),
                    &B::from_host(&y, Device::Cpu).unwrap(),
                    &plan,
                )
                .unwrap()
        })
        .collect()
}

fn optimizer_name(config: &OptimizerConfig) -> &'static str {
    match config {
        OptimizerConfig::Sgd(_) => "sgd",
        OptimizerConfig::Adam(_) => "adam",
        _ => "other",
    }
}

#[test]
fn fifty_steps_of_sgd_and_adam_agree_within_1e4() {
    let _serial = serial();
    let optimizers = [
        OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9)),
        OptimizerConfig::Adam(AdamConfig::new(1e-3)),
    ];
    for case in cases() {
        for config in &optimizers {
            let (mut torch, mut tf) = pair(&case);
            let mut t_opt = torch.build_optimizer(config, &[]).unwrap();
            let mut f_opt = tf.build_optimizer(config, &[]).unwrap();
            let runs_before = tf.session_runs().unwrap();
            let t_losses = train::<TorchBackend>(&mut torch, &mut t_opt, &case, 50, 10);
            let f_losses = train::<TfBackend>(&mut tf, &mut f_opt, &case, 50, 10);
            assert_eq!(
                tf.session_runs().unwrap() - runs_before,
                50,
                "one session run per training step"
            );
            let worst = t_losses
                .iter()
                .zip(&f_losses)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            eprintln!(
                "{} {}: loss {:.5} -> {:.5}, max |diff| over 50 steps {worst:.2e}",
                case.name,
                optimizer_name(config),
                t_losses[0],
                t_losses[49]
            );
            assert!(
                t_losses[49] < t_losses[0],
                "{} {}: training reduces the loss",
                case.name,
                optimizer_name(config)
            );
            assert!(
                worst < 1e-4,
                "{} {}: losses differ by {worst}",
                case.name,
                optimizer_name(config)
            );
        }
    }
}

#[test]
fn checkpoints_resume_across_backends() {
    let _serial = serial();
    let case = &cases()[1]; // the CNN: parameters, buffers and Adam state all move
    let config = OptimizerConfig::Adam(AdamConfig::new(1e-3));
    let dir = std::env::temp_dir().join(format!("kiln-cross-backend-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    // Reference: 20 steps on torch alone.
    let (mut torch, _) = pair(case);
    let mut t_opt = torch.build_optimizer(&config, &[]).unwrap();
    let reference = train::<TorchBackend>(&mut torch, &mut t_opt, case, 20, 0);

    // 10 steps on torch, checkpoint, 10 more on TensorFlow; and the reverse.
    for (first, second) in [("torch", "tensorflow"), ("tensorflow", "torch")] {
        let (mut torch, mut tf) = pair(case);
        let mut t_opt = torch.build_optimizer(&config, &[]).unwrap();
        let mut f_opt = tf.build_optimizer(&config, &[]).unwrap();
        let mut losses = Vec::new();
        let path = dir.join(format!("{first}.safetensors"));
        let checkpoint = |model: StateDict, optimizer: StateDict, backend: &str| Checkpoint {
            model,
            optimizer,
            step: 10,
            epoch: 0,
            batch_in_epoch: 10,
            seed: 7,
            world_size: 1,
            backend: backend.to_owned(),
            optimizer_kind: None,
            model_definition: Some(case.spec.clone()),
            lora: None,
            data: None,
            data_order: None,
            scheduler: None,
            metrics: Default::default(),
            epoch_loss: None,
            epoch_metrics: Default::default(),
            averaged: None,
            callbacks: Default::default(),
        };
        if first == "torch" {
            losses.extend(train::<TorchBackend>(&mut torch, &mut t_opt, case, 10, 0));
            checkpoint(
                torch.state_dict().unwrap(),
                t_opt.state_dict().unwrap(),
                first,
            )
            .save(&path)
            .unwrap();
            let loaded = Checkpoint::load(&path).unwrap();
            tf.load_state_dict(&loaded.model).unwrap();
            f_opt.load_state_dict(&loaded.optimizer).unwrap();
            losses.extend(train::<TfBackend>(&mut tf, &mut f_opt, case, 10, 10));
        } else {
            losses.extend(train::<TfBackend>(&mut tf, &mut f_opt, case, 10, 0));
            checkpoint(tf.state_dict().unwrap(), f_opt.state_dict().unwrap(), first)
                .save(&path)
                .unwrap();
            let loaded = Checkpoint::load(&path).unwrap();
            torch.load_state_dict(&loaded.model).unwrap();
            t_opt.load_state_dict(&loaded.optimizer).unwrap();
            losses.extend(train::<TorchBackend>(&mut torch, &mut t_opt, case, 10, 10));
        }
        let worst = reference
            .iter()
            .zip(&losses)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        eprintln!("{first} -> {second}: loss curve max |diff| vs torch alone {worst:.2e}");
        assert!(
            worst < 1e-4,
            "{first} -> {second}: losses differ by {worst}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn max_state_diff(a: &StateDict, b: &StateDict) -> f64 {
    a.iter()
        .map(|(key, t)| max_diff(t, b.get(key).unwrap_or_else(|| panic!("no {key}"))))
        .fold(0.0, f64::max)
}

/// Every optimizer and option, parameter groups, gradient accumulation and both
/// kinds of clipping: parameters and optimizer state after 20 steps agree.
#[test]
fn every_optimizer_groups_accumulation_and_clipping_agree() {
    use kiln::core::optim::{
        AdagradConfig, AdamWConfig, GradClip, ParamGroup, ParamSelector, RmsPropConfig,
    };
    let _serial = serial();
    let case = &cases()[0];
    let configs = [
        OptimizerConfig::Sgd(SgdConfig::new(0.05).with_weight_decay(0.01)),
        OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9).with_nesterov(true)),
        OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.8).with_dampening(0.3)),
        OptimizerConfig::Adam(AdamConfig::new(1e-2).with_weight_decay(0.01)),
        OptimizerConfig::Adam(AdamConfig::new(1e-2).with_amsgrad(true)),
        OptimizerConfig::AdamW(AdamWConfig::new(1e-2).with_weight_decay(0.1)),
        OptimizerConfig::AdamW(
            AdamWConfig::new(1e-2)
                .with_weight_decay(0.1)
                .with_amsgrad(true),
        ),
        OptimizerConfig::RmsProp(RmsPropConfig::new(1e-3)),
        OptimizerConfig::RmsProp(
            RmsPropConfig::new(1e-3)
                .with_momentum(0.9)
                .with_centered(true)
                .with_weight_decay(0.01),
        ),
        OptimizerConfig::Adagrad(
            AdagradConfig::new(0.05)
                .with_lr_decay(0.01)
                .with_initial_accumulator_value(0.1),
        ),
    ];
    let groups = [ParamGroup::new("head", ParamSelector::Prefix("4.".to_owned())).with_lr(0.02)];
    let clips = [
        None,
        Some(GradClip::Norm {
            max_norm: 0.5,
            norm_type: 2.0,
        }),
        Some(GradClip::Value { clip_value: 0.01 }),
    ];
    for (i, config) in configs.iter().enumerate() {
        let clip = clips[i % clips.len()];
        let accumulate = if i % 2 == 0 { 1 } else { 2 };
        let group_list: &[ParamGroup] = if i % 3 == 1 { &groups } else { &[] };
        let (mut torch, mut tf) = pair(case);
        let mut t_opt = torch.build_optimizer(config, group_list).unwrap();
        let mut f_opt = tf.build_optimizer(config, group_list).unwrap();
        let mut worst_loss = 0.0f64;
        for step in 0..20u64 {
            t_opt.zero_grad().unwrap();
            f_opt.zero_grad().unwrap();
            for micro in 0..accumulate {
                let (x, y) = batch(case, step * 2 + micro + 1);
                let plan = StepPlan {
                    loss: &case.loss,
                    scale: 1.0 / accumulate as f64,
                    apply: micro + 1 == accumulate,
                    clip: clip.as_ref(),
                };
                let a = torch
                    .train_step(
                        &mut t_opt,
                        &TorchBackend::from_host(&x, Device::Cpu).unwrap(),
                        &TorchBackend::from_host(&y, Device::Cpu).unwrap(),
                        &plan,
                    )
                    .unwrap();
                let b = tf
                    .train_step(
                        &mut f_opt,
                        &TfBackend::from_host(&x, Device::Cpu).unwrap(),
                        &TfBackend::from_host(&y, Device::Cpu).unwrap(),
                        &plan,
                    )
                    .unwrap();
                worst_loss = worst_loss.max((a - b).abs());
            }
        }
        let params = max_state_diff(&torch.state_dict().unwrap(), &tf.state_dict().unwrap());
        let state = max_state_diff(&t_opt.state_dict().unwrap(), &f_opt.state_dict().unwrap());
        eprintln!(
            "{config:?} clip {clip:?} accumulate {accumulate} groups {}: loss {worst_loss:.1e}, params {params:.1e}, state {state:.1e}",
            group_list.len()
        );
        assert!(
            worst_loss < 1e-5 && params < 1e-5 && state < 1e-4,
            "{config:?}: loss {worst_loss}, params {params}, state {state}"
        );
    }
}

/// A batch whose loss is not finite changes nothing on the TensorFlow backend:
/// the update ops (batch-norm statistics included) depend on an in-graph
/// assertion that the loss is finite.
#[test]
fn a_non_finite_loss_leaves_the_model_and_optimizer_unchanged() {
    let _serial = serial();
    let spec = Layer::sequential([
        LinearConfig::new(6, 8).into(),
        Layer::BatchNorm1d(BatchNormConfig::new(8)),
        LinearConfig::new(8, 2).into(),
    ]);
    let loss = Loss::Mse {
        reduction: Reduction::Mean,
    };
    TfBackend::manual_seed(1);
    let mut tf = TfBackend::build_model(&spec, Device::Cpu).unwrap();
    let mut opt = tf
        .build_optimizer(&OptimizerConfig::Adam(AdamConfig::new(1e-2)), &[])
        .unwrap();
    let plan = StepPlan {
        loss: &loss,
        scale: 1.0,
        apply: true,
        clip: None,
    };
    let x = HostTensor::new(noise(24, 1), [4, 6]).unwrap();
    let y = HostTensor::new(noise(8, 2), [4, 2]).unwrap();
    let to_tf = |h: &HostTensor| TfBackend::from_host(h, Device::Cpu).unwrap();
    tf.train_step(&mut opt, &to_tf(&x), &to_tf(&y), &plan)
        .unwrap();
    let (model_before, opt_before) = (tf.state_dict().unwrap(), opt.state_dict().unwrap());
    for bad in [f32::NAN, f32::INFINITY] {
        let mut values = noise(8, 2);
        values[3] = bad;
        let poisoned = HostTensor::new(values, [4, 2]).unwrap();
        let value = tf
            .train_step(&mut opt, &to_tf(&x), &to_tf(&poisoned), &plan)
            .unwrap();
        assert!(
            !value.is_finite(),
            "the non-finite loss is reported: {value}"
        );
        assert_eq!(tf.state_dict().unwrap(), model_before);
        assert_eq!(opt.state_dict().unwrap(), opt_before);
    }
    // And training goes on.
    let value = tf
        .train_step(&mut opt, &to_tf(&x), &to_tf(&y), &plan)
        .unwrap();
    assert!(value.is_finite());
    assert_ne!(tf.state_dict().unwrap(), model_before);
}

/// TensorFlow's two halves of a step, gradients then an update from given
/// gradients (what data-parallel training runs, with an all-reduce between),
/// give what one fused training step gives; bad gradients change nothing.
#[test]
fn tensorflow_gradients_then_apply_equals_a_training_step() {
    let _serial = serial();
    let spec = Layer::sequential([
        LinearConfig::new(6, 8).into(),
        Layer::Relu,
        LinearConfig::new(8, 2).into(),
    ]);
    let loss = Loss::Mse {
        reduction: Reduction::Mean,
    };
    let clip = kiln::core::optim::GradClip::Norm {
        max_norm: 0.05,
        norm_type: 2.0,
    };
    let config = OptimizerConfig::Adam(AdamConfig::new(1e-2).with_weight_decay(0.01));
    TfBackend::manual_seed(3);
    let mut fused = TfBackend::build_model(&spec, Device::Cpu).unwrap();
    let mut split = TfBackend::build_model(&spec, Device::Cpu).unwrap();
    split.load_state_dict(&fused.state_dict().unwrap()).unwrap();
    let mut fused_opt = fused.build_optimizer(&config, &[]).unwrap();
    let mut split_opt = split.build_optimizer(&config, &[]).unwrap();
    let plan = StepPlan {
        loss: &loss,
        scale: 1.0,
        apply: true,
        clip: Some(&clip),
    };
    let to_tf = |h: &HostTensor| TfBackend::from_host(h, Device::Cpu).unwrap();
    for step in 0..3u64 {
        let x = to_tf(&HostTensor::new(noise(24, 10 + step), [4, 6]).unwrap());
        let y = to_tf(&HostTensor::new(noise(8, 20 + step), [4, 2]).unwrap());
        let fused_loss = fused.train_step(&mut fused_opt, &x, &y, &plan).unwrap();
        let (split_loss, grads) = split.gradients(&loss, &x, &y).unwrap();
        assert_eq!(grads.len(), 4, "every parameter has a gradient");
        split_opt.apply_gradients(&grads, Some(&clip)).unwrap();
        assert!(
            (fused_loss - split_loss).abs() < 1e-6,
            "{fused_loss} vs {split_loss}"
        );
        let diff = max_state_diff(&fused.state_dict().unwrap(), &split.state_dict().unwrap());
        assert!(diff < 1e-6, "step {step}: parameters differ by {diff}");
        let diff = max_state_diff(
            &fused_opt.state_dict().unwrap(),
            &split_opt.state_dict().unwrap(),
        );
        assert!(
            diff < 1e-6,
            "step {step}: optimizer states differ by {diff}"
        );
    }

    // A gradient for no parameter, or of the wrong shape, changes nothing.
    let (model_before, opt_before) = (split.state_dict().unwrap(), split_opt.state_dict().unwrap());
    let x = to_tf(&HostTensor::new(noise(24, 30), [4, 6]).unwrap());
    let y = to_tf(&HostTensor::new(noise(8, 31), [4, 2]).unwrap());
    let (_, grads) = split.gradients(&loss, &x, &y).unwrap();
    let mut unknown = grads.clone();
    unknown.insert(
        "9.weight".to_owned(),
        HostTensor::new(vec![0f32; 2], [2]).unwrap(),
    );
    let err = split_opt.apply_gradients(&unknown, None).unwrap_err();
    assert!(err.to_string().contains("9.weight"), "{err}");
    let mut misshapen = grads.clone();
    misshapen.insert(
        "0.bias".to_owned(),
        HostTensor::new(vec![0f32; 3], [3]).unwrap(),
    );
    let err = split_opt.apply_gradients(&misshapen, None).unwrap_err();
    assert!(err.to_string().contains("0.bias"), "{err}");
    assert_eq!(split.state_dict().unwrap(), model_before);
    assert_eq!(split_opt.state_dict().unwrap(), opt_before);

    // A parameter without a gradient is left alone, as PyTorch skips `grad is None`.
    let mut partial = grads;
    partial.remove("0.weight");
    split_opt.apply_gradients(&partial, None).unwrap();
    let after = split.state_dict().unwrap();
    assert_eq!(after.get("0.weight"), model_before.get("0.weight"));
    assert_ne!(after.get("0.bias"), model_before.get("0.bias"));
}

/// TensorFlow models draw their initial weights from PyTorch's distributions,
/// reproducibly from the backend's seed.
#[test]
fn tensorflow_initialisation_follows_pytorch_defaults_and_the_seed() {
    let _serial = serial();
    let spec: Layer = LinearConfig::new(256, 128).into();
    TfBackend::manual_seed(11);
    let a = TfBackend::build_model(&spec, Device::Cpu)
        .unwrap()
        .state_dict()
        .unwrap();
    TfBackend::manual_seed(11);
    let b = TfBackend::build_model(&spec, Device::Cpu)
        .unwrap()
        .state_dict()
        .unwrap();
    assert_eq!(a, b, "the same seed gives the same weights");
    TfBackend::manual_seed(12);
    let c = TfBackend::build_model(&spec, Device::Cpu)
        .unwrap()
        .state_dict()
        .unwrap();
    assert_ne!(a, c);
    // nn.Linear: kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in)), bias likewise.
    let bound = 1.0 / 256f64.sqrt();
    let w = a.get("weight").unwrap().to_f64_vec();
    assert!(w.iter().all(|v| v.abs() <= bound));
    let mean = w.iter().sum::<f64>() / w.len() as f64;
    let var = w.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / w.len() as f64;
    assert!(mean.abs() < 0.05 * bound, "mean {mean}");
    assert!(
        (var / (bound * bound / 3.0) - 1.0).abs() < 0.05,
        "variance {var} vs {}",
        bound * bound / 3.0
    );
    assert!(a
        .get("bias")
        .unwrap()
        .to_f64_vec()
        .iter()
        .all(|v| v.abs() <= bound));
}

/// Bad input to the TensorFlow backend is a typed error naming what was expected.
#[test]
fn tensorflow_errors_name_what_was_expected() {
    let _serial = serial();
    let case = &cases()[0];
    let mut tf = TfBackend::build_model(&case.spec, Device::Cpu).unwrap();
    let x = TfBackend::from_host(
        &HostTensor::new(vec![0f32; 48], [16, 3]).unwrap(),
        Device::Cpu,
    )
    .unwrap();
    let err = tf.forward(&x).unwrap_err();
    assert_eq!(
        err.to_string(),
        "0 (Linear): expected shape [*, 20], got [16, 3]"
    );
    let x64 = TfBackend::from_host(
        &HostTensor::new(vec![0f64; 40], [2, 20]).unwrap(),
        Device::Cpu,
    )
    .unwrap();
    assert!(matches!(
        tf.forward(&x64).unwrap_err(),
        kiln::Error::DTypeMismatch { .. }
    ));
    assert!(matches!(
        TfBackend::build_model(&case.spec, Device::Cuda(0)).unwrap_err(),
        kiln::Error::DeviceUnavailable { .. }
    ));
    let mut bad = tf.state_dict().unwrap();
    let before = bad.clone();
    bad.insert("4.bias", HostTensor::new(vec![0f32; 3], [3]).unwrap());
    assert_eq!(
        tf.load_state_dict(&bad).unwrap_err().to_string(),
        "state dict entry `4.bias`: expected shape [5], got [3]"
    );
    assert_eq!(
        tf.state_dict().unwrap(),
        before,
        "a failed load changes nothing"
    );
    // `backward` on TensorFlow was an `Unsupported` error at run time; it is now
    // a compile error: TfBackend is a TrainBackend, not an EagerBackend.
}
