//! `StepLR`: decay by `gamma` every `step_size` epochs.

use serde::{Deserialize, Serialize};

use super::{check_non_negative, check_positive_steps, closed_form_scheduler, Progress};
use crate::error::Result;

fn default_gamma() -> f64 {
    0.1
}

/// Options of [`StepLr`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepLrConfig {
    /// Epochs between decays.
    pub step_size: u64,
    /// Factor applied at each decay (default 0.1).
    #[serde(default = "default_gamma")]
    pub gamma: f64,
}

impl StepLrConfig {
    /// Rejects a zero `step_size` and a negative or non-finite `gamma`.
    pub fn validate(&self) -> Result<()> {
        check_positive_steps("step_size", self.step_size)?;
        check_non_negative("gamma", self.gamma)
    }
}

/// `lr = base_lr * gamma^(epoch / step_size)` (integer division), as
/// `torch.optim.lr_scheduler.StepLR`.
///
/// ```
/// use kiln_core::schedule::{LrScheduler, StepLr, StepLrConfig};
///
/// let mut s = StepLr::new(StepLrConfig { step_size: 2, gamma: 0.5 }, &[1.0])?;
/// let lrs: Vec<f64> = (0..4).map(|_| s.step().map(|l| l[0])).collect::<Result<_, _>>()?;
/// assert_eq!(lrs, [1.0, 0.5, 0.5, 0.25]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct StepLr {
    config: StepLrConfig,
    progress: Progress,
}

impl StepLr {
    /// The schedule for groups with `base_lrs`, at epoch 0.
    pub fn new(config: StepLrConfig, base_lrs: &[f64]) -> Result<Self> {
        config.validate()?;
        Ok(StepLr {
            config,
            progress: Progress::new(base_lrs)?,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &StepLrConfig {
        &self.config
    }

    fn lr_at(&self, base: f64, epoch: u64) -> f64 {
        base * self
            .config
            .gamma
            .powf((epoch / self.config.step_size) as f64)
    }
}

closed_form_scheduler!(StepLr, "step_lr");
