//! Every optimizer's parameters after 10 steps against `torch.optim` (within 1e-6),
//! with parameter groups and gradient clipping, and its state saved and restored
//! mid-run continuing exactly. References: `tests/reference/optim_parity.py`.

#![allow(clippy::unwrap_used)]

mod common;

use kiln_core::{
    loss::Loss,
    model::{Layer, LinearConfig},
    module::Module,
    optim::{
        AdagradConfig, AdamConfig, AdamWConfig, GradClip, Optimizer, OptimizerConfig, ParamGroup,
        ParamSelector, RmsPropConfig, SgdConfig,
    },
    state_dict::StateDict,
    state_tensors::StateTensor,
    Device,
};
use kiln_torch::{
    clip_grad_norm, clip_grad_norm_on_device, clip_grad_value, compute_loss, from_tch, to_tch,
    TorchModel, TorchOptimizer,
};

const STEPS: usize = 10;

struct Case {
    name: &'static str,
    optimizer: OptimizerConfig,
    groups: Vec<ParamGroup>,
    clip: Option<GradClip>,
}

fn case(name: &'static str, optimizer: OptimizerConfig) -> Case {
    Case {
        name,
        optimizer,
        groups: Vec::new(),
        clip: None,
    }
}

fn mlp() -> Layer {
    Layer::sequential([
        LinearConfig::new(5, 8).into(),
        Layer::Tanh,
        LinearConfig::new(8, 3).into(),
    ])
}

fn cases() -> Vec<Case> {
    let no_decay_bias = vec![
        ParamGroup::new("no_decay", ParamSelector::Suffix("bias".into()))
            .with_lr(0.05)
            .with_weight_decay(0.0),
    ];
    vec![
        case("sgd", OptimizerConfig::Sgd(SgdConfig::new(0.1))),
        case(
            "sgd_momentum_dampening_decay",
            OptimizerConfig::Sgd(
                SgdConfig::new(0.05)
                    .with_momentum(0.9)
                    .with_dampening(0.1)
                    .with_weight_decay(1e-2),
            ),
        ),
        case(
            "sgd_nesterov",
            OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9).with_nesterov(true)),
        ),
        case("adam", OptimizerConfig::Adam(AdamConfig::new(1e-2))),
        case(
            "adam_decay_amsgrad",
            OptimizerConfig::Adam(
                AdamConfig::new(1e-2)
                    .with_weight_decay(0.01)
                    .with_amsgrad(true)
                    .with_betas((0.8, 0.99)),
            ),
        ),
        case(
            "adamw",
            OptimizerConfig::AdamW(AdamWConfig::new(1e-2).with_weight_decay(0.1)),
        ),
        case(
            "adamw_amsgrad",
            OptimizerConfig::AdamW(AdamWConfig::new(2e-2).with_amsgrad(true)),
        ),
        case(
            "rmsprop",
            OptimizerConfig::RmsProp(RmsPropConfig::new(1e-2)),
        ),
        case(
            "rmsprop_centered_momentum_decay",
            OptimizerConfig::RmsProp(
                RmsPropConfig::new(5e-3)
                    .with_centered(true)
                    .with_momentum(0.5)
                    .with_weight_decay(0.01),
            ),
        ),
        case(
            "adagrad",
            OptimizerConfig::Adagrad(
                AdagradConfig::new(0.1)
                    .with_lr_decay(0.01)
                    .with_initial_accumulator_value(0.1)
                    .with_weight_decay(0.01),
            ),
        ),
        Case {
            groups: no_decay_bias.clone(),
            ..case(
                "adamw_param_groups",
                OptimizerConfig::AdamW(AdamWConfig::new(1e-2).with_weight_decay(0.1)),
            )
        },
        Case {
            groups: vec![
                ParamGroup::new("first_layer", ParamSelector::Prefix("0.".into())).with_lr(0.2),
            ],
            ..case(
                "sgd_param_groups",
                OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.5)),
            )
        },
        Case {
            clip: Some(GradClip::Norm {
                max_norm: 0.1,
                norm_type: 2.0,
            }),
            ..case("sgd_clip_norm", OptimizerConfig::Sgd(SgdConfig::new(0.1)))
        },
        Case {
            clip: Some(GradClip::Value { clip_value: 0.01 }),
            ..case(
                "adam_clip_value",
                OptimizerConfig::Adam(AdamConfig::new(1e-2)),
            )
        },
    ]
}

