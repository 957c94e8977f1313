//! A limit on a run's training time, as a callback: Lightning's `Timer` and
//! its `Trainer(max_time=...)`.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::learner::callback::{Callback, Context, FitInfo, Flow};
use crate::learner::trainer::EpochRecord;
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::error::{Error, Result};

/// How long a run may train: Lightning's `max_time`, written `"DD:HH:MM:SS"`
/// (`"00:12:00:00"`: twelve hours) or as a table of `days`, `hours`,
/// `minutes` and `seconds` (`{ hours = 1, minutes = 30 }`), as Lightning
/// takes a string or a dict.
///
/// ```
/// use std::time::Duration;
/// use kiln_train::MaxTime;
///
/// let t: MaxTime = serde_json::from_str(r#""01:02:03:04""#)?;
/// assert_eq!(t.duration(), Duration::from_secs(((24 + 2) * 60 + 3) * 60 + 4));
/// let t: MaxTime = serde_json::from_str(r#"{"hours": 1, "minutes": 30}"#)?;
/// assert_eq!(t.to_string(), "00:01:30:00");
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct MaxTime(Duration);

impl MaxTime {
    /// The limit `duration` (whole seconds count; a fraction is dropped when
    /// it is written out).
    pub fn new(duration: Duration) -> Self {
        Self(duration)
    }

    /// The limit.
    pub fn duration(self) -> Duration {
        self.0
    }

    /// `"DD:HH:MM:SS"` read as Lightning's `Timer` reads it: four fields of
    /// digits, hours below 24, minutes and seconds below 60.
    pub fn parse(text: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::invalid_argument(
                "max_time",
                format!("{why} in {text:?}; expected \"DD:HH:MM:SS\", e.g. \"00:12:00:00\""),
            )
        };
        let fields: Vec<&str> = text.split(':').collect();
        let [days, hours, minutes, seconds] = fields.as_slice() else {
            return Err(bad(&format!("{} fields", fields.len())));
        };
        let number = |field: &str, name: &str, below: Option<u64>| -> Result<u64> {
            let value: u64 = field
                .parse()
                .ok()
                .filter(|_| !field.is_empty() && field.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| bad(&format!("{name} {field:?} is not a whole number")))?;
            match below {
                Some(limit) if value >= limit => {
                    Err(bad(&format!("{name} {value} is not below {limit}")))
                }
                _ => Ok(value),
            }
        };
        Self::from_parts(
            number(days, "days", None)?,
            number(hours, "hours", Some(24))?,
            number(minutes, "minutes", Some(60))?,
            number(seconds, "seconds", Some(60))?,
        )
    }

    fn from_parts(days: u64, hours: u64, minutes: u64, seconds: u64) -> Result<Self> {
        days.checked_mul(24)
            .and_then(|h| h.checked_add(hours))
            .and_then(|h| h.checked_mul(60))
            .and_then(|m| m.checked_add(minutes))
            .and_then(|m| m.checked_mul(60))
            .and_then(|s| s.checked_add(seconds))
            .map(|s| Self(Duration::from_secs(s)))
            .ok_or_else(|| Error::invalid_argument("max_time", "is too long to count in seconds"))
    }
}

impl std::fmt::Display for MaxTime {
    /// `"DD:HH:MM:SS"`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.0.as_secs();
        write!(
            f,
            "{:02}:{:02}:{:02}:{:02}",
            s / 86_400,
            s / 3_600 % 24,
            s / 60 % 60,
            s % 60
        )
    }
}

impl Serialize for MaxTime {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MaxTime {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        /// Lightning's dict form.
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Parts {
            #[serde(default)]
            days: u64,
            #[serde(default)]
            hours: u64,
            #[serde(default)]
            minutes: u64,
            #[serde(default)]
            seconds: u64,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Text(String),
            Parts(Parts),
        }
        let parsed = match Written::deserialize(d).map_err(|_| {
            serde::de::Error::custom(
                "expected \"DD:HH:MM:SS\" or a table of days, hours, minutes and seconds",
            )
        })? {
            Written::Text(text) => MaxTime::parse(&text),
            Written::Parts(p) => MaxTime::from_parts(p.days, p.hours, p.minutes, p.seconds),
        };
        parsed.map_err(|e| match e {
            Error::InvalidArgument { reason, .. } => serde::de::Error::custom(reason),
            other => serde::de::Error::custom(other),
        })
    }
}

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
            MaxTime(self.duration)
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
