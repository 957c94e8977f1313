//! Training precision: the dtype parameters are kept in and the dtype the
//! matrix work runs in, named as PyTorch Lightning names them.

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::{Error, Result};

/// How a model stores its parameters and computes, like Lightning's
/// `Trainer(precision=...)` (the same names, in a config file's `[training]
/// precision`).
///
/// | precision | parameters and optimizer state | forward pass | inputs | output |
/// | --- | --- | --- | --- | --- |
/// | `32-true` | float32 | float32 | float32 | float32 |
/// | `bf16-mixed` | float32 | autocast to bfloat16 (matrix products, convolutions; float32 where PyTorch's autocast keeps it) | float32 | float32 |
/// | `bf16-true` | bfloat16 | bfloat16 | cast to bfloat16 | bfloat16 |
/// | `16-mixed` | float32 | autocast to float16, with dynamic loss scaling | float32 | float32 |
/// | `16-true` | float16 | float16 | cast to float16 | float16 |
///
/// `bf16-mixed` is what to train with on hardware with fast bfloat16 (recent
/// GPUs, CPUs with AMX or AVX-512 BF16): the speed of bfloat16 matrix products
/// with float32 weights and updates. `bf16-true` halves the memory of parameters
/// and optimizer state too, at the cost of updates rounded to bfloat16.
///
/// `16-mixed` is Lightning's float16 mixed precision, for GPUs without fast
/// bfloat16: autocast to float16, and the loss scaled as `torch.amp.GradScaler`
/// scales it (see [`LossScaling`]), since float16's narrow range would let small
/// gradients underflow to zero. `16-true` keeps everything in float16, without
/// loss scaling, as Lightning's `16-true` does.
///
/// In configs it is the same string as on the command line (serde goes through
/// [`FromStr`](std::str::FromStr) and [`Display`](std::fmt::Display)).
///
/// ```
/// use kiln_core::{precision::FloatPrecision, DType};
///
/// let p: FloatPrecision = "bf16-mixed".parse()?;
/// assert_eq!(p, FloatPrecision::Bf16Mixed);
/// assert_eq!(p.parameter_dtype(), DType::F32);
/// assert_eq!(p.autocast_dtype(), Some(DType::BF16));
/// assert_eq!(p.to_string(), "bf16-mixed");
/// assert!("fp8".parse::<FloatPrecision>().is_err());
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum FloatPrecision {
    /// Everything in float32 (the default).
    #[default]
    F32,
    /// float32 parameters, the forward pass under bfloat16 autocast.
    Bf16Mixed,
    /// Parameters, optimizer state, inputs and the forward pass in bfloat16.
    Bf16True,
    /// float32 parameters, the forward pass under float16 autocast, the loss
    /// scaled dynamically ([`LossScaling`]).
    F16Mixed,
    /// Parameters, optimizer state, inputs and the forward pass in float16.
    F16True,
}

impl FloatPrecision {
    /// Every precision, in the order the names are listed in errors.
    pub const ALL: [FloatPrecision; 5] = [
        FloatPrecision::F32,
        FloatPrecision::Bf16Mixed,
        FloatPrecision::Bf16True,
        FloatPrecision::F16Mixed,
        FloatPrecision::F16True,
    ];

    /// The name in configs and on the command line (`32-true`, `bf16-mixed`,
    /// `bf16-true`, `16-mixed`, `16-true`).
    pub const fn name(self) -> &'static str {
        match self {
            FloatPrecision::F32 => "32-true",
            FloatPrecision::Bf16Mixed => "bf16-mixed",
            FloatPrecision::Bf16True => "bf16-true",
            FloatPrecision::F16Mixed => "16-mixed",
            FloatPrecision::F16True => "16-true",
        }
    }

    /// The dtype the floating-point parameters (and the optimizer's state) are kept in.
    pub const fn parameter_dtype(self) -> DType {
        match self {
            FloatPrecision::F32 | FloatPrecision::Bf16Mixed | FloatPrecision::F16Mixed => {
                DType::F32
            }
            FloatPrecision::Bf16True => DType::BF16,
            FloatPrecision::F16True => DType::F16,
        }
    }

    /// The dtype autocast runs the forward pass's eligible ops in, for mixed precision.
    pub const fn autocast_dtype(self) -> Option<DType> {
        match self {
            FloatPrecision::Bf16Mixed => Some(DType::BF16),
            FloatPrecision::F16Mixed => Some(DType::F16),
            FloatPrecision::F32 | FloatPrecision::Bf16True | FloatPrecision::F16True => None,
        }
    }

    /// Whether training scales the loss ([`LossScaling`]): only `16-mixed`, as
    /// Lightning's `MixedPrecision("16-mixed")` runs a `GradScaler`.
    pub const fn scales_loss(self) -> bool {
        matches!(self, FloatPrecision::F16Mixed)
    }
}

