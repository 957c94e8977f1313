//! Gradient clipping options; the trainer applies them between backward and step.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

fn two() -> f64 {
    2.0
}

/// How gradients are clipped before the optimizer step.
///
/// In a config file: `clip = { type = "norm", max_norm = 1.0 }` or
/// `clip = { type = "value", clip_value = 0.5 }`.
///
/// ```
/// use kiln_core::optim::GradClip;
///
/// let clip: GradClip = serde_json::from_str(r#"{"type": "norm", "max_norm": 1.0}"#).expect("valid");
/// assert_eq!(clip, GradClip::norm(1.0));
/// clip.validate()?;
/// assert!(GradClip::value(-1.0).validate().is_err());
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum GradClip {
    /// Scale all gradients together so that their joint `norm_type`-norm is
    /// at most `max_norm` (`torch.nn.utils.clip_grad_norm_`).
    Norm {
        /// The largest allowed norm.
        max_norm: f64,
        /// Which p-norm (default 2; `f64::INFINITY` for the max-norm).
        #[serde(default = "two")]
        norm_type: f64,
    },
    /// Clamp every gradient element to `[-clip_value, clip_value]`
    /// (`torch.nn.utils.clip_grad_value_`).
    Value {
        /// The largest allowed magnitude.
        clip_value: f64,
    },
}

impl GradClip {
    /// Clipping by the 2-norm.
    pub fn norm(max_norm: f64) -> Self {
        GradClip::Norm {
            max_norm,
            norm_type: 2.0,
        }
    }

    /// Clipping by value.
    pub fn value(clip_value: f64) -> Self {
        GradClip::Value { clip_value }
    }

    /// Rejects negative or non-finite bounds and norm types that are not positive.
    pub fn validate(&self) -> Result<()> {
        match *self {
            GradClip::Norm {
                max_norm,
                norm_type,
            } => {
                if !(max_norm.is_finite() && max_norm >= 0.0) {
                    return Err(Error::invalid_argument(
                        "max_norm",
                        format!("must be finite and >= 0, got {max_norm}"),
                    ));
                }
                if norm_type.is_nan() || norm_type <= 0.0 {
                    return Err(Error::invalid_argument(
                        "norm_type",
                        format!("must be > 0 (or infinity), got {norm_type}"),
                    ));
                }
                Ok(())
            }
            GradClip::Value { clip_value } => {
                if !(clip_value.is_finite() && clip_value >= 0.0) {
                    return Err(Error::invalid_argument(
                        "clip_value",
                        format!("must be finite and >= 0, got {clip_value}"),
                    ));
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_validation() -> Result<()> {
        let clip: GradClip = serde_json::from_str(r#"{"type": "norm", "max_norm": 5}"#)
            .map_err(|e| Error::invalid_argument("json", e.to_string()))?;
        assert_eq!(clip, GradClip::norm(5.0));
        let clip: GradClip = serde_json::from_str(r#"{"type": "value", "clip_value": 0.1}"#)
            .map_err(|e| Error::invalid_argument("json", e.to_string()))?;
        assert_eq!(clip, GradClip::value(0.1));
        GradClip::Norm {
            max_norm: 1.0,
            norm_type: f64::INFINITY,
        }
        .validate()?;
        let err = GradClip::Norm {
            max_norm: 1.0,
            norm_type: 0.0,
        }
        .validate()
        .expect_err("norm_type 0");
        assert_eq!(
            err.to_string(),
            "invalid argument `norm_type`: must be > 0 (or infinity), got 0"
        );
        assert!(GradClip::norm(f64::NAN).validate().is_err());
        assert!(GradClip::value(f64::INFINITY).validate().is_err());
        assert!(serde_json::from_str::<GradClip>(r#"{"type": "norm", "max": 1}"#).is_err());
        Ok(())
    }
}