/// One training step; returns the loss before the update.
fn step(
    model: &TorchModel,
    opt: &mut TorchOptimizer,
    x: &tch::Tensor,
    y: &tch::Tensor,
    clip: &Option<GradClip>,
) -> f64 {
    opt.zero_grad().unwrap();
    let loss = compute_loss(&Loss::mse(), &model.forward(x).unwrap(), y).unwrap();
    loss.backward();
    let params = opt.parameters();
    match clip {
        Some(GradClip::Norm {
            max_norm,
            norm_type,
        }) if opt.is_capturable() => {
            clip_grad_norm_on_device(&params, *max_norm, *norm_type).unwrap();
        }
        Some(GradClip::Norm {
            max_norm,
            norm_type,
        }) => {
            clip_grad_norm(&params, *max_norm, *norm_type).unwrap();
        }
        Some(GradClip::Value { clip_value }) => clip_grad_value(&params, *clip_value).unwrap(),
        _ => {}
    }
    opt.step().unwrap();
    loss.double_value(&[])
}

fn batch(reference: &StateDict, k: usize, device: Device) -> (tch::Tensor, tch::Tensor) {
    let get = |key: String| to_tch(reference.get(&key).unwrap(), device).unwrap();
    (get(format!("x.{k}")), get(format!("y.{k}")))
}

#[test]
fn every_optimizer_matches_torch_optim_after_ten_steps() {
    let Some(python) = common::python("every_optimizer_matches_torch_optim_after_ten_steps") else {
        return;
    };
    let dir = common::scratch_dir("optim-parity");
    let cases = cases();
    let request: Vec<serde_json::Value> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            serde_json::json!({
                "name": c.name, "layer": mlp(), "optimizer": c.optimizer, "groups": c.groups,
                "clip": c.clip, "steps": STEPS, "seed": 7 + i, "batch": 16, "inputs": 5, "outputs": 3,
            })
        })
        .collect();
    let request_path = common::write_json(&dir, "cases.json", &request);
    common::run_reference(&python, "optim_parity.py", &[&request_path, &dir]);

    for (device, _) in common::devices() {
        // Different kernels on the GPU round differently; ten steps amplify that a little.
        let tol = if device.is_cuda() { 1e-4 } else { 1e-6 };
        for case in &cases {
            check_case(case, &dir, device, tol, false);
            // Capturable mode (for CUDA graphs): step counts and learning rates on the
            // device, clipping without reading the norm back; the same numbers.
            let capturable = match &case.optimizer {
                OptimizerConfig::Sgd(c) => c.dampening == 0.0,
                OptimizerConfig::Adam(_) | OptimizerConfig::AdamW(_) => true,
                _ => false,
            };
            if capturable {
                check_case(case, &dir, device, tol, true);
            }
        }
    }
}

