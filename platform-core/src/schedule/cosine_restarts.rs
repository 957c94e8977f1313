//! `CosineAnnealingWarmRestarts`: cosine annealing restarted every `T_i` epochs (SGDR).

use std::f64::consts::PI;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    check_base_lrs, check_finite, check_positive_steps, check_state_groups, from_state,
    state_error, to_state, LrScheduler,
};
use crate::error::Result;

fn one() -> u64 {
    1
}

/// Options of [`CosineAnnealingWarmRestarts`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CosineAnnealingWarmRestartsConfig {
    /// Epochs until the first restart (PyTorch's `T_0`).
    pub t_0: u64,
    /// Factor by which the period grows after each restart (default 1; PyTorch's `T_mult`).
    #[serde(default = "one")]
    pub t_mult: u64,
    /// The lowest rate (default 0).
    #[serde(default)]
    pub eta_min: f64,
}

impl CosineAnnealingWarmRestartsConfig {
    /// Rejects a zero `t_0` or `t_mult` and a non-finite `eta_min`.
    pub fn validate(&self) -> Result<()> {
        check_positive_steps("t_0", self.t_0)?;
        check_positive_steps("t_mult", self.t_mult)?;
        check_finite("eta_min", self.eta_min)
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RestartState {
    scheduler: String,
    base_lrs: Vec<f64>,
    last_epoch: u64,
    t_cur: u64,
    t_i: u64,
}

/// `lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * t_cur / t_i)) / 2`,
/// where `t_cur` counts epochs since the last restart and the period `t_i`
/// starts at `t_0` and is multiplied by `t_mult` at each restart, as
/// `torch.optim.lr_scheduler.CosineAnnealingWarmRestarts` stepped without
/// an explicit epoch.
///
/// ```
/// use kiln_core::{schedule::{CosineAnnealingWarmRestarts, CosineAnnealingWarmRestartsConfig, LrScheduler}};
///
/// let config = CosineAnnealingWarmRestartsConfig { t_0: 2, t_mult: 1, eta_min: 0.0 };
/// let mut s = CosineAnnealingWarmRestarts::new(config, &[1.0])?;
/// assert!((s.step()?[0] - 0.5).abs() < 1e-15);
/// assert_eq!(s.step()?, [1.0]); // restart
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct CosineAnnealingWarmRestarts {
    config: CosineAnnealingWarmRestartsConfig,
    base_lrs: Vec<f64>,
    last_epoch: u64,
    t_cur: u64,
    t_i: u64,
    lrs: Vec<f64>,
}

const NAME: &str = "cosine_annealing_warm_restarts";

impl CosineAnnealingWarmRestarts {
    /// The schedule for groups with `base_lrs`, at epoch 0.
    pub fn new(config: CosineAnnealingWarmRestartsConfig, base_lrs: &[f64]) -> Result<Self> {
        config.validate()?;
        check_base_lrs(base_lrs)?;
        let t_i = config.t_0;
        let mut scheduler = CosineAnnealingWarmRestarts {
            config,
            base_lrs: base_lrs.to_vec(),
            last_epoch: 0,
            t_cur: 0,
            t_i,
            lrs: Vec::new(),
        };
        scheduler.lrs = scheduler.compute();
        Ok(scheduler)
    }

    /// The configuration.
    pub fn config(&self) -> &CosineAnnealingWarmRestartsConfig {
        &self.config
    }

    /// Epochs since the last restart (PyTorch's `T_cur`).
    pub fn t_cur(&self) -> u64 {
        self.t_cur
    }

    /// The current period (PyTorch's `T_i`).
    pub fn t_i(&self) -> u64 {
        self.t_i
    }

    fn compute(&self) -> Vec<f64> {
        let eta_min = self.config.eta_min;
        let phase = PI * self.t_cur as f64 / self.t_i as f64;
        self.base_lrs
            .iter()
            .map(|&base| eta_min + (base - eta_min) * (1.0 + phase.cos()) / 2.0)
            .collect()
    }
}

impl LrScheduler for CosineAnnealingWarmRestarts {
    fn name(&self) -> &'static str {
        NAME
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

    fn step(&mut self) -> Result<Vec<f64>> {
        let overflow = || state_error(NAME, "epoch counter overflow");
        let epoch = self.last_epoch.checked_add(1).ok_or_else(overflow)?;
        let mut t_cur = self.t_cur + 1;
        let mut t_i = self.t_i;
        if t_cur >= t_i {
            t_cur %= t_i;
            t_i = t_i.checked_mul(self.config.t_mult).ok_or_else(overflow)?;
        }
        self.last_epoch = epoch;
        self.t_cur = t_cur;
        self.t_i = t_i;
        self.lrs = self.compute();
        Ok(self.lrs.clone())
    }

    fn state(&self) -> Result<Value> {
        to_state(
            NAME,
            &RestartState {
                scheduler: NAME.to_owned(),
                base_lrs: self.base_lrs.clone(),
                last_epoch: self.last_epoch,
                t_cur: self.t_cur,
                t_i: self.t_i,
            },
        )
    }

    fn load_state(&mut self, state: &Value) -> Result<()> {
        let state: RestartState = from_state(NAME, state)?;
        check_state_groups(NAME, self.base_lrs.len(), &state.base_lrs)?;
        if state.t_i == 0 || state.t_cur >= state.t_i {
            return Err(state_error(
                NAME,
                format!(
                    "t_cur ({}) must be below the period t_i ({})",
                    state.t_cur, state.t_i
                ),
            ));
        }
        self.base_lrs = state.base_lrs;
        self.last_epoch = state.last_epoch;
        self.t_cur = state.t_cur;
        self.t_i = state.t_i;
        self.lrs = self.compute();
        Ok(())
    }
}
