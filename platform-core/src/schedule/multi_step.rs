//! `MultiStepLR`: decay by `gamma` at each milestone epoch.

use serde::{Deserialize, Serialize};

use super::{check_non_negative, closed_form_scheduler, Progress};
use crate::error::Result;

fn default_gamma() -> f64 {
    0.1
}

/// Options of [`MultiStepLr`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MultiStepLrConfig {
    /// Epochs at which the rate is multiplied by `gamma`; a milestone listed
    /// twice applies twice, as in PyTorch.
    pub milestones: Vec<u64>,
    /// Factor applied at each milestone (default 0.1).
    #[serde(default = "default_gamma")]
    pub gamma: f64,
}

impl MultiStepLrConfig {
    /// Rejects a negative or non-finite `gamma`.
    pub fn validate(&self) -> Result<()> {
        check_non_negative("gamma", self.gamma)
    }
}

/// `lr = base_lr * gamma^(number of milestones <= epoch)`, as
/// `torch.optim.lr_scheduler.MultiStepLR`.
///
/// ```
/// use kiln_core::schedule::{LrScheduler, MultiStepLr, MultiStepLrConfig};
///
/// let config = MultiStepLrConfig { milestones: vec![1, 3], gamma: 0.1 };
/// let mut s = MultiStepLr::new(config, &[1.0])?;
/// assert_eq!(s.step()?, [0.1]);
/// assert_eq!(s.step()?, [0.1]);
/// assert!((s.step()?[0] - 0.01).abs() < 1e-15);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct MultiStepLr {
    config: MultiStepLrConfig,
    progress: Progress,
}

impl MultiStepLr {
    /// The schedule for groups with `base_lrs`, at epoch 0.
    pub fn new(config: MultiStepLrConfig, base_lrs: &[f64]) -> Result<Self> {
        config.validate()?;
        Ok(MultiStepLr {
            config,
            progress: Progress::new(base_lrs)?,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &MultiStepLrConfig {
        &self.config
    }

    fn lr_at(&self, base: f64, epoch: u64) -> f64 {
        let passed = self
            .config
            .milestones
            .iter()
            .filter(|&&m| m <= epoch)
            .count();
        base * self.config.gamma.powf(passed as f64)
    }
}

closed_form_scheduler!(MultiStepLr, "multi_step_lr");
