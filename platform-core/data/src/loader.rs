//! A single-threaded data loader.

use crate::collate::StackCollate;
use crate::dataset::InMemoryDataset;
use crate::sampler::DistributedSampler;
use crate::{Batch, DataLoader, Dataset};
use kiln_core::error::{Error, Result};
use kiln_core::rng::epoch_order;
use kiln_core::tensor::HostTensor;

/// Batches the samples of a [`Dataset`] of `(input, target)` pairs in the
/// calling thread, stacking rows along a new leading axis.
///
/// Without [`shuffle`](SequentialLoader::shuffle) the order is `0..len` every
/// epoch. With it, epoch `e` uses a permutation determined by `(seed, e)`
/// only, so a resumed run sees the same batches as an uninterrupted one.
/// With a [`sampler`](SequentialLoader::sampler), each epoch batches the
/// indices that sampler gives this rank instead.
///
/// ```
/// use kiln_data::{DataLoader, InMemoryDataset, SequentialLoader};
/// use kiln_core::HostTensor;
///
/// let x = HostTensor::new((0..8).collect::<Vec<i64>>(), [8])?;
/// let ds = InMemoryDataset::new(x.clone(), x)?;
/// let loader = SequentialLoader::new(ds, 3)?.shuffle(42).drop_last(true);
/// assert_eq!(loader.num_batches(), 2);
/// let first = loader.batches(0).next().transpose()?.map(|b| b.inputs);
/// assert_eq!(first.map(|t| t.numel()), Some(3));
/// assert_eq!(loader.epoch_order(5), loader.epoch_order(5));
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct SequentialLoader<D = InMemoryDataset> {
    dataset: D,
    batch_size: usize,
    seed: Option<u64>,
    drop_last: bool,
    sampler: Option<DistributedSampler>,
}

impl<D> SequentialLoader<D>
where
    D: Dataset<Item = (HostTensor, HostTensor)>,
{
    /// A loader yielding batches of `batch_size` samples in index order,
    /// keeping an incomplete last batch. `batch_size` must be positive.
    pub fn new(dataset: D, batch_size: usize) -> Result<Self> {
        if batch_size == 0 {
            return Err(Error::invalid_argument(
                "batch_size",
                "must be at least 1, got 0",
            ));
        }
        Ok(SequentialLoader {
            dataset,
            batch_size,
            seed: None,
            drop_last: false,
            sampler: None,
        })
    }

    /// Shuffles the samples every epoch with a permutation derived from `seed` and the epoch.
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Whether to drop the last batch when it has fewer than `batch_size` samples.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Visits, each epoch, the indices `sampler` gives its rank
    /// ([`DistributedSampler::indices`]) instead of the whole dataset; the
    /// sampler's own shuffling then decides the order, and
    /// [`shuffle`](SequentialLoader::shuffle)'s seed is not used. The
    /// loader's [`drop_last`](SequentialLoader::drop_last) still applies to
    /// the last batch of the rank's share.
    ///
    /// ```
    /// use kiln_data::{DataLoader, DistributedSampler, InMemoryDataset, SequentialLoader};
    /// use kiln_core::HostTensor;
    ///
    /// let x = HostTensor::new((0..10).collect::<Vec<i64>>(), [10])?;
    /// let loader = SequentialLoader::new(InMemoryDataset::new(x.clone(), x)?, 2)?
    ///     .sampler(DistributedSampler::new(3, 1)?);
    /// assert_eq!(loader.epoch_order(0), [1, 4, 7, 0]);
    /// assert_eq!(loader.num_batches(), 2);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn sampler(mut self, sampler: DistributedSampler) -> Self {
        self.sampler = Some(sampler);
        self
    }

    /// The dataset.
    pub fn dataset(&self) -> &D {
        &self.dataset
    }

    /// Samples per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The distributed sampler choosing this rank's samples, if one was set
    /// with [`sampler`](SequentialLoader::sampler).
    pub fn distributed_sampler(&self) -> Option<&DistributedSampler> {
        self.sampler.as_ref()
    }

    /// The sample indices of epoch `epoch`, in the order they are batched
    /// (including any dropped tail): the [`sampler`](SequentialLoader::sampler)'s
    /// indices when there is one.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let len = self.dataset.len();
        match &self.sampler {
            Some(sampler) => sampler.indices(len, epoch),
            None => epoch_order(len, self.seed, epoch),
        }
    }

    /// Number of indices in an epoch's order, before `drop_last`.
    fn order_len(&self) -> usize {
        let len = self.dataset.len();
        match &self.sampler {
            Some(sampler) => sampler.num_samples(len),
            None => len,
        }
    }

    /// Number of samples yielded per epoch.
    fn samples_per_epoch(&self) -> usize {
        let n = self.order_len();
        if self.drop_last {
            n - n % self.batch_size
        } else {
            n
        }
    }
}

