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
///
/// `bf16-mixed` is what to train with on hardware with fast bfloat16 (recent
/// GPUs, CPUs with AMX or AVX-512 BF16): the speed of bfloat16 matrix products
/// with float32 weights and updates. `bf16-true` halves the memory of parameters
/// and optimizer state too, at the cost of updates rounded to bfloat16.
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
}

impl FloatPrecision {
    /// Every precision, in the order the names are listed in errors.
    pub const ALL: [FloatPrecision; 3] = [
        FloatPrecision::F32,
        FloatPrecision::Bf16Mixed,
        FloatPrecision::Bf16True,
    ];

    /// The name in configs and on the command line (`32-true`, `bf16-mixed`, `bf16-true`).
    pub const fn name(self) -> &'static str {
        match self {
            FloatPrecision::F32 => "32-true",
            FloatPrecision::Bf16Mixed => "bf16-mixed",
            FloatPrecision::Bf16True => "bf16-true",
        }
    }

    /// The dtype the floating-point parameters (and the optimizer's state) are kept in.
    pub const fn parameter_dtype(self) -> DType {
        match self {
            FloatPrecision::F32 | FloatPrecision::Bf16Mixed => DType::F32,
            FloatPrecision::Bf16True => DType::BF16,
        }
    }

    /// The dtype autocast runs the forward pass's eligible ops in, for mixed precision.
    pub const fn autocast_dtype(self) -> Option<DType> {
        match self {
            FloatPrecision::Bf16Mixed => Some(DType::BF16),
            FloatPrecision::F32 | FloatPrecision::Bf16True => None,
        }
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
        let err = "16-mixed"
            .parse::<FloatPrecision>()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"16-mixed\"") && err.contains("32-true, bf16-mixed, bf16-true"),
            "{err}"
        );
        let err = toml::from_str::<Holder>("precision = \"bf16\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("bf16-mixed"), "{err}");
    }
}
