//! How to train, independent of the model and the data: [`TrainerConfig`]
//! (`[training]` in a config file), when the schedule advances, the time
//! limit ([`MaxTime`]), and an epoch's record of metrics.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::averaging::{AveragingConfig, EmaConfig, SwaConfig};
use kiln_core::device::Device;
use kiln_core::error::{Error, Result};
use kiln_core::optim::GradClip;
use kiln_core::precision::FloatPrecision;

/// When the learning-rate schedule advances.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleInterval {
    /// After every optimizer step (warm-up, one-cycle).
    Step,
    /// After every epoch (PyTorch's usual `scheduler.step()` per epoch).
    #[default]
    Epoch,
}

/// How to train, independent of the model and the data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerConfig {
    /// Epochs to train for.
    #[serde(default = "ten")]
    pub epochs: u64,
    /// Stop after this many optimizer steps, if reached before `epochs`.
    #[serde(default)]
    pub max_steps: Option<u64>,
    /// Stop once training has run this long (Lightning's `max_time`,
    /// `"DD:HH:MM:SS"`), looking after every step: the trainer registers a
    /// [`Timer`](crate::Timer), whose elapsed time checkpoints keep.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_time: Option<MaxTime>,
    /// Micro-batches whose gradients add up before each optimizer step (>= 1).
    #[serde(default = "one")]
    pub accumulate: u64,
    /// Gradient clipping before each optimizer step.
    #[serde(default)]
    pub clip: Option<GradClip>,
    /// The run's seed: initial weights, data order and dropout derive from it
    /// (in a config file: the top-level `seed`).
    #[serde(skip)]
    pub seed: u64,
    /// Where the model and batches live (in a config file: the top-level `device`).
    #[serde(skip)]
    pub device: Device,
    /// When the schedule advances.
    #[serde(default)]
    pub schedule_interval: ScheduleInterval,
    /// Log the step's training loss and learning rate (`steps.csv`, TensorBoard)
    /// every this many optimizer steps, as Lightning's `log_every_n_steps`
    /// (0: only the per-epoch record).
    #[serde(default = "fifty")]
    pub log_every: u64,
    /// Keep host memory that tensors free for the next step instead of
    /// returning it to the OS (see [`host_memory`](kiln_core::host_memory); on by
    /// default, glibc only). `fit` applies it process-wide.
    #[serde(default = "yes")]
    pub retain_host_memory: bool,
    /// The dtype of parameters and of the forward pass, like Lightning's
    /// `precision` (`32-true`, `bf16-mixed`, `bf16-true`). The model must have
    /// been given it
    /// ([`TrainBackend::set_precision`](kiln_core::backend::TrainBackend::set_precision))
    /// before its optimizer was built; `fit` checks.
    #[serde(default)]
    pub precision: FloatPrecision,
    /// Keep an exponential moving average of the weights
    /// (`ema = { decay = 0.999 }`; see [`EmaConfig`]). `fit` starts one from
    /// the model's weights when the state has none
    /// ([`TrainingState::with_weight_averaging`](crate::TrainingState::with_weight_averaging)
    /// gives one before a resume, so that the checkpoint's average is
    /// restored).
    #[serde(default)]
    pub ema: Option<EmaConfig>,
    /// Stochastic weight averaging (`swa = { lrs = 0.05 }`; see [`SwaConfig`]),
    /// instead of `ema`: its learning-rate schedule replaces the run's from
    /// its first epoch on, and
    /// [`Trainer::apply_average`](crate::Trainer::apply_average) ends the run
    /// with the average and its batch-norm statistics.
    #[serde(default)]
    pub swa: Option<SwaConfig>,
}

fn ten() -> u64 {
    10
}
fn one() -> u64 {
    1
}
fn fifty() -> u64 {
    50
}
fn yes() -> bool {
    true
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            epochs: 10,
            max_steps: None,
            max_time: None,
            accumulate: 1,
            clip: None,
            seed: 0,
            device: Device::Cpu,
            schedule_interval: ScheduleInterval::Epoch,
            log_every: 50,
            retain_host_memory: true,
            precision: FloatPrecision::F32,
            ema: None,
            swa: None,
        }
    }
}

impl TrainerConfig {
    /// Rejects settings that cannot work, naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.accumulate == 0 {
            return Err(Error::invalid_argument("accumulate", "must be at least 1"));
        }
        if self.epochs == 0 && self.max_steps.is_none() {
            return Err(Error::invalid_argument("epochs", "must be at least 1"));
        }
        if let Some(clip) = &self.clip {
            clip.validate()?;
        }
        if let Some(ema) = &self.ema {
            ema.validate()?;
        }
        if let Some(swa) = &self.swa {
            if self.ema.is_some() {
                return Err(Error::invalid_argument(
                    "training.swa",
                    "a run keeps one weight average: set training.ema or training.swa, not both",
                ));
            }
            swa.validate()?;
            swa.start_epoch(self.epochs)?;
        }
        Ok(())
    }

    /// The weight average the run keeps, if any.
    pub fn averaging(&self) -> Option<AveragingConfig> {
        match (&self.ema, &self.swa) {
            (Some(ema), _) => Some(ema.clone().into()),
            (None, Some(swa)) => Some(swa.clone().into()),
            (None, None) => None,
        }
    }
}

/// The metrics of one epoch, by name.
pub type EpochRecord = BTreeMap<String, f64>;

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