impl<D> DataLoader for SequentialLoader<D>
where
    D: Dataset<Item = (HostTensor, HostTensor)>,
{
    fn num_batches(&self) -> usize {
        self.samples_per_epoch().div_ceil(self.batch_size)
    }

    fn batches(&self, epoch: u64) -> Box<dyn Iterator<Item = Result<Batch>> + Send + '_> {
        let mut order = self.epoch_order(epoch);
        order.truncate(self.samples_per_epoch());
        log::debug!(
            "SequentialLoader epoch {epoch}: {} samples in {} batches of up to {}",
            order.len(),
            self.num_batches(),
            self.batch_size
        );
        Box::new(BatchIter {
            dataset: &self.dataset,
            order,
            batch_size: self.batch_size,
            epoch,
            next: 0,
        })
    }
}

/// Iterator over the batches of one epoch.
struct BatchIter<'a, D> {
    dataset: &'a D,
    order: Vec<usize>,
    batch_size: usize,
    epoch: u64,
    next: usize,
}

impl<D> Iterator for BatchIter<'_, D>
where
    D: Dataset<Item = (HostTensor, HostTensor)>,
{
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        let start = self.next;
        let indices = self.order.get(start..)?;
        if indices.is_empty() {
            return None;
        }
        let indices = &indices[..indices.len().min(self.batch_size)];
        self.next = start + indices.len();
        Some(collate(self.dataset, indices, self.epoch))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = (self.order.len() - self.next.min(self.order.len())).div_ceil(self.batch_size);
        (left, Some(left))
    }
}

