//! One conformance suite, generic over the backend, that every engine runs (as
//! Burn's `testgen_all!`): each test is a function of `B: TrainBackend`, and
//! `conformance!` instantiates all of them for libtorch and for TensorFlow.
//!
//! The references are hand-derived: a linear layer under a mean squared error,
//! whose loss, gradients and SGD update are computed here in f64 from the
//! formulas, so a backend that agrees with another by sharing a mistake still
//! fails.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln::core::backend::Trainable;
use kiln::core::{
    backend::{StepPlan, TrainBackend},
    loss::{Loss, Reduction},
    model::{Layer, LinearConfig},
    module::Module,
    optim::{AdamConfig, GradClip, Optimizer, OptimizerConfig, SgdConfig},
    state_dict::StateDict,
    Device, HostTensor,
};

const W: [[f64; 3]; 2] = [[0.1, -0.2, 0.3], [0.4, 0.5, -0.6]];
const BIAS: [f64; 2] = [0.05, -0.05];
const X: [[f64; 3]; 4] = [
    [1.0, 2.0, -1.0],
    [0.5, -1.5, 2.0],
    [-2.0, 0.25, 0.75],
    [1.5, 1.0, 0.5],
];
const T: [[f64; 2]; 4] = [[0.5, -1.0], [1.0, 0.0], [-0.5, 0.5], [2.0, 1.0]];
const LR: f64 = 0.1;

fn mse() -> Loss {
    Loss::Mse {
        reduction: Reduction::Mean,
    }
}

fn host(rows: &[[f64; 3]]) -> HostTensor {
    let values: Vec<f32> = rows.iter().flatten().map(|&v| v as f32).collect();
    HostTensor::new(values, [rows.len(), 3]).unwrap()
}

fn targets(rows: &[[f64; 2]]) -> HostTensor {
    let values: Vec<f32> = rows.iter().flatten().map(|&v| v as f32).collect();
    HostTensor::new(values, [rows.len(), 2]).unwrap()
}

fn tensor<B: TrainBackend>(h: &HostTensor) -> B::Tensor {
    B::from_host(h, Device::Cpu).unwrap()
}

/// `Linear(3, 2)` with the weights above.
fn model<B: TrainBackend>() -> B::Model {
    let mut model = B::build_model(&Layer::Linear(LinearConfig::new(3, 2)), Device::Cpu).unwrap();
    let mut state = StateDict::new();
    let w: Vec<f32> = W.iter().flatten().map(|&v| v as f32).collect();
    state.insert("weight", HostTensor::new(w, [2, 3]).unwrap());
    let b: Vec<f32> = BIAS.iter().map(|&v| v as f32).collect();
    state.insert("bias", HostTensor::new(b, [2]).unwrap());
    model.load_state_dict(&state).unwrap();
    model
}

fn sgd<B: TrainBackend>(model: &B::Model) -> B::Optim {
    model
        .build_optimizer(&OptimizerConfig::Sgd(SgdConfig::new(LR)), &[])
        .unwrap()
}

/// The hand-derived forward pass, loss and gradients on `rows` of the batch.
struct Reference {
    output: Vec<f64>,
    loss: f64,
    grad_w: [[f64; 3]; 2],
    grad_b: [f64; 2],
}

fn reference(rows: std::ops::Range<usize>) -> Reference {
    let n = (rows.len() * 2) as f64;
    let (mut output, mut loss) = (Vec::new(), 0.0);
    let (mut grad_w, mut grad_b) = ([[0.0; 3]; 2], [0.0; 2]);
    for r in rows {
        for o in 0..2 {
            let y: f64 = BIAS[o] + (0..3).map(|i| W[o][i] * X[r][i]).sum::<f64>();
            output.push(y);
            loss += (y - T[r][o]).powi(2) / n;
            // d mean((y - t)^2) / dy = 2 (y - t) / n.
            let dy = 2.0 * (y - T[r][o]) / n;
            grad_b[o] += dy;
            for i in 0..3 {
                grad_w[o][i] += dy * X[r][i];
            }
        }
    }
    Reference {
        output,
        loss,
        grad_w,
        grad_b,
    }
}

