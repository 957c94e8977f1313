//! The running mean of a loss.

use super::{no_samples, Metric};
use kiln_core::dtype::DType;
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// The mean of per-batch losses, weighted by batch size: the mean loss per
/// sample over every batch seen.
///
/// The trainer feeds it with [`LossMetric::update_value`] from the loss it
/// already has; [`Metric::update`] takes the loss as a one-element tensor.
///
/// ```
/// use kiln_train::{LossMetric, Metric};
///
/// let mut loss = LossMetric::new("val_loss");
/// loss.update_value(2.0, 3);
/// loss.update_value(1.0, 1);
/// assert_eq!(loss.name(), "val_loss");
/// assert_eq!(loss.compute()?, 7.0 / 4.0);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct LossMetric {
    name: String,
    sum: f64,
    samples: u64,
}

impl Default for LossMetric {
    /// An empty running mean named `"loss"`.
    fn default() -> Self {
        Self::new("loss")
    }
}

impl LossMetric {
    /// An empty running mean, logged as `name` (`"loss"`, `"val_loss"`, ...).
    pub fn new(name: impl Into<String>) -> Self {
        LossMetric {
            name: name.into(),
            sum: 0.0,
            samples: 0,
        }
    }

    /// Adds one batch whose mean loss is `loss` over `batch_size` samples.
    ///
    /// A batch of size 0 is ignored. A NaN or infinite loss is kept, so that
    /// the reported value shows it.
    pub fn update_value(&mut self, loss: f64, batch_size: usize) {
        if batch_size == 0 {
            return;
        }
        let n = batch_size as u64;
        self.sum += loss * n as f64;
        self.samples += n;
    }

    /// Number of samples seen since the last reset.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// The sum of the per-sample losses seen (the mean times [`samples`](Self::samples)).
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// A running mean named `name` that has already seen `samples` samples
    /// whose losses add up to `sum` (as a checkpoint records it mid-epoch).
    pub fn with_parts(name: impl Into<String>, sum: f64, samples: u64) -> Self {
        LossMetric {
            name: name.into(),
            sum,
            samples,
        }
    }
}

impl Metric for LossMetric {
    fn name(&self) -> &str {
        &self.name
    }

    /// `output` is the batch's mean loss as a one-element float tensor (of any
    /// shape); the batch size is the first dimension of `target` (1 for a
    /// scalar target).
    fn update(&mut self, output: &HostTensor, target: &HostTensor) -> Result<()> {
        if !output.dtype().is_float() {
            return Err(Error::DTypeMismatch {
                context: format!(
                    "{}: batch loss of shape {} (targets {} of shape {})",
                    self.name,
                    output.shape(),
                    target.dtype(),
                    target.shape()
                ),
                expected: DType::F32,
                actual: output.dtype(),
            });
        }
        let loss = match output.to_f64_vec().as_slice() {
            &[loss] => loss,
            _ => {
                return Err(Error::ShapeMismatch {
                    context: format!(
                        "{}: batch loss (targets of shape {})",
                        self.name,
                        target.shape()
                    ),
                    expected: "with exactly 1 element".into(),
                    actual: output.shape().to_string(),
                })
            }
        };
        self.update_value(loss, target.dims().first().copied().unwrap_or(1));
        Ok(())
    }

    fn compute(&self) -> Result<f64> {
        if self.samples == 0 {
            return Err(no_samples(&self.name));
        }
        Ok(self.sum / self.samples as f64)
    }

    fn reset(&mut self) {
        self.sum = 0.0;
        self.samples = 0;
    }

    fn state(&self) -> Option<Vec<f64>> {
        Some(vec![self.sum, self.samples as f64])
    }

    fn load_state(&mut self, state: &[f64]) -> Result<()> {
        let (sum, samples) = super::pair(&self.name, state)?;
        (self.sum, self.samples) = (sum, samples as u64);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_batches_by_size() -> Result<()> {
        let mut m = LossMetric::default();
        assert_eq!(m.name(), "loss");
        assert!(m.compute().is_err());
        m.update(
            &HostTensor::scalar(0.5f32),
            &HostTensor::zeros(DType::I64, [4])?,
        )?;
        m.update(
            &HostTensor::new(vec![2.0f64], [1])?,
            &HostTensor::scalar(1i64),
        )?;
        m.update_value(9.0, 0);
        assert_eq!(m.samples(), 5);
        assert_eq!(m.compute()?, (0.5 * 4.0 + 2.0) / 5.0);

        let err = m
            .update(
                &HostTensor::new(vec![1.0f32, 2.0], [2])?,
                &HostTensor::scalar(0i64),
            )
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("loss: batch loss (targets of shape []): expected shape with exactly 1 element, got [2]")
        );
        assert!(m
            .update(&HostTensor::scalar(1i64), &HostTensor::scalar(0i64))
            .is_err());
        assert_eq!(m.samples(), 5);
        m.reset();
        assert_eq!(m.samples(), 0);
        assert!(m.compute().is_err());
        Ok(())
    }
}
