//! The generic Trainer on the torch backend: gradient accumulation equals one big
//! batch, a non-finite loss stops training naming the step and leaves the
//! checkpoints intact, early stopping, evaluate and predict, resuming bitwise in every
//! precision; weight averaging against PyTorch's `AveragedModel` (`trainer/weight_averaging.rs`,
//! `trainer/swa.rs`); the profiler (`trainer/profile.rs`); an objective other
//! than a supervised loss, distillation against PyTorch (`trainer/objective.rs`).

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln::core::{
    backend::TrainBackend,
    loss::Loss,
    model::{Layer, LinearConfig},
    optim::{OptimizerConfig, SgdConfig},
    precision::FloatPrecision,
    Error,
};
use kiln::data::{InMemoryDataset, SequentialLoader};
use kiln::prelude::*;
use kiln::torch::TorchBackend as B;
use kiln::train::{
    Checkpoint, CheckpointPolicy, Checkpointer, EarlyStopping, LossReads, MonitorMode, Trainer,
    TrainerConfig, TrainingState,
};

#[path = "trainer/lr_finder.rs"]
mod lr_finder;
#[path = "trainer/objective.rs"]
mod objective;
#[path = "trainer/preference.rs"]
mod preference;
#[path = "trainer/profile.rs"]
mod profile;
#[path = "trainer/step_views.rs"]
mod step_views;
#[path = "trainer/swa.rs"]
mod swa;
#[path = "trainer/weight_averaging.rs"]
mod weight_averaging;

/// libtorch's generator is global and the trainer reseeds it every step: tests in
/// this binary run one at a time so they do not draw from each other's stream.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn spec() -> Layer {
    Layer::sequential([
        LinearConfig::new(3, 8).into(),
        Layer::Tanh,
        LinearConfig::new(8, 1).into(),
    ])
}

/// y = x0 - 2 x1 + 0.5 x2 on 64 fixed points.
fn data(poison_row: Option<usize>) -> (HostTensor, HostTensor) {
    let mut x = Vec::new();
    let mut y = Vec::new();
    for i in 0..64 {
        let row = [
            ((i * 7) % 13) as f32 / 13.0,
            ((i * 5) % 11) as f32 / 11.0,
            ((i * 3) % 7) as f32 / 7.0,
        ];
        y.push(row[0] - 2.0 * row[1] + 0.5 * row[2]);
        x.extend(row);
    }
    if let Some(r) = poison_row {
        x[r * 3] = f32::NAN;
    }
    (
        HostTensor::new(x, [64, 3]).unwrap(),
        HostTensor::new(y, [64, 1]).unwrap(),
    )
}

fn state(seed: u64) -> TrainingState<B> {
    B::manual_seed(seed);
    let model = B::build_model(&spec(), Device::Cpu).unwrap();
    let opt = model
        .build_optimizer(&OptimizerConfig::Sgd(SgdConfig::new(0.1)), &[])
        .unwrap();
    TrainingState::new(model, opt, None)
}

fn loader(batch: usize, poison: Option<usize>) -> SequentialLoader {
    let (x, y) = data(poison);
    SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), batch).unwrap()
}

#[test]
fn accumulating_two_half_batches_equals_one_batch() {
    let _serial = serial();
    // Same initial weights by copying (the generator is shared with parallel tests).
    let mut whole = state(1);
    let mut halves = state(1);
    halves
        .model
        .load_state_dict(&whole.model.state_dict().unwrap())
        .unwrap();
    let config = TrainerConfig {
        epochs: 3,
        ..TrainerConfig::default()
    };
    Trainer::<B>::new(config.clone(), Loss::mse())
        .unwrap()
        .fit(&mut whole, &loader(32, None), None)
        .unwrap();
    let accumulate = TrainerConfig {
        accumulate: 2,
        ..config
    };
    Trainer::<B>::new(accumulate, Loss::mse())
        .unwrap()
        .fit(&mut halves, &loader(16, None), None)
        .unwrap();
    assert_eq!(whole.step, 6);
    assert_eq!(halves.step, 6, "one optimizer step per two micro-batches");
    let (a, b) = (
        whole.model.state_dict().unwrap(),
        halves.model.state_dict().unwrap(),
    );
    for (name, t) in a.iter() {
        assert!(
            t.allclose(b.get(name).unwrap(), 1e-6, 1e-6),
            "{name} differs"
        );
    }
}

