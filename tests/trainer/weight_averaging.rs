//! Weight averaging (`TrainerConfig::ema`) against PyTorch's
//! `torch.optim.swa_utils.AveragedModel`, the same run step by step; an
//! interrupted run resumes its average bitwise; validation uses the average.

use super::serial;
use kiln::core::{
    backend::TrainBackend,
    loss::Loss,
    model::{BatchNormConfig, Layer, LinearConfig},
    optim::{OptimizerConfig, SgdConfig},
};
use kiln::data::{InMemoryDataset, SequentialLoader};
use kiln::prelude::*;
use kiln::torch::TorchBackend as B;
use kiln::train::{
    Checkpoint, CheckpointPolicy, Checkpointer, EmaConfig, Trainer, TrainerConfig, TrainingState,
};

const ROWS: usize = 48;
const BATCH: usize = 8;

/// Linear, batch norm, ReLU, linear: parameters and running statistics.
pub(super) fn spec() -> Layer {
    Layer::sequential([
        LinearConfig::new(4, 8).into(),
        Layer::BatchNorm1d(BatchNormConfig::new(8)),
        Layer::Relu,
        LinearConfig::new(8, 3).into(),
    ])
}

/// Three classes by the sign pattern of fixed points.
fn data() -> (HostTensor, HostTensor) {
    classes(7)
}

/// [`ROWS`] points of 4 features (noise of `seed`) in three classes by their
/// sign pattern.
pub(super) fn classes(seed: u64) -> (HostTensor, HostTensor) {
    let x = kiln_testkit::noise(ROWS * 4, seed);
    let y: Vec<i64> = x
        .chunks(4)
        .map(|r| i64::from(r[0] + r[1] > 0.0) + i64::from(r[2] - r[3] > 0.3))
        .collect();
    (
        HostTensor::new(x, [ROWS, 4]).unwrap(),
        HostTensor::new(y, [ROWS]).unwrap(),
    )
}

fn loader() -> SequentialLoader {
    let (x, y) = data();
    SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), BATCH).unwrap()
}

fn state() -> TrainingState<B> {
    B::manual_seed(3);
    let model = B::build_model(&spec(), Device::Cpu).unwrap();
    let opt = model
        .build_optimizer(
            &OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9)),
            &[],
        )
        .unwrap();
    TrainingState::new(model, opt, None)
}

fn trainer(epochs: u64, ema: &EmaConfig) -> Trainer<B> {
    Trainer::<B>::new(
        TrainerConfig {
            epochs,
            ema: Some(ema.clone()),
            ..TrainerConfig::default()
        },
        Loss::cross_entropy(),
    )
    .unwrap()
}

#[test]
fn the_average_equals_pytorchs_averaged_model_step_by_step() {
    let _serial = serial();
    let Some(python) = kiln_testkit::python("weight averaging parity") else {
        return;
    };
    let dir = kiln_testkit::TempDir::new("ema-parity");
    let (x, y) = data();
    let mut io = StateDict::new();
    io.insert("x", x);
    io.insert("y", y);
    io.save_safetensors(dir.path().join("data.safetensors"), &Default::default())
        .unwrap();
    let mut every_step = EmaConfig::new(0.9);
    every_step.buffers = false;
    let mut sparse = EmaConfig::new(0.95);
    sparse.every_n_steps = 2;
    sparse.start_step = 3;
    sparse.warmup = true;
    for ema in [every_step, sparse] {
        let mut s = state();
        s.model
            .state_dict()
            .unwrap()
            .save_safetensors(dir.path().join("init.safetensors"), &Default::default())
            .unwrap();
        trainer(3, &ema).fit(&mut s, &loader(), None).unwrap();
        let flag = |b: bool| if b { "1" } else { "0" };
        let args = [
            dir.path().to_str().unwrap().to_owned(),
            ema.decay.to_string(),
            ema.every_n_steps.to_string(),
            ema.start_step.to_string(),
            flag(ema.warmup).to_owned(),
            flag(ema.buffers).to_owned(),
            "3".to_owned(),
            BATCH.to_string(),
        ];
        kiln_testkit::run_reference_script!(&python, "weight_averaging.py", &args);
        let (reference, _) =
            StateDict::load_safetensors(dir.path().join("out.safetensors")).unwrap();
        let averaging = s.averaging.as_ref().unwrap();
        let expected_updates = reference.get("updates").unwrap().to_f64_vec()[0] as u64;
        assert_eq!(averaging.updates(), expected_updates, "{ema:?}");
        assert!(
            expected_updates > 3,
            "{ema:?}: the run updates several times"
        );
        // The training itself matches, so the averages are of the same weights.
        for (name, t) in s.model.state_dict().unwrap().iter() {
            let want = reference.get(&format!("model.{name}")).unwrap();
            assert!(t.allclose(want, 1e-5, 1e-6), "{ema:?}: model {name}");
        }
        let averaged = averaging.state_dict().unwrap();
        let names: Vec<&String> = averaged.keys().collect();
        let floats = if ema.buffers { 8 } else { 6 };
        assert_eq!(names.len(), floats, "{ema:?}: {names:?}");
        let trained = s.model.state_dict().unwrap();
        let mut apart = 0.0f64;
        for (name, t) in averaged.iter() {
            let want = reference.get(&format!("averaged.{name}")).unwrap();
            assert!(
                t.allclose(want, 1e-5, 1e-6),
                "{ema:?}: average of {name}: {:?} vs PyTorch {:?}",
                &t.to_f64_vec()[..3],
                &want.to_f64_vec()[..3]
            );
            let weights = trained.get(name).unwrap().to_f64_vec();
            apart = apart.max(kiln_testkit::max_abs_diff(&t.to_f64_vec(), &weights));
        }
        assert!(
            apart > 1e-3,
            "{ema:?}: the average is not the weights themselves ({apart})"
        );
    }
}

