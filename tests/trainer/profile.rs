//! The trainer's profiler (`Trainer::with_profiler`) through the Rust API: an
//! input-bound run shows as the data loader's wait, a run stopped inside the
//! window writes what it recorded, a step that fails inside it leaves no
//! profiler running, windows at and across an epoch's start record each step
//! once, and windows the run cannot record are refused before its first step.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use super::serial;
use super::weight_averaging::{classes, spec};
use kiln::core::{
    backend::TrainBackend,
    loss::Loss,
    optim::{OptimizerConfig, SgdConfig},
    Error, Result,
};
use kiln::data::{Batch, DataLoader, InMemoryDataset, SequentialLoader};
use kiln::prelude::*;
use kiln::torch::TorchBackend as B;
use kiln::train::{Callback, Flow, ProfileConfig, Trainer, TrainerConfig, TrainingState};

/// 48 rows in batches of 8: 6 steps an epoch.
const BATCH: usize = 8;

/// A loader that sleeps before each batch, and fails at batch `fail_at` if given.
struct SlowLoader {
    inner: SequentialLoader,
    sleep: Duration,
    fail_at: Option<usize>,
}

impl SlowLoader {
    fn new(sleep_ms: u64, fail_at: Option<usize>) -> Self {
        let (x, y) = classes(7);
        SlowLoader {
            inner: SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), BATCH).unwrap(),
            sleep: Duration::from_millis(sleep_ms),
            fail_at,
        }
    }
}

impl DataLoader for SlowLoader {
    fn num_batches(&self) -> usize {
        self.inner.num_batches()
    }
    fn batches(&self, epoch: u64) -> Box<dyn Iterator<Item = Result<Batch>> + Send + '_> {
        let (sleep, fail_at) = (self.sleep, self.fail_at);
        Box::new(
            self.inner
                .batches(epoch)
                .enumerate()
                .map(move |(i, batch)| {
                    std::thread::sleep(sleep);
                    if Some(i) == fail_at {
                        return Err(Error::invalid_argument("batch", "a corrupt sample"));
                    }
                    batch
                }),
        )
    }
}

fn state() -> TrainingState<B> {
    B::manual_seed(3);
    let model = B::build_model(&spec(), Device::Cpu).unwrap();
    let opt = model
        .build_optimizer(&OptimizerConfig::Sgd(SgdConfig::new(0.1)), &[])
        .unwrap();
    TrainingState::new(model, opt, None)
}

fn trainer(epochs: u64, profile: ProfileConfig) -> Trainer<B> {
    Trainer::<B>::new(
        TrainerConfig {
            epochs,
            log_every: 0,
            ..TrainerConfig::default()
        },
        Loss::cross_entropy(),
    )
    .unwrap()
    .with_profiler(profile)
}

/// `ops.csv`: name -> (calls, self µs).
fn rows(dir: &Path) -> BTreeMap<String, (u64, f64)> {
    std::fs::read_to_string(dir.join("ops.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| {
            let cells: Vec<&str> = l.split(',').collect();
            (
                cells[0].to_owned(),
                (cells[1].parse().unwrap(), cells[2].parse().unwrap()),
            )
        })
        .collect()
}

#[test]
fn an_input_bound_run_shows_as_the_data_loader_wait() {
    let _serial = serial();
    let dir = kiln_testkit::TempDir::new("profile-wait");
    let profile = ProfileConfig::new(3..7).in_dir(dir.path().join("profile"));
    let mut state = state();
    // 100 ms per batch, against about a millisecond of step for this model.
    let loader = SlowLoader::new(100, None);
    trainer(2, profile.clone())
        .fit(&mut state, &loader, None)
        .unwrap();
    assert_eq!(state.step, 12, "the whole run trained");
    let rows = rows(&profile.dir);
    assert_eq!(rows["ProfilerStep*"].0, 4);
    let (waits, wait_us) = rows["kiln::data_loader_wait"];
    assert_eq!(waits, 4);
    assert!(wait_us >= 4.0 * 100_000.0, "{wait_us} µs");
    // The top row by self time, and most of the steps' time in the table's line.
    assert_eq!(
        rows.iter()
            .max_by(|a, b| a.1 .1.total_cmp(&b.1 .1))
            .unwrap()
            .0,
        "kiln::data_loader_wait"
    );
    // The table's line gives the wait per step and its share of the steps'
    // time, consistent with the rows (how large the share is depends on how
    // busy the machine is, so it is checked against the line's own numbers).
    let table = std::fs::read_to_string(profile.dir.join("ops.txt")).unwrap();
    let line = table.lines().next().unwrap();
    // The last word before `marker`, without a leading parenthesis.
    let word_before = |marker: &str| -> &str {
        let head = line.split(marker).next().unwrap();
        head.rsplit(' ').next().unwrap().trim_start_matches('(')
    };
    // A duration as the table writes it (`263.467ms`, `1.054s`), in ms.
    let ms = |word: &str| -> f64 {
        let units = [("ms", 1.0), ("us", 1e-3), ("ns", 1e-6), ("s", 1e3)];
        let (unit, scale) = units.iter().find(|(u, _)| word.ends_with(u)).unwrap();
        word.trim_end_matches(unit).parse::<f64>().unwrap() * scale
    };
    let step_ms = ms(word_before(" per step)"));
    let wait_ms = ms(word_before(" per step,"));
    let share: f64 = word_before("% of the steps' time").parse().unwrap();
    assert!(
        (wait_ms - wait_us / 4.0 / 1000.0).abs() <= 0.01 * wait_ms,
        "{line}"
    );
    assert!((share - 100.0 * wait_ms / step_ms).abs() < 0.1, "{line}");
    assert!(wait_ms <= step_ms, "{line}");
    // Two linear layers per step (forward), eight rows a batch.
    assert_eq!(rows["aten::linear"].0, 8);
    assert!(profile.dir.join("trace.json").is_file());
}

