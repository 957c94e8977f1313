//! `torch.optim.RMSprop`'s options.

use serde::{Deserialize, Serialize};

use super::{check_non_negative, default_eps};
use crate::error::Result;

fn default_lr() -> f64 {
    1e-2
}

fn default_alpha() -> f64 {
    0.99
}

/// RMSprop (`torch.optim.RMSprop`; defaults as PyTorch).
///
/// ```
/// use kiln_core::optim::RmsPropConfig;
///
/// let rms = RmsPropConfig::default().with_centered(true).with_momentum(0.9);
/// assert_eq!((rms.lr, rms.alpha), (1e-2, 0.99));
/// rms.validate()?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RmsPropConfig {
    /// Learning rate (default 1e-2).
    #[serde(default = "default_lr")]
    pub lr: f64,
    /// Smoothing constant of the squared-gradient average (default 0.99).
    #[serde(default = "default_alpha")]
    pub alpha: f64,
    /// Added to the denominator for stability (default 1e-8).
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// L2 penalty added to the gradient (default 0).
    #[serde(default)]
    pub weight_decay: f64,
    /// Momentum factor (default 0).
    #[serde(default)]
    pub momentum: f64,
    /// Whether to normalise by the estimated variance instead of the
    /// uncentered second moment (default `false`).
    #[serde(default)]
    pub centered: bool,
}

impl Default for RmsPropConfig {
    fn default() -> Self {
        RmsPropConfig::new(default_lr())
    }
}

impl RmsPropConfig {
    /// RMSprop with learning rate `lr` and PyTorch's other defaults.
    pub fn new(lr: f64) -> Self {
        RmsPropConfig {
            lr,
            alpha: default_alpha(),
            eps: default_eps(),
            weight_decay: 0.0,
            momentum: 0.0,
            centered: false,
        }
    }

    /// Sets the smoothing constant.
    pub fn with_alpha(mut self, alpha: f64) -> Self {
        self.alpha = alpha;
        self
    }

    /// Sets `eps`.
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// Sets the weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Sets the momentum.
    pub fn with_momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// Sets centering.
    pub fn with_centered(mut self, centered: bool) -> Self {
        self.centered = centered;
        self
    }

    /// Rejects what `torch.optim.RMSprop` rejects, and non-finite values.
    pub fn validate(&self) -> Result<()> {
        check_non_negative("lr", self.lr)?;
        check_non_negative("eps", self.eps)?;
        check_non_negative("momentum", self.momentum)?;
        check_non_negative("weight_decay", self.weight_decay)?;
        check_non_negative("alpha", self.alpha)
    }
}