/// Dynamic loss scaling for `16-mixed` training, `torch.amp.GradScaler`'s
/// algorithm and defaults: the loss is multiplied by `scale` before the backward
/// pass; the gradients are divided by it (and checked for inf/NaN in the same
/// pass) before clipping and the optimizer step; a step whose gradients are not
/// finite is skipped and the scale multiplied by `backoff_factor`; after
/// `growth_interval` finite steps in a row the scale is multiplied by
/// `growth_factor`.
///
/// ```
/// use kiln_core::precision::LossScaling;
///
/// let s = LossScaling::default();
/// assert_eq!(s.init_scale, 65536.0);
/// assert_eq!((s.growth_factor, s.backoff_factor, s.growth_interval), (2.0, 0.5, 2000));
/// assert!(s.validate().is_ok());
/// assert!(LossScaling { growth_factor: 0.5, ..s }.validate().is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossScaling {
    /// The first scale (2^16).
    pub init_scale: f64,
    /// Factor the scale grows by after `growth_interval` finite steps (2).
    pub growth_factor: f64,
    /// Factor the scale shrinks by after a step with inf/NaN gradients (0.5).
    pub backoff_factor: f64,
    /// Finite steps in a row before the scale grows (2000).
    pub growth_interval: u32,
}

impl Default for LossScaling {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl LossScaling {
    /// Checks the values as `GradScaler`'s constructor does: a positive finite
    /// initial scale, `growth_factor > 1`, `0 < backoff_factor < 1`, a positive
    /// `growth_interval`.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, reason: String| {
            Err(Error::invalid_argument(
                format!("loss_scaling.{field}"),
                reason,
            ))
        };
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return bad(
                "init_scale",
                format!("{} is not a positive finite number", self.init_scale),
            );
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return bad(
                "growth_factor",
                format!("{} must be greater than 1", self.growth_factor),
            );
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad(
                "backoff_factor",
                format!(
                    "{} must be between 0 and 1 (exclusive)",
                    self.backoff_factor
                ),
            );
        }
        if self.growth_interval == 0 {
            return bad("growth_interval", "must be at least 1".to_owned());
        }
        Ok(())
    }
}

impl std::fmt::Display for FloatPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for FloatPrecision {
    type Err = Error;

    /// The Lightning names, plus `32`/`float32` for `32-true`.
    fn from_str(s: &str) -> Result<Self> {
        let name = s.trim().to_ascii_lowercase();
        match name.as_str() {
            "32" | "float32" | "fp32" => return Ok(FloatPrecision::F32),
            _ => {}
        }
        FloatPrecision::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| {
                let known: Vec<&str> = FloatPrecision::ALL.iter().map(|p| p.name()).collect();
                Error::invalid_argument(
                    "precision",
                    format!(
                        "unknown precision {s:?}; expected one of {}",
                        known.join(", ")
                    ),
                )
            })
    }
}

impl TryFrom<String> for FloatPrecision {
    type Error = Error;

    fn try_from(name: String) -> Result<Self> {
        name.parse()
    }
}

impl From<FloatPrecision> for String {
    fn from(precision: FloatPrecision) -> Self {
        precision.name().to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Serialize, Deserialize)]
    struct Holder {
        precision: FloatPrecision,
    }

    #[test]
    fn names_round_trip_through_serde_and_from_str() {
        for p in FloatPrecision::ALL {
            let text = toml::to_string(&Holder { precision: p }).unwrap();
            assert_eq!(text.trim(), format!("precision = \"{}\"", p.name()));
            let back: Holder = toml::from_str(&text).unwrap();
            assert_eq!(back.precision, p);
            assert_eq!(p.name().parse::<FloatPrecision>().unwrap(), p);
        }
        assert_eq!("32".parse::<FloatPrecision>().unwrap(), FloatPrecision::F32);
        let alias: Holder = toml::from_str("precision = \"32\"").unwrap();
        assert_eq!(alias.precision, FloatPrecision::F32);
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let err = "fp8".parse::<FloatPrecision>().unwrap_err().to_string();
        assert!(
            err.contains("\"fp8\"")
                && err.contains("32-true, bf16-mixed, bf16-true, 16-mixed, 16-true"),
            "{err}"
        );
        let err = toml::from_str::<Holder>("precision = \"bf16\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("bf16-mixed"), "{err}");
    }
}
