//! The training objective as a seam: knowledge distillation
//! (`kiln::torch::Distillation`, a frozen teacher inside the step) trained by
//! the same Trainer as a supervised loss, against PyTorch's loop step for step
//! (weights, the epochs' losses and metrics, validation); the checkpoint keeps
//! the objective's running means; an objective TensorFlow's compiled step
//! cannot compute is refused before the first step.

use super::serial;
use kiln::core::{
    backend::TrainBackend,
    loss::Loss,
    model::{Layer, LinearConfig, SparseMoeConfig},
    module::Module,
    objective::{Objective, ObjectiveBatch, ObjectiveOutput, Supervised},
    optim::{OptimizerConfig, SgdConfig},
    Error,
};
use kiln::data::{InMemoryDataset, SequentialLoader};
use kiln::prelude::*;
use kiln::torch::{Distillation, DistillationConfig, TorchBackend as B};
use kiln::train::{
    Checkpoint, CheckpointPolicy, Checkpointer, Trainer, TrainerConfig, TrainingState,
};

const BATCH: usize = 8;

fn mlp(hidden: usize) -> Layer {
    Layer::sequential([
        LinearConfig::new(4, hidden).into(),
        Layer::Relu,
        LinearConfig::new(hidden, 3).into(),
    ])
}

fn split(seed: u64, rows: usize) -> (HostTensor, HostTensor) {
    let x = kiln_testkit::noise(rows * 4, seed);
    let y: Vec<i64> = x
        .chunks(4)
        .map(|r| i64::from(r[0] + r[1] > 0.0) + i64::from(r[2] - r[3] > 0.3))
        .collect();
    (
        HostTensor::new(x, [rows, 4]).unwrap(),
        HostTensor::new(y, [rows]).unwrap(),
    )
}

fn loader((x, y): (HostTensor, HostTensor)) -> SequentialLoader {
    SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), BATCH).unwrap()
}

fn student() -> TrainingState<B> {
    B::manual_seed(3);
    let model = B::build_model(&mlp(6), Device::Cpu).unwrap();
    let opt = model
        .build_optimizer(
            &OptimizerConfig::Sgd(SgdConfig::new(0.2).with_momentum(0.9)),
            &[],
        )
        .unwrap();
    TrainingState::new(model, opt, None)
}

fn teacher() -> <B as TrainBackend>::Model {
    B::manual_seed(11);
    B::build_model(&mlp(8), Device::Cpu).unwrap()
}

fn config() -> DistillationConfig {
    DistillationConfig {
        temperature: 2.5,
        alpha: 0.7,
        ..DistillationConfig::default()
    }
}

fn trainer(epochs: u64) -> Trainer<B> {
    let objective = Distillation::new(teacher(), config()).unwrap();
    Trainer::<B>::with_objective(
        TrainerConfig {
            epochs,
            accumulate: 2,
            log_every: 0,
            ..TrainerConfig::default()
        },
        objective,
    )
    .unwrap()
    .with_metric(kiln::train::metric_by_name("accuracy").unwrap())
}

fn save(dict: &StateDict, path: std::path::PathBuf) {
    dict.save_safetensors(path, &Default::default()).unwrap();
}