/// Fetches the samples at `indices` (as seen in `epoch`) and stacks them into a batch.
fn collate<D>(dataset: &D, indices: &[usize], epoch: u64) -> Result<Batch>
where
    D: Dataset<Item = (HostTensor, HostTensor)>,
{
    let samples = indices
        .iter()
        .map(|&i| dataset.get_for_epoch(i, epoch))
        .collect::<Result<Vec<_>>>()?;
    StackCollate::stack(samples)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::dtype::DType;

    /// Ten samples: input row `[i, 10 i]` (f32), target `i` (i64).
    fn ten() -> Result<InMemoryDataset> {
        let x = (0..10).flat_map(|i| [i as f32, 10.0 * i as f32]).collect();
        InMemoryDataset::new(
            HostTensor::new(x, [10, 2])?,
            HostTensor::new((0..10).collect::<Vec<i64>>(), [10])?,
        )
    }

    fn targets_of(loader: &SequentialLoader, epoch: u64) -> Result<Vec<Vec<i64>>> {
        loader
            .batches(epoch)
            .map(|b| b.and_then(|b| b.targets.into_vec::<i64>()))
            .collect()
    }

    #[test]
    fn sequential_order_and_stacking() -> Result<()> {
        let loader = SequentialLoader::new(ten()?, 4)?;
        assert_eq!(loader.num_batches(), 3);
        assert_eq!(loader.batch_size(), 4);
        assert_eq!(loader.dataset().len(), 10);
        let batches: Vec<Batch> = loader.batches(0).collect::<Result<_>>()?;
        assert_eq!(batches.len(), 3);
        assert_eq!(batches[0].inputs.dims(), &[4, 2]);
        assert_eq!(batches[0].targets.dims(), &[4]);
        assert_eq!(batches[0].targets.dtype(), DType::I64);
        assert_eq!(
            batches[1].inputs.as_slice::<f32>()?,
            &[4.0, 40.0, 5.0, 50.0, 6.0, 60.0, 7.0, 70.0]
        );
        assert_eq!(batches[2].inputs.dims(), &[2, 2]);
        assert_eq!(
            targets_of(&loader, 7)?,
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]
        );
        Ok(())
    }

    #[test]
    fn drop_last_drops_the_short_batch() -> Result<()> {
        let loader = SequentialLoader::new(ten()?, 4)?.drop_last(true);
        assert_eq!(loader.num_batches(), 2);
        assert_eq!(
            targets_of(&loader, 0)?,
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
        );
        let exact = SequentialLoader::new(ten()?, 5)?.drop_last(true);
        assert_eq!(exact.num_batches(), 2);
        let too_big = SequentialLoader::new(ten()?, 11)?.drop_last(true);
        assert_eq!(too_big.num_batches(), 0);
        assert_eq!(too_big.batches(0).count(), 0);
        Ok(())
    }

    #[test]
    fn shuffle_is_deterministic_per_seed_and_epoch() -> Result<()> {
        let loader = SequentialLoader::new(ten()?, 3)?.shuffle(1234);
        let e0 = targets_of(&loader, 0)?;
        assert_eq!(e0, targets_of(&loader, 0)?);
        let e1 = targets_of(&loader, 1)?;
        assert_ne!(e0, e1);

        // A separately built loader with the same seed agrees.
        let again = SequentialLoader::new(ten()?, 3)?.shuffle(1234);
        assert_eq!(targets_of(&again, 1)?, e1);
        let other_seed = SequentialLoader::new(ten()?, 3)?.shuffle(4321);
        assert_ne!(targets_of(&other_seed, 0)?, e0);

        for epoch in 0..20 {
            let batches = targets_of(&loader, epoch)?;
            let sizes: Vec<usize> = batches.iter().map(Vec::len).collect();
            assert_eq!(sizes, [3, 3, 3, 1]);
            let mut seen: Vec<i64> = batches.concat();
            assert_eq!(
                seen.iter().map(|&t| t as usize).collect::<Vec<_>>(),
                loader.epoch_order(epoch)
            );
            seen.sort_unstable();
            assert_eq!(seen, (0..10).collect::<Vec<i64>>(), "epoch {epoch}");
        }
        Ok(())
    }

    #[test]
    fn inputs_stay_paired_with_targets_when_shuffled() -> Result<()> {
        let loader = SequentialLoader::new(ten()?, 4)?.shuffle(9);
        for batch in loader.batches(3) {
            let batch = batch?;
            let x = batch.inputs.as_slice::<f32>()?;
            let y = batch.targets.as_slice::<i64>()?;
            for (row, &t) in x.chunks(2).zip(y) {
                assert_eq!(row, &[t as f32, 10.0 * t as f32]);
            }
        }
        Ok(())
    }

    #[test]
    fn a_sampler_chooses_the_rank_s_samples() -> Result<()> {
        // 10 samples over 4 ranks, padded to 12: rank 2 gets 2, 6 and 0.
        let sampler = DistributedSampler::new(4, 2)?;
        let loader = SequentialLoader::new(ten()?, 2)?
            .shuffle(5)
            .sampler(sampler);
        assert_eq!(loader.distributed_sampler(), Some(&sampler));
        assert_eq!(loader.epoch_order(3), [2, 6, 0]);
        assert_eq!(loader.num_batches(), 2);
        assert_eq!(targets_of(&loader, 3)?, vec![vec![2, 6], vec![0]]);
        let dropping = loader.clone().drop_last(true);
        assert_eq!(dropping.num_batches(), 1);
        assert_eq!(targets_of(&dropping, 0)?, vec![vec![2, 6]]);

        let shuffled = SequentialLoader::new(ten()?, 2)?.sampler(sampler.shuffle(7));
        assert_eq!(shuffled.epoch_order(1), sampler.shuffle(7).indices(10, 1));
        assert_eq!(
            targets_of(&shuffled, 1)?.concat(),
            shuffled
                .epoch_order(1)
                .iter()
                .map(|&i| i as i64)
                .collect::<Vec<_>>()
        );
        assert_eq!(
            SequentialLoader::new(ten()?, 2)?.distributed_sampler(),
            None
        );
        Ok(())
    }

    #[test]
    fn size_hint_counts_remaining_batches() -> Result<()> {
        let loader = SequentialLoader::new(ten()?, 4)?;
        let mut it = loader.batches(0);
        assert_eq!(it.size_hint(), (3, Some(3)));
        it.next();
        assert_eq!(it.size_hint(), (2, Some(2)));
        Ok(())
    }

    #[test]
    fn zero_batch_size_is_rejected() -> Result<()> {
        let err = SequentialLoader::new(ten()?, 0).expect_err("batch size 0");
        assert_eq!(
            err.to_string(),
            "invalid argument `batch_size`: must be at least 1, got 0"
        );
        Ok(())
    }

    #[test]
    fn dataset_errors_surface_as_items() -> Result<()> {
        /// Fails for sample 2.
        struct Flaky;
        impl Dataset for Flaky {
            type Item = (HostTensor, HostTensor);
            fn len(&self) -> usize {
                4
            }
            fn get(&self, index: usize) -> Result<Self::Item> {
                if index == 2 {
                    return Err(Error::unsupported("sample 2"));
                }
                Ok((HostTensor::scalar(index as f32), HostTensor::scalar(0i64)))
            }
        }
        let loader = SequentialLoader::new(Flaky, 2)?;
        let results: Vec<Result<Batch>> = loader.batches(0).collect();
        assert_eq!(results.len(), 2);
        assert_eq!(results[0].as_ref().map(|b| b.inputs.numel()).ok(), Some(2));
        let err = results[1].as_ref().expect_err("sample 2 fails");
        assert_eq!(err.to_string(), "unsupported: sample 2");
        Ok(())
    }
}
