//! Macro-averaged recall.

use super::confusion::{ratio, ClassCounts};
use super::Metric;
use kiln_core::error::Result;
use kiln_core::tensor::HostTensor;

/// Macro-averaged recall of the argmax predictions, as scikit-learn's
/// `precision_recall_fscore_support(average="macro", zero_division=0)`.
///
/// A class's recall is `tp / (tp + fn)`: the fraction of the class's samples
/// that are predicted as it. The reported value is the unweighted mean over the
/// classes that occur among the targets or the predictions (scikit-learn's
/// default label set); a class whose denominator is 0 scores 0. The number of
/// classes `C` is fixed by the first batch.
#[derive(Clone, Debug, Default)]
pub struct Recall {
    counts: ClassCounts,
}

impl Recall {
    /// An empty metric, logged as `"recall"`.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Metric for Recall {
    fn name(&self) -> &str {
        "recall"
    }

    fn update(&mut self, output: &HostTensor, target: &HostTensor) -> Result<()> {
        self.counts.update("recall", output, target)
    }

    fn compute(&self) -> Result<f64> {
        self.counts
            .macro_average("recall", |c| ratio(c.tp, c.tp + c.fn_))
    }

    fn reset(&mut self) {
        self.counts.reset();
    }

    fn state(&self) -> Option<Vec<f64>> {
        Some(self.counts.state())
    }

    fn load_state(&mut self, state: &[f64]) -> Result<()> {
        self.counts.load_state("recall", state)
    }
}
