//! Turning the samples of a batch into a [`Batch`].

use crate::Batch;
use kiln_core::error::Result;
use kiln_core::tensor::HostTensor;

/// `ai-dataloader`'s collate trait: how the samples of one batch are gathered.
///
/// Kiln's loaders take any `C: Collate<Item, Output = Result<Batch>>`. The
/// trait is implemented for every closure `Fn(Vec<Item>) -> Result<Batch>`,
/// so a custom collate is usually just a closure:
///
/// ```
/// use kiln_data::{Batch, Collate};
/// use kiln_core::HostTensor;
///
/// // Samples are (pixels, label) with a u8 label.
/// let collate = |samples: Vec<(Vec<f32>, u8)>| -> kiln_core::Result<Batch> {
///     let n = samples.len();
///     let width = samples.first().map_or(0, |s| s.0.len());
///     let labels: Vec<i64> = samples.iter().map(|s| i64::from(s.1)).collect();
///     let pixels: Vec<f32> = samples.into_iter().flat_map(|s| s.0).collect();
///     Ok(Batch {
///         inputs: HostTensor::new(pixels, [n, width])?,
///         targets: HostTensor::new(labels, [n])?,
///     })
/// };
/// let batch = collate.collate(vec![(vec![0.5, 1.0], 3), (vec![2.0, 4.0], 7)])?;
/// assert_eq!(batch.inputs.dims(), &[2, 2]);
/// assert_eq!(batch.targets.as_slice::<i64>()?, &[3, 7]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub use ai_dataloader::collate::Collate;

/// The default collate for `(input, target)` samples: stacks the inputs and
/// the targets along a new leading axis (PyTorch's `default_collate` for
/// tensors).
///
/// ```
/// use kiln_data::{Collate, StackCollate};
/// use kiln_core::HostTensor;
///
/// let sample = |v: f32, t: i64| -> kiln_core::Result<_> {
///     Ok((HostTensor::new(vec![v, v], [2])?, HostTensor::scalar(t)))
/// };
/// let batch = StackCollate.collate(vec![sample(1.0, 4)?, sample(2.0, 5)?])?;
/// assert_eq!(batch.inputs.dims(), &[2, 2]);
/// assert_eq!(batch.inputs.as_slice::<f32>()?, &[1.0, 1.0, 2.0, 2.0]);
/// assert_eq!(batch.targets.as_slice::<i64>()?, &[4, 5]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackCollate;

impl StackCollate {
    /// Stacks the inputs and the targets of `samples`; fails if the list is
    /// empty or if shapes or dtypes differ between samples.
    pub(crate) fn stack(samples: Vec<(HostTensor, HostTensor)>) -> Result<Batch> {
        let (inputs, targets): (Vec<HostTensor>, Vec<HostTensor>) = samples.into_iter().unzip();
        Ok(Batch {
            inputs: HostTensor::stack(&inputs)?,
            targets: HostTensor::stack(&targets)?,
        })
    }
}

impl Collate<(HostTensor, HostTensor)> for StackCollate {
    type Output = Result<Batch>;

    fn collate(&self, batch: Vec<(HostTensor, HostTensor)>) -> Result<Batch> {
        StackCollate::stack(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::dtype::DType;

    #[test]
    fn stacks_inputs_and_targets() -> Result<()> {
        let samples = vec![
            (
                HostTensor::new(vec![1u8, 2, 3, 4], [1, 2, 2])?,
                HostTensor::new(vec![0.5f32], [1])?,
            ),
            (
                HostTensor::new(vec![5u8, 6, 7, 8], [1, 2, 2])?,
                HostTensor::new(vec![-1.5f32], [1])?,
            ),
        ];
        let batch = StackCollate.collate(samples)?;
        assert_eq!(batch.inputs.dims(), &[2, 1, 2, 2]);
        assert_eq!(batch.inputs.as_slice::<u8>()?, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(batch.targets.dims(), &[2, 1]);
        assert_eq!(batch.targets.as_slice::<f32>()?, &[0.5, -1.5]);
        Ok(())
    }

    #[test]
    fn mismatched_samples_are_errors() -> Result<()> {
        let a = (
            HostTensor::zeros(DType::F32, [2])?,
            HostTensor::scalar(0i64),
        );
        let b = (
            HostTensor::zeros(DType::F32, [3])?,
            HostTensor::scalar(1i64),
        );
        let err = StackCollate.collate(vec![a, b]).expect_err("shapes differ");
        assert_eq!(
            err.to_string(),
            "HostTensor::stack: tensor 1: expected shape [2], got [3]"
        );
        assert!(StackCollate.collate(Vec::new()).is_err());
        Ok(())
    }
}
