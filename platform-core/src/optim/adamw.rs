//! `torch.optim.AdamW`'s options.

use serde::{Deserialize, Serialize};

use super::{check_betas, check_non_negative, default_betas, default_eps, default_lr_adam};
use crate::error::Result;

fn default_weight_decay() -> f64 {
    1e-2
}

/// AdamW: Adam with decoupled weight decay (`torch.optim.AdamW`; defaults as
/// PyTorch, including `weight_decay = 0.01`).
///
/// ```
/// use kiln_core::optim::AdamWConfig;
///
/// let adamw = AdamWConfig::new(1e-3);
/// assert_eq!(adamw.weight_decay, 0.01);
/// adamw.validate()?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamWConfig {
    /// Learning rate (default 1e-3).
    #[serde(default = "default_lr_adam")]
    pub lr: f64,
    /// Decay rates of the first and second moment estimates (default `(0.9, 0.999)`).
    #[serde(default = "default_betas")]
    pub betas: (f64, f64),
    /// Added to the denominator for stability (default 1e-8).
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Decoupled weight decay (default 0.01).
    #[serde(default = "default_weight_decay")]
    pub weight_decay: f64,
    /// Whether to use the AMSGrad variant (default `false`).
    #[serde(default)]
    pub amsgrad: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig::new(default_lr_adam())
    }
}

impl AdamWConfig {
    /// AdamW with learning rate `lr` and PyTorch's other defaults.
    pub fn new(lr: f64) -> Self {
        AdamWConfig {
            lr,
            betas: default_betas(),
            eps: default_eps(),
            weight_decay: default_weight_decay(),
            amsgrad: false,
        }
    }

    /// Sets the moment decay rates.
    pub fn with_betas(mut self, betas: (f64, f64)) -> Self {
        self.betas = betas;
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

    /// Sets AMSGrad.
    pub fn with_amsgrad(mut self, amsgrad: bool) -> Self {
        self.amsgrad = amsgrad;
        self
    }

    /// Rejects what `torch.optim.AdamW` rejects, and non-finite values.
    pub fn validate(&self) -> Result<()> {
        check_non_negative("lr", self.lr)?;
        check_non_negative("eps", self.eps)?;
        check_betas(self.betas)?;
        check_non_negative("weight_decay", self.weight_decay)
    }
}
