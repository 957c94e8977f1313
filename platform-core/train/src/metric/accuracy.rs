//! Top-1 accuracy.

use super::{class_batch, no_samples, Metric};
use kiln_core::error::Result;
use kiln_core::tensor::HostTensor;

/// The fraction of samples whose largest logit is at the target class
/// (scikit-learn's `accuracy_score` of the argmax predictions).
///
/// Logits `[N, C]` of a float dtype, targets `[N]` of `int64`; see
/// [`Metric`] for an example.
#[derive(Clone, Debug, Default)]
pub struct Accuracy {
    correct: u64,
    total: u64,
}

impl Accuracy {
    /// An empty accuracy, logged as `"accuracy"`.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Metric for Accuracy {
    fn name(&self) -> &str {
        "accuracy"
    }

    fn update(&mut self, output: &HostTensor, target: &HostTensor) -> Result<()> {
        let batch = class_batch("accuracy", output, target)?;
        let correct = (0..batch.rows())
            .filter(|&i| batch.argmax(i) == batch.target(i))
            .count();
        self.correct += correct as u64;
        self.total += batch.rows() as u64;
        Ok(())
    }

    fn compute(&self) -> Result<f64> {
        if self.total == 0 {
            return Err(no_samples("accuracy"));
        }
        Ok(self.correct as f64 / self.total as f64)
    }

    fn reset(&mut self) {
        *self = Self::default();
    }

    fn state(&self) -> Option<Vec<f64>> {
        Some(vec![self.correct as f64, self.total as f64])
    }

    fn load_state(&mut self, state: &[f64]) -> Result<()> {
        let (correct, total) = super::pair("accuracy", state)?;
        (self.correct, self.total) = (correct as u64, total as u64);
        Ok(())
    }
}