/// Training 3 epochs straight, and 2 then a resume from the epoch-2
/// checkpoint for the third, give bitwise the same average; the checkpoint
/// holds the average and its update count.
#[test]
fn a_resumed_run_continues_its_average_bitwise() {
    let _serial = serial();
    let dir = kiln_testkit::TempDir::new("ema-resume");
    let ema = EmaConfig::new(0.9);
    let mut straight = state();
    trainer(3, &ema)
        .fit(&mut straight, &loader(), None)
        .unwrap();

    let policy = CheckpointPolicy {
        every_n_epochs: Some(1),
        ..CheckpointPolicy::default()
    };
    let mut first = state();
    trainer(2, &ema)
        .with_checkpointer(Checkpointer::new(dir.path(), policy).unwrap(), Some(spec()))
        .fit(&mut first, &loader(), None)
        .unwrap();
    let path = Checkpointer::last_path(dir.path());
    let checkpoint = Checkpoint::load(&path).unwrap();
    let saved = checkpoint
        .averaged
        .as_ref()
        .expect("the average is checkpointed");
    assert_eq!(saved.updates, 12, "two epochs of 6 steps");
    assert_eq!(
        saved.tensors.len(),
        8,
        "6 parameters and 2 running statistics"
    );

    let mut resumed = state().with_weight_averaging(ema.clone()).unwrap();
    Trainer::<B>::resume(&mut resumed, &path).unwrap();
    assert_eq!(resumed.averaging.as_ref().unwrap().updates(), 12);
    trainer(3, &ema).fit(&mut resumed, &loader(), None).unwrap();
    let (a, b) = (
        straight.averaging.as_ref().unwrap().state_dict().unwrap(),
        resumed.averaging.as_ref().unwrap().state_dict().unwrap(),
    );
    assert_eq!(a, b, "the resumed average is bitwise the uninterrupted one");

    // A checkpoint's average of other shapes is refused and changes nothing.
    let mut other = EmaConfig::new(0.9);
    other.buffers = false;
    let mut wrong = state().with_weight_averaging(other).unwrap();
    let before = wrong.model.state_dict().unwrap();
    let err = Trainer::<B>::resume(&mut wrong, &path).unwrap_err();
    let message = err.display_chain().to_string();
    assert!(
        message.contains("its weight average holds 8 tensors, this run averages 6"),
        "{message}"
    );
    assert_eq!(wrong.model.state_dict().unwrap(), before);
    assert_eq!(wrong.step, 0);
}

