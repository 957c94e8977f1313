//! `LinearLR`: a factor moving linearly from `start_factor` to `end_factor` (warm-up or decay).

use serde::{Deserialize, Serialize};

use super::{closed_form_scheduler, Progress};
use crate::error::{Error, Result};

fn default_start_factor() -> f64 {
    1.0 / 3.0
}

fn default_end_factor() -> f64 {
    1.0
}

fn default_total_iters() -> u64 {
    5
}

/// Options of [`LinearLr`] (defaults as PyTorch: 1/3, 1 and 5).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinearLrConfig {
    /// Factor at epoch 0, in `(0, 1]`.
    #[serde(default = "default_start_factor")]
    pub start_factor: f64,
    /// Factor from `total_iters` on, in `[0, 1]`.
    #[serde(default = "default_end_factor")]
    pub end_factor: f64,
    /// Epochs over which the factor moves.
    #[serde(default = "default_total_iters")]
    pub total_iters: u64,
}

impl Default for LinearLrConfig {
    fn default() -> Self {
        LinearLrConfig {
            start_factor: default_start_factor(),
            end_factor: default_end_factor(),
            total_iters: default_total_iters(),
        }
    }
}

impl LinearLrConfig {
    /// Rejects the factors PyTorch rejects.
    pub fn validate(&self) -> Result<()> {
        if !(self.start_factor > 0.0 && self.start_factor <= 1.0) {
            return Err(Error::invalid_argument(
                "start_factor",
                format!("must be in (0, 1], got {}", self.start_factor),
            ));
        }
        if !(0.0..=1.0).contains(&self.end_factor) {
            return Err(Error::invalid_argument(
                "end_factor",
                format!("must be in [0, 1], got {}", self.end_factor),
            ));
        }
        Ok(())
    }
}

/// `lr = base_lr * (start + (end - start) * min(epoch, total_iters) / total_iters)`,
/// as `torch.optim.lr_scheduler.LinearLR` (with `total_iters = 0` the factor
/// stays `start_factor`, as PyTorch's recursive form leaves it).
///
/// ```
/// use kiln_core::schedule::{LinearLr, LinearLrConfig, LrScheduler};
///
/// let warmup = LinearLrConfig { start_factor: 0.25, end_factor: 1.0, total_iters: 3 };
/// let mut s = LinearLr::new(warmup, &[0.4])?;
/// assert_eq!(s.lrs(), [0.1]);
/// assert_eq!(s.step()?, [0.2]);
/// s.step()?;
/// assert_eq!(s.step()?, [0.4]);
/// assert_eq!(s.step()?, [0.4]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct LinearLr {
    config: LinearLrConfig,
    progress: Progress,
}

impl LinearLr {
    /// The schedule for groups with `base_lrs`, at epoch 0 (rates `base * start_factor`).
    pub fn new(config: LinearLrConfig, base_lrs: &[f64]) -> Result<Self> {
        config.validate()?;
        let mut scheduler = LinearLr {
            config,
            progress: Progress::new(base_lrs)?,
        };
        scheduler.progress.lrs = base_lrs.iter().map(|&b| scheduler.lr_at(b, 0)).collect();
        Ok(scheduler)
    }

    /// The configuration.
    pub fn config(&self) -> &LinearLrConfig {
        &self.config
    }

    fn lr_at(&self, base: f64, epoch: u64) -> f64 {
        let LinearLrConfig {
            start_factor,
            end_factor,
            total_iters,
        } = self.config;
        if total_iters == 0 {
            return base * start_factor;
        }
        let done = epoch.min(total_iters) as f64;
        base * (start_factor + (end_factor - start_factor) * done / total_iters as f64)
    }
}

closed_form_scheduler!(LinearLr, "linear_lr");
