//! The bridge to `ai-dataloader`'s indexable (map-style) abstractions.
//!
//! Kiln uses `ai-dataloader` for what it gives with the guarantees Kiln
//! needs: its [`Len`]/[`GetSample`] dataset traits (adapted by
//! [`IndexableDataset`]), its [`Sampler`] trait and its [`BatchSampler`]
//! (which cuts an epoch's order into batches and applies `drop_last`), and
//! its `Collate` trait. Two parts are Kiln's own:
//!
//! * the shuffling: `ai-dataloader`'s `RandomSampler` draws from
//!   `rand::thread_rng()` and cannot be seeded, so an epoch's order could not
//!   be reproduced. [`EpochSampler`] implements `ai-dataloader`'s
//!   [`Sampler`] trait with Kiln's seeded epoch order instead
//!   ([`epoch_order`]: `torch.randperm` of `seed + epoch`, the order of
//!   [`DistributedSampler`](crate::DistributedSampler) at world size 1);
//! * the loading: `ai-dataloader`'s `DataLoader` fetches each batch inside a
//!   global rayon pool on the caller's thread, with no prefetching, and its
//!   `GetSample` cannot report errors (it panics instead). Kiln's
//!   [`PrefetchLoader`](crate::PrefetchLoader) runs its own worker threads
//!   with a bounded queue, keeps batch order, and turns failures and panics
//!   into `Err` items.

use ai_dataloader::sampler::{BatchSampler, Sampler};
use ai_dataloader::{GetSample, Len};

use crate::Dataset;
use kiln_core::error::{Error, Result};
use kiln_core::rng::epoch_order;

/// An `ai-dataloader` [`Sampler`] that visits `0..len` in index order, or
/// in a permutation determined only by `(seed, epoch)`.
///
/// This replaces `ai-dataloader`'s `RandomSampler`, which cannot be seeded.
/// The order is the one [`SequentialLoader`](crate::SequentialLoader) and
/// [`PrefetchLoader`](crate::PrefetchLoader) use, so wrapping it in
/// `ai-dataloader`'s [`BatchSampler`] gives their batches' indices:
///
/// ```
/// use ai_dataloader::sampler::BatchSampler;
/// use kiln_data::EpochSampler;
///
/// let sampler = EpochSampler::sequential(5);
/// let batches = BatchSampler { sampler, batch_size: 2, drop_last: false };
/// assert_eq!(batches.iter().collect::<Vec<_>>(), [vec![0, 1], vec![2, 3], vec![4]]);
///
/// let shuffled = EpochSampler::shuffled(5, 42, 0);
/// assert_eq!(shuffled.indices(), EpochSampler::shuffled(5, 42, 0).indices());
/// assert_ne!(shuffled.indices(), EpochSampler::shuffled(5, 42, 1).indices());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EpochSampler {
    len: usize,
    seed: Option<u64>,
    epoch: u64,
}

impl EpochSampler {
    /// Visits `0..len` in order.
    pub fn sequential(len: usize) -> Self {
        EpochSampler {
            len,
            seed: None,
            epoch: 0,
        }
    }

    /// Visits `0..len` in the permutation of epoch `epoch` under `seed`.
    pub fn shuffled(len: usize, seed: u64, epoch: u64) -> Self {
        EpochSampler {
            len,
            seed: Some(seed),
            epoch,
        }
    }

    /// The order: sequential without a seed, shuffled with one.
    pub(crate) fn with_seed(len: usize, seed: Option<u64>, epoch: u64) -> Self {
        EpochSampler { len, seed, epoch }
    }

    /// The indices in the order visited.
    pub fn indices(&self) -> Vec<usize> {
        epoch_order(self.len, self.seed, self.epoch)
    }
}

impl Len for EpochSampler {
    fn len(&self) -> usize {
        self.len
    }
}

impl IntoIterator for EpochSampler {
    type Item = usize;
    type IntoIter = std::vec::IntoIter<usize>;

    fn into_iter(self) -> Self::IntoIter {
        self.indices().into_iter()
    }
}

impl Sampler for EpochSampler {
    /// A sequential sampler, as `ai-dataloader`'s `SequentialSampler::new`.
    fn new(data_source_len: usize) -> Self {
        EpochSampler::sequential(data_source_len)
    }
}

