//! `ReduceLROnPlateau`: cut the rate when a monitored metric stops improving.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    any_f64, check_base_lrs, check_non_negative, check_state_groups, from_state, state_error,
    to_state, LrScheduler, PerGroup,
};
use crate::error::{Error, Result};

/// Whether [`ReduceLrOnPlateau`] wants the metric to fall or to rise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlateauMode {
    /// Lower is better (a loss; the default).
    #[default]
    Min,
    /// Higher is better (an accuracy).
    Max,
}

/// How [`ReduceLrOnPlateau`] decides that a metric improved on the best so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ThresholdMode {
    /// By the fraction `threshold` of the best (the default).
    #[default]
    Rel,
    /// By at least `threshold`.
    Abs,
}

fn default_factor() -> f64 {
    0.1
}

fn default_patience() -> u64 {
    10
}

fn default_threshold() -> f64 {
    1e-4
}

fn default_min_lr() -> PerGroup {
    PerGroup::Same(0.0)
}

fn default_eps() -> f64 {
    1e-8
}

fn default_monitor() -> String {
    "val_loss".to_owned()
}

/// Options of [`ReduceLrOnPlateau`] (defaults as PyTorch).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReduceLrOnPlateauConfig {
    /// The epoch metric the trainer feeds it (default `val_loss`; any metric of
    /// the run's epoch record, e.g. `val_accuracy` with `mode = "max"`).
    #[serde(default = "default_monitor")]
    pub monitor: String,
    /// Whether the metric should fall or rise (default `min`).
    #[serde(default)]
    pub mode: PlateauMode,
    /// Factor applied at each reduction, in `[0, 1)` (default 0.1).
    #[serde(default = "default_factor")]
    pub factor: f64,
    /// Epochs without improvement tolerated before a reduction (default 10).
    #[serde(default = "default_patience")]
    pub patience: u64,
    /// Minimum change counted as an improvement (default 1e-4).
    #[serde(default = "default_threshold")]
    pub threshold: f64,
    /// Relative or absolute threshold (default relative).
    #[serde(default)]
    pub threshold_mode: ThresholdMode,
    /// Epochs after a reduction during which bad epochs are not counted (default 0).
    #[serde(default)]
    pub cooldown: u64,
    /// Lowest rate, for all groups or per group (default 0).
    #[serde(default = "default_min_lr")]
    pub min_lr: PerGroup,
    /// A reduction smaller than this is skipped (default 1e-8).
    #[serde(default = "default_eps")]
    pub eps: f64,
}

impl Default for ReduceLrOnPlateauConfig {
    fn default() -> Self {
        ReduceLrOnPlateauConfig {
            monitor: default_monitor(),
            mode: PlateauMode::Min,
            factor: default_factor(),
            patience: default_patience(),
            threshold: default_threshold(),
            threshold_mode: ThresholdMode::Rel,
            cooldown: 0,
            min_lr: default_min_lr(),
            eps: default_eps(),
        }
    }
}