/// With `validate` the epoch's validation metrics are the average's; without,
/// the training weights'; the training weights are left as they were.
#[test]
fn validation_uses_the_average_and_puts_the_weights_back() {
    let _serial = serial();
    let mut metrics = Vec::new();
    for validate in [true, false] {
        let mut ema = EmaConfig::new(0.9);
        ema.validate = validate;
        let mut s = state();
        let history = trainer(2, &ema)
            .fit(&mut s, &loader(), Some(&loader()))
            .unwrap();
        let val_loss = history.last("val_loss").unwrap();
        // The same loss, evaluated by hand with each set of weights.
        let trainer = trainer(2, &ema);
        let training = trainer.evaluate(&mut s.model, &loader()).unwrap();
        let weights = s.model.state_dict().unwrap();
        s.averaging
            .as_ref()
            .unwrap()
            .swap_into(&mut s.model)
            .unwrap();
        let averaged = trainer.evaluate(&mut s.model, &loader()).unwrap();
        let loss = |m: &[(String, f64)]| m.iter().find(|(k, _)| k == "loss").unwrap().1;
        let expected = if validate {
            loss(&averaged)
        } else {
            loss(&training)
        };
        assert!(
            (val_loss - expected).abs() < 1e-9,
            "validate = {validate}: {val_loss} vs {expected}"
        );
        assert!((loss(&averaged) - loss(&training)).abs() > 1e-6);
        s.model.load_state_dict(&weights).unwrap();
        metrics.push(val_loss);
    }
    assert_ne!(metrics[0], metrics[1]);
}

#[test]
fn bad_settings_are_errors_naming_the_key() {
    let mut ema = EmaConfig::new(1.0);
    let err = TrainerConfig {
        ema: Some(ema.clone()),
        ..TrainerConfig::default()
    }
    .validate()
    .unwrap_err();
    assert!(err.to_string().contains("training.ema.decay"), "{err}");
    ema.decay = 0.99;
    ema.every_n_steps = 0;
    let err = ema.validate().unwrap_err();
    assert!(err.to_string().contains("every_n_steps"), "{err}");
}

/// Fails at the first validation batch it sees.
struct FailingValidation;

impl kiln::train::Callback<B> for FailingValidation {
    fn on_validation_batch_end(
        &mut self,
        _batch: &kiln::train::ValidationBatch<'_>,
    ) -> kiln::core::Result<()> {
        Err(kiln::core::Error::unsupported("a validation that fails"))
    }
}

/// A validation that fails while the average is in the model leaves the
/// training weights there (the averager's `on_exception`), not the average.
#[test]
fn a_failed_validation_on_the_average_leaves_the_training_weights() {
    let _serial = serial();
    let ema = EmaConfig::new(0.9);
    let mut s = state();
    trainer(1, &ema).fit(&mut s, &loader(), None).unwrap();
    let weights = s.model.state_dict().unwrap();
    let average = s.averaging.as_ref().unwrap().state_dict().unwrap();
    assert_ne!(weights, average);
    // One more epoch that stops in its validation: the weights are those its
    // steps left, not the average's.
    let err = trainer(2, &ema)
        .with_callback(FailingValidation)
        .fit(&mut s, &loader(), Some(&loader()))
        .unwrap_err();
    assert!(err.to_string().contains("a validation that fails"), "{err}");
    let after = s.model.state_dict().unwrap();
    let average = s.averaging.as_ref().unwrap().state_dict().unwrap();
    assert_ne!(after, weights, "the epoch trained");
    for (name, tensor) in average.iter() {
        assert_ne!(after.get(name), Some(tensor), "`{name}` is the average's");
    }
}

/// An average the trainer does not keep, and one under sharded checkpoints,
/// are refused before the first step.
#[test]
fn an_average_the_trainer_does_not_keep_or_cannot_checkpoint_is_refused() {
    let _serial = serial();
    let ema = EmaConfig::new(0.9);
    let mut s = state().with_weight_averaging(ema.clone()).unwrap();
    let err = Trainer::<B>::new(TrainerConfig::default(), Loss::cross_entropy())
        .unwrap()
        .fit(&mut s, &loader(), None)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("the trainer is configured for none"),
        "{err}"
    );
    assert_eq!(s.step, 0);
    let dir = kiln_testkit::TempDir::new("ema-sharded");
    let err = trainer(1, &ema)
        .with_sharded_checkpoints(dir.path())
        .fit(&mut s, &loader(), None)
        .unwrap_err();
    assert!(err.to_string().contains("training.ema"), "{err}");
    assert!(err.to_string().contains("sharded checkpoints"), "{err}");
    assert_eq!(s.step, 0);
}
