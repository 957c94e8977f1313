//! `16-mixed`: float16 autocast with dynamic loss scaling against a PyTorch
//! `torch.amp.GradScaler` loop on the same model, data and initial weights
//! (`tests/reference/grad_scaler.py`): the per-step losses, the scale after each
//! step (an initial scale of 2^24 overflows float16 gradients, so the first steps
//! are skipped and the scale backs off; a growth interval of 3 makes it grow
//! again), and the final weights. Through the model's training step, as the
//! `Trainer` runs it, reading the loss every step or deferring it; with Adam (the
//! fused kernel, also with its step counts on the device, where the kernel itself
//! skips the overflowing steps) and SGD with momentum, and clipping of the
//! unscaled gradients.
//! Also: a checkpoint of the optimizer mid-run resumes the scale exactly.

#![allow(clippy::unwrap_used)]

mod common;

use kiln_core::{
    backend::{StepLoss, StepPlan, Trainable},
    loss::Loss,
    model::{Layer, LinearConfig},
    module::Module,
    optim::{AdamConfig, GradClip, Optimizer, OptimizerConfig, SgdConfig},
    precision::{FloatPrecision, LossScaling},
    state_dict::StateDict,
    Device,
};
use kiln_torch::{to_tch, TorchBackend, TorchModel, TorchOptimizer};

const STEPS: usize = 14;
const INIT_SCALE: f64 = 16_777_216.0; // 2^24
const GROWTH_INTERVAL: u32 = 3;

struct Case {
    name: &'static str,
    optimizer: OptimizerConfig,
    clip_norm: Option<f64>,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "adam_clip",
            optimizer: OptimizerConfig::Adam(AdamConfig::new(1e-2)),
            clip_norm: Some(1.0),
        },
        Case {
            name: "sgd_momentum",
            optimizer: OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9)),
            clip_norm: None,
        },
    ]
}

fn mlp() -> Layer {
    Layer::sequential([
        LinearConfig::new(6, 32).into(),
        Layer::Relu,
        LinearConfig::new(32, 4).into(),
    ])
}

fn scaling() -> LossScaling {
    LossScaling {
        init_scale: INIT_SCALE,
        growth_interval: GROWTH_INTERVAL,
        ..LossScaling::default()
    }
}

/// A 16-mixed model with the reference's initial weights, and its optimizer with
/// the test's loss scaling.
fn setup(case: &Case, reference: &StateDict, device: Device) -> (TorchModel, TorchOptimizer) {
    setup_with(case, reference, device, false)
}

/// [`setup`], with Adam's step counts on the device when `steps_on_device` (its
/// fused kernel then skips inf/NaN steps there).
fn setup_with(
    case: &Case,
    reference: &StateDict,
    device: Device,
    steps_on_device: bool,
) -> (TorchModel, TorchOptimizer) {
    let mut model = TorchModel::new(&mlp(), device).unwrap();
    model.set_precision(FloatPrecision::F16Mixed).unwrap();
    model
        .load_state_dict(&common::strip(reference, "initial."))
        .unwrap();
    let mut opt = model.build_optimizer(&case.optimizer, &[]).unwrap();
    assert_eq!(
        opt.loss_scaling(),
        Some(&LossScaling::default()),
        "16-mixed models build optimizers with GradScaler's defaults"
    );
    opt.set_loss_scaling(Some(scaling())).unwrap();
    if steps_on_device {
        opt.set_steps_on_device(true).unwrap();
        assert!(opt.steps_on_device() && !opt.is_capturable());
    }
    (model, opt)
}

/// Runs steps `range` of the reference's batches; returns (loss, scale) per step.
fn run(
    case: &Case,
    reference: &StateDict,
    model: &mut TorchModel,
    opt: &mut TorchOptimizer,
    range: std::ops::Range<usize>,
    deferred: bool,
    device: Device,
) -> Vec<(f64, f64)> {
    let loss = Loss::cross_entropy();
    let clip = case.clip_norm.map(|max_norm| GradClip::Norm {
        max_norm,
        norm_type: 2.0,
    });
    let plan = StepPlan {
        loss: &loss,
        scale: 1.0,
        apply: true,
        clip: clip.as_ref(),
    };
    range
        .map(|k| {
            let get = |key: String| to_tch(reference.get(&key).unwrap(), device).unwrap();
            let (x, y) = (get(format!("x.{k}")), get(format!("y.{k}")));
            opt.zero_grad().unwrap();
            let value = if deferred {
                let step = model.train_step_deferred(opt, &x, &y, &plan).unwrap();
                assert!(
                    matches!(step, StepLoss::Device(_)),
                    "a deferred torch step leaves the loss on the device"
                );
                step.value::<TorchBackend>().unwrap()
            } else {
                model.train_step(opt, &x, &y, &plan).unwrap()
            };
            (value, opt.loss_scale().unwrap().unwrap())
        })
        .collect()
}

fn check(what: &str, got: &[(f64, f64)], reference: &StateDict, offset: usize, tol: f64) {
    let losses = reference.get("loss").unwrap().to_f64_vec();
    let scales = reference.get("scale").unwrap().to_f64_vec();
    for (i, (loss, scale)) in got.iter().enumerate() {
        let k = i + offset;
        assert!(
            (loss - losses[k]).abs() <= tol * losses[k].abs().max(1.0),
            "{what}: loss at step {k}: {loss} vs PyTorch's {}",
            losses[k]
        );
        assert_eq!(*scale, scales[k], "{what}: scale after step {k}");
    }
}

