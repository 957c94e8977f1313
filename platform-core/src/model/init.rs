//! Parameter initialisers, resolved to concrete distributions the way
//! `torch.nn.init` computes them.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How a parameter is initialised, before its shape is known.
///
/// [`Init::resolve`] turns it into an [`InitDistribution`] for a concrete
/// shape, computing fans and gains exactly like `torch.nn.init`. Written by
/// hand in a config file as, e.g.,
/// `{ type = "kaiming_uniform", nonlinearity = "relu" }`.
///
/// ```
/// use kiln_core::model::{Init, InitDistribution, Nonlinearity};
///
/// // torch.nn.init.kaiming_uniform_(w, nonlinearity="relu") on a [64, 32] weight
/// let init = Init::kaiming_uniform(Nonlinearity::Relu);
/// let InitDistribution::Uniform { low, high } = init.resolve(&[64, 32])? else {
///     unreachable!()
/// };
/// let bound = 3f64.sqrt() * (2f64.sqrt() / 32f64.sqrt());
/// assert!((high - bound).abs() < 1e-15 && low == -high);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Init {
    /// All zeros (`nn.init.zeros_`).
    Zeros,
    /// All ones (`nn.init.ones_`).
    Ones,
    /// Every element `value` (`nn.init.constant_`).
    Constant {
        /// The value.
        value: f64,
    },
    /// Uniform on `[low, high)` (`nn.init.uniform_`; defaults 0 and 1).
    Uniform {
        /// Lower bound (default 0).
        #[serde(default)]
        low: f64,
        /// Upper bound (default 1).
        #[serde(default = "one")]
        high: f64,
    },
    /// Normal with `mean` and standard deviation `std` (`nn.init.normal_`; defaults 0 and 1).
    Normal {
        /// Mean (default 0).
        #[serde(default)]
        mean: f64,
        /// Standard deviation (default 1).
        #[serde(default = "one")]
        std: f64,
    },
    /// Glorot uniform (`nn.init.xavier_uniform_`).
    XavierUniform {
        /// Scaling factor (default 1).
        #[serde(default = "one")]
        gain: f64,
    },
    /// Glorot normal (`nn.init.xavier_normal_`).
    XavierNormal {
        /// Scaling factor (default 1).
        #[serde(default = "one")]
        gain: f64,
    },
    /// He uniform (`nn.init.kaiming_uniform_`).
    KaimingUniform {
        /// Negative slope of the rectifier that follows (only used with
        /// [`Nonlinearity::LeakyRelu`]; default 0).
        #[serde(default)]
        a: f64,
        /// Which fan to preserve (default [`FanMode::FanIn`]).
        #[serde(default)]
        mode: FanMode,
        /// The non-linearity that follows (default [`Nonlinearity::LeakyRelu`], as in PyTorch).
        #[serde(default)]
        nonlinearity: Nonlinearity,
    },
    /// He normal (`nn.init.kaiming_normal_`).
    KaimingNormal {
        /// Negative slope of the rectifier that follows (only used with
        /// [`Nonlinearity::LeakyRelu`]; default 0).
        #[serde(default)]
        a: f64,
        /// Which fan to preserve (default [`FanMode::FanIn`]).
        #[serde(default)]
        mode: FanMode,
        /// The non-linearity that follows (default [`Nonlinearity::LeakyRelu`], as in PyTorch).
        #[serde(default)]
        nonlinearity: Nonlinearity,
    },
}

fn one() -> f64 {
    1.0
}

/// Which fan [`Init::KaimingUniform`] and [`Init::KaimingNormal`] preserve.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FanMode {
    /// Preserve the variance of activations in the forward pass (the default).
    #[default]
    FanIn,
    /// Preserve the variance of gradients in the backward pass.
    FanOut,
}

