//! Top-k accuracy.

use super::{class_batch, no_samples, Metric};
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// The fraction of samples whose target class is among the `k` largest
/// logits, as scikit-learn's `top_k_accuracy_score`.
///
/// Ties are broken like scikit-learn (a stable ascending sort, reversed):
/// among equal logits, the higher class index ranks first. With `k >= C`
/// every sample counts as a hit.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_train::{Metric, TopKAccuracy};
///
/// let mut top2 = TopKAccuracy::new(2)?;
/// let logits = HostTensor::new(vec![0.5f32, 0.3, 0.2, 0.1, 0.2, 0.7], [2, 3])?;
/// top2.update(&logits, &HostTensor::new(vec![1i64, 0], [2])?)?;
/// assert_eq!(top2.name(), "top2_accuracy");
/// assert_eq!(top2.compute()?, 0.5);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct TopKAccuracy {
    k: usize,
    name: String,
    hits: u64,
    total: u64,
}

impl TopKAccuracy {
    /// An empty top-`k` accuracy, logged as `"top{k}_accuracy"`; `k` must be
    /// at least 1.
    pub fn new(k: usize) -> Result<Self> {
        if k == 0 {
            return Err(Error::invalid_argument(
                "k",
                "top-k accuracy needs k >= 1, got 0",
            ));
        }
        Ok(TopKAccuracy {
            k,
            name: format!("top{k}_accuracy"),
            hits: 0,
            total: 0,
        })
    }

    /// The `k` this metric counts hits within.
    pub fn k(&self) -> usize {
        self.k
    }
}

impl Metric for TopKAccuracy {
    fn name(&self) -> &str {
        &self.name
    }

    fn update(&mut self, output: &HostTensor, target: &HostTensor) -> Result<()> {
        let batch = class_batch(&self.name, output, target)?;
        let mut hits = 0u64;
        for i in 0..batch.rows() {
            let row = batch.row(i);
            let t = batch.target(i);
            let score = row[t];
            // Rank of the target in scikit-learn's order: every larger logit,
            // and every equal one with a higher index, comes first.
            let ahead = row
                .iter()
                .enumerate()
                .filter(|&(c, &v)| v > score || (v == score && c > t))
                .count();
            if ahead < self.k {
                hits += 1;
            }
        }
        self.hits += hits;
        self.total += batch.rows() as u64;
        Ok(())
    }

    fn compute(&self) -> Result<f64> {
        if self.total == 0 {
            return Err(no_samples(&self.name));
        }
        Ok(self.hits as f64 / self.total as f64)
    }

    fn reset(&mut self) {
        self.hits = 0;
        self.total = 0;
    }

    fn state(&self) -> Option<Vec<f64>> {
        Some(vec![self.hits as f64, self.total as f64])
    }

    fn load_state(&mut self, state: &[f64]) -> Result<()> {
        let (hits, total) = super::pair(&self.name, state)?;
        (self.hits, self.total) = (hits as u64, total as u64);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_rank_higher_indices_first_and_k_is_checked() -> Result<()> {
        assert!(TopKAccuracy::new(0).is_err());
        let mut m = TopKAccuracy::new(1)?;
        // All logits equal: only the last class is "top 1".
        let logits = HostTensor::new(vec![1.0f32; 6], [2, 3])?;
        m.update(&logits, &HostTensor::new(vec![2i64, 0], [2])?)?;
        assert_eq!(m.compute()?, 0.5);
        let mut m = TopKAccuracy::new(5)?;
        m.update(&logits, &HostTensor::new(vec![2i64, 0], [2])?)?;
        assert_eq!(m.compute()?, 1.0);
        m.reset();
        assert!(m.compute().is_err());
        Ok(())
    }
}
