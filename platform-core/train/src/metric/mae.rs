//! Mean absolute error.

use super::{no_samples, Metric};
use kiln_core::dtype::DType;
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// The mean of `|output - target|` over every element seen, as
/// scikit-learn's `mean_absolute_error` (whose default averaging over the
/// columns of a 2-D target gives the same mean).
///
/// `output` and `target` must have the same shape and the same float dtype.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_train::{MeanAbsoluteError, Metric};
///
/// let mut mae = MeanAbsoluteError::new();
/// mae.update(
///     &HostTensor::new(vec![1.0f32, 2.0, 4.0], [3])?,
///     &HostTensor::new(vec![1.5f32, 2.0, 1.0], [3])?,
/// )?;
/// assert_eq!(mae.compute()?, (0.5 + 0.0 + 3.0) / 3.0);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct MeanAbsoluteError {
    sum: f64,
    count: u64,
}

impl MeanAbsoluteError {
    /// An empty metric, logged as `"mae"`.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Metric for MeanAbsoluteError {
    fn name(&self) -> &str {
        "mae"
    }

    fn update(&mut self, output: &HostTensor, target: &HostTensor) -> Result<()> {
        if !output.dtype().is_float() {
            return Err(Error::DTypeMismatch {
                context: format!(
                    "mae: predictions of shape {} (targets {} of shape {})",
                    output.shape(),
                    target.dtype(),
                    target.shape()
                ),
                expected: DType::F32,
                actual: output.dtype(),
            });
        }
        if target.dtype() != output.dtype() {
            return Err(Error::DTypeMismatch {
                context: format!(
                    "mae: targets of shape {} for predictions {} of shape {}",
                    target.shape(),
                    output.dtype(),
                    output.shape()
                ),
                expected: output.dtype(),
                actual: target.dtype(),
            });
        }
        if target.shape() != output.shape() {
            return Err(Error::ShapeMismatch {
                context: format!("mae: targets for predictions of shape {}", output.shape()),
                expected: output.shape().to_string(),
                actual: target.shape().to_string(),
            });
        }
        let sum: f64 = output
            .to_f64_vec()
            .iter()
            .zip(target.to_f64_vec())
            .map(|(o, t)| (o - t).abs())
            .sum();
        self.sum += sum;
        self.count += output.numel() as u64;
        Ok(())
    }

    fn compute(&self) -> Result<f64> {
        if self.count == 0 {
            return Err(no_samples("mae"));
        }
        Ok(self.sum / self.count as f64)
    }

    fn reset(&mut self) {
        *self = Self::default();
    }

    fn state(&self) -> Option<Vec<f64>> {
        Some(vec![self.sum, self.count as f64])
    }

    fn load_state(&mut self, state: &[f64]) -> Result<()> {
        let (sum, count) = super::pair("mae", state)?;
        (self.sum, self.count) = (sum, count as u64);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_shapes_and_dtypes() -> Result<()> {
        let mut m = MeanAbsoluteError::new();
        let a = HostTensor::new(vec![1.0f32, 2.0], [2])?;
        let err = m
            .update(&a, &a.to_dtype(DType::F64))
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("mae: targets of shape [2] for predictions float32 of shape [2]: expected dtype float32, got float64")
        );
        let err = m
            .update(&a, &a.clone().reshape([2, 1])?)
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("mae: targets for predictions of shape [2]: expected shape [2], got [2, 1]")
        );
        let ints = a.to_dtype(DType::I64);
        assert!(matches!(
            m.update(&ints, &ints),
            Err(Error::DTypeMismatch {
                actual: DType::I64,
                ..
            })
        ));
        assert!(m.compute().is_err());
        Ok(())
    }
}