#[test]
fn windows_across_and_at_an_epochs_start_count_each_step_once() {
    let _serial = serial();
    let dir = kiln_testkit::TempDir::new("profile-epochs");
    // Six steps an epoch: 5..9 spans the boundary, 7..9 starts with the second epoch.
    for (window, name) in [(5..9, "across"), (7..9, "second")] {
        let profile = ProfileConfig::new(window.clone()).in_dir(dir.path().join(name));
        let mut state = state();
        trainer(2, profile.clone())
            .fit(&mut state, &SlowLoader::new(0, None), None)
            .unwrap();
        let rows = rows(&profile.dir);
        let steps = window.end - window.start;
        assert_eq!(rows["ProfilerStep*"].0, steps, "{name}");
        assert_eq!(
            rows["kiln::data_loader_wait"].0, steps,
            "{name}: one wait a step"
        );
        assert_eq!(rows["aten::linear"].0, 2 * steps, "{name}");
    }
}

/// Stops the run after step `at`.
struct StopAt(u64);

impl<E: TrainBackend, N: kiln::core::backend::Trainable<E>> Callback<E, N> for StopAt {
    fn on_step_end(&mut self, cx: &mut kiln::train::Context<'_, E, N>, _loss: f64) -> Result<Flow> {
        Ok(if cx.state.step >= self.0 {
            Flow::Stop
        } else {
            Flow::Continue
        })
    }
}

#[test]
fn a_run_stopped_inside_the_window_writes_the_steps_it_took() {
    let _serial = serial();
    let dir = kiln_testkit::TempDir::new("profile-stopped");
    let profile = ProfileConfig::new(2..6).in_dir(dir.path().join("profile"));
    let mut state = state();
    trainer(2, profile.clone())
        .with_callback(StopAt(3))
        .fit(&mut state, &SlowLoader::new(0, None), None)
        .unwrap();
    assert_eq!(state.step, 3);
    assert_eq!(rows(&profile.dir)["ProfilerStep*"].0, 2, "steps 2 and 3");
}

#[test]
fn a_step_failing_inside_the_window_stops_the_profiler_and_writes_nothing() {
    let _serial = serial();
    let dir = kiln_testkit::TempDir::new("profile-failed");
    let failed = ProfileConfig::new(2..5).in_dir(dir.path().join("failed"));
    // Batch 3 (step 4) fails.
    let err = trainer(1, failed.clone())
        .fit(&mut state(), &SlowLoader::new(0, Some(3)), None)
        .unwrap_err();
    assert!(err.to_string().contains("corrupt sample"), "{err}");
    assert!(
        failed.files().iter().all(|f| !f.exists()),
        "nothing written"
    );
    // libtorch's profiler is not left recording: the next profile runs.
    let next = ProfileConfig::new(1..3).in_dir(dir.path().join("next"));
    trainer(1, next.clone())
        .fit(&mut state(), &SlowLoader::new(0, None), None)
        .unwrap();
    assert_eq!(rows(&next.dir)["ProfilerStep*"].0, 2);
}

#[test]
fn windows_the_run_cannot_record_are_refused_before_the_first_step() {
    let _serial = serial();
    let dir = kiln_testkit::TempDir::new("profile-refused");
    let loader = SlowLoader::new(0, None);
    let refused = |profile: ProfileConfig, state: &mut TrainingState<B>| {
        let before = state.step;
        let err = trainer(2, profile).fit(state, &loader, None).unwrap_err();
        assert_eq!(state.step, before, "no step taken");
        err.to_string()
    };
    let at = |r: std::ops::Range<u64>| ProfileConfig::new(r).in_dir(dir.path().join("p"));
    let err = refused(at(10..14), &mut state());
    assert!(err.contains("ends after step 12, the run's last"), "{err}");
    let err = refused(at(0..3), &mut state());
    assert!(err.contains("1 <= START < END"), "{err}");
    // A run resumed at step 7 (after one epoch and one step).
    let mut resumed = state();
    trainer(2, at(1..2))
        .fit(&mut resumed, &loader, None)
        .unwrap();
    std::fs::remove_dir_all(dir.path().join("p")).unwrap();
    resumed.epoch = 1;
    resumed.step = 7;
    resumed.batch_in_epoch = 1;
    let err = refused(at(3..6), &mut resumed);
    assert!(err.contains("starts before step 8"), "{err}");
    // A file in the way.
    std::fs::create_dir_all(dir.path().join("p")).unwrap();
    std::fs::write(dir.path().join("p/ops.csv"), "mine").unwrap();
    let err = refused(at(2..3), &mut state());
    assert!(err.contains("ops.csv exists"), "{err}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("p/ops.csv")).unwrap(),
        "mine"
    );
}
