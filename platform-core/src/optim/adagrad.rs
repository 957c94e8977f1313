//! `torch.optim.Adagrad`'s options.

use serde::{Deserialize, Serialize};

use super::check_non_negative;
use crate::error::Result;

fn default_lr() -> f64 {
    1e-2
}

fn default_eps() -> f64 {
    1e-10
}

/// Adagrad (`torch.optim.Adagrad`; defaults as PyTorch).
///
/// ```
/// use kiln_core::optim::AdagradConfig;
///
/// let ada = AdagradConfig::default().with_lr_decay(1e-4);
/// assert_eq!((ada.lr, ada.eps), (1e-2, 1e-10));
/// ada.validate()?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdagradConfig {
    /// Learning rate (default 1e-2).
    #[serde(default = "default_lr")]
    pub lr: f64,
    /// Learning-rate decay per step: `lr / (1 + (step - 1) * lr_decay)` (default 0).
    #[serde(default)]
    pub lr_decay: f64,
    /// L2 penalty added to the gradient (default 0).
    #[serde(default)]
    pub weight_decay: f64,
    /// Starting value of the squared-gradient sums (default 0).
    #[serde(default)]
    pub initial_accumulator_value: f64,
    /// Added to the denominator for stability (default 1e-10).
    #[serde(default = "default_eps")]
    pub eps: f64,
}

impl Default for AdagradConfig {
    fn default() -> Self {
        AdagradConfig::new(default_lr())
    }
}

impl AdagradConfig {
    /// Adagrad with learning rate `lr` and PyTorch's other defaults.
    pub fn new(lr: f64) -> Self {
        AdagradConfig {
            lr,
            lr_decay: 0.0,
            weight_decay: 0.0,
            initial_accumulator_value: 0.0,
            eps: default_eps(),
        }
    }

    /// Sets the learning-rate decay.
    pub fn with_lr_decay(mut self, lr_decay: f64) -> Self {
        self.lr_decay = lr_decay;
        self
    }

    /// Sets the weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Sets the initial accumulator value.
    pub fn with_initial_accumulator_value(mut self, value: f64) -> Self {
        self.initial_accumulator_value = value;
        self
    }

    /// Sets `eps`.
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// Rejects what `torch.optim.Adagrad` rejects, and non-finite values.
    pub fn validate(&self) -> Result<()> {
        check_non_negative("lr", self.lr)?;
        check_non_negative("lr_decay", self.lr_decay)?;
        check_non_negative("weight_decay", self.weight_decay)?;
        check_non_negative("initial_accumulator_value", self.initial_accumulator_value)?;
        check_non_negative("eps", self.eps)
    }
}
