//! Macro-averaged precision.

use super::confusion::{ratio, ClassCounts};
use super::Metric;
use kiln_core::error::Result;
use kiln_core::tensor::HostTensor;

/// Macro-averaged precision of the argmax predictions, as scikit-learn's
/// `precision_recall_fscore_support(average="macro", zero_division=0)`.
///
/// A class's precision is `tp / (tp + fp)`: the fraction of predictions of the
/// class that are right. The reported value is the unweighted mean over the
/// classes that occur among the targets or the predictions (scikit-learn's
/// default label set); a class whose denominator is 0 scores 0. The number of
/// classes `C` is fixed by the first batch.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_train::{F1, Metric, Precision, Recall};
///
/// // Predictions (argmax) 0, 0, 1 for targets 0, 1, 1; class 2 occurs in neither.
/// let logits = HostTensor::new(vec![0.9f32, 0.1, 0.0, 0.8, 0.2, 0.0, 0.3, 0.7, 0.0], [3, 3])?;
/// let targets = HostTensor::new(vec![0i64, 1, 1], [3])?;
/// let (mut p, mut r, mut f) = (Precision::new(), Recall::new(), F1::new());
/// for m in [&mut p as &mut dyn Metric, &mut r, &mut f] {
///     m.update(&logits, &targets)?;
/// }
/// assert_eq!(p.compute()?, (1.0 / 2.0 + 1.0) / 2.0);
/// assert_eq!(r.compute()?, (1.0 + 1.0 / 2.0) / 2.0);
/// assert_eq!(f.compute()?, (2.0 / 3.0 + 2.0 / 3.0) / 2.0);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct Precision {
    counts: ClassCounts,
}

impl Precision {
    /// An empty metric, logged as `"precision"`.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Metric for Precision {
    fn name(&self) -> &str {
        "precision"
    }

    fn update(&mut self, output: &HostTensor, target: &HostTensor) -> Result<()> {
        self.counts.update("precision", output, target)
    }

    fn compute(&self) -> Result<f64> {
        self.counts
            .macro_average("precision", |c| ratio(c.tp, c.tp + c.fp))
    }

    fn reset(&mut self) {
        self.counts.reset();
    }

    fn state(&self) -> Option<Vec<f64>> {
        Some(self.counts.state())
    }

    fn load_state(&mut self, state: &[f64]) -> Result<()> {
        self.counts.load_state("precision", state)
    }
}
