//! `CosineAnnealingLR`: half a cosine from the base rate to `eta_min` over `t_max` epochs.

use std::f64::consts::PI;

use serde::{Deserialize, Serialize};

use super::{check_finite, check_positive_steps, closed_form_scheduler, Progress};
use crate::error::Result;

/// Options of [`CosineAnnealingLr`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CosineAnnealingLrConfig {
    /// Epochs from the base rate down to `eta_min` (PyTorch's `T_max`).
    pub t_max: u64,
    /// The lowest rate (default 0).
    #[serde(default)]
    pub eta_min: f64,
}

impl CosineAnnealingLrConfig {
    /// Rejects a zero `t_max` and a non-finite `eta_min`.
    pub fn validate(&self) -> Result<()> {
        check_positive_steps("t_max", self.t_max)?;
        check_finite("eta_min", self.eta_min)
    }
}

/// `lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * epoch / t_max)) / 2`,
/// as `torch.optim.lr_scheduler.CosineAnnealingLR` (whose recursive form
/// this closed form equals); past `t_max` the cosine continues, rising again,
/// as in PyTorch.
///
/// ```
/// use kiln_core::schedule::{CosineAnnealingLr, CosineAnnealingLrConfig, LrScheduler};
///
/// let mut s = CosineAnnealingLr::new(CosineAnnealingLrConfig { t_max: 2, eta_min: 0.0 }, &[1.0])?;
/// assert!((s.step()?[0] - 0.5).abs() < 1e-15);
/// assert_eq!(s.step()?, [0.0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct CosineAnnealingLr {
    config: CosineAnnealingLrConfig,
    progress: Progress,
}

impl CosineAnnealingLr {
    /// The schedule for groups with `base_lrs`, at epoch 0.
    pub fn new(config: CosineAnnealingLrConfig, base_lrs: &[f64]) -> Result<Self> {
        config.validate()?;
        Ok(CosineAnnealingLr {
            config,
            progress: Progress::new(base_lrs)?,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CosineAnnealingLrConfig {
        &self.config
    }

    fn lr_at(&self, base: f64, epoch: u64) -> f64 {
        let eta_min = self.config.eta_min;
        eta_min
            + (base - eta_min) * (1.0 + (PI * epoch as f64 / self.config.t_max as f64).cos()) / 2.0
    }
}

closed_form_scheduler!(CosineAnnealingLr, "cosine_annealing_lr");
