//! Macro-averaged F1 score.

use super::confusion::{ratio, ClassCounts};
use super::Metric;
use kiln_core::error::Result;
use kiln_core::tensor::HostTensor;

/// Macro-averaged F1 score of the argmax predictions, as scikit-learn's
/// `precision_recall_fscore_support(average="macro", zero_division=0)`.
///
/// A class's F1 score is `2 tp / (2 tp + fp + fn)`: the harmonic mean of its
/// precision and recall. The reported value is the unweighted mean over the
/// classes that occur among the targets or the predictions (scikit-learn's
/// default label set); a class whose denominator is 0 scores 0. The number of
/// classes `C` is fixed by the first batch.
#[derive(Clone, Debug, Default)]
pub struct F1 {
    counts: ClassCounts,
}

impl F1 {
    /// An empty metric, logged as `"f1"`.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Metric for F1 {
    fn name(&self) -> &str {
        "f1"
    }

    fn update(&mut self, output: &HostTensor, target: &HostTensor) -> Result<()> {
        self.counts.update("f1", output, target)
    }

    fn compute(&self) -> Result<f64> {
        self.counts
            .macro_average("f1", |c| ratio(2 * c.tp, 2 * c.tp + c.fp + c.fn_))
    }

    fn reset(&mut self) {
        self.counts.reset();
    }

    fn state(&self) -> Option<Vec<f64>> {
        Some(self.counts.state())
    }

    fn load_state(&mut self, state: &[f64]) -> Result<()> {
        self.counts.load_state("f1", state)
    }
}