#[test]
fn distillation_trains_as_pytorchs_loop_does() {
    let _serial = serial();
    let Some(python) = kiln_testkit::python("distillation parity") else {
        return;
    };
    let dir = kiln_testkit::TempDir::new("distillation");
    let (train, val) = (split(7, 48), split(8, 20));
    for (name, (x, y)) in [("train", &train), ("val", &val)] {
        let mut io = StateDict::new();
        io.insert("x", x.clone());
        io.insert("y", y.clone());
        save(&io, dir.path().join(format!("{name}.safetensors")));
    }
    let mut state = student();
    save(
        &state.model.state_dict().unwrap(),
        dir.path().join("student.safetensors"),
    );
    save(
        &teacher().state_dict().unwrap(),
        dir.path().join("teacher.safetensors"),
    );
    let epochs = 3;
    let history = trainer(epochs)
        .fit(&mut state, &loader(train), Some(&loader(val)))
        .unwrap();
    let args = [
        dir.path().to_str().unwrap().to_owned(),
        config().temperature.to_string(),
        config().alpha.to_string(),
        epochs.to_string(),
        BATCH.to_string(),
        "2".to_owned(),
    ];
    kiln_testkit::run_reference_script!(&python, "distillation.py", &args);
    let (reference, _) = StateDict::load_safetensors(dir.path().join("out.safetensors")).unwrap();
    for (name, t) in state.model.state_dict().unwrap().iter() {
        let want = reference.get(&format!("model.{name}")).unwrap();
        assert!(
            t.allclose(want, 1e-5, 1e-6),
            "student {name}: {:?} vs PyTorch {:?}",
            &t.to_f64_vec()[..3],
            &want.to_f64_vec()[..3]
        );
    }
    let names = [
        "loss",
        "distill_kl",
        "hard_loss",
        "val_loss",
        "val_distill_kl",
        "val_hard_loss",
        "val_accuracy",
    ];
    for epoch in 0..epochs {
        for name in names {
            let got = history
                .get(epoch, name)
                .unwrap_or_else(|| panic!("epoch {epoch} has no `{name}`: {:?}", history.names()));
            let want = reference
                .get(&format!("{epoch}.{name}"))
                .unwrap()
                .to_f64_vec()[0];
            assert!(
                kiln_testkit::close(got, want, 1e-5),
                "epoch {epoch} {name}: {got} vs PyTorch {want}"
            );
        }
    }
    // The soft term moved: the student learns the teacher's predictions.
    let kl = |e| history.get(e, "distill_kl").unwrap();
    assert!(kl(epochs - 1) < kl(0), "{} -> {}", kl(0), kl(epochs - 1));
}

/// A checkpoint written mid-epoch keeps the objective's running means, so
/// the resumed run's epoch record is the uninterrupted one's.
#[test]
fn a_resumed_run_reports_the_objectives_metrics_over_the_whole_epoch() {
    let _serial = serial();
    let dir = kiln_testkit::TempDir::new("distillation-resume");
    let train = split(7, 48);
    let policy = CheckpointPolicy {
        every_n_steps: Some(2),
        every_n_epochs: None,
        keep_last: 5,
        ..CheckpointPolicy::default()
    };
    let mut straight = student();
    let whole = trainer(1)
        .with_checkpointer(Checkpointer::new(dir.path(), policy).unwrap(), Some(mlp(6)))
        .fit(&mut straight, &loader(train.clone()), None)
        .unwrap();
    let at = dir.path().join("step-00000002.safetensors");
    let checkpoint = Checkpoint::load(&at).unwrap();
    assert_eq!(checkpoint.batch_in_epoch, 4);
    assert_eq!(
        checkpoint.epoch_metrics.keys().collect::<Vec<_>>(),
        ["distill_kl", "hard_loss"]
    );
    let mut resumed = student();
    Trainer::<B>::resume(&mut resumed, &at).unwrap();
    let rest = trainer(1).fit(&mut resumed, &loader(train), None).unwrap();
    for name in ["loss", "distill_kl", "hard_loss"] {
        assert_eq!(
            rest.get(0, name).map(f64::to_bits),
            whole.get(0, name).map(f64::to_bits),
            "{name}"
        );
    }
    assert_eq!(
        resumed.model.state_dict().unwrap(),
        straight.model.state_dict().unwrap()
    );
}

/// A supervised loss that does not say it is one: on TensorFlow, whose step
/// compiles the loss with the model, only a declared supervised loss trains.
struct UndeclaredMse;

impl<Bk: TrainBackend> Objective<Bk> for UndeclaredMse {
    fn name(&self) -> String {
        "undeclared mse".to_owned()
    }

    fn compute(
        &self,
        model: &dyn Module<Bk>,
        batch: &ObjectiveBatch<'_, Bk::Tensor>,
    ) -> kiln::core::Result<ObjectiveOutput<Bk::Tensor>> {
        Objective::<Bk>::compute(&Supervised::new(Loss::mse()), model, batch)
    }
}

