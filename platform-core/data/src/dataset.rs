//! A dataset held in memory.

use crate::Dataset;
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// Samples stored as the rows of two host tensors: features `[N, ...]` and
/// targets `[N]` or `[N, ...]`.
///
/// ```
/// use kiln_data::{Dataset, InMemoryDataset};
/// use kiln_core::HostTensor;
///
/// let x = HostTensor::new(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2])?;
/// let y = HostTensor::new(vec![7i64, 9], [2])?;
/// let ds = InMemoryDataset::new(x, y)?;
/// let (row, label) = ds.get(1)?;
/// assert_eq!(row.as_slice::<f32>()?, &[3.0, 4.0]);
/// assert_eq!(label.item::<i64>()?, 9);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct InMemoryDataset {
    features: HostTensor,
    targets: HostTensor,
}

impl InMemoryDataset {
    /// A dataset of the rows of `features` and `targets`; both need at least
    /// one dimension and the same first dimension.
    pub fn new(features: HostTensor, targets: HostTensor) -> Result<Self> {
        let Some(&n) = features.dims().first() else {
            return Err(Error::invalid_argument(
                "features",
                "expected shape [N, ...], got a scalar",
            ));
        };
        match targets.dims().first() {
            None => Err(Error::invalid_argument(
                "targets",
                format!("expected shape [{n}] or [{n}, ...], got a scalar"),
            )),
            Some(&m) if m != n => Err(Error::ShapeMismatch {
                context: format!(
                    "InMemoryDataset::new: targets need one row per feature row (features {})",
                    features.shape()
                ),
                expected: format!("[{n}, ...]"),
                actual: targets.shape().to_string(),
            }),
            Some(_) => Ok(InMemoryDataset { features, targets }),
        }
    }

    /// All features, `[N, ...]`.
    pub fn features(&self) -> &HostTensor {
        &self.features
    }

    /// All targets, `[N]` or `[N, ...]`.
    pub fn targets(&self) -> &HostTensor {
        &self.targets
    }

    /// The features and targets.
    pub fn into_parts(self) -> (HostTensor, HostTensor) {
        (self.features, self.targets)
    }
}

impl Dataset for InMemoryDataset {
    type Item = (HostTensor, HostTensor);

    fn len(&self) -> usize {
        self.features.dims().first().copied().unwrap_or(0)
    }

    /// Row `index` of the features and of the targets (a scalar for `[N]` targets).
    fn get(&self, index: usize) -> Result<Self::Item> {
        if index >= self.len() {
            return Err(Error::invalid_argument(
                "index",
                format!(
                    "index {index} is out of range for a dataset of {} samples",
                    self.len()
                ),
            ));
        }
        Ok((self.features.row(index)?, self.targets.row(index)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::dtype::DType;

    fn sample() -> Result<InMemoryDataset> {
        InMemoryDataset::new(
            HostTensor::new((0..6).map(|v| v as f32).collect(), [3, 2])?,
            HostTensor::new(vec![10i64, 11, 12], [3])?,
        )
    }

    #[test]
    fn rows_are_returned_in_place() -> Result<()> {
        let ds = sample()?;
        assert_eq!(ds.len(), 3);
        assert!(!ds.is_empty());
        let (x, y) = ds.get(2)?;
        assert_eq!(x.dims(), &[2]);
        assert_eq!(x.as_slice::<f32>()?, &[4.0, 5.0]);
        assert_eq!(y, HostTensor::scalar(12i64));
        assert_eq!(ds.features().dims(), &[3, 2]);
        assert_eq!(ds.targets().dtype(), DType::I64);
        let (f, t) = ds.into_parts();
        assert_eq!((f.numel(), t.numel()), (6, 3));
        Ok(())
    }

    #[test]
    fn multi_dimensional_targets() -> Result<()> {
        let ds = InMemoryDataset::new(
            HostTensor::zeros(DType::U8, [2, 1, 3])?,
            HostTensor::new(vec![0.0f64, 1.0, 2.0, 3.0], [2, 2])?,
        )?;
        let (x, y) = ds.get(1)?;
        assert_eq!(x.dims(), &[1, 3]);
        assert_eq!(y.as_slice::<f64>()?, &[2.0, 3.0]);
        Ok(())
    }

    #[test]
    fn out_of_range_get_is_an_error() -> Result<()> {
        let err = sample()?.get(3).expect_err("index 3 of 3");
        assert_eq!(
            err.to_string(),
            "invalid argument `index`: index 3 is out of range for a dataset of 3 samples"
        );
        Ok(())
    }

    #[test]
    fn new_validates_shapes() -> Result<()> {
        let x = HostTensor::zeros(DType::F32, [3, 2])?;
        let err = InMemoryDataset::new(x.clone(), HostTensor::zeros(DType::I64, [4])?)
            .expect_err("3 vs 4 rows");
        assert_eq!(
            err.to_string(),
            "InMemoryDataset::new: targets need one row per feature row (features [3, 2]): \
             expected shape [3, ...], got [4]"
        );
        let err = InMemoryDataset::new(x, HostTensor::scalar(1i64)).expect_err("scalar targets");
        assert!(matches!(err, Error::InvalidArgument { ref name, .. } if name == "targets"));
        let err = InMemoryDataset::new(HostTensor::scalar(1.0f32), HostTensor::scalar(1i64))
            .expect_err("scalar features");
        assert!(matches!(err, Error::InvalidArgument { ref name, .. } if name == "features"));

        let empty = InMemoryDataset::new(
            HostTensor::zeros(DType::F32, [0, 4])?,
            HostTensor::zeros(DType::I64, [0])?,
        )?;
        assert!(empty.is_empty());
        assert!(empty.get(0).is_err());
        Ok(())
    }
}