fn check_case(case: &Case, dir: &std::path::Path, device: Device, tol: f64, capturable: bool) {
    {
        let reference = common::load(&dir.join(format!("{}.safetensors", case.name)));
        let mut model = TorchModel::new(&mlp(), device).unwrap();
        model
            .load_state_dict(&common::strip(&reference, "initial."))
            .unwrap();
        let mut opt = TorchOptimizer::new(
            case.optimizer.clone(),
            model.named_parameters().unwrap(),
            &case.groups,
        )
        .unwrap();
        opt.set_capturable(capturable).unwrap();
        let losses: Vec<f64> = (0..STEPS)
            .map(|k| {
                let (x, y) = batch(&reference, k, device);
                step(&model, &mut opt, &x, &y, &case.clip)
            })
            .collect();
        let name = if capturable {
            format!("{} (capturable)", case.name)
        } else {
            case.name.to_owned()
        };
        let expected_losses = reference.get("loss").unwrap().to_f64_vec();
        for (k, (a, e)) in losses.iter().zip(&expected_losses).enumerate() {
            assert!(
                (a - e).abs() <= tol * e.abs().max(1.0),
                "{name} on {device}: loss at step {k}: {a} vs {e}"
            );
        }
        let state = model.state_dict().unwrap();
        for (key, expected) in common::strip(&reference, "final.").iter() {
            common::assert_close(
                &format!("{} on {device}: {key}", name),
                state.get(key).unwrap(),
                expected,
                tol,
            );
        }
        let opt_state = opt.state_dict().unwrap();
        for (key, expected) in common::strip(&reference, "state.").iter() {
            let actual = opt_state
                .get(&format!("state.{key}"))
                .unwrap_or_else(|| panic!("{name}: optimizer state has no {key}"));
            // The state is checked looser than the parameters: centred RMSprop's
            // sqrt(square_avg - grad_avg^2) amplifies last-bit differences in how
            // libtorch's fused kernels round (seen: 1.4e-6 relative).
            common::assert_close(
                &format!("{name} on {device}: state {key}"),
                actual,
                expected,
                10.0 * tol,
            );
        }
    }
}

/// `n` random regression batches for the MLP (16 rows, 5 inputs, 3 outputs) on the CPU.
fn random_batches(n: usize) -> Vec<(tch::Tensor, tch::Tensor)> {
    (0..n)
        .map(|_| {
            (
                tch::Tensor::randn([16, 5], (tch::Kind::Float, tch::Device::Cpu)),
                tch::Tensor::randn([16, 3], (tch::Kind::Float, tch::Device::Cpu)),
            )
        })
        .collect()
}

/// Stop after 4 steps, save model and optimizer state, restore into fresh objects,
/// continue: the parameters are bitwise those of an uninterrupted run.
#[test]
fn optimizer_state_round_trip_resumes_bitwise() {
    for config in [
        OptimizerConfig::Adam(AdamConfig::new(1e-2).with_amsgrad(true)),
        OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9)),
        OptimizerConfig::RmsProp(
            RmsPropConfig::new(1e-2)
                .with_centered(true)
                .with_momentum(0.3),
        ),
        OptimizerConfig::Adagrad(AdagradConfig::new(0.1).with_lr_decay(0.1)),
    ] {
        <kiln_torch::TorchBackend as kiln_core::backend::Backend>::manual_seed(3);
        let data = random_batches(8);
        let model = TorchModel::new(&mlp(), Device::Cpu).unwrap();
        let initial = model.state_dict().unwrap();
        let mut opt =
            TorchOptimizer::new(config.clone(), model.named_parameters().unwrap(), &[]).unwrap();
        for (x, y) in &data {
            step(&model, &mut opt, x, y, &None);
        }
        let uninterrupted = model.state_dict().unwrap();

        let mut first = TorchModel::new(&mlp(), Device::Cpu).unwrap();
        first.load_state_dict(&initial).unwrap();
        let mut opt1 =
            TorchOptimizer::new(config.clone(), first.named_parameters().unwrap(), &[]).unwrap();
        for (x, y) in &data[..4] {
            step(&first, &mut opt1, x, y, &None);
        }
        let (saved_model, saved_opt) = (first.state_dict().unwrap(), opt1.state_dict().unwrap());
        // What a checkpoint writes (handles read in place) is what `state_dict` copies.
        let live = opt1.state_tensors().unwrap();
        assert_eq!(live.to_state_dict().unwrap(), saved_opt, "{config:?}");
        assert!(live
            .iter()
            .any(|(_, t)| matches!(t, StateTensor::Backend(_))));

        let mut second = TorchModel::new(&mlp(), Device::Cpu).unwrap();
        second.load_state_dict(&saved_model).unwrap();
        let mut opt2 =
            TorchOptimizer::new(config.clone(), second.named_parameters().unwrap(), &[]).unwrap();
        opt2.load_state_dict(&saved_opt).unwrap();
        for (x, y) in &data[4..] {
            step(&second, &mut opt2, x, y, &None);
        }
        assert_eq!(second.state_dict().unwrap(), uninterrupted, "{config:?}");
    }
}