#[test]
fn a_nan_loss_stops_training_at_its_step_and_keeps_the_checkpoints() {
    let _serial = serial();
    nan_at_step_3_keeps_the_checkpoints(LossReads::EveryStep, 1, 50);
}

/// Trains on data whose row 40 is NaN (in the third batch of 16: step 3) with a
/// checkpoint every `checkpoint_every` steps, and checks that training stops
/// with `NonFiniteLoss` naming step 3 and that the last checkpoint is the last
/// good one (step 2), with finite weights.
fn nan_at_step_3_keeps_the_checkpoints(reads: LossReads, checkpoint_every: u64, log_every: u64) {
    let dir = std::env::temp_dir().join(format!("kiln-nan-{reads:?}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let policy = CheckpointPolicy {
        every_n_steps: Some(checkpoint_every),
        every_n_epochs: None,
        ..CheckpointPolicy::default()
    };
    let mut trainer = Trainer::<B>::new(
        TrainerConfig {
            epochs: 2,
            log_every,
            ..TrainerConfig::default()
        },
        Loss::mse(),
    )
    .unwrap()
    .with_loss_reads(reads)
    .with_checkpointer(Checkpointer::new(&dir, policy).unwrap(), Some(spec()));
    let mut s = state(2);
    let err = trainer
        .fit(&mut s, &loader(16, Some(40)), None)
        .unwrap_err();
    match err {
        Error::NonFiniteLoss { step, value } => {
            assert_eq!(step, 3, "{reads:?}");
            assert!(value.is_nan());
        }
        other => panic!("{reads:?}: expected NonFiniteLoss, got {other}"),
    }
    let last = Checkpoint::load(&Checkpointer::last_path(&dir)).unwrap();
    assert_eq!(
        last.step, 2,
        "{reads:?}: the last good checkpoint is intact"
    );
    assert!(last
        .model
        .iter()
        .all(|(_, t)| t.to_f64_vec().iter().all(|v| v.is_finite())));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn deferred_loss_reads_train_the_same_and_still_report_a_nan() {
    let _serial = serial();
    let config = TrainerConfig {
        epochs: 3,
        log_every: 3,
        ..TrainerConfig::default()
    };
    let cpu = Trainer::<B>::new(config.clone(), Loss::mse()).unwrap();
    assert_eq!(cpu.loss_reads(), LossReads::EveryStep, "the CPU's default");
    let cuda = TrainerConfig {
        device: Device::Cuda(0),
        ..config.clone()
    };
    let cuda = Trainer::<B>::new(cuda, Loss::mse()).unwrap();
    assert_eq!(cuda.loss_reads(), LossReads::WhenLogged, "CUDA's default");
    let mut runs = Vec::new();
    for reads in [LossReads::EveryStep, LossReads::WhenLogged] {
        let mut s = state(4);
        let trainer = Trainer::<B>::new(config.clone(), Loss::mse())
            .unwrap()
            .with_loss_reads(reads);
        assert_eq!(trainer.loss_reads(), reads);
        let mut trainer = trainer;
        let history = trainer.fit(&mut s, &loader(16, None), None).unwrap();
        runs.push((history.series("loss"), s.model.state_dict().unwrap()));
    }
    assert_eq!(runs[0], runs[1], "the same losses and weights either way");
    // A callback that needs every step's loss turns deferral off.
    let trainer = Trainer::<B>::new(config.clone(), Loss::mse())
        .unwrap()
        .with_loss_reads(LossReads::WhenLogged)
        .with_callback(EveryLoss(Vec::new()));
    assert_eq!(trainer.loss_reads(), LossReads::EveryStep);

    // No log and a checkpoint every 2 steps: the NaN of step 3 is read before
    // step 4's checkpoint, which is then not written.
    nan_at_step_3_keeps_the_checkpoints(LossReads::WhenLogged, 2, 0);
}

/// A callback that records every step's loss.
struct EveryLoss(Vec<f64>);

impl<E: TrainBackend, N: kiln::core::backend::Trainable<E>> kiln::train::Callback<E, N>
    for EveryLoss
{
    fn on_step_end(
        &mut self,
        _cx: &mut kiln::train::Context<'_, E, N>,
        loss: f64,
    ) -> kiln::Result<kiln::train::Flow> {
        self.0.push(loss);
        Ok(kiln::train::Flow::Continue)
    }
}

#[test]
fn early_stopping_evaluate_and_predict() {
    let _serial = serial();
    let mut s = state(3);
    let (x, y) = data(None);
    let val = SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), 64).unwrap();
    // Patience 0-like: stop as soon as val_loss fails to improve by a large margin.
    let mut trainer = Trainer::<B>::new(
        TrainerConfig {
            epochs: 50,
            ..TrainerConfig::default()
        },
        Loss::mse(),
    )
    .unwrap()
    .with_callback(EarlyStopping::new("val_loss", MonitorMode::Min, 1, 10.0));
    let history = trainer.fit(&mut s, &loader(16, None), Some(&val)).unwrap();
    assert_eq!(
        history.len(),
        2,
        "the first epoch sets the best, the second cannot beat it by 10"
    );
    let metrics = trainer.evaluate(&mut s.model, &val).unwrap();
    let loss = metrics.iter().find(|(k, _)| k == "loss").unwrap().1;
    assert!((loss - history.last("val_loss").unwrap()).abs() < 1e-12);
    let predictions = trainer.predict(&mut s.model, &val).unwrap();
    assert_eq!(predictions.len(), 1);
    assert_eq!(predictions[0].dims(), &[64, 1]);
    assert_eq!(
        s.model.mode(),
        Mode::Train,
        "evaluate and predict restore the mode"
    );
}

