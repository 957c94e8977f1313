//! `Linear`: `y = x W^T + b` on the last dimension.

use serde::{Deserialize, Serialize};

use super::builder::config_builder;
use super::defaults::yes;
use super::{FieldCheck, LayerSpec, Params, ShapeCheck};
use crate::error::Result;
use crate::model::init::Init;

/// `nn.Linear(in_features, out_features, bias)`: `y = x W^T + b` on the last dimension.
///
/// ```
/// use kiln_core::model::{Init, Layer, LinearConfig};
///
/// let layer: Layer = LinearConfig::new(64, 10)
///     .with_bias(false)
///     .with_weight_init(Init::XavierUniform { gain: 1.0 })
///     .into();
/// assert_eq!(layer.output_shape(&[32, 64])?, vec![32, 10]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinearConfig {
    /// Size of the input's last dimension.
    pub in_features: usize,
    /// Size of the output's last dimension.
    pub out_features: usize,
    /// Whether to add a learnable bias (default `true`).
    #[serde(default = "yes")]
    pub bias: bool,
    /// Initialiser of `weight`; `None` is PyTorch's default, `U(-1/sqrt(in), 1/sqrt(in))`.
    #[serde(default)]
    pub weight_init: Option<Init>,
    /// Initialiser of `bias`; `None` is PyTorch's default, `U(-1/sqrt(in), 1/sqrt(in))`.
    #[serde(default)]
    pub bias_init: Option<Init>,
}

config_builder! {
    LinearConfig {
        /// A linear layer with bias and PyTorch's default initialisation.
        new(in_features: usize, out_features: usize) {
            in_features,
            out_features,
            bias: true,
            weight_init: None,
            bias_init: None,
        }
        /// Sets whether the layer has a bias.
        with_bias(bias: bool);
        /// Sets the initialiser of `weight`.
        with_weight_init(weight_init: Some(Init));
        /// Sets the initialiser of `bias`.
        with_bias_init(bias_init: Some(Init));
    }
}

impl LayerSpec for LinearConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        check.positive("in_features", self.in_features)?;
        check.positive("out_features", self.out_features)
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        match input.split_last() {
            Some((&last, rest)) if last == self.in_features => {
                let mut out = rest.to_vec();
                out.push(self.out_features);
                Ok(out)
            }
            _ => Err(at.mismatch(format!("[*, {}]", self.in_features))),
        }
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        params.weight_and_bias(
            vec![self.out_features, self.in_features],
            self.bias.then_some(self.out_features),
            self.weight_init.as_ref(),
            self.bias_init.as_ref(),
        )
    }
}
