//! Activations: `Relu`, `LeakyRelu`, `Gelu`, `Silu`, `Tanh`, `Sigmoid` (all
//! element-wise) and `Softmax`, `LogSoftmax` (along a dimension).

use serde::{Deserialize, Serialize};

use super::structure::normalize_dim;
use super::{FieldCheck, LayerSpec, ShapeCheck};
use crate::error::Result;

/// Which formula [`Layer::Gelu`](crate::model::Layer::Gelu) uses (PyTorch's `approximate`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GeluApproximation {
    /// The exact `x * Phi(x)` (`approximate="none"`, the default).
    #[default]
    None,
    /// The tanh approximation (`approximate="tanh"`).
    Tanh,
}

/// An element-wise activation without fields to check: `Relu`, `Gelu`,
/// `Silu`, `Tanh`, `Sigmoid`.
pub(crate) struct Elementwise;

impl LayerSpec for Elementwise {
    fn output_shape(&self, input: &[usize], _at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        Ok(input.to_vec())
    }
}

/// [`Layer::LeakyRelu`](crate::model::Layer::LeakyRelu)'s `negative_slope`.
pub(crate) struct LeakyRelu(pub(crate) f64);

impl LayerSpec for LeakyRelu {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        let negative_slope = self.0;
        if negative_slope.is_finite() {
            Ok(())
        } else {
            Err(check.invalid(
                "negative_slope",
                format!("must be finite, got {negative_slope}"),
            ))
        }
    }

    fn output_shape(&self, input: &[usize], _at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        Ok(input.to_vec())
    }
}

/// [`Layer::Scale`](crate::model::Layer::Scale)'s `factor`.
pub(crate) struct Scale(pub(crate) f64);

impl LayerSpec for Scale {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        let factor = self.0;
        if factor.is_finite() {
            Ok(())
        } else {
            Err(check.invalid("factor", format!("must be finite, got {factor}")))
        }
    }

    fn output_shape(&self, input: &[usize], _at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        Ok(input.to_vec())
    }
}

/// [`Layer::Softmax`](crate::model::Layer::Softmax)'s or
/// [`Layer::LogSoftmax`](crate::model::Layer::LogSoftmax)'s `dim`.
pub(crate) struct Softmax(pub(crate) isize);

impl LayerSpec for Softmax {
    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let dim = self.0;
        // Like torch.softmax, a scalar accepts dim 0 and -1.
        match normalize_dim(dim, input.len().max(1)) {
            Some(_) => Ok(input.to_vec()),
            None => Err(at.mismatch(format!("a tensor with dimension {dim}"))),
        }
    }
}