/// A non-linearity, for [`Nonlinearity::gain`] (`torch.nn.init.calculate_gain`).
///
/// Serialized with PyTorch's names: `"linear"`, `"conv2d"`,
/// `"conv_transpose2d"`, `"sigmoid"`, `"tanh"`, `"relu"`, `"leaky_relu"`, `"selu"`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Nonlinearity {
    /// Identity (gain 1).
    Linear,
    /// 1-d convolution (gain 1).
    Conv1d,
    /// 2-d convolution (gain 1).
    Conv2d,
    /// 3-d convolution (gain 1).
    Conv3d,
    /// 1-d transposed convolution (gain 1).
    ConvTranspose1d,
    /// 2-d transposed convolution (gain 1).
    ConvTranspose2d,
    /// 3-d transposed convolution (gain 1).
    ConvTranspose3d,
    /// Logistic sigmoid (gain 1).
    Sigmoid,
    /// Hyperbolic tangent (gain 5/3).
    Tanh,
    /// Rectifier (gain sqrt(2)).
    Relu,
    /// Leaky rectifier (gain sqrt(2 / (1 + slope^2)); PyTorch's default for Kaiming).
    #[default]
    LeakyRelu,
    /// Scaled exponential linear unit (gain 3/4).
    Selu,
}

impl Nonlinearity {
    /// The recommended gain, as `torch.nn.init.calculate_gain(self, param)`.
    ///
    /// `param` is the negative slope for [`Nonlinearity::LeakyRelu`]
    /// (`None` means PyTorch's 0.01) and ignored otherwise.
    ///
    /// ```
    /// use kiln_core::model::Nonlinearity;
    ///
    /// assert_eq!(Nonlinearity::Tanh.gain(None), 5.0 / 3.0);
    /// assert_eq!(Nonlinearity::LeakyRelu.gain(Some(0.0)), 2f64.sqrt());
    /// ```
    pub fn gain(self, param: Option<f64>) -> f64 {
        match self {
            Nonlinearity::Linear
            | Nonlinearity::Conv1d
            | Nonlinearity::Conv2d
            | Nonlinearity::Conv3d
            | Nonlinearity::ConvTranspose1d
            | Nonlinearity::ConvTranspose2d
            | Nonlinearity::ConvTranspose3d
            | Nonlinearity::Sigmoid => 1.0,
            Nonlinearity::Tanh => 5.0 / 3.0,
            Nonlinearity::Relu => 2f64.sqrt(),
            Nonlinearity::LeakyRelu => {
                let slope = param.unwrap_or(0.01);
                (2.0 / (1.0 + slope * slope)).sqrt()
            }
            Nonlinearity::Selu => 3.0 / 4.0,
        }
    }
}

/// A concrete distribution to draw a parameter's initial values from.
///
/// Backends sample it with their own generator; [`Init::resolve`] and
/// [`Layer::parameter_specs`](crate::model::Layer::parameter_specs) produce it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum InitDistribution {
    /// Every element equal to the value.
    Constant {
        /// The value.
        value: f64,
    },
    /// Uniform on `[low, high)`.
    Uniform {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
    },
    /// Normal with `mean` and standard deviation `std`.
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
}

/// `(fan_in, fan_out)` of a weight of `shape`, as
/// `torch.nn.init._calculate_fan_in_and_fan_out`: dimension 1 times the
/// receptive field (the product of dimensions 2..), and dimension 0 times it.
///
/// Fails for fewer than two dimensions.
///
/// ```
/// // a Conv2d(3, 16, 5) weight
/// assert_eq!(kiln_core::model::fan_in_and_fan_out(&[16, 3, 5, 5])?, (75, 400));
/// assert!(kiln_core::model::fan_in_and_fan_out(&[16]).is_err());
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn fan_in_and_fan_out(shape: &[usize]) -> Result<(usize, usize)> {
    let [fan_out_maps, fan_in_maps, rest @ ..] = shape else {
        return Err(Error::invalid_argument(
            "shape",
            format!(
                "fan in and fan out cannot be computed for a tensor with fewer than 2 \
                 dimensions, got shape {shape:?}"
            ),
        ));
    };
    let overflow = || {
        Error::invalid_argument(
            "shape",
            format!("the fan of shape {shape:?} overflows usize"),
        )
    };
    let receptive: usize = rest
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)?;
    let fan_in = fan_in_maps.checked_mul(receptive).ok_or_else(overflow)?;
    let fan_out = fan_out_maps.checked_mul(receptive).ok_or_else(overflow)?;
    Ok((fan_in, fan_out))
}

/// Converts a fan to `f64` after checking it is non-zero.
fn nonzero_fan(fan: usize, what: &str, shape: &[usize]) -> Result<f64> {
    if fan == 0 {
        return Err(Error::invalid_argument(
            "shape",
            format!("{what} of shape {shape:?} is 0; cannot scale an initialiser by it"),
        ));
    }
    // Fans of real tensors are far below 2^53, so the conversion is exact.
    Ok(fan as f64)
}

