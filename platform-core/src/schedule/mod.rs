//! Learning-rate schedules with the semantics of `torch.optim.lr_scheduler`.
//!
//! A scheduler holds one base learning rate per parameter group. Right after
//! construction [`LrScheduler::lrs`] are the rates for the first epoch (as a
//! PyTorch scheduler sets them on its optimizer when it is created); after
//! each epoch (or batch), once the optimizer has stepped, call
//! [`LrScheduler::step`] and give the returned rates to
//! [`Optimizer::set_learning_rates`](crate::optim::Optimizer::set_learning_rates).
//!
//! Where PyTorch computes a rate recursively from the previous one
//! ("chainable" form), Kiln uses the equivalent closed form; the two agree to
//! a few units in the last place.

mod cosine;
mod cosine_restarts;
mod exponential;
mod linear;
mod multi_step;
mod one_cycle;
mod plateau;
mod step;

use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};

pub use cosine::{CosineAnnealingLr, CosineAnnealingLrConfig};
pub use cosine_restarts::{CosineAnnealingWarmRestarts, CosineAnnealingWarmRestartsConfig};
pub use exponential::{ExponentialLr, ExponentialLrConfig};
pub use linear::{LinearLr, LinearLrConfig};
pub use multi_step::{MultiStepLr, MultiStepLrConfig};
pub use one_cycle::{AnnealStrategy, OneCycleLr, OneCycleLrConfig};
pub use plateau::{PlateauMode, ReduceLrOnPlateau, ReduceLrOnPlateauConfig, ThresholdMode};
pub use step::{StepLr, StepLrConfig};

/// A learning-rate schedule over one or more parameter groups, kept separate
/// from the optimizer as in `torch.optim.lr_scheduler`.
///
/// ```
/// use kiln_core::schedule::{LrScheduler, SchedulerConfig, StepLrConfig};
///
/// // Two parameter groups with base rates 0.1 and 0.01; halve every 2 epochs.
/// let config = SchedulerConfig::StepLr(StepLrConfig { step_size: 2, gamma: 0.5 });
/// let mut sched = config.build(&[0.1, 0.01])?;
/// assert_eq!(sched.lrs(), [0.1, 0.01]); // epoch 0, set on the optimizer at start
/// for _epoch in 0..2 {
///     // ... train one epoch, optimizer.step() per batch ...
///     let lrs = sched.step()?; // then optimizer.set_learning_rates(&lrs)?
///     assert_eq!(lrs.len(), 2);
/// }
/// assert_eq!(sched.lrs(), [0.05, 0.005]);
///
/// // Checkpoint and resume.
/// let saved = sched.state()?;
/// let mut resumed = config.build(&[0.1, 0.01])?;
/// resumed.load_state(&saved)?;
/// assert_eq!(resumed.step()?, sched.step()?);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub trait LrScheduler: fmt::Debug {
    /// The config `type` of this scheduler (`"step_lr"`, ...), also recorded in its state.
    fn name(&self) -> &'static str;

    /// The base learning rate of each group (PyTorch's `base_lrs`).
    fn base_lrs(&self) -> &[f64];

    /// The learning rate of each group for the current epoch (PyTorch's `get_last_lr()`).
    fn lrs(&self) -> &[f64];

    /// Number of [`step`](LrScheduler::step)s taken (PyTorch's `last_epoch`; 0 after construction).
    fn last_epoch(&self) -> u64;

    /// Advances the schedule by one epoch (or batch) and returns each group's
    /// new learning rate. Call it after the optimizer's step.
    ///
    /// Fails for [`ReduceLrOnPlateau`], which needs
    /// [`step_with_metric`](LrScheduler::step_with_metric), and for a
    /// [`OneCycleLr`] stepped past its `total_steps`; the state is then unchanged.
    fn step(&mut self) -> Result<Vec<f64>>;

    /// The epoch metric this schedule steps on (`val_loss`, ...), for a
    /// schedule that needs one ([`ReduceLrOnPlateau`]); `None` (the default)
    /// for one that steps on time alone. The trainer feeds that metric to
    /// [`step_with_metric`](LrScheduler::step_with_metric) after each epoch.
    fn monitor(&self) -> Option<&str> {
        None
    }

    /// Advances the schedule given the latest value of the monitored metric
    /// (for [`ReduceLrOnPlateau`]); other schedulers ignore the metric and
    /// [`step`](LrScheduler::step).
    fn step_with_metric(&mut self, metric: f64) -> Result<Vec<f64>> {
        let _ = metric;
        self.step()
    }

    /// The momentum (SGD) or beta1 (Adam) of each group the schedule sets
    /// along with the rate, for schedules that cycle it ([`OneCycleLr`]).
    fn momentums(&self) -> Option<&[f64]> {
        None
    }

    /// Everything needed to resume the schedule exactly: its name, base
    /// learning rates, epoch and any internal counters, as JSON.
    fn state(&self) -> Result<Value>;

    /// Restores a [`state`](LrScheduler::state), including the base learning
    /// rates, as PyTorch's `load_state_dict` does; the configuration
    /// (`gamma`, `t_max`, ...) stays the one this scheduler was built with.
    ///
    /// Fails, leaving the scheduler unchanged, for the state of another
    /// scheduler type or group count, or an inconsistent state.
    fn load_state(&mut self, state: &Value) -> Result<()>;
}