#[test]
fn loss_scaling_matches_torch_amp_grad_scaler() {
    let Some(python) = common::python("loss_scaling_matches_torch_amp_grad_scaler") else {
        return;
    };
    let dir = common::scratch_dir("grad-scaler");
    let cases = cases();
    let request: Vec<serde_json::Value> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let (optimizer, lr, momentum) = match &c.optimizer {
                OptimizerConfig::Sgd(s) => ("sgd", s.lr, s.momentum),
                OptimizerConfig::Adam(a) => ("adam", a.lr, 0.0),
                other => panic!("no reference for {other:?}"),
            };
            serde_json::json!({
                "name": c.name, "layer": mlp(), "optimizer": optimizer, "lr": lr,
                "momentum": momentum, "clip_norm": c.clip_norm, "init_scale": INIT_SCALE,
                "growth_interval": GROWTH_INTERVAL, "steps": STEPS, "seed": 3 + i,
                "batch": 16, "inputs": 6, "classes": 4,
            })
        })
        .collect();
    let request_path = common::write_json(&dir, "cases.json", &request);
    common::run_reference(&python, "grad_scaler.py", &[&request_path, &dir]);

    // float16 forward passes: the same kernels as PyTorch's on the CPU, other
    // ones (and TF32) on a GPU.
    for (device, tol) in [(Device::Cpu, 1e-5), (Device::Cuda(0), 1e-3)] {
        if device.is_cuda() && kiln_torch::cuda_device_count() == 0 {
            eprintln!("loss scaling: no CUDA device, CPU only");
            continue;
        }
        for case in &cases {
            let reference = common::load(&dir.join(format!("{}.safetensors", case.name)));
            let skipped = reference.get("skipped").unwrap().to_f64_vec();
            assert!(
                skipped[0] == 1.0 && skipped.contains(&0.0),
                "{}: the reference must skip its first steps and then train: {skipped:?}",
                case.name
            );
            let scales = reference.get("scale").unwrap().to_f64_vec();
            assert!(
                scales.windows(2).any(|w| w[1] > w[0]),
                "{}: the reference's scale must grow again: {scales:?}",
                case.name
            );
            let adam = matches!(case.optimizer, OptimizerConfig::Adam(_));
            let variants: &[(bool, bool)] = if adam {
                &[(false, false), (true, false), (true, true)]
            } else {
                &[(false, false), (true, false)]
            };
            for &(deferred, steps_on_device) in variants {
                let what = format!(
                    "{} on {device} (deferred: {deferred}, steps on the device: {steps_on_device})",
                    case.name
                );
                let (mut model, mut opt) = setup_with(case, &reference, device, steps_on_device);
                let got = run(
                    case,
                    &reference,
                    &mut model,
                    &mut opt,
                    0..STEPS,
                    deferred,
                    device,
                );
                check(&what, &got, &reference, 0, tol);
                let state = model.state_dict().unwrap();
                for (key, expected) in common::strip(&reference, "final.").iter() {
                    common::assert_close(
                        &format!("{what}: {key}"),
                        state.get(key).unwrap(),
                        expected,
                        tol,
                    );
                }
            }

            // Interrupted after step 5 and resumed from the state dicts: the same run.
            let what = format!("{} on {device} (resumed)", case.name);
            let (mut model, mut opt) = setup(case, &reference, device);
            let first = run(case, &reference, &mut model, &mut opt, 0..5, false, device);
            let saved_model = model.state_dict().unwrap();
            let saved_opt = opt.state_dict().unwrap();
            assert_eq!(
                saved_opt.get("grad_scaler.scale").unwrap().to_f64_vec(),
                vec![first[4].1],
                "{what}: the optimizer state holds the scale"
            );
            let (mut model, mut opt) = setup(case, &reference, device);
            model.load_state_dict(&saved_model).unwrap();
            opt.load_state_dict(&saved_opt).unwrap();
            let rest = run(
                case,
                &reference,
                &mut model,
                &mut opt,
                5..STEPS,
                false,
                device,
            );
            check(&what, &rest, &reference, 5, tol);
        }
    }
}

#[test]
fn a_loss_scale_does_not_load_into_an_optimizer_without_scaling_nor_back() {
    let w = tch::Tensor::zeros([3], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    let make = || {
        TorchOptimizer::new(
            OptimizerConfig::Adam(AdamConfig::new(1e-3)),
            vec![("w".to_owned(), w.shallow_clone())],
            &[],
        )
        .unwrap()
    };
    let mut scaled = make();
    scaled
        .set_loss_scaling(Some(LossScaling::default()))
        .unwrap();
    let mut plain = make();
    let err = plain
        .load_state_dict(&scaled.state_dict().unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("grad_scaler.scale") && err.contains("16-mixed"),
        "{err}"
    );
    let err = scaled
        .load_state_dict(&plain.state_dict().unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("no loss scale"), "{err}");

    let bad = LossScaling {
        backoff_factor: 1.5,
        ..LossScaling::default()
    };
    let err = plain.set_loss_scaling(Some(bad)).unwrap_err().to_string();
    assert!(err.contains("backoff_factor"), "{err}");
    assert!(plain.loss_scaling().is_none());

    let mut sgd = TorchOptimizer::new(
        OptimizerConfig::Sgd(SgdConfig::new(0.1)),
        vec![("w".to_owned(), w.shallow_clone())],
        &[],
    )
    .unwrap();
    let err = sgd.set_steps_on_device(true).unwrap_err().to_string();
    assert!(err.contains("Adam and AdamW"), "{err}");
}