impl Init {
    /// `Init::KaimingUniform` with PyTorch's defaults except the non-linearity.
    pub fn kaiming_uniform(nonlinearity: Nonlinearity) -> Self {
        Init::KaimingUniform {
            a: 0.0,
            mode: FanMode::FanIn,
            nonlinearity,
        }
    }

    /// `Init::KaimingNormal` with PyTorch's defaults except the non-linearity.
    pub fn kaiming_normal(nonlinearity: Nonlinearity) -> Self {
        Init::KaimingNormal {
            a: 0.0,
            mode: FanMode::FanIn,
            nonlinearity,
        }
    }

    /// PyTorch's default for `Linear` and convolution weights:
    /// `kaiming_uniform_(w, a=sqrt(5))`, i.e. `U(-1/sqrt(fan_in), 1/sqrt(fan_in))`.
    pub fn torch_default_weight() -> Self {
        Init::KaimingUniform {
            a: 5f64.sqrt(),
            mode: FanMode::FanIn,
            nonlinearity: Nonlinearity::LeakyRelu,
        }
    }

    /// The distribution for a tensor of `shape`.
    ///
    /// Fan-based initialisers fail for tensors of fewer than two dimensions or
    /// with a zero fan; every initialiser fails for non-finite or negative
    /// scale parameters (`std`, `gain`) and for `low > high`.
    pub fn resolve(&self, shape: &[usize]) -> Result<InitDistribution> {
        self.check()?;
        let dist = match *self {
            Init::Zeros => InitDistribution::Constant { value: 0.0 },
            Init::Ones => InitDistribution::Constant { value: 1.0 },
            Init::Constant { value } => InitDistribution::Constant { value },
            Init::Uniform { low, high } => InitDistribution::Uniform { low, high },
            Init::Normal { mean, std } => InitDistribution::Normal { mean, std },
            Init::XavierUniform { gain } => {
                let std = xavier_std(gain, shape)?;
                let a = 3f64.sqrt() * std;
                InitDistribution::Uniform { low: -a, high: a }
            }
            Init::XavierNormal { gain } => InitDistribution::Normal {
                mean: 0.0,
                std: xavier_std(gain, shape)?,
            },
            Init::KaimingUniform {
                a,
                mode,
                nonlinearity,
            } => {
                let std = kaiming_std(a, mode, nonlinearity, shape)?;
                let bound = 3f64.sqrt() * std;
                InitDistribution::Uniform {
                    low: -bound,
                    high: bound,
                }
            }
            Init::KaimingNormal {
                a,
                mode,
                nonlinearity,
            } => InitDistribution::Normal {
                mean: 0.0,
                std: kaiming_std(a, mode, nonlinearity, shape)?,
            },
        };
        Ok(dist)
    }

    /// Rejects parameters no tensor could be initialised with.
    fn check(&self) -> Result<()> {
        let finite = |name: &str, v: f64| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(Error::invalid_argument(
                    format!("init.{name}"),
                    format!("must be finite, got {v}"),
                ))
            }
        };
        let non_negative = |name: &str, v: f64| {
            finite(name, v)?;
            if v < 0.0 {
                return Err(Error::invalid_argument(
                    format!("init.{name}"),
                    format!("must be >= 0, got {v}"),
                ));
            }
            Ok(())
        };
        match *self {
            Init::Zeros | Init::Ones => Ok(()),
            Init::Constant { value } => finite("value", value),
            Init::Uniform { low, high } => {
                finite("low", low)?;
                finite("high", high)?;
                if low > high {
                    return Err(Error::invalid_argument(
                        "init.low",
                        format!("must not exceed high ({high}), got {low}"),
                    ));
                }
                Ok(())
            }
            Init::Normal { mean, std } => {
                finite("mean", mean)?;
                non_negative("std", std)
            }
            Init::XavierUniform { gain } | Init::XavierNormal { gain } => {
                non_negative("gain", gain)
            }
            Init::KaimingUniform { a, .. } | Init::KaimingNormal { a, .. } => finite("a", a),
        }
    }
}

/// `gain * sqrt(2 / (fan_in + fan_out))`, as `xavier_uniform_` and `xavier_normal_`.
fn xavier_std(gain: f64, shape: &[usize]) -> Result<f64> {
    let (fan_in, fan_out) = fan_in_and_fan_out(shape)?;
    let sum = fan_in.saturating_add(fan_out);
    let sum = nonzero_fan(sum, "fan_in + fan_out", shape)?;
    Ok(gain * (2.0 / sum).sqrt())
}