/// A value for every parameter group, or one value per group; written in a
/// config file as `0.1` or `[0.1, 0.01]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PerGroup {
    /// The same value for every group.
    Same(f64),
    /// One value per group, in group order.
    Each(Vec<f64>),
}

impl PerGroup {
    /// The value of each of `groups` groups; fails if a list has another length.
    pub fn resolve(&self, name: &str, groups: usize) -> Result<Vec<f64>> {
        match self {
            PerGroup::Same(v) => Ok(vec![*v; groups]),
            PerGroup::Each(values) if values.len() == groups => Ok(values.clone()),
            PerGroup::Each(values) => Err(Error::invalid_argument(
                name,
                format!(
                    "expected one value per parameter group ({groups}), got {}",
                    values.len()
                ),
            )),
        }
    }
}

impl From<f64> for PerGroup {
    fn from(value: f64) -> Self {
        PerGroup::Same(value)
    }
}

impl From<Vec<f64>> for PerGroup {
    fn from(values: Vec<f64>) -> Self {
        PerGroup::Each(values)
    }
}

/// Which schedule to build, with its options; PyTorch's defaults where the
/// PyTorch scheduler has them.
///
/// In a config file: `scheduler = { type = "cosine_annealing_lr", t_max = 100 }`.
///
/// ```
/// use kiln_core::schedule::{LrScheduler, SchedulerConfig};
///
/// let config: SchedulerConfig =
///     serde_json::from_str(r#"{"type": "linear_lr", "start_factor": 0.5, "total_iters": 2}"#)
///         .expect("valid");
/// let mut warmup = config.build(&[1.0])?;
/// assert_eq!(warmup.lrs(), [0.5]);
/// assert_eq!(warmup.step()?, [0.75]);
/// assert_eq!(warmup.step()?, [1.0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[non_exhaustive]
pub enum SchedulerConfig {
    /// `StepLR`.
    StepLr(StepLrConfig),
    /// `MultiStepLR`.
    MultiStepLr(MultiStepLrConfig),
    /// `ExponentialLR`.
    ExponentialLr(ExponentialLrConfig),
    /// `CosineAnnealingLR`.
    CosineAnnealingLr(CosineAnnealingLrConfig),
    /// `CosineAnnealingWarmRestarts`.
    CosineAnnealingWarmRestarts(CosineAnnealingWarmRestartsConfig),
    /// `LinearLR` (linear warm-up or decay).
    LinearLr(LinearLrConfig),
    /// `OneCycleLR`.
    OneCycleLr(OneCycleLrConfig),
    /// `ReduceLROnPlateau`.
    ReduceLrOnPlateau(ReduceLrOnPlateauConfig),
}

impl SchedulerConfig {
    /// Builds the scheduler for parameter groups with `base_lrs` (the
    /// optimizer's learning rates, one per group).
    ///
    /// Fails with [`Error::InvalidArgument`] for an invalid configuration,
    /// no groups, or a negative or non-finite base rate.
    pub fn build(&self, base_lrs: &[f64]) -> Result<Box<dyn LrScheduler + Send>> {
        Ok(match self {
            SchedulerConfig::StepLr(c) => Box::new(StepLr::new(c.clone(), base_lrs)?),
            SchedulerConfig::MultiStepLr(c) => Box::new(MultiStepLr::new(c.clone(), base_lrs)?),
            SchedulerConfig::ExponentialLr(c) => Box::new(ExponentialLr::new(c.clone(), base_lrs)?),
            SchedulerConfig::CosineAnnealingLr(c) => {
                Box::new(CosineAnnealingLr::new(c.clone(), base_lrs)?)
            }
            SchedulerConfig::CosineAnnealingWarmRestarts(c) => {
                Box::new(CosineAnnealingWarmRestarts::new(c.clone(), base_lrs)?)
            }
            SchedulerConfig::LinearLr(c) => Box::new(LinearLr::new(c.clone(), base_lrs)?),
            SchedulerConfig::OneCycleLr(c) => Box::new(OneCycleLr::new(c.clone(), base_lrs)?),
            SchedulerConfig::ReduceLrOnPlateau(c) => {
                Box::new(ReduceLrOnPlateau::new(c.clone(), base_lrs)?)
            }
        })
    }

