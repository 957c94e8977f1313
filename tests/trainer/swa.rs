//! Stochastic weight averaging (`TrainerConfig::swa`) against PyTorch's
//! `torch.optim.swa_utils` recipe (`AveragedModel`, `SWALR`, `update_bn`),
//! epoch by epoch; an interrupted run resumes its average and schedule
//! bitwise; bad settings are refused before training.

use super::serial;
use super::weight_averaging::{classes, spec};
use kiln::core::{
    backend::TrainBackend,
    loss::Loss,
    optim::{OptimizerConfig, SgdConfig},
    schedule::{AnnealStrategy, SchedulerConfig, StepLrConfig},
};
use kiln::data::{InMemoryDataset, SequentialLoader};
use kiln::prelude::*;
use kiln::torch::TorchBackend as B;
use kiln::train::{
    AveragingMethod, Checkpoint, CheckpointPolicy, Checkpointer, EmaConfig, SwaConfig, SwaStart,
    Trainer, TrainerConfig, TrainingState,
};

const BATCH: usize = 8;

fn loader() -> SequentialLoader {
    let (x, y) = classes(11);
    SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), BATCH).unwrap()
}

/// The model of `spec()` with SGD (lr 0.1, momentum 0.9) and, with `gamma`,
/// a StepLR multiplying the rate by `gamma` after every epoch.
fn state(gamma: Option<f64>) -> TrainingState<B> {
    B::manual_seed(5);
    let model = B::build_model(&spec(), Device::Cpu).unwrap();
    let opt = model
        .build_optimizer(
            &OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9)),
            &[],
        )
        .unwrap();
    let schedule = gamma.map(|gamma| {
        SchedulerConfig::StepLr(StepLrConfig {
            step_size: 1,
            gamma,
        })
        .build(&opt.learning_rates())
        .unwrap()
    });
    TrainingState::new(model, opt, schedule)
}

fn trainer(epochs: u64, swa: &SwaConfig) -> Trainer<B> {
    Trainer::<B>::new(
        TrainerConfig {
            epochs,
            swa: Some(swa.clone()),
            ..TrainerConfig::default()
        },
        Loss::cross_entropy(),
    )
    .unwrap()
}

fn swa(lr: f64, start: SwaStart, anneal: u64, strategy: AnnealStrategy) -> SwaConfig {
    let mut swa = SwaConfig::new(lr);
    swa.epoch_start = start;
    swa.annealing_epochs = anneal;
    swa.annealing_strategy = strategy;
    swa
}