fn values(state: &StateDict, key: &str) -> Vec<f64> {
    state.get(key).unwrap().to_f64_vec()
}

fn assert_close(actual: &[f64], expected: &[f64], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths");
    for (a, e) in actual.iter().zip(expected) {
        assert!(
            (a - e).abs() < 1e-5,
            "{what}: {actual:?} against {expected:?}"
        );
    }
}

/// The parameters after one SGD step with (clipped) gradients `grad_w`, `grad_b`.
fn assert_sgd_update<B: TrainBackend>(model: &B::Model, grad_w: [[f64; 3]; 2], grad_b: [f64; 2]) {
    let state = model.state_dict().unwrap();
    let w: Vec<f64> = (0..2)
        .flat_map(|o| (0..3).map(move |i| W[o][i] - LR * grad_w[o][i]))
        .collect();
    let b: Vec<f64> = (0..2).map(|o| BIAS[o] - LR * grad_b[o]).collect();
    assert_close(&values(&state, "weight"), &w, "weight after the step");
    assert_close(&values(&state, "bias"), &b, "bias after the step");
}

/// One optimizer step as the trainer takes it: `zero_grad`, then the step
/// (gradients accumulate across `train_step` calls until `zero_grad`, as in PyTorch).
fn step<B: TrainBackend>(
    model: &mut B::Model,
    optimizer: &mut B::Optim,
    x: &B::Tensor,
    t: &B::Tensor,
    plan: &StepPlan<'_>,
) -> kiln::Result<f64> {
    optimizer.zero_grad()?;
    model.train_step(optimizer, x, t, plan)
}

fn plan<'a>(loss: &'a Loss, scale: f64, apply: bool, clip: Option<&'a GradClip>) -> StepPlan<'a> {
    StepPlan {
        loss,
        scale,
        apply,
        clip,
    }
}

fn eval_step_gives_the_hand_computed_loss_and_output<B: TrainBackend>() {
    let mut model = model::<B>();
    model.set_mode(kiln::core::backend::Mode::Eval);
    let expected = reference(0..4);
    let (loss, output) = model
        .eval_step(&mse(), &tensor::<B>(&host(&X)), &tensor::<B>(&targets(&T)))
        .unwrap();
    assert_close(&[loss], &[expected.loss], "loss");
    assert_close(&output.to_f64_vec(), &expected.output, "output");
    let predicted = model.predict_step(&tensor::<B>(&host(&X))).unwrap();
    assert_eq!(predicted, output, "predict_step gives eval_step's output");
}

fn one_sgd_step_matches_the_hand_derived_update<B: TrainBackend>() {
    let mut model = model::<B>();
    let mut optimizer = sgd::<B>(&model);
    let expected = reference(0..4);
    let loss = mse();
    let value = model
        .train_step(
            &mut optimizer,
            &tensor::<B>(&host(&X)),
            &tensor::<B>(&targets(&T)),
            &plan(&loss, 1.0, true, None),
        )
        .unwrap();
    assert_close(&[value], &[expected.loss], "the returned loss");
    assert_sgd_update::<B>(&model, expected.grad_w, expected.grad_b);
}

fn accumulating_two_halves_equals_one_step_on_the_whole_batch<B: TrainBackend>() {
    let mut model = model::<B>();
    let mut optimizer = sgd::<B>(&model);
    let loss = mse();
    for (rows, apply) in [(0..2, false), (2..4, true)] {
        let before = model.state_dict().unwrap();
        model
            .train_step(
                &mut optimizer,
                &tensor::<B>(&host(&X[rows.clone()])),
                &tensor::<B>(&targets(&T[rows])),
                &plan(&loss, 0.5, apply, None),
            )
            .unwrap();
        if !apply {
            assert_eq!(model.state_dict().unwrap(), before, "nothing applied yet");
        }
    }
    // Two equal halves, each mean scaled by 1/2: the whole batch's mean.
    let expected = reference(0..4);
    assert_sgd_update::<B>(&model, expected.grad_w, expected.grad_b);
}