#[test]
fn an_objective_a_compiled_step_cannot_compute_is_refused_before_the_first_step() {
    use kiln::tf::TfBackend;
    let spec = Layer::from(LinearConfig::new(4, 3));
    let model = TfBackend::build_model(&spec, Device::Cpu).unwrap();
    let before = model.state_dict().unwrap();
    let opt = model
        .build_optimizer(&OptimizerConfig::Sgd(SgdConfig::new(0.1)), &[])
        .unwrap();
    let mut state = TrainingState::<TfBackend>::new(model, opt, None);
    let mut trainer =
        Trainer::<TfBackend>::with_objective(TrainerConfig::default(), UndeclaredMse).unwrap();
    let (x, _) = split(7, 16);
    let y = HostTensor::new(kiln_testkit::noise(16 * 3, 9), [16, 3]).unwrap();
    let err = trainer
        .fit(&mut state, &loader((x, y.clone())), None)
        .unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("the undeclared mse objective") && message.contains("supervised loss"),
        "{message}"
    );
    assert_eq!(state.step, 0);
    assert_eq!(state.model.state_dict().unwrap(), before);

    // The same loss, declared, trains on the same model.
    let one_epoch = TrainerConfig {
        epochs: 1,
        ..TrainerConfig::default()
    };
    let mut trainer =
        Trainer::<TfBackend>::with_objective(one_epoch, Supervised::new(Loss::mse())).unwrap();
    let (x, _) = split(7, 16);
    trainer.fit(&mut state, &loader((x, y)), None).unwrap();
    assert_eq!(state.step, 2);
}

#[test]
fn distillation_settings_that_cannot_work_are_refused_naming_the_key() {
    for (config, key) in [
        (
            DistillationConfig {
                temperature: 0.0,
                ..config()
            },
            "distillation.temperature",
        ),
        (
            DistillationConfig {
                alpha: 1.5,
                ..config()
            },
            "distillation.alpha",
        ),
    ] {
        let err = Distillation::new(teacher(), config).unwrap_err();
        assert!(err.to_string().contains(key), "{err}");
    }
    // A teacher whose logits do not match the student's is named at the first step.
    let wide = B::build_model(&Layer::from(LinearConfig::new(4, 5)), Device::Cpu).unwrap();
    let mut trainer = Trainer::<B>::with_objective(
        TrainerConfig {
            epochs: 1,
            ..TrainerConfig::default()
        },
        Distillation::new(wide, config()).unwrap(),
    )
    .unwrap();
    let mut state = student();
    let before = state.model.state_dict().unwrap();
    let err = trainer
        .fit(&mut state, &loader(split(7, 16)), None)
        .unwrap_err();
    assert!(err.to_string().contains("teacher's logits"), "{err}");
    assert_eq!(state.model.state_dict().unwrap(), before);
}

/// A student that is a mixture of experts adds its router losses to the
/// distillation loss with their weights, as its supervised training does,
/// and reports them after the distillation terms: the loss is
/// `α·T²·KL + (1 − α)·hard + 0.3·aux_loss + 0.01·router_z_loss` from the
/// reported terms, and the router terms are those `Supervised` reports for
/// the same batch.
#[test]
fn a_mixture_of_experts_student_adds_its_router_losses() {
    let _serial = serial();
    let moe = SparseMoeConfig::new(6, 5, 4, 2)
        .with_router_aux_loss_coef(0.3)
        .with_router_z_loss_coef(0.01);
    let spec = Layer::sequential([
        LinearConfig::new(4, 6).into(),
        Layer::SparseMoe(moe),
        LinearConfig::new(6, 3).into(),
    ]);
    B::manual_seed(4);
    let student = B::build_model(&spec, Device::Cpu).unwrap();
    let distillation = Distillation::new(teacher(), config()).unwrap();
    assert_eq!(
        Objective::<B>::metric_names(&distillation, &student),
        ["distill_kl", "hard_loss", "aux_loss", "router_z_loss"]
    );
    let (x, y) = split(5, 12);
    let (x, y) = (
        B::from_host(&x, Device::Cpu).unwrap(),
        B::from_host(&y, Device::Cpu).unwrap(),
    );
    let batch = ObjectiveBatch {
        inputs: &x,
        targets: &y,
    };
    let value = |t: &tch::Tensor| B::item(t).unwrap();
    let out = distillation.compute(&student, &batch).unwrap();
    let m: Vec<f64> = out.metrics.iter().map(value).collect();
    let c = config();
    let expected = c.alpha * c.temperature * c.temperature * m[0]
        + (1.0 - c.alpha) * m[1]
        + 0.3 * m[2]
        + 0.01 * m[3];
    assert!(
        kiln_testkit::close(value(&out.loss), expected, 1e-6),
        "{} vs {expected} from {m:?}",
        value(&out.loss)
    );
    let supervised =
        Objective::<B>::compute(&Supervised::new(Loss::cross_entropy()), &student, &batch).unwrap();
    let s: Vec<f64> = supervised.metrics.iter().map(value).collect();
    assert_eq!(s, m[2..], "the router losses Supervised reports");
    assert!(m[2] > 0.0 && m[3] > 0.0, "{m:?}");
}