/// Early stopping's count is in every checkpoint (a callback's state,
/// `kiln.callbacks`): a run stopped after two epochs and resumed with a fresh
/// `EarlyStopping` stops after the same epoch as the uninterrupted run, with
/// the same weights. Without the count the resumed run would set a new best
/// and train two epochs more.
#[test]
fn early_stopping_resumes_its_count_from_the_checkpoint() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("kiln-es-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (x, y) = data(None);
    let val = SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), 64).unwrap();
    // Patience 2, and no epoch can improve on the first by 10: stops after epoch 2.
    let trainer = |max_steps: Option<u64>| {
        let policy = CheckpointPolicy {
            every_n_steps: None,
            every_n_epochs: Some(1),
            ..CheckpointPolicy::default()
        };
        Trainer::<B>::new(
            TrainerConfig {
                epochs: 50,
                max_steps,
                ..TrainerConfig::default()
            },
            Loss::mse(),
        )
        .unwrap()
        .with_callback(EarlyStopping::new("val_loss", MonitorMode::Min, 2, 10.0))
        .with_checkpointer(Checkpointer::new(&dir, policy).unwrap(), Some(spec()))
    };
    let mut whole = state(5);
    let history = trainer(None)
        .fit(&mut whole, &loader(16, None), Some(&val))
        .unwrap();
    assert_eq!(history.len(), 3, "epochs 0 (the best), 1 and 2 (bad)");
    assert_eq!(whole.step, 12);

    let _ = std::fs::remove_dir_all(&dir);
    let mut first = state(5);
    // 4 batches an epoch: two epochs, then the next batch stops it.
    trainer(Some(8))
        .fit(&mut first, &loader(16, None), Some(&val))
        .unwrap();
    let last = Checkpointer::last_path(&dir);
    let saved = Checkpoint::load(&last).unwrap();
    assert_eq!((saved.step, saved.epoch), (8, 2));
    let count = &saved.callbacks["EarlyStopping"];
    assert_eq!(count["bad_epochs"], 1, "{count}");
    assert_eq!(count["monitor"], "val_loss", "{count}");

    let mut resumed = state(6);
    Trainer::<B>::resume(&mut resumed, &last).unwrap();
    let rest = trainer(None)
        .fit(&mut resumed, &loader(16, None), Some(&val))
        .unwrap();
    assert_eq!(
        rest.len(),
        1,
        "the count goes on: epoch 2 is the second bad one"
    );
    assert_eq!(resumed.step, whole.step);
    assert_eq!(
        resumed.model.state_dict().unwrap(),
        whole.model.state_dict().unwrap()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two callbacks keeping their state under one key would overwrite each
/// other in checkpoints: `fit` refuses them before the first step.
#[test]
fn two_callbacks_with_one_state_key_are_refused_before_training() {
    let _serial = serial();
    let mut s = state(7);
    let err = Trainer::<B>::new(TrainerConfig::default(), Loss::mse())
        .unwrap()
        .with_callback(EarlyStopping::new("loss", MonitorMode::Min, 2, 0.0))
        .with_callback(EarlyStopping::new("loss", MonitorMode::Min, 5, 0.0))
        .fit(&mut s, &loader(16, None), None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`EarlyStopping`") && err.contains("state_key"),
        "{err}"
    );
    assert_eq!(s.step, 0, "no step taken");
}

/// Resume in one process, bitwise: train 12 steps with a checkpoint every 3; a
/// fresh state restored from step 6 (mid-epoch) and trained on ends with exactly the weights,
/// buffers and optimizer state of the uninterrupted run. Dropout makes the
/// per-step randomness matter; a mid-epoch checkpoint makes the data position matter.
#[test]
fn resume_from_a_checkpoint_is_bitwise_in_process() {
    let _serial = serial();
    resume_is_bitwise(FloatPrecision::F32);
}

/// The same in bfloat16 and float16: mixed precision keeps float32 weights and
/// Adam state (its forward under autocast; `16-mixed` also its loss scale, which
/// the checkpoint carries), `bf16-true` and `16-true` keep both in the half type,
/// and the loss still falls.
#[test]
fn half_precisions_train_and_resume_bitwise() {
    let _serial = serial();
    for precision in [
        FloatPrecision::Bf16Mixed,
        FloatPrecision::Bf16True,
        FloatPrecision::F16Mixed,
        FloatPrecision::F16True,
    ] {
        let state = resume_is_bitwise(precision);
        let dtype = precision.parameter_dtype();
        for (name, t) in state.model.state_dict().unwrap().iter() {
            assert_eq!(t.dtype(), dtype, "{precision}: {name}");
        }
        for (name, t) in state.optimizer.state_dict().unwrap().iter() {
            if t.dtype().is_float() && t.numel() > 1 {
                assert_eq!(t.dtype(), dtype, "{precision}: optimizer {name}");
            }
        }
    }
}

/// Trains a dropout MLP with Adam and a step schedule 12 steps at `precision`,
/// checkpointing every 3, resumes a fresh state from step 6 and checks both end
/// bitwise equal and that training lowered the loss; returns the full run's state.
fn resume_is_bitwise(precision: FloatPrecision) -> TrainingState<B> {
    let spec = Layer::sequential([
        LinearConfig::new(3, 16).into(),
        Layer::Relu,
        Layer::Dropout { p: 0.3 },
        LinearConfig::new(16, 1).into(),
    ]);
    let dir = std::env::temp_dir().join(format!("kiln-resume-{precision}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let make = || {
        let mut model = B::build_model(&spec, Device::Cpu).unwrap();
        B::set_precision(&mut model, precision).unwrap();
        let opt = model
            .build_optimizer(
                &OptimizerConfig::Adam(kiln::core::optim::AdamConfig::new(0.01)),
                &[],
            )
            .unwrap();
        let schedule =
            kiln::core::schedule::SchedulerConfig::StepLr(kiln::core::schedule::StepLrConfig {
                step_size: 2,
                gamma: 0.5,
            })
            .build(&[0.01])
            .unwrap();
        TrainingState::<B>::new(model, opt, Some(schedule))
    };
    let config = TrainerConfig {
        epochs: 3,
        seed: 9,
        schedule_interval: kiln::train::ScheduleInterval::Step,
        precision,
        ..TrainerConfig::default()
    };
    let policy = CheckpointPolicy {
        every_n_steps: Some(3),
        every_n_epochs: None,
        keep_last: 5,
        ..CheckpointPolicy::default()
    };
    let batches = || {
        SequentialLoader::new(
            InMemoryDataset::new(data(None).0, data(None).1).unwrap(),
            16,
        )
        .unwrap()
        .shuffle(9)
    };

    let mut full = make();
    let initial = full.model.state_dict().unwrap();
    let history = Trainer::<B>::new(config.clone(), Loss::mse())
        .unwrap()
        .with_checkpointer(
            Checkpointer::new(&dir, policy.clone()).unwrap(),
            Some(spec.clone()),
        )
        .fit(&mut full, &batches(), None)
        .unwrap();
    assert_eq!(full.step, 12);

    let mut resumed = make();
    resumed.model.load_state_dict(&initial).unwrap(); // any weights: the checkpoint replaces them
    let checkpoint =
        Trainer::<B>::resume(&mut resumed, &dir.join("step-00000006.safetensors")).unwrap();
    assert_eq!(
        (checkpoint.step, checkpoint.epoch, checkpoint.batch_in_epoch),
        (6, 1, 2)
    );
    Trainer::<B>::new(config, Loss::mse())
        .unwrap()
        .fit(&mut resumed, &batches(), None)
        .unwrap();
    assert_eq!(resumed.step, 12);
    assert_eq!(
        resumed.model.state_dict().unwrap(),
        full.model.state_dict().unwrap()
    );
    assert_eq!(
        resumed.optimizer.state_dict().unwrap(),
        full.optimizer.state_dict().unwrap()
    );
    let losses: Vec<f64> = history.series("loss").into_iter().map(|(_, v)| v).collect();
    assert!(
        losses[2] < losses[0],
        "{precision}: the training loss did not fall: {losses:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    full
}

#[test]
fn a_model_without_the_configured_precision_is_refused() {
    let _serial = serial();
    let mut state = state(3);
    let before = state.model.state_dict().unwrap();
    let config = TrainerConfig {
        epochs: 1,
        precision: FloatPrecision::Bf16Mixed,
        ..TrainerConfig::default()
    };
    let err = Trainer::<B>::new(config, Loss::mse())
        .unwrap()
        .fit(&mut state, &loader(16, None), None)
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert!(
        text.contains("bf16-mixed") && text.contains("32-true") && text.contains("set_precision"),
        "{text}"
    );
    assert_eq!(state.step, 0);
    assert_eq!(state.model.state_dict().unwrap(), before);
}

#[test]
fn a_checkpoint_of_another_model_is_refused_naming_file_and_key() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("kiln-mismatch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let policy = CheckpointPolicy {
        every_n_steps: Some(1),
        every_n_epochs: None,
        ..CheckpointPolicy::default()
    };
    let mut s = state(4);
    Trainer::<B>::new(
        TrainerConfig {
            epochs: 1,
            max_steps: Some(1),
            ..TrainerConfig::default()
        },
        Loss::mse(),
    )
    .unwrap()
    .with_checkpointer(Checkpointer::new(&dir, policy).unwrap(), Some(spec()))
    .fit(&mut s, &loader(16, None), None)
    .unwrap();
    // A wider model cannot take these weights.
    let wide = Layer::sequential([
        LinearConfig::new(3, 9).into(),
        Layer::Tanh,
        LinearConfig::new(9, 1).into(),
    ]);
    let model = B::build_model(&wide, Device::Cpu).unwrap();
    let opt = model
        .build_optimizer(&OptimizerConfig::Sgd(SgdConfig::new(0.1)), &[])
        .unwrap();
    let mut other = TrainingState::<B>::new(model, opt, None);
    let before = other.model.state_dict().unwrap();
    let last = Checkpointer::last_path(&dir);
    let err = Trainer::<B>::resume(&mut other, &last).unwrap_err();
    // What does not fit is the error's source: read the chain, as the CLI shows it.
    let text = err.display_chain().to_string();
    assert!(matches!(err, Error::Checkpoint { .. }), "{text}");
    assert!(
        text.contains("last.safetensors") && text.contains("0.weight") && text.contains("[9, 3]"),
        "{text}"
    );
    assert_eq!(other.model.state_dict().unwrap(), before, "nothing changed");
}

/// A step checkpoint written at an epoch's last batch (here every 4 steps, 4
/// batches an epoch, no epoch checkpoints) resumes: the epoch's record is made
/// from the loss the checkpoint carries, and every epoch's training loss equals
/// the uninterrupted run's, bitwise. (It used to fail: the resumed epoch had no
/// batch left to average.)
#[test]
fn a_checkpoint_at_an_epochs_last_batch_resumes_with_the_epochs_loss() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("kiln-epoch-end-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let policy = CheckpointPolicy {
        every_n_steps: Some(4),
        every_n_epochs: None,
        keep_last: 5,
        ..CheckpointPolicy::default()
    };
    let config = TrainerConfig {
        epochs: 3,
        ..TrainerConfig::default()
    };
    let mut full = state(5);
    let history = Trainer::<B>::new(config.clone(), Loss::mse())
        .unwrap()
        .with_checkpointer(Checkpointer::new(&dir, policy).unwrap(), Some(spec()))
        .fit(&mut full, &loader(16, None), None)
        .unwrap();

    let mut resumed = state(6);
    let checkpoint =
        Trainer::<B>::resume(&mut resumed, &dir.join("step-00000004.safetensors")).unwrap();
    assert_eq!(
        (checkpoint.epoch, checkpoint.batch_in_epoch),
        (0, 4),
        "written before the epoch ended"
    );
    let rest = Trainer::<B>::new(config, Loss::mse())
        .unwrap()
        .fit(&mut resumed, &loader(16, None), None)
        .unwrap();
    assert_eq!(rest.series("loss"), history.series("loss"));
    assert_eq!(
        resumed.model.state_dict().unwrap(),
        full.model.state_dict().unwrap()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
