//! Per-class counts shared by [`Precision`](super::Precision),
//! [`Recall`](super::Recall) and [`F1`](super::F1).

use super::{class_batch, no_samples};
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// True positives, false positives and false negatives per class.
#[derive(Clone, Debug, Default)]
pub(super) struct ClassCounts {
    tp: Vec<u64>,
    fp: Vec<u64>,
    fn_: Vec<u64>,
}

/// One class's counts.
#[derive(Clone, Copy, Debug)]
pub(super) struct Counts {
    pub(super) tp: u64,
    pub(super) fp: u64,
    pub(super) fn_: u64,
}

/// `num / den`, or 0 when `den` is 0 (scikit-learn's `zero_division=0`).
pub(super) fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

impl ClassCounts {
    /// Adds one batch of argmax predictions; the number of classes is fixed
    /// by the first batch.
    pub(super) fn update(
        &mut self,
        metric: &str,
        output: &HostTensor,
        target: &HostTensor,
    ) -> Result<()> {
        let batch = class_batch(metric, output, target)?;
        if self.tp.is_empty() {
            self.tp = vec![0; batch.classes];
            self.fp = vec![0; batch.classes];
            self.fn_ = vec![0; batch.classes];
        } else if self.tp.len() != batch.classes {
            return Err(Error::ShapeMismatch {
                context: format!(
                    "{metric}: logits (earlier batches had {} classes)",
                    self.tp.len()
                ),
                expected: format!("[N, {}]", self.tp.len()),
                actual: output.shape().to_string(),
            });
        }
        for i in 0..batch.rows() {
            let (p, t) = (batch.argmax(i), batch.target(i));
            if p == t {
                self.tp[t] += 1;
            } else {
                self.fp[p] += 1;
                self.fn_[t] += 1;
            }
        }
        Ok(())
    }

    /// The macro average of `score` over the classes that occur among the
    /// targets or the predictions (scikit-learn's default label set).
    pub(super) fn macro_average(&self, metric: &str, score: impl Fn(Counts) -> f64) -> Result<f64> {
        let mut sum = 0.0;
        let mut labels = 0usize;
        for c in 0..self.tp.len() {
            let counts = Counts {
                tp: self.tp[c],
                fp: self.fp[c],
                fn_: self.fn_[c],
            };
            if counts.tp + counts.fp + counts.fn_ > 0 {
                sum += score(counts);
                labels += 1;
            }
        }
        if labels == 0 {
            return Err(no_samples(metric));
        }
        Ok(sum / labels as f64)
    }

    /// `tp`, `fp` and `fn` per class, concatenated (empty before any batch).
    pub(super) fn state(&self) -> Vec<f64> {
        self.tp
            .iter()
            .chain(&self.fp)
            .chain(&self.fn_)
            .map(|&c| c as f64)
            .collect()
    }

    /// The counts from a [`state`](Self::state) (or a sum of them).
    pub(super) fn load_state(&mut self, metric: &str, state: &[f64]) -> Result<()> {
        if !state.len().is_multiple_of(3) {
            return Err(super::bad_state(metric, "3 counts per class", state.len()));
        }
        let classes = state.len() / 3;
        let counts = |part: usize| -> Vec<u64> {
            state[part * classes..(part + 1) * classes]
                .iter()
                .map(|&c| c as u64)
                .collect()
        };
        (self.tp, self.fp, self.fn_) = (counts(0), counts(1), counts(2));
        Ok(())
    }

    /// Forgets all counts, including the number of classes.
    pub(super) fn reset(&mut self) {
        *self = Self::default();
    }
}