fn clipping_by_value_matches_the_hand_derived_update<B: TrainBackend>() {
    let mut model = model::<B>();
    let mut optimizer = sgd::<B>(&model);
    let clip = GradClip::Value { clip_value: 0.3 };
    let loss = mse();
    model
        .train_step(
            &mut optimizer,
            &tensor::<B>(&host(&X)),
            &tensor::<B>(&targets(&T)),
            &plan(&loss, 1.0, true, Some(&clip)),
        )
        .unwrap();
    let expected = reference(0..4);
    let clamp = |g: f64| g.clamp(-0.3, 0.3);
    assert!(
        expected.grad_w.iter().flatten().any(|g| g.abs() > 0.3),
        "the case clips something"
    );
    let grad_w = expected.grad_w.map(|row| row.map(clamp));
    let grad_b = expected.grad_b.map(clamp);
    assert_sgd_update::<B>(&model, grad_w, grad_b);
}

fn a_non_finite_loss_changes_nothing<B: TrainBackend>() {
    let mut model = model::<B>();
    let config = OptimizerConfig::Adam(AdamConfig::new(1e-2));
    let mut optimizer = model.build_optimizer(&config, &[]).unwrap();
    let loss = mse();
    let good = plan(&loss, 1.0, true, None);
    let (x, t) = (tensor::<B>(&host(&X)), tensor::<B>(&targets(&T)));
    step::<B>(&mut model, &mut optimizer, &x, &t, &good).unwrap();
    let (model_before, optimizer_before) =
        (model.state_dict().unwrap(), optimizer.state_dict().unwrap());
    let mut poisoned = T;
    poisoned[1][0] = f64::NAN;
    let value = step::<B>(
        &mut model,
        &mut optimizer,
        &x,
        &tensor::<B>(&targets(&poisoned)),
        &good,
    )
    .unwrap();
    assert!(value.is_nan(), "the loss is reported: {value}");
    assert_eq!(model.state_dict().unwrap(), model_before);
    assert_eq!(optimizer.state_dict().unwrap(), optimizer_before);
    step::<B>(&mut model, &mut optimizer, &x, &t, &good).unwrap();
    assert_ne!(
        model.state_dict().unwrap(),
        model_before,
        "training goes on"
    );
}

fn state_dicts_resume_into_fresh_objects<B: TrainBackend>() {
    let config = OptimizerConfig::Adam(AdamConfig::new(1e-2));
    let loss = mse();
    let one = plan(&loss, 1.0, true, None);
    let (x, t) = (tensor::<B>(&host(&X)), tensor::<B>(&targets(&T)));
    let mut model = model::<B>();
    let mut optimizer = model.build_optimizer(&config, &[]).unwrap();
    for _ in 0..2 {
        step::<B>(&mut model, &mut optimizer, &x, &t, &one).unwrap();
    }
    let mut resumed = B::build_model(&Layer::Linear(LinearConfig::new(3, 2)), Device::Cpu).unwrap();
    resumed
        .load_state_dict(&model.state_dict().unwrap())
        .unwrap();
    let mut resumed_optimizer = resumed.build_optimizer(&config, &[]).unwrap();
    resumed_optimizer
        .load_state_dict(&optimizer.state_dict().unwrap())
        .unwrap();
    step::<B>(&mut model, &mut optimizer, &x, &t, &one).unwrap();
    step::<B>(&mut resumed, &mut resumed_optimizer, &x, &t, &one).unwrap();
    assert_eq!(resumed.state_dict().unwrap(), model.state_dict().unwrap());
    assert_eq!(
        resumed_optimizer.state_dict().unwrap(),
        optimizer.state_dict().unwrap()
    );
}

