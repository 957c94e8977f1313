//! A limit on a run's training time, as a callback: Lightning's `Timer` and
//! its `Trainer(max_time=...)`.

use std::time::{Duration, Instant};

use crate::learner::callback::{Callback, Context, FitInfo, Flow};
use crate::learner::config::{EpochRecord, MaxTime};
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::error::{Error, Result};

/// When a [`Timer`] looks at the clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TimerInterval {
    /// After every optimizer step (Lightning's default): the run stops at
    /// the first step that ends past the limit, before that epoch's
    /// validation.
    #[default]
    Step,
    /// After every epoch, its validation and checkpoint done.
    Epoch,
}

/// Stops training once it has run for a given time (Lightning's `Timer`;
/// [`TrainerConfig::max_time`](crate::TrainerConfig::max_time) registers
/// one). The time counts from the start of `fit`, plus the time of the run a
/// checkpoint resumes, which the checkpoint keeps (`time_elapsed`, in
/// seconds, as Lightning's `Timer.state_dict`). Stopping is a clean stop, as
/// `max_steps` is: the run's outputs are written as after its last epoch.
///
/// ```
/// use std::time::Duration;
/// use kiln_train::{Timer, TimerInterval, Trainer, TrainerConfig};
/// # use kiln_core::loss::Loss;
/// # fn run<B: kiln_core::backend::TrainBackend>() -> kiln_core::Result<()> {
/// let timer = Timer::new(Duration::from_secs(3_600)).interval(TimerInterval::Epoch);
/// let trainer = Trainer::<B>::new(TrainerConfig::default(), Loss::cross_entropy())?
///     .with_callback(timer);
/// # let _ = trainer; Ok(()) }
/// ```
#[derive(Debug)]
pub struct Timer {
    duration: Duration,
    interval: TimerInterval,
    /// The training time of the runs before this one (from the checkpoint).
    before: Duration,
    /// When this run's `fit` started.
    started: Option<Instant>,
}

impl Timer {
    /// A timer that stops training after `duration`, looking after every step.
    pub fn new(duration: Duration) -> Self {
        Self {
            duration,
            interval: TimerInterval::Step,
            before: Duration::ZERO,
            started: None,
        }
    }

    /// Looks at the clock after every step or every epoch instead.
    pub fn interval(mut self, interval: TimerInterval) -> Self {
        self.interval = interval;
        self
    }

    /// The limit.
    pub fn duration(&self) -> Duration {
        self.duration
    }

    /// Training time so far, the resumed runs' included.
    pub fn time_elapsed(&self) -> Duration {
        self.before + self.started.map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// Training time left before the limit (zero once it is reached).
    pub fn time_remaining(&self) -> Duration {
        self.duration.saturating_sub(self.time_elapsed())
    }

    /// What a checkpoint keeps: `{"time_elapsed": seconds}`.
    fn saved_state(&self) -> serde_json::Value {
        serde_json::json!({ "time_elapsed": self.time_elapsed().as_secs_f64() })
    }

    /// The training time of the run a checkpoint resumes.
    fn load_saved_state(&mut self, state: &serde_json::Value) -> Result<()> {
        let seconds = state
            .get("time_elapsed")
            .and_then(serde_json::Value::as_f64)
            .filter(|s| s.is_finite() && *s >= 0.0)
            .ok_or_else(|| {
                Error::invalid_argument(
                    "checkpoint",
                    format!(
                        "the Timer's state {state} has no time_elapsed in seconds \
                         (a number, at least 0)"
                    ),
                )
            })?;
        self.before = Duration::try_from_secs_f64(seconds).map_err(|e| {
            Error::invalid_argument("checkpoint", format!("the Timer's time_elapsed: {e}"))
        })?;
        Ok(())
    }

    /// `Stop` once the limit is reached, with the log line Lightning prints.
    fn check(&self, now: TimerInterval) -> Flow {
        if now != self.interval || self.time_elapsed() < self.duration {
            return Flow::Continue;
        }
        log::info!(
            "Time limit reached. Elapsed time is {:.1} s (max_time {}). Signaling Trainer to stop.",
            self.time_elapsed().as_secs_f64(),
            MaxTime::new(self.duration)
        );
        Flow::Stop
    }
}

impl<B: TrainBackend, M: Trainable<B>> Callback<B, M> for Timer {
    fn on_fit_start(&mut self, _cx: &mut Context<'_, B, M>, _run: &FitInfo<'_>) -> Result<()> {
        self.started = Some(Instant::now());
        Ok(())
    }