/// The MLP on the CPU with an Adam optimizer (capturable or not) and the
/// gradients of one random batch.
fn adam_with_gradients(capturable: bool) -> (TorchModel, TorchOptimizer) {
    let model = TorchModel::new(&mlp(), Device::Cpu).unwrap();
    let mut opt = TorchOptimizer::new(
        OptimizerConfig::Adam(AdamConfig::new(0.1)),
        model.named_parameters().unwrap(),
        &[],
    )
    .unwrap();
    opt.set_capturable(capturable).unwrap();
    let x = tch::Tensor::randn([4, 5], (tch::Kind::Float, tch::Device::Cpu));
    model.forward(&x).unwrap().sum(tch::Kind::Float).backward();
    (model, opt)
}

#[test]
fn a_failed_step_leaves_parameters_unchanged() {
    let (model, mut opt) = adam_with_gradients(false);
    // Corrupt one gradient's shape: the step must refuse before touching anything.
    let before = model.state_dict().unwrap();
    let (_, last) = model.named_parameters().unwrap().pop().unwrap();
    let mut grad = last.grad();
    grad.set_data(&tch::Tensor::zeros(
        [7],
        (tch::Kind::Float, tch::Device::Cpu),
    ));
    let err = opt.step().unwrap_err();
    assert!(
        matches!(err, kiln_core::Error::ShapeMismatch { .. }),
        "{err}"
    );
    assert_eq!(model.state_dict().unwrap(), before);
    let _ = from_tch(&last).unwrap();
}

/// A gradient of another dtype than its parameter (here float64 for a float32
/// weight) is refused before anything changes, in both modes: libtorch's fused CPU
/// kernel would otherwise update the parameters before it in the list first.
#[test]
fn a_gradient_of_another_dtype_is_refused_in_both_modes() {
    for capturable in [false, true] {
        let (model, mut opt) = adam_with_gradients(capturable);
        opt.step().unwrap();
        let (before, state_before) = (model.state_dict().unwrap(), opt.state_dict().unwrap());
        let (_, last) = model.named_parameters().unwrap().pop().unwrap();
        let mut grad = last.grad();
        grad.set_data(&grad.to_kind(tch::Kind::Double));
        let err = opt.step().unwrap_err();
        assert!(
            err.to_string()
                .contains("expected dtype float32, got float64"),
            "capturable {capturable}: {err}"
        );
        assert_eq!(model.state_dict().unwrap(), before);
        assert_eq!(opt.state_dict().unwrap(), state_before);
    }
}

/// AdamW with AMSGrad, written out in float64 for one element: the independent
/// reference of the test below (`torch.optim.AdamW`'s update rule).
fn adamw_amsgrad_reference(p0: f64, grad: impl Fn(f64) -> f64, steps: i32) -> f64 {
    let (lr, weight_decay, beta1, beta2, eps) = (0.05, 0.1, 0.9, 0.999, 1e-8);
    let (mut p, mut m, mut v, mut v_max) = (p0, 0.0, 0.0, 0.0f64);
    for t in 1..=steps {
        let g = grad(p);
        p *= 1.0 - lr * weight_decay;
        m = beta1 * m + (1.0 - beta1) * g;
        v = beta2 * v + (1.0 - beta2) * g * g;
        v_max = v_max.max(v);
        let denom = (v_max / (1.0 - beta2.powi(t))).sqrt() + eps;
        p -= lr / (1.0 - beta1.powi(t)) * m / denom;
    }
    p
}