    /// The epoch metric the built schedule steps on ([`LrScheduler::monitor`]),
    /// known before building, so that a config can be checked against the
    /// metrics a run records.
    pub fn monitor(&self) -> Option<&str> {
        match self {
            SchedulerConfig::ReduceLrOnPlateau(c) => Some(&c.monitor),
            _ => None,
        }
    }

    /// Checks the options without building (group-count checks need [`build`](SchedulerConfig::build)).
    pub fn validate(&self) -> Result<()> {
        match self {
            SchedulerConfig::StepLr(c) => c.validate(),
            SchedulerConfig::MultiStepLr(c) => c.validate(),
            SchedulerConfig::ExponentialLr(c) => c.validate(),
            SchedulerConfig::CosineAnnealingLr(c) => c.validate(),
            SchedulerConfig::CosineAnnealingWarmRestarts(c) => c.validate(),
            SchedulerConfig::LinearLr(c) => c.validate(),
            SchedulerConfig::OneCycleLr(c) => c.validate(),
            SchedulerConfig::ReduceLrOnPlateau(c) => c.validate(),
        }
    }
}

macro_rules! scheduler_from_config {
    ($($config:ty => $variant:ident),* $(,)?) => {
        $(
            impl From<$config> for SchedulerConfig {
                fn from(config: $config) -> Self {
                    SchedulerConfig::$variant(config)
                }
            }
        )*
    };
}

scheduler_from_config! {
    StepLrConfig => StepLr,
    MultiStepLrConfig => MultiStepLr,
    ExponentialLrConfig => ExponentialLr,
    CosineAnnealingLrConfig => CosineAnnealingLr,
    CosineAnnealingWarmRestartsConfig => CosineAnnealingWarmRestarts,
    LinearLrConfig => LinearLr,
    OneCycleLrConfig => OneCycleLr,
    ReduceLrOnPlateauConfig => ReduceLrOnPlateau,
}

/// Checks the optimizer's learning rates a scheduler starts from.
fn check_base_lrs(base_lrs: &[f64]) -> Result<()> {
    if base_lrs.is_empty() {
        return Err(Error::invalid_argument(
            "base_lrs",
            "need the learning rate of at least one parameter group",
        ));
    }
    if let Some((i, lr)) = base_lrs
        .iter()
        .enumerate()
        .find(|(_, lr)| !(lr.is_finite() && **lr >= 0.0))
    {
        return Err(Error::invalid_argument(
            "base_lrs",
            format!("group {i}: learning rate must be finite and >= 0, got {lr}"),
        ));
    }
    Ok(())
}

fn check_finite(name: &str, v: f64) -> Result<()> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(Error::invalid_argument(
            name,
            format!("must be finite, got {v}"),
        ))
    }
}

fn check_non_negative(name: &str, v: f64) -> Result<()> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(Error::invalid_argument(
            name,
            format!("must be finite and >= 0, got {v}"),
        ))
    }
}

fn check_positive_steps(name: &str, v: u64) -> Result<()> {
    if v == 0 {
        return Err(Error::invalid_argument(name, "must be at least 1, got 0"));
    }
    Ok(())
}

fn state_error(scheduler: &str, reason: impl fmt::Display) -> Error {
    Error::invalid_argument("scheduler state", format!("{scheduler}: {reason}"))
}

/// Serializes a scheduler's state.
fn to_state<T: Serialize>(scheduler: &str, state: &T) -> Result<Value> {
    serde_json::to_value(state).map_err(|e| state_error(scheduler, e))
}

/// Deserializes a scheduler's state after checking it is one of `scheduler`'s.
fn from_state<T: DeserializeOwned>(scheduler: &str, state: &Value) -> Result<T> {
    match state.get("scheduler").and_then(Value::as_str) {
        Some(name) if name == scheduler => {}
        Some(name) => {
            return Err(state_error(
                scheduler,
                format!("the state is of a `{name}` scheduler"),
            ))
        }
        None => {
            return Err(state_error(
                scheduler,
                "not a scheduler state (no `scheduler` name)",
            ))
        }
    }
    T::deserialize(state).map_err(|e| state_error(scheduler, e))
}