#[test]
fn swa_equals_pytorchs_recipe_epoch_by_epoch() {
    let _serial = serial();
    let Some(python) = kiln_testkit::python("SWA parity") else {
        return;
    };
    let dir = kiln_testkit::TempDir::new("swa-parity");
    let (x, y) = classes(11);
    let mut io = StateDict::new();
    io.insert("x", x);
    io.insert("y", y);
    io.save_safetensors(dir.path().join("data.safetensors"), &Default::default())
        .unwrap();
    // (config, epochs, StepLR gamma before SWA, the first SWA epoch)
    let runs = [
        (
            swa(0.02, SwaStart::Epoch(2), 2, AnnealStrategy::Cos),
            5,
            Some(0.5),
            2,
        ),
        (
            swa(0.3, SwaStart::Fraction(0.5), 0, AnnealStrategy::Linear),
            4,
            None,
            2,
        ),
        (
            swa(0.01, SwaStart::Epoch(1), 5, AnnealStrategy::Linear),
            4,
            Some(0.8),
            1,
        ),
    ];
    for (config, epochs, gamma, start) in runs {
        let mut s = state(gamma);
        s.model
            .state_dict()
            .unwrap()
            .save_safetensors(dir.path().join("init.safetensors"), &Default::default())
            .unwrap();
        let mut trainer = trainer(epochs, &config);
        let history = trainer.fit(&mut s, &loader(), None).unwrap();
        let strategy = match config.annealing_strategy {
            AnnealStrategy::Cos => "cos",
            AnnealStrategy::Linear => "linear",
        };
        let args = [
            dir.path().to_str().unwrap().to_owned(),
            match config.lrs {
                kiln::core::schedule::PerGroup::Same(lr) => lr.to_string(),
                _ => unreachable!("one rate"),
            },
            start.to_string(),
            config.annealing_epochs.to_string(),
            strategy.to_owned(),
            epochs.to_string(),
            BATCH.to_string(),
            gamma.unwrap_or(0.0).to_string(),
        ];
        kiln_testkit::run_reference_script!(&python, "swa.py", &args);
        let (reference, _) =
            StateDict::load_safetensors(dir.path().join("out.safetensors")).unwrap();

        // Each epoch's rate: StepLR's, then SWALR's annealing.
        let lrs: Vec<f64> = history.series("lr").into_iter().map(|(_, v)| v).collect();
        let want = reference.get("lrs").unwrap().to_f64_vec();
        assert_eq!(lrs.len(), want.len(), "{config:?}");
        for (epoch, (got, want)) in lrs.iter().zip(&want).enumerate() {
            assert!(
                (got - want).abs() <= 1e-12 * want.abs().max(1.0),
                "{config:?}: epoch {epoch} lr {got} vs PyTorch {want}; all {lrs:?} vs {want:?}"
            );
        }
        let averaging = s.averaging.as_ref().unwrap();
        let updates = reference.get("updates").unwrap().to_f64_vec()[0] as u64;
        assert_eq!(averaging.updates(), updates, "{config:?}");
        assert_eq!(updates, epochs - start, "{config:?}");
        // The training matches, so the average is of the same weights.
        for (name, t) in s.model.state_dict().unwrap().iter() {
            let want = reference.get(&format!("model.{name}")).unwrap();
            assert!(t.allclose(want, 1e-5, 1e-6), "{config:?}: model {name}");
        }
        // The average: parameters only (6 tensors), equal weights.
        let averaged = averaging.state_dict().unwrap();
        assert_eq!(averaged.len(), 6, "{config:?}");
        for (name, t) in averaged.iter() {
            let want = reference.get(&format!("parameters.{name}")).unwrap();
            assert!(t.allclose(want, 1e-5, 1e-6), "{config:?}: average {name}");
        }

        // The end: the average in the model, batch norm recomputed as update_bn.
        let trained = s.model.state_dict().unwrap();
        assert!(trainer.apply_average(&mut s, &loader()).unwrap());
        let end = s.model.state_dict().unwrap();
        for (name, t) in end.iter() {
            let want = reference.get(&format!("averaged.{name}")).unwrap();
            assert!(
                t.allclose(want, 1e-5, 1e-6),
                "{config:?}: final {name}: {:?} vs PyTorch {:?}",
                &t.to_f64_vec()[..t.numel().min(3)],
                &want.to_f64_vec()[..want.numel().min(3)]
            );
        }
        let moved = |name: &str| {
            kiln_testkit::max_abs_diff(
                &end.get(name).unwrap().to_f64_vec(),
                &trained.get(name).unwrap().to_f64_vec(),
            )
        };
        assert!(
            moved("1.running_var") > 1e-4,
            "{config:?}: statistics recomputed"
        );
        assert!(moved("0.weight") > 1e-4, "{config:?}: averaged weights");
        assert_eq!(
            end.get("1.num_batches_tracked").unwrap().to_f64_vec(),
            [6.0]
        );
    }
}