/// Adam and AdamW run one fused update per group, device and dtype: float32 and
/// float64 parameters, one of which gets no gradient, in both modes, against the
/// update rule written out in float64; the parameter without a gradient keeps no
/// state and no step, as in PyTorch.
#[test]
fn fused_adam_batches_by_dtype_and_skips_parameters_without_gradients() {
    let options = |kind| (kind, tch::Device::Cpu);
    let (a0, b0) = ([-1.0, -0.6, -0.2, 0.2, 0.6, 1.0], [0.5, 1.0, 1.5, 2.0]);
    for capturable in [false, true] {
        let params: Vec<(String, tch::Tensor)> = [
            ("a", tch::Tensor::from_slice(&a0).to_kind(tch::Kind::Float)),
            ("b", tch::Tensor::from_slice(&b0)),
            ("unused", tch::Tensor::ones([3], options(tch::Kind::Float))),
        ]
        .into_iter()
        .map(|(name, t)| (name.to_owned(), t.set_requires_grad(true)))
        .collect();
        let tensors: Vec<tch::Tensor> = params.iter().map(|(_, t)| t.shallow_clone()).collect();
        let config = AdamWConfig::new(0.05)
            .with_weight_decay(0.1)
            .with_amsgrad(true);
        let mut opt = TorchOptimizer::new(OptimizerConfig::AdamW(config), params, &[]).unwrap();
        opt.set_capturable(capturable).unwrap();
        for _ in 0..4 {
            let loss = (&tensors[0] * &tensors[0]).sum(tch::Kind::Float)
                + (&tensors[1] * &tensors[1] * &tensors[1]).sum(tch::Kind::Double);
            loss.backward();
            opt.step().unwrap();
            opt.zero_grad().unwrap();
        }
        let state = opt.state_dict().unwrap();
        assert_eq!(
            state.get("state.a.step").unwrap().to_f64_vec(),
            [4.0],
            "capturable {capturable}"
        );
        assert_eq!(state.get("state.unused.step").unwrap().to_f64_vec(), [0.0]);
        assert!(state.get("state.unused.exp_avg").is_none());
        assert_eq!(from_tch(&tensors[2]).unwrap().to_f64_vec(), [1.0, 1.0, 1.0]);
        let expect = |p0: &[f64], grad: fn(f64) -> f64| {
            let values: Vec<f64> = p0
                .iter()
                .map(|&p| adamw_amsgrad_reference(p, grad, 4))
                .collect();
            kiln_core::HostTensor::new(values, vec![p0.len()]).unwrap()
        };
        // The capturable learning rate is a float32 tensor, as PyTorch's: 0.05
        // rounds by 1.5e-8.
        let tol_f64 = if capturable { 1e-7 } else { 1e-12 };
        for (index, expected, tol) in [
            (0, expect(&a0, |p| 2.0 * p), 1e-6),
            (1, expect(&b0, |p| 3.0 * p * p), tol_f64),
        ] {
            common::assert_close(
                &format!("parameter {index}, capturable {capturable}"),
                &from_tch(&tensors[index]).unwrap(),
                &expected,
                tol,
            );
        }
    }
}

/// Adam folds its step size into the denominator; a learning rate of 0 (a warm-up's
/// first step) or one too small to invert must still leave the weights as they were,
/// finite, while the moments advance.
#[test]
fn adam_at_a_zero_or_tiny_learning_rate_keeps_the_weights() {
    for lr in [0.0, 1e-320] {
        for config in [
            OptimizerConfig::Adam(AdamConfig::new(lr)),
            OptimizerConfig::AdamW(AdamWConfig::new(lr).with_weight_decay(0.1)),
        ] {
            let model = TorchModel::new(&mlp(), Device::Cpu).unwrap();
            let mut opt =
                TorchOptimizer::new(config.clone(), model.named_parameters().unwrap(), &[])
                    .unwrap();
            let before = model.state_dict().unwrap();
            for _ in 0..3 {
                opt.zero_grad().unwrap();
                let x = tch::Tensor::randn([4, 5], (tch::Kind::Float, tch::Device::Cpu));
                model.forward(&x).unwrap().sum(tch::Kind::Float).backward();
                opt.step().unwrap();
            }
            assert_eq!(model.state_dict().unwrap(), before, "{config:?}");
            let moments = opt.state_dict().unwrap();
            let values: Vec<f64> = moments
                .iter()
                .filter(|(k, _)| k.contains("exp_avg"))
                .flat_map(|(_, v)| v.to_f64_vec())
                .collect();
            assert!(
                !values.is_empty(),
                "{:?}",
                moments.keys().collect::<Vec<_>>()
            );
            assert!(values.iter().all(|v| v.is_finite()), "{config:?}");
            assert!(values.iter().any(|v| *v != 0.0), "{config:?}");
        }
    }
}