fn a_batch_of_the_wrong_width_is_an_error_and_changes_nothing<B: TrainBackend>() {
    let mut model = model::<B>();
    let mut optimizer = sgd::<B>(&model);
    let before = model.state_dict().unwrap();
    let loss = mse();
    let wide = HostTensor::new(vec![0.5f32; 8], [2, 4]).unwrap();
    let err = model
        .train_step(
            &mut optimizer,
            &tensor::<B>(&wide),
            &tensor::<B>(&targets(&T[..2])),
            &plan(&loss, 1.0, true, None),
        )
        .unwrap_err();
    let message = err.to_string();
    assert!(message.contains('3') && message.contains('4'), "{message}");
    assert_eq!(model.state_dict().unwrap(), before);
}

/// SWA's `update_bn`: a `BatchNorm1d(3)` of momentum 0.3 over `X` in batches
/// of two ends with the mean of the batches' means and unbiased variances,
/// computed here in f64, and `num_batches_tracked` 2; the weights and the mode
/// are untouched. A momentum of 0 is refused with the model unchanged.
fn update_batch_norm_averages_the_batch_statistics<B: TrainBackend>() {
    use kiln::core::model::BatchNormConfig;
    use kiln::data::{InMemoryDataset, SequentialLoader};
    let bn = |momentum| Layer::BatchNorm1d(BatchNormConfig::new(3).with_momentum(momentum));
    let mut model = B::build_model(&bn(0.3), Device::Cpu).unwrap();
    model.set_mode(kiln::core::backend::Mode::Eval);
    let before = model.state_dict().unwrap();
    let loader =
        SequentialLoader::new(InMemoryDataset::new(host(&X), targets(&T)).unwrap(), 2).unwrap();
    let batches =
        kiln::train::update_batch_norm::<B, _>(&mut model, &loader, 0, Device::Cpu).unwrap();
    assert_eq!(batches, 2);
    let (mut mean, mut var) = ([0.0f64; 3], [0.0f64; 3]);
    for pair in X.chunks(2) {
        for c in 0..3 {
            let m = (pair[0][c] + pair[1][c]) / 2.0;
            let v = (pair[0][c] - m).powi(2) + (pair[1][c] - m).powi(2); // n - 1 = 1
            mean[c] += m / 2.0;
            var[c] += v / 2.0;
        }
    }
    let after = model.state_dict().unwrap();
    assert_close(&values(&after, "running_mean"), &mean, "running mean");
    assert_close(&values(&after, "running_var"), &var, "running variance");
    assert_eq!(values(&after, "num_batches_tracked"), [2.0]);
    assert_eq!(after.get("weight"), before.get("weight"));
    assert_eq!(model.mode(), kiln::core::backend::Mode::Eval);

    let mut frozen = B::build_model(&bn(0.0), Device::Cpu).unwrap();
    let before = frozen.state_dict().unwrap();
    let err = kiln::train::update_batch_norm::<B, _>(&mut frozen, &loader, 0, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("the batch norm `` has momentum 0"), "{err}");
    assert_eq!(frozen.state_dict().unwrap(), before);
}

macro_rules! conformance {
    ($module:ident, $backend:ty: $($test:ident),+ $(,)?) => {
        mod $module {
            $(
                #[test]
                fn $test() {
                    super::$test::<$backend>();
                }
            )+
        }
    };
}

macro_rules! conformance_all {
    ($module:ident, $backend:ty) => {
        conformance!($module, $backend:
            eval_step_gives_the_hand_computed_loss_and_output,
            one_sgd_step_matches_the_hand_derived_update,
            accumulating_two_halves_equals_one_step_on_the_whole_batch,
            clipping_by_value_matches_the_hand_derived_update,
            a_non_finite_loss_changes_nothing,
            state_dicts_resume_into_fresh_objects,
            a_batch_of_the_wrong_width_is_an_error_and_changes_nothing,
            update_batch_norm_averages_the_batch_statistics,
        );
    };
}

conformance_all!(torch, kiln::torch::TorchBackend);
conformance_all!(tensorflow, kiln::tf::TfBackend);