/// Checks that restored base learning rates fit this scheduler's groups.
fn check_state_groups(scheduler: &str, groups: usize, base_lrs: &[f64]) -> Result<()> {
    if base_lrs.len() != groups {
        return Err(state_error(
            scheduler,
            format!(
                "the state has {} parameter groups, this scheduler {groups}",
                base_lrs.len()
            ),
        ));
    }
    check_base_lrs(base_lrs).map_err(|e| state_error(scheduler, e))
}

/// The state of a schedule that depends only on its epoch.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct EpochState {
    scheduler: String,
    base_lrs: Vec<f64>,
    last_epoch: u64,
}

/// Base rates, epoch and current rates of a closed-form schedule.
#[derive(Clone, Debug, PartialEq)]
struct Progress {
    base_lrs: Vec<f64>,
    last_epoch: u64,
    lrs: Vec<f64>,
}

impl Progress {
    fn new(base_lrs: &[f64]) -> Result<Self> {
        check_base_lrs(base_lrs)?;
        Ok(Progress {
            base_lrs: base_lrs.to_vec(),
            last_epoch: 0,
            lrs: base_lrs.to_vec(),
        })
    }

    fn next_epoch(&self, scheduler: &str) -> Result<u64> {
        self.last_epoch
            .checked_add(1)
            .ok_or_else(|| state_error(scheduler, "epoch counter overflow"))
    }

    fn state(&self, scheduler: &str) -> Result<Value> {
        to_state(
            scheduler,
            &EpochState {
                scheduler: scheduler.to_owned(),
                base_lrs: self.base_lrs.clone(),
                last_epoch: self.last_epoch,
            },
        )
    }

    /// Parses and checks a state; the caller recomputes the rates.
    fn parse(&self, scheduler: &str, state: &Value) -> Result<EpochState> {
        let state: EpochState = from_state(scheduler, state)?;
        check_state_groups(scheduler, self.base_lrs.len(), &state.base_lrs)?;
        Ok(state)
    }
}

/// Implements [`LrScheduler`] for a schedule whose rate is a function of
/// the base rate and the epoch, given by its `lr_at(&self, base, epoch)`.
macro_rules! closed_form_scheduler {
    ($ty:ident, $name:literal) => {
        impl $crate::schedule::LrScheduler for $ty {
            fn name(&self) -> &'static str {
                $name
            }

            fn base_lrs(&self) -> &[f64] {
                &self.progress.base_lrs
            }

            fn lrs(&self) -> &[f64] {
                &self.progress.lrs
            }

            fn last_epoch(&self) -> u64 {
                self.progress.last_epoch
            }

            fn step(&mut self) -> $crate::error::Result<Vec<f64>> {
                let epoch = self.progress.next_epoch($name)?;
                let lrs: Vec<f64> = self
                    .progress
                    .base_lrs
                    .iter()
                    .map(|&base| self.lr_at(base, epoch))
                    .collect();
                self.progress.last_epoch = epoch;
                self.progress.lrs = lrs.clone();
                Ok(lrs)
            }

            fn state(&self) -> $crate::error::Result<serde_json::Value> {
                self.progress.state($name)
            }

            fn load_state(&mut self, state: &serde_json::Value) -> $crate::error::Result<()> {
                let state = self.progress.parse($name, state)?;
                self.progress.lrs = state
                    .base_lrs
                    .iter()
                    .map(|&base| self.lr_at(base, state.last_epoch))
                    .collect();
                self.progress.base_lrs = state.base_lrs;
                self.progress.last_epoch = state.last_epoch;
                Ok(())
            }
        }
    };
}

use closed_form_scheduler;

/// Serializes an `f64` that may be infinite (a plateau's initial best) as a
/// number, or as `"inf"`, `"-inf"` or `"nan"`, which JSON numbers cannot hold.
mod any_f64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else if v.is_nan() {
            s.serialize_str("nan")
        } else if *v > 0.0 {
            s.serialize_str("inf")
        } else {
            s.serialize_str("-inf")
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Repr {
            Number(f64),
            Text(String),
        }
        match Repr::deserialize(d)? {
            Repr::Number(v) => Ok(v),
            Repr::Text(t) => match t.as_str() {
                "inf" => Ok(f64::INFINITY),
                "-inf" => Ok(f64::NEG_INFINITY),
                "nan" => Ok(f64::NAN),
                other => Err(serde::de::Error::custom(format!(
                    "expected a number, \"inf\", \"-inf\" or \"nan\", got {other:?}"
                ))),
            },
        }
    }
}

#[cfg(test)]
mod tests;
