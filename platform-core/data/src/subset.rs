//! A dataset restricted to some of its indices (`torch.utils.data.Subset`).

use crate::Dataset;
use kiln_core::error::{Error, Result};

/// The samples of `dataset` at `indices`, in that order, as
/// `torch.utils.data.Subset(dataset, indices)`: sample `i` of the subset is
/// sample `indices[i]` of the dataset. Used to hold out a validation split of
/// a dataset read from files, without reading it.
///
/// ```
/// use kiln_data::{Dataset, IndexableDataset, Subset};
///
/// let ds = IndexableDataset::new(vec![10, 11, 12, 13]);
/// let odd = Subset::new(ds, vec![1, 3])?;
/// assert_eq!(odd.len(), 2);
/// assert_eq!(odd.get(1)?, 13);
/// assert!(odd.get(2).is_err());
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Subset<D> {
    dataset: D,
    indices: Vec<usize>,
}

impl<D: Dataset> Subset<D> {
    /// The samples of `dataset` at `indices`; every index must be below its length.
    pub fn new(dataset: D, indices: Vec<usize>) -> Result<Self> {
        let len = dataset.len();
        if let Some(bad) = indices.iter().find(|&&i| i >= len) {
            return Err(Error::invalid_argument(
                "indices",
                format!("index {bad} is out of range for a dataset of {len} samples"),
            ));
        }
        Ok(Subset { dataset, indices })
    }

    /// The dataset's indices, in the subset's order.
    pub fn indices(&self) -> &[usize] {
        &self.indices
    }

    /// The whole dataset.
    pub fn inner(&self) -> &D {
        &self.dataset
    }
}

impl<D: Dataset> Dataset for Subset<D> {
    type Item = D::Item;

    fn len(&self) -> usize {
        self.indices.len()
    }

    fn get(&self, index: usize) -> Result<D::Item> {
        self.dataset.get(self.map(index)?)
    }

    fn get_for_epoch(&self, index: usize, epoch: u64) -> Result<D::Item> {
        self.dataset.get_for_epoch(self.map(index)?, epoch)
    }
}

impl<D: Dataset> Subset<D> {
    fn map(&self, index: usize) -> Result<usize> {
        self.indices.get(index).copied().ok_or_else(|| {
            Error::invalid_argument(
                "index",
                format!(
                    "{index} is out of range for a subset of {} samples",
                    self.indices.len()
                ),
            )
        })
    }
}