/// Capturable mode against the ordinary one through a learning-rate change, a state
/// saved and loaded mid-run (into the existing tensors) and back out of the mode.
#[test]
fn capturable_mode_follows_learning_rates_and_loaded_state() {
    for config in [
        OptimizerConfig::Adam(AdamConfig::new(1e-2).with_amsgrad(true)),
        OptimizerConfig::AdamW(AdamWConfig::new(1e-2).with_weight_decay(0.1)),
        OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9)),
    ] {
        <kiln_torch::TorchBackend as kiln_core::backend::Backend>::manual_seed(5);
        let data = random_batches(6);
        // Drawn once: tests on other threads draw from the same global generator.
        let initial = TorchModel::new(&mlp(), Device::Cpu)
            .unwrap()
            .state_dict()
            .unwrap();
        let mut runs = Vec::new();
        for capturable in [false, true] {
            let mut model = TorchModel::new(&mlp(), Device::Cpu).unwrap();
            model.load_state_dict(&initial).unwrap();
            let mut opt =
                TorchOptimizer::new(config.clone(), model.named_parameters().unwrap(), &[])
                    .unwrap();
            opt.set_capturable(capturable).unwrap();
            assert_eq!(opt.is_capturable(), capturable);
            for (x, y) in &data[..2] {
                step(&model, &mut opt, x, y, &None);
            }
            let saved = opt.state_dict().unwrap();
            step(&model, &mut opt, &data[2].0, &data[2].1, &None);
            // Back to the state after two steps (the third step is undone).
            opt.load_state_dict(&saved).unwrap();
            opt.set_learning_rate(opt.learning_rate() / 3.0).unwrap();
            for (x, y) in &data[2..] {
                step(&model, &mut opt, x, y, &None);
            }
            opt.set_capturable(false).unwrap();
            let steps = opt.state_dict().unwrap();
            assert_eq!(
                steps
                    .get("state.0.weight.step")
                    .unwrap()
                    .as_slice::<i64>()
                    .unwrap(),
                [6],
                "{config:?}, capturable {capturable}"
            );
            runs.push(model.state_dict().unwrap());
        }
        for (key, expected) in runs[0].iter() {
            common::assert_close(
                &format!("{config:?}: {key}"),
                runs[1].get(key).unwrap(),
                expected,
                1e-6,
            );
        }
    }
    let model = TorchModel::new(&mlp(), Device::Cpu).unwrap();
    let mut rmsprop = TorchOptimizer::new(
        OptimizerConfig::RmsProp(RmsPropConfig::new(1e-2)),
        model.named_parameters().unwrap(),
        &[],
    )
    .unwrap();
    let err = rmsprop.set_capturable(true).unwrap_err();
    assert!(err.to_string().contains("capturable"), "{err}");
    assert!(!rmsprop.is_capturable());
}

#[test]
fn groups_that_select_nothing_and_wrong_lr_counts_are_errors() {
    let model = TorchModel::new(&mlp(), Device::Cpu).unwrap();
    let groups = [ParamGroup::new(
        "encoder",
        ParamSelector::Prefix("encoder.".into()),
    )];
    let err = TorchOptimizer::new(
        OptimizerConfig::Sgd(SgdConfig::new(0.1)),
        model.named_parameters().unwrap(),
        &groups,
    )
    .unwrap_err();
    assert!(err.to_string().contains("encoder"), "{err}");
    let groups = [ParamGroup::new(
        "bias",
        ParamSelector::Suffix("bias".into()),
    )];
    let mut opt = TorchOptimizer::new(
        OptimizerConfig::Sgd(SgdConfig::new(0.1)),
        model.named_parameters().unwrap(),
        &groups,
    )
    .unwrap();
    assert_eq!(opt.learning_rates(), vec![0.1, 0.1]);
    opt.set_learning_rates(&[0.5, 0.25]).unwrap();
    assert_eq!(opt.learning_rates(), vec![0.5, 0.25]);
    assert!(opt.set_learning_rates(&[0.5]).is_err());
}
