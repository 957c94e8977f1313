//! `Dropout`: zeroes elements with probability `p` in training.

use super::{FieldCheck, LayerSpec, ShapeCheck};
use crate::error::Result;

/// [`Layer::Dropout`](crate::model::Layer::Dropout)'s `p`.
pub(crate) struct Dropout(pub(crate) f64);

impl LayerSpec for Dropout {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        check.probability("p", self.0)
    }

    fn output_shape(&self, input: &[usize], _at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        Ok(input.to_vec())
    }
}