/// `calculate_gain(nonlinearity, a) / sqrt(fan)`, as `kaiming_uniform_` and `kaiming_normal_`.
fn kaiming_std(a: f64, mode: FanMode, nonlinearity: Nonlinearity, shape: &[usize]) -> Result<f64> {
    let (fan_in, fan_out) = fan_in_and_fan_out(shape)?;
    let fan = match mode {
        FanMode::FanIn => nonzero_fan(fan_in, "fan_in", shape)?,
        FanMode::FanOut => nonzero_fan(fan_out, "fan_out", shape)?,
    };
    Ok(nonlinearity.gain(Some(a)) / fan.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uniform_bound(d: InitDistribution) -> f64 {
        match d {
            InitDistribution::Uniform { low, high } => {
                assert_eq!(low, -high);
                high
            }
            other => panic!("expected a uniform distribution, got {other:?}"),
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-15 * a.abs().max(b.abs())
    }

    #[test]
    fn fans_follow_torch() -> Result<()> {
        assert_eq!(fan_in_and_fan_out(&[10, 4])?, (4, 10));
        assert_eq!(fan_in_and_fan_out(&[16, 3, 5, 5])?, (75, 400));
        // ConvTranspose2d(8, 4, 3) weight is [in, out, k, k]: fan_in uses dim 1.
        assert_eq!(fan_in_and_fan_out(&[8, 4, 3, 3])?, (36, 72));
        assert_eq!(fan_in_and_fan_out(&[6, 2, 7])?, (14, 42));
        let err = fan_in_and_fan_out(&[5]).expect_err("1-d");
        assert!(err.to_string().contains("fewer than 2 dimensions"), "{err}");
        assert!(fan_in_and_fan_out(&[]).is_err());
        assert!(fan_in_and_fan_out(&[usize::MAX, 2, 2]).is_err());
        Ok(())
    }

    #[test]
    fn gains_follow_calculate_gain() {
        assert_eq!(Nonlinearity::Linear.gain(None), 1.0);
        assert_eq!(Nonlinearity::Conv2d.gain(None), 1.0);
        assert_eq!(Nonlinearity::ConvTranspose3d.gain(None), 1.0);
        assert_eq!(Nonlinearity::Sigmoid.gain(None), 1.0);
        assert_eq!(Nonlinearity::Tanh.gain(None), 5.0 / 3.0);
        assert_eq!(Nonlinearity::Relu.gain(None), 2f64.sqrt());
        assert_eq!(Nonlinearity::Selu.gain(None), 0.75);
        assert_eq!(
            Nonlinearity::LeakyRelu.gain(None),
            (2.0 / (1.0 + 0.01f64 * 0.01)).sqrt()
        );
        assert_eq!(
            Nonlinearity::LeakyRelu.gain(Some(0.2)),
            (2.0 / 1.04f64).sqrt()
        );
        // The ignored parameter does not change other gains.
        assert_eq!(Nonlinearity::Relu.gain(Some(0.3)), 2f64.sqrt());
    }

    #[test]
    fn torch_default_weight_is_one_over_sqrt_fan_in() -> Result<()> {
        for shape in [&[10usize, 4][..], &[16, 3, 5, 5], &[8, 4, 3, 3]] {
            let (fan_in, _) = fan_in_and_fan_out(shape)?;
            let bound = uniform_bound(Init::torch_default_weight().resolve(shape)?);
            assert!(
                close(bound, 1.0 / (fan_in as f64).sqrt()),
                "{shape:?}: {bound}"
            );
        }
        Ok(())
    }

    #[test]
    fn hand_derived_bounds() -> Result<()> {
        // xavier_uniform on [20, 30]: sqrt(3) * sqrt(2 / 50) = sqrt(6 / 50)
        let b = uniform_bound(Init::XavierUniform { gain: 1.0 }.resolve(&[20, 30])?);
        assert!(close(b, (6.0f64 / 50.0).sqrt()), "{b}");
        // xavier_normal with gain 2 on [4, 6, 3]: fans 18 and 12
        let d = Init::XavierNormal { gain: 2.0 }.resolve(&[4, 6, 3])?;
        let InitDistribution::Normal { mean, std } = d else {
            panic!("{d:?}")
        };
        assert_eq!(mean, 0.0);
        assert!(close(std, 2.0 * (2.0f64 / 30.0).sqrt()), "{std}");
        // kaiming_normal fan_out relu on a [32, 16, 3, 3] conv weight: fan_out 288
        let d = Init::KaimingNormal {
            a: 0.0,
            mode: FanMode::FanOut,
            nonlinearity: Nonlinearity::Relu,
        }
        .resolve(&[32, 16, 3, 3])?;
        let InitDistribution::Normal { std, .. } = d else {
            panic!("{d:?}")
        };
        assert!(close(std, (2.0f64 / 288.0).sqrt()), "{std}");
        // kaiming_uniform leaky_relu a=0.2 fan_in on [5, 7]
        let b = uniform_bound(
            Init::KaimingUniform {
                a: 0.2,
                mode: FanMode::FanIn,
                nonlinearity: Nonlinearity::LeakyRelu,
            }
            .resolve(&[5, 7])?,
        );
        assert!(close(b, (3.0f64 * 2.0 / 1.04 / 7.0).sqrt()), "{b}");
        Ok(())
    }

    #[test]
    fn simple_inits_ignore_shape() -> Result<()> {
        assert_eq!(
            Init::Zeros.resolve(&[3])?,
            InitDistribution::Constant { value: 0.0 }
        );
        assert_eq!(
            Init::Ones.resolve(&[])?,
            InitDistribution::Constant { value: 1.0 }
        );
        assert_eq!(
            Init::Constant { value: 0.5 }.resolve(&[2, 2])?,
            InitDistribution::Constant { value: 0.5 }
        );
        assert_eq!(
            Init::Uniform {
                low: -1.0,
                high: 2.0
            }
            .resolve(&[7])?,
            InitDistribution::Uniform {
                low: -1.0,
                high: 2.0
            }
        );
        assert_eq!(
            Init::Normal {
                mean: 1.0,
                std: 0.02
            }
            .resolve(&[7])?,
            InitDistribution::Normal {
                mean: 1.0,
                std: 0.02
            }
        );
        Ok(())
    }

    #[test]
    fn bad_inits_are_rejected() {
        let err = Init::XavierUniform { gain: 1.0 }
            .resolve(&[8])
            .expect_err("1-d");
        assert!(matches!(err, Error::InvalidArgument { .. }));
        let err = Init::kaiming_uniform(Nonlinearity::Relu)
            .resolve(&[8, 0])
            .expect_err("zero fan");
        assert!(
            err.to_string().contains("fan_in of shape [8, 0] is 0"),
            "{err}"
        );
        let err = Init::Normal {
            mean: 0.0,
            std: -1.0,
        }
        .resolve(&[2])
        .expect_err("negative std");
        assert_eq!(
            err.to_string(),
            "invalid argument `init.std`: must be >= 0, got -1"
        );
        let err = Init::Uniform {
            low: 1.0,
            high: 0.0,
        }
        .resolve(&[2])
        .expect_err("low > high");
        assert!(err.to_string().contains("init.low"), "{err}");
        assert!(Init::Constant { value: f64::NAN }.resolve(&[1]).is_err());
    }

    #[test]
    fn serde_uses_torch_names_and_defaults() -> Result<()> {
        let init: Init = serde_json::from_str(r#"{"type": "kaiming_normal", "mode": "fan_out"}"#)
            .map_err(|e| Error::invalid_argument("json", e.to_string()))?;
        assert_eq!(
            init,
            Init::KaimingNormal {
                a: 0.0,
                mode: FanMode::FanOut,
                nonlinearity: Nonlinearity::LeakyRelu
            }
        );
        let json = serde_json::to_string(&Init::kaiming_uniform(Nonlinearity::ConvTranspose2d))
            .map_err(|e| Error::invalid_argument("json", e.to_string()))?;
        assert_eq!(
            json,
            r#"{"type":"kaiming_uniform","a":0.0,"mode":"fan_in","nonlinearity":"conv_transpose2d"}"#
        );
        let init: Init = serde_json::from_str(r#"{"type": "uniform", "high": 3}"#)
            .map_err(|e| Error::invalid_argument("json", e.to_string()))?;
        assert_eq!(
            init,
            Init::Uniform {
                low: 0.0,
                high: 3.0
            }
        );
        Ok(())
    }
}