/// Five epochs straight, and three then a resume from the epoch-3 checkpoint
/// (SWA began at epoch 2) for the rest, give bitwise the same average, rates
/// and final model.
#[test]
fn an_interrupted_swa_run_resumes_bitwise() {
    let _serial = serial();
    let dir = kiln_testkit::TempDir::new("swa-resume");
    let config = swa(0.02, SwaStart::Epoch(2), 3, AnnealStrategy::Cos);
    let mut straight = state(Some(0.5));
    let full = trainer(5, &config)
        .fit(&mut straight, &loader(), None)
        .unwrap();

    let policy = CheckpointPolicy {
        every_n_epochs: Some(1),
        ..CheckpointPolicy::default()
    };
    let mut first = state(Some(0.5));
    trainer(3, &config)
        .with_checkpointer(Checkpointer::new(dir.path(), policy).unwrap(), Some(spec()))
        .fit(&mut first, &loader(), None)
        .unwrap();
    let path = Checkpointer::last_path(dir.path());
    let checkpoint = Checkpoint::load(&path).unwrap();
    let saved = checkpoint.averaged.as_ref().expect("the average is saved");
    assert_eq!(saved.method, AveragingMethod::Swa);
    assert_eq!(saved.updates, 1, "epoch 2 only");
    assert_eq!(
        saved.swa_lrs_from.as_deref(),
        Some(&[0.025][..]),
        "0.1 halved twice"
    );

    let mut resumed = state(Some(0.5))
        .with_weight_averaging(config.clone())
        .unwrap();
    Trainer::<B>::resume(&mut resumed, &path).unwrap();
    let rest = trainer(5, &config)
        .fit(&mut resumed, &loader(), None)
        .unwrap();
    assert_eq!(
        full.series("lr")[3..],
        rest.series("lr")[..],
        "the resumed run anneals on"
    );
    let average = |s: &TrainingState<B>| s.averaging.as_ref().unwrap().state_dict().unwrap();
    assert_eq!(average(&straight), average(&resumed), "bitwise");
    for s in [&mut straight, &mut resumed] {
        trainer(5, &config).apply_average(s, &loader()).unwrap();
    }
    assert_eq!(
        straight.model.state_dict().unwrap(),
        resumed.model.state_dict().unwrap()
    );

    // An EMA run does not take over an SWA average.
    let mut ema = state(Some(0.5))
        .with_weight_averaging(EmaConfig::new(0.9))
        .unwrap();
    let before = ema.model.state_dict().unwrap();
    let err = Trainer::<B>::resume(&mut ema, &path).unwrap_err();
    let message = err.display_chain().to_string();
    assert!(
        message.contains("its weight average is kept by SWA, this run keeps EMA"),
        "{message}"
    );
    assert_eq!(ema.model.state_dict().unwrap(), before);
}

#[test]
fn bad_swa_settings_are_errors_naming_the_key() {
    let with = |swa: SwaConfig, epochs| TrainerConfig {
        epochs,
        swa: Some(swa),
        ..TrainerConfig::default()
    };
    let check = |config: TrainerConfig, expected: &str| {
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains(expected), "{err}");
    };
    let mut both = with(SwaConfig::new(0.1), 4);
    both.ema = Some(EmaConfig::default());
    check(both, "set training.ema or training.swa, not both");
    check(
        with(swa(0.1, SwaStart::Epoch(4), 1, AnnealStrategy::Cos), 4),
        "averaging would begin at epoch 4 (0-based), but the run has 4 epochs",
    );
    // int(0.1 * 4) = 0: averaging from the first epoch.
    with(swa(0.1, SwaStart::Fraction(0.1), 1, AnnealStrategy::Cos), 4)
        .validate()
        .unwrap();
    check(
        with(swa(0.1, SwaStart::Epoch(0), 1, AnnealStrategy::Cos), 4),
        "training.swa.epoch_start",
    );
    check(
        with(swa(0.1, SwaStart::Fraction(1.5), 1, AnnealStrategy::Cos), 4),
        "must be in (0, 1), got 1.5",
    );
    check(with(SwaConfig::new(-0.1), 4), "training.swa.lrs");

    // One rate per parameter group, checked before the first step.
    let _serial = serial();
    let mut s = state(None);
    let per_group = swa(0.1, SwaStart::Epoch(1), 1, AnnealStrategy::Cos);
    let per_group = SwaConfig {
        lrs: vec![0.1, 0.2].into(),
        ..per_group
    };
    let err = trainer(2, &per_group)
        .fit(&mut s, &loader(), None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("expected one value per parameter group (1), got 2"),
        "{err}"
    );
    assert_eq!(s.step, 0);
}
