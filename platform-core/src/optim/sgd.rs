//! `torch.optim.SGD`'s options.

use serde::{Deserialize, Serialize};

use super::{check_non_negative, default_lr_sgd};
use crate::error::{Error, Result};

/// Stochastic gradient descent with optional momentum, dampening, weight
/// decay and Nesterov momentum (`torch.optim.SGD`; defaults as PyTorch).
///
/// ```
/// use kiln_core::optim::SgdConfig;
///
/// let sgd = SgdConfig::new(0.1).with_momentum(0.9).with_nesterov(true);
/// sgd.validate()?;
/// assert!(SgdConfig::new(0.1).with_nesterov(true).validate().is_err());
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SgdConfig {
    /// Learning rate (default 1e-3).
    #[serde(default = "default_lr_sgd")]
    pub lr: f64,
    /// Momentum factor (default 0).
    #[serde(default)]
    pub momentum: f64,
    /// Dampening for momentum (default 0).
    #[serde(default)]
    pub dampening: f64,
    /// L2 penalty added to the gradient (default 0).
    #[serde(default)]
    pub weight_decay: f64,
    /// Whether to use Nesterov momentum (default `false`); needs momentum > 0
    /// and zero dampening.
    #[serde(default)]
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig::new(default_lr_sgd())
    }
}

impl SgdConfig {
    /// Plain SGD with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        SgdConfig {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// Sets the momentum.
    pub fn with_momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// Sets the dampening.
    pub fn with_dampening(mut self, dampening: f64) -> Self {
        self.dampening = dampening;
        self
    }

    /// Sets the weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Sets Nesterov momentum.
    pub fn with_nesterov(mut self, nesterov: bool) -> Self {
        self.nesterov = nesterov;
        self
    }

    /// Rejects what `torch.optim.SGD` rejects, and non-finite values.
    pub fn validate(&self) -> Result<()> {
        check_non_negative("lr", self.lr)?;
        check_non_negative("momentum", self.momentum)?;
        if !self.dampening.is_finite() {
            return Err(Error::invalid_argument(
                "dampening",
                format!("must be finite, got {}", self.dampening),
            ));
        }
        check_non_negative("weight_decay", self.weight_decay)?;
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::invalid_argument(
                "nesterov",
                format!(
                    "Nesterov momentum requires a momentum > 0 and zero dampening, \
                     got momentum {} and dampening {}",
                    self.momentum, self.dampening
                ),
            ));
        }
        Ok(())
    }
}
