//! `ExponentialLR`: decay by `gamma` every epoch.

use serde::{Deserialize, Serialize};

use super::{check_non_negative, closed_form_scheduler, Progress};
use crate::error::Result;

/// Options of [`ExponentialLr`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExponentialLrConfig {
    /// Factor applied every epoch.
    pub gamma: f64,
}

impl ExponentialLrConfig {
    /// Rejects a negative or non-finite `gamma`.
    pub fn validate(&self) -> Result<()> {
        check_non_negative("gamma", self.gamma)
    }
}

/// `lr = base_lr * gamma^epoch`, as `torch.optim.lr_scheduler.ExponentialLR`.
///
/// ```
/// use kiln_core::schedule::{ExponentialLr, ExponentialLrConfig, LrScheduler};
///
/// let mut s = ExponentialLr::new(ExponentialLrConfig { gamma: 0.5 }, &[1.0, 0.1])?;
/// s.step()?;
/// assert_eq!(s.step()?, [0.25, 0.025]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct ExponentialLr {
    config: ExponentialLrConfig,
    progress: Progress,
}

impl ExponentialLr {
    /// The schedule for groups with `base_lrs`, at epoch 0.
    pub fn new(config: ExponentialLrConfig, base_lrs: &[f64]) -> Result<Self> {
        config.validate()?;
        Ok(ExponentialLr {
            config,
            progress: Progress::new(base_lrs)?,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ExponentialLrConfig {
        &self.config
    }

    fn lr_at(&self, base: f64, epoch: u64) -> f64 {
        base * self.config.gamma.powf(epoch as f64)
    }
}

closed_form_scheduler!(ExponentialLr, "exponential_lr");