impl ReduceLrOnPlateauConfig {
    /// Rejects a `factor` outside `[0, 1)` (PyTorch requires `< 1`) and
    /// negative or non-finite thresholds, `eps` and `min_lr`.
    pub fn validate(&self) -> Result<()> {
        if !(0.0..1.0).contains(&self.factor) {
            return Err(Error::invalid_argument(
                "factor",
                format!("must be in [0, 1), got {}", self.factor),
            ));
        }
        check_non_negative("threshold", self.threshold)?;
        check_non_negative("eps", self.eps)?;
        match &self.min_lr {
            PerGroup::Same(v) => check_non_negative("min_lr", *v),
            PerGroup::Each(values) => values
                .iter()
                .try_for_each(|v| check_non_negative("min_lr", *v)),
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlateauState {
    scheduler: String,
    base_lrs: Vec<f64>,
    last_epoch: u64,
    lrs: Vec<f64>,
    #[serde(with = "any_f64")]
    best: f64,
    num_bad_epochs: u64,
    cooldown_counter: u64,
}

/// Multiplies every group's rate by `factor` (not below its `min_lr`) once
/// the metric has not improved for more than `patience` epochs, then waits
/// `cooldown` epochs, as `torch.optim.lr_scheduler.ReduceLROnPlateau`.
///
/// Feed it the metric with [`step_with_metric`](LrScheduler::step_with_metric)
/// once per epoch; [`step`](LrScheduler::step) without a metric is an error
/// (an epoch without a metric would silently never reduce the rate). A NaN
/// metric counts as no improvement, as in PyTorch.
///
/// ```
/// use kiln_core::schedule::{LrScheduler, ReduceLrOnPlateau, ReduceLrOnPlateauConfig};
///
/// let config = ReduceLrOnPlateauConfig { patience: 1, factor: 0.5, ..Default::default() };
/// let mut s = ReduceLrOnPlateau::new(config, &[0.1])?;
/// assert_eq!(s.step_with_metric(1.0)?, [0.1]); // the first metric is the best so far
/// assert_eq!(s.step_with_metric(1.0)?, [0.1]); // 1 bad epoch: within patience
/// assert_eq!(s.step_with_metric(1.0)?, [0.05]); // 2 bad epochs: reduce
/// assert!(s.step().is_err());
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct ReduceLrOnPlateau {
    config: ReduceLrOnPlateauConfig,
    base_lrs: Vec<f64>,
    min_lrs: Vec<f64>,
    last_epoch: u64,
    lrs: Vec<f64>,
    best: f64,
    num_bad_epochs: u64,
    cooldown_counter: u64,
}

const NAME: &str = "reduce_lr_on_plateau";

impl ReduceLrOnPlateau {
    /// The scheduler for groups with `base_lrs`, before the first metric.
    pub fn new(config: ReduceLrOnPlateauConfig, base_lrs: &[f64]) -> Result<Self> {
        config.validate()?;
        check_base_lrs(base_lrs)?;
        let min_lrs = config.min_lr.resolve("min_lr", base_lrs.len())?;
        let best = Self::worst(config.mode);
        Ok(ReduceLrOnPlateau {
            config,
            base_lrs: base_lrs.to_vec(),
            min_lrs,
            last_epoch: 0,
            lrs: base_lrs.to_vec(),
            best,
            num_bad_epochs: 0,
            cooldown_counter: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ReduceLrOnPlateauConfig {
        &self.config
    }

    /// The best metric seen so far (infinite before the first).
    pub fn best(&self) -> f64 {
        self.best
    }

    /// Consecutive epochs without improvement, outside cooldown.
    pub fn num_bad_epochs(&self) -> u64 {
        self.num_bad_epochs
    }

    /// Epochs of cooldown left.
    pub fn cooldown_counter(&self) -> u64 {
        self.cooldown_counter
    }

    fn worst(mode: PlateauMode) -> f64 {
        match mode {
            PlateauMode::Min => f64::INFINITY,
            PlateauMode::Max => f64::NEG_INFINITY,
        }
    }

    fn is_better(&self, current: f64) -> bool {
        let threshold = self.config.threshold;
        let best = self.best;
        match (self.config.mode, self.config.threshold_mode) {
            (PlateauMode::Min, ThresholdMode::Rel) => current < best * (1.0 - threshold),
            (PlateauMode::Min, ThresholdMode::Abs) => current < best - threshold,
            (PlateauMode::Max, ThresholdMode::Rel) => current > best * (threshold + 1.0),
            (PlateauMode::Max, ThresholdMode::Abs) => current > best + threshold,
        }
    }
}

impl LrScheduler for ReduceLrOnPlateau {
    fn name(&self) -> &'static str {
        NAME
    }

    fn monitor(&self) -> Option<&str> {
        Some(&self.config.monitor)
    }

    fn base_lrs(&self) -> &[f64] {
        &self.base_lrs
    }

    fn lrs(&self) -> &[f64] {
        &self.lrs
    }

    fn last_epoch(&self) -> u64 {
        self.last_epoch
    }

    /// Always fails: this schedule needs the metric, see
    /// [`step_with_metric`](LrScheduler::step_with_metric).
    fn step(&mut self) -> Result<Vec<f64>> {
        Err(Error::invalid_argument(
            "metric",
            "reduce_lr_on_plateau needs the monitored metric each epoch: \
             call step_with_metric(value) instead of step()",
        ))
    }

    fn step_with_metric(&mut self, metric: f64) -> Result<Vec<f64>> {
        let epoch = self
            .last_epoch
            .checked_add(1)
            .ok_or_else(|| state_error(NAME, "epoch counter overflow"))?;
        self.last_epoch = epoch;
        if self.is_better(metric) {
            self.best = metric;
            self.num_bad_epochs = 0;
        } else {
            self.num_bad_epochs += 1;
        }
        if self.cooldown_counter > 0 {
            self.cooldown_counter -= 1;
            // Bad epochs during cooldown are not counted.
            self.num_bad_epochs = 0;
        }
        if self.num_bad_epochs > self.config.patience {
            for (lr, &min_lr) in self.lrs.iter_mut().zip(&self.min_lrs) {
                let new_lr = (*lr * self.config.factor).max(min_lr);
                if *lr - new_lr > self.config.eps {
                    log::info!("{NAME}: epoch {epoch}: reducing learning rate {lr} to {new_lr}");
                    *lr = new_lr;
                }
            }
            self.cooldown_counter = self.config.cooldown;
            self.num_bad_epochs = 0;
        }
        Ok(self.lrs.clone())
    }

    fn state(&self) -> Result<Value> {
        to_state(
            NAME,
            &PlateauState {
                scheduler: NAME.to_owned(),
                base_lrs: self.base_lrs.clone(),
                last_epoch: self.last_epoch,
                lrs: self.lrs.clone(),
                best: self.best,
                num_bad_epochs: self.num_bad_epochs,
                cooldown_counter: self.cooldown_counter,
            },
        )
    }

    fn load_state(&mut self, state: &Value) -> Result<()> {
        let state: PlateauState = from_state(NAME, state)?;
        check_state_groups(NAME, self.base_lrs.len(), &state.base_lrs)?;
        check_state_groups(NAME, self.base_lrs.len(), &state.lrs)?;
        self.base_lrs = state.base_lrs;
        self.last_epoch = state.last_epoch;
        self.lrs = state.lrs;
        self.best = state.best;
        self.num_bad_epochs = state.num_bad_epochs;
        self.cooldown_counter = state.cooldown_counter;
        Ok(())
    }
}