/// The batches of sample indices of one epoch.
pub(crate) fn batch_plan(
    len: usize,
    seed: Option<u64>,
    epoch: u64,
    batch_size: usize,
    drop_last: bool,
) -> BatchSampler<EpochSampler> {
    BatchSampler {
        sampler: EpochSampler::with_seed(len, seed, epoch),
        batch_size,
        drop_last,
    }
}

/// Any `ai-dataloader` dataset (something with [`Len`] and [`GetSample`],
/// such as a `Vec` of samples) as a Kiln [`Dataset`].
///
/// `GetSample` has no way to fail, and panics for an index out of range;
/// this adapter checks the index first and returns
/// [`Error::InvalidArgument`] instead.
///
/// ```
/// use kiln_data::{Dataset, IndexableDataset};
/// use kiln_core::HostTensor;
///
/// let samples: Vec<(HostTensor, HostTensor)> = (0..3)
///     .map(|i| (HostTensor::scalar(i as f32), HostTensor::scalar(i as i64)))
///     .collect();
/// let ds = IndexableDataset::new(samples);
/// assert_eq!(ds.len(), 3);
/// assert_eq!(ds.get(2)?.1.item::<i64>()?, 2);
/// assert!(ds.get(3).is_err());
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IndexableDataset<T> {
    inner: T,
}

impl<T> IndexableDataset<T> {
    /// Wraps `inner`.
    pub fn new(inner: T) -> Self {
        IndexableDataset { inner }
    }

    /// The wrapped dataset.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    /// Unwraps the dataset.
    pub fn into_inner(self) -> T {
        self.inner
    }
}

impl<T> Dataset for IndexableDataset<T>
where
    T: Len + GetSample + Send + Sync,
    T::Sample: Send,
{
    type Item = T::Sample;

    fn len(&self) -> usize {
        Len::len(&self.inner)
    }

    fn get(&self, index: usize) -> Result<Self::Item> {
        let len = Len::len(&self.inner);
        if index >= len {
            return Err(Error::invalid_argument(
                "index",
                format!("index {index} is out of range for a dataset of {len} samples"),
            ));
        }
        Ok(self.inner.get_sample(index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::rng::torch_randperm;

    #[test]
    fn sampler_order_matches_the_seeded_permutation() {
        let s = EpochSampler::shuffled(12, 77, 4);
        assert_eq!(s.indices(), torch_randperm(12, 77 + 4));
        assert_eq!(
            s.indices(),
            crate::DistributedSampler::new(1, 0)
                .expect("one replica")
                .shuffle(77)
                .indices(12, 4)
        );
        assert_eq!(s.into_iter().collect::<Vec<_>>(), s.indices());
        assert_eq!(Len::len(&s), 12);
        assert_eq!(<EpochSampler as Sampler>::new(3).indices(), vec![0, 1, 2]);
    }

    #[test]
    fn batch_plan_cuts_and_drops() {
        let plan = batch_plan(7, None, 0, 3, false);
        assert_eq!(Len::len(&plan), 3);
        assert_eq!(
            plan.iter().collect::<Vec<_>>(),
            [vec![0, 1, 2], vec![3, 4, 5], vec![6]]
        );
        let plan = batch_plan(7, None, 0, 3, true);
        assert_eq!(Len::len(&plan), 2);
        assert_eq!(
            plan.iter().collect::<Vec<_>>(),
            [vec![0, 1, 2], vec![3, 4, 5]]
        );

        let shuffled = batch_plan(7, Some(5), 2, 3, false);
        let flat: Vec<usize> = shuffled.iter().flatten().collect();
        assert_eq!(flat, EpochSampler::shuffled(7, 5, 2).indices());
    }

    #[test]
    fn indexable_dataset_checks_the_index() -> Result<()> {
        let ds = IndexableDataset::new(vec![10u8, 20, 30]);
        assert_eq!(Dataset::len(&ds), 3);
        assert_eq!(ds.get(1)?, 20);
        let err = ds.get(3).expect_err("out of range");
        assert_eq!(
            err.to_string(),
            "invalid argument `index`: index 3 is out of range for a dataset of 3 samples"
        );
        assert_eq!(ds.inner().len(), 3);
        assert_eq!(ds.into_inner(), vec![10, 20, 30]);
        Ok(())
    }
}