    fn on_step_end(&mut self, _cx: &mut Context<'_, B, M>, _loss: f64) -> Result<Flow> {
        Ok(self.check(TimerInterval::Step))
    }

    fn needs_step_loss(&self) -> bool {
        false
    }

    fn on_epoch_end(&mut self, _cx: &mut Context<'_, B, M>, _record: &EpochRecord) -> Result<Flow> {
        Ok(self.check(TimerInterval::Epoch))
    }

    fn state_dict(&self) -> Result<Option<serde_json::Value>> {
        Ok(Some(self.saved_state()))
    }

    fn load_state_dict(&mut self, state: &serde_json::Value) -> Result<()> {
        self.load_saved_state(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_time_reads_lightnings_forms_and_names_what_is_wrong() {
        let read = |json: &str| serde_json::from_str::<MaxTime>(json).map_err(|e| e.to_string());
        assert_eq!(
            read(r#""00:12:00:00""#).unwrap().duration(),
            Duration::from_secs(12 * 3600)
        );
        assert_eq!(
            read(r#"{"days": 2, "seconds": 5}"#).unwrap().to_string(),
            "02:00:00:05"
        );
        assert_eq!(read(r#""00:00:00:00""#).unwrap().duration(), Duration::ZERO);
        let err = read(r#""12:00:00""#).unwrap_err();
        assert!(
            err.starts_with("3 fields in \"12:00:00\"; expected \"DD:HH:MM:SS\""),
            "{err}"
        );
        let err = read(r#""00:24:00:00""#).unwrap_err();
        assert!(err.starts_with("hours 24 is not below 24"), "{err}");
        let err = read(r#""00:01:-1:00""#).unwrap_err();
        assert!(
            err.starts_with("minutes \"-1\" is not a whole number"),
            "{err}"
        );
        let err = read(r#"{"hour": 1}"#).unwrap_err();
        assert!(
            err.starts_with("expected \"DD:HH:MM:SS\" or a table"),
            "{err}"
        );
        assert!(read(&format!(r#"{{"days": {}}}"#, u64::MAX)).is_err());
        let text = serde_json::to_string(&MaxTime::parse("03:04:05:06").unwrap()).unwrap();
        assert_eq!(text, r#""03:04:05:06""#);
    }

    #[test]
    fn the_elapsed_time_is_kept_and_restored() {
        let mut timer = Timer::new(Duration::from_secs(60));
        assert_eq!(timer.time_remaining(), Duration::from_secs(60));
        timer
            .load_saved_state(&serde_json::json!({ "time_elapsed": 45.5 }))
            .unwrap();
        assert_eq!(timer.time_elapsed(), Duration::from_millis(45_500));
        assert_eq!(timer.time_remaining(), Duration::from_millis(14_500));
        assert_eq!(
            timer.saved_state(),
            serde_json::json!({ "time_elapsed": 45.5 })
        );
        assert_eq!(timer.check(TimerInterval::Step), Flow::Continue);
        timer.before = Duration::from_secs(60);
        assert_eq!(timer.check(TimerInterval::Step), Flow::Stop);
        assert_eq!(
            timer.check(TimerInterval::Epoch),
            Flow::Continue,
            "not its interval"
        );
        for bad in [
            serde_json::json!({}),
            serde_json::json!({ "time_elapsed": -1.0 }),
        ] {
            let err = timer.load_saved_state(&bad).unwrap_err();
            assert!(err.to_string().contains("has no time_elapsed"), "{err}");
        }
    }
}
