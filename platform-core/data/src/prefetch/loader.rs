//! [`PrefetchLoader`]: the public type, its builder and its order, and the
//! [`DataLoader`] implementation that hands an epoch's batch plan to the workers.

use std::fmt;
use std::sync::Arc;

use ai_dataloader::sampler::BatchSampler;
use ai_dataloader::Len;

use super::job::{Job, SkippedSamples};
use super::workers::{InlineIter, WorkerIter};
use super::EpochOrder;
use crate::collate::{Collate, StackCollate};
use crate::indexable::batch_plan;
use crate::sampler::{DistributedSampler, LoaderSampler};
use crate::{Batch, DataLoader, Dataset};
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// Batches [`prefetch`](PrefetchLoader::prefetch) keeps ready per worker unless told otherwise.
const DEFAULT_PREFETCH: usize = 2;

/// A [`DataLoader`] that loads batches in background worker threads, like
/// PyTorch's `DataLoader(dataset, batch_size, shuffle, num_workers,
/// prefetch_factor, drop_last, collate_fn)`.
///
/// * **Order.** Epoch `e` visits the samples in an order determined by
///   `(seed, e)` only ([`shuffle`](PrefetchLoader::shuffle)), the same order
///   as a [`SequentialLoader`](crate::SequentialLoader) with that seed, cut
///   into batches by `ai-dataloader`'s [`BatchSampler`]. Batches come out in
///   that order whatever the number of workers: workers take the next batch
///   as they become free and a reorder buffer puts the results back in order.
///   Samples are read with [`Dataset::get_for_epoch`], so seeded
///   augmentations ([`TransformedDataset`](crate::TransformedDataset))
///   reproduce across worker counts too. With a
///   [`sampler`](PrefetchLoader::sampler), the order is instead the indices
///   that [`DistributedSampler`] gives this rank, batched the same way.
/// * **Prefetching.** With `n` [`num_workers`](PrefetchLoader::num_workers),
///   loading starts when [`batches`](DataLoader::batches) is called and runs
///   at most `n * prefetch` batches ahead of the consumer (a bounded queue),
///   so a training step finds its batch ready whenever loading is faster than
///   training, and memory stays bounded when it is slower. With 0 workers
///   each batch is loaded on the caller's thread when it is asked for.
/// * **Errors.** If reading a sample or collating a batch fails, the
///   iterator yields that error at the batch's position, with the batch
///   number and the dataset index added to its message, and then ends. A
///   panic in the dataset or the collate function is caught and yielded the
///   same way, as [`Error::Backend`] with backend `"data loader"` and the
///   panic message; it never hangs the consumer.
/// * **Stopping.** Dropping the iterator mid-epoch stops the workers and
///   joins them; it waits at most for the samples being read at that moment.
///
/// ```
/// use kiln_data::{DataLoader, InMemoryDataset, PrefetchLoader};
/// use kiln_core::HostTensor;
///
/// let x = HostTensor::new((0..20).map(|v| v as f32).collect(), [10, 2])?;
/// let y = HostTensor::new((0..10).collect::<Vec<i64>>(), [10])?;
/// let loader = PrefetchLoader::new(InMemoryDataset::new(x, y)?, 4)?
///     .shuffle(7)
///     .num_workers(2)
///     .drop_last(true);
/// assert_eq!(loader.num_batches(), 2);
/// let mut seen = Vec::new();
/// for batch in loader.batches(0) {
///     let batch = batch?;
///     assert_eq!(batch.inputs.dims(), &[4, 2]);
///     seen.extend(batch.targets.into_vec::<i64>()?);
/// }
/// let order: Vec<i64> = loader.epoch_order(0).iter().map(|&i| i as i64).collect();
/// assert_eq!(seen, order[..8]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub struct PrefetchLoader<D, C = StackCollate> {
    dataset: Arc<D>,
    collate: Arc<C>,
    batch_size: usize,
    seed: Option<u64>,
    drop_last: bool,
    sampler: Option<DistributedSampler>,
    num_workers: usize,
    prefetch: usize,
    order: Option<Arc<dyn EpochOrder>>,
    skip_failed: bool,
    skipped: Arc<SkippedSamples>,
}

impl<D> PrefetchLoader<D, StackCollate>
where
    D: Dataset<Item = (HostTensor, HostTensor)>,
{
    /// A loader of `(input, target)` samples stacked by [`StackCollate`],
    /// with batches of `batch_size` (positive) in index order, keeping an
    /// incomplete last batch, and loading on the caller's thread until
    /// [`num_workers`](PrefetchLoader::num_workers) is set.
    pub fn new(dataset: D, batch_size: usize) -> Result<Self> {
        Self::with_collate(dataset, batch_size, StackCollate)
    }
}

impl<D: Dataset, C> PrefetchLoader<D, C> {
    /// A loader that gathers each batch's samples with `collate` (any
    /// `Fn(Vec<D::Item>) -> Result<Batch>`, or a [`Collate`] implementation).
    ///
    /// ```
    /// use kiln_data::{Batch, DataLoader, IndexableDataset, PrefetchLoader};
    /// use kiln_core::HostTensor;
    ///
    /// // Samples are plain (value, label) pairs.
    /// let ds = IndexableDataset::new(vec![(0.5f32, 1i64), (1.5, 0), (2.5, 1)]);
    /// let loader = PrefetchLoader::with_collate(ds, 2, |s: Vec<(f32, i64)>| {
    ///     let n = s.len();
    ///     let (x, y): (Vec<f32>, Vec<i64>) = s.into_iter().unzip();
    ///     Ok(Batch { inputs: HostTensor::new(x, [n, 1])?, targets: HostTensor::new(y, [n])? })
    /// })?
    /// .num_workers(1);
    /// let sizes: Vec<usize> = loader
    ///     .batches(0)
    ///     .map(|b| b.map(|b| b.inputs.numel()))
    ///     .collect::<kiln_core::Result<_>>()?;
    /// assert_eq!(sizes, [2, 1]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn with_collate(dataset: D, batch_size: usize, collate: C) -> Result<Self> {
        if batch_size == 0 {
            return Err(Error::invalid_argument(
                "batch_size",
                "must be at least 1, got 0",
            ));
        }
        Ok(PrefetchLoader {
            dataset: Arc::new(dataset),
            collate: Arc::new(collate),
            batch_size,
            seed: None,
            drop_last: false,
            sampler: None,
            num_workers: 0,
            prefetch: DEFAULT_PREFETCH,
            order: None,
            skip_failed: false,
            skipped: Arc::default(),
        })
    }

    /// The same loader with another collate function.
    pub fn collate<C2>(self, collate: C2) -> PrefetchLoader<D, C2> {
        PrefetchLoader {
            dataset: self.dataset,
            collate: Arc::new(collate),
            batch_size: self.batch_size,
            seed: self.seed,
            drop_last: self.drop_last,
            sampler: self.sampler,
            num_workers: self.num_workers,
            prefetch: self.prefetch,
            order: self.order,
            skip_failed: self.skip_failed,
            skipped: self.skipped,
        }
    }

    /// Shuffles the samples every epoch with a permutation derived from
    /// `seed` and the epoch (not from the number of workers).
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Whether to drop the last batch when it has fewer than `batch_size` samples.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Loads, each epoch, the indices `sampler` gives its rank
    /// ([`DistributedSampler::indices`]) instead of the whole dataset, as
    /// PyTorch's `DataLoader(dataset, sampler=DistributedSampler(...))`. The
    /// sampler's own shuffling then decides the order, and
    /// [`shuffle`](PrefetchLoader::shuffle)'s seed is not used; the loader's
    /// [`drop_last`](PrefetchLoader::drop_last) still applies to the last
    /// batch of the rank's share. The workers load exactly these indices.
    ///
    /// ```
    /// use kiln_data::{DataLoader, DistributedSampler, InMemoryDataset, PrefetchLoader};
    /// use kiln_core::HostTensor;
    ///
    /// let x = HostTensor::new((0..10).collect::<Vec<i64>>(), [10])?;
    /// let loader = PrefetchLoader::new(InMemoryDataset::new(x.clone(), x)?, 2)?
    ///     .sampler(DistributedSampler::new(4, 3)?)
    ///     .num_workers(2);
    /// assert_eq!(loader.batch_indices(0), [vec![3, 7], vec![1]]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn sampler(mut self, sampler: DistributedSampler) -> Self {
        self.sampler = Some(sampler);
        self
    }

    /// Visits each epoch's samples in `order`'s order instead of the loader's
    /// own (index order or [`shuffle`](PrefetchLoader::shuffle)d) or a
    /// [`sampler`](PrefetchLoader::sampler)'s, which are then not used.
    /// [`epoch_order`](PrefetchLoader::epoch_order),
    /// [`batch_indices`](PrefetchLoader::batch_indices),
    /// [`num_batches`](DataLoader::num_batches) and
    /// [`batches_from`](DataLoader::batches_from) all follow it;
    /// [`drop_last`](PrefetchLoader::drop_last) still applies.
    ///
    /// ```
    /// use kiln_data::{DataLoader, EpochOrder, InMemoryDataset, PrefetchLoader};
    /// use kiln_core::HostTensor;
    ///
    /// struct Reversed;
    /// impl EpochOrder for Reversed {
    ///     fn order(&self, len: usize, _epoch: u64) -> Vec<usize> {
    ///         (0..len).rev().collect()
    ///     }
    /// }
    /// let x = HostTensor::new((0..5).collect::<Vec<i64>>(), [5])?;
    /// let loader = PrefetchLoader::new(InMemoryDataset::new(x.clone(), x)?, 2)?.order(Reversed);
    /// assert_eq!(loader.batch_indices(0), [vec![4, 3], vec![2, 1], vec![0]]);
    /// assert_eq!(loader.num_batches(), 3);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn order(mut self, order: impl EpochOrder + 'static) -> Self {
        self.order = Some(Arc::new(order));
        self
    }

    /// Whether a sample whose loading fails is left out of its batch (with a
    /// `log::warn!` naming it and the error, and counted in
    /// [`skipped_samples`](PrefetchLoader::skipped_samples)) instead of
    /// failing the batch (`false`, the default). The decision is per sample,
    /// so batches stay the same for any number of workers. A batch whose
    /// samples all fail is still an error. Panics are never skipped.
    pub fn skip_failed_samples(mut self, skip: bool) -> Self {
        self.skip_failed = skip;
        self
    }

    /// Samples left out because they failed to load, over this loader's
    /// life (shared with its clones): each sample once, however many epochs
    /// or evaluation passes met it.
    pub fn skipped_samples(&self) -> u64 {
        self.skipped.count()
    }

    /// Number of background threads loading batches; 0 (the default) loads
    /// on the caller's thread.
    pub fn num_workers(mut self, num_workers: usize) -> Self {
        self.num_workers = num_workers;
        self
    }

    /// Batches each worker may have loaded ahead of the consumer (PyTorch's
    /// `prefetch_factor`, default 2); must be positive. The queue holds at
    /// most `num_workers * batches_per_worker` batches.
    pub fn prefetch(mut self, batches_per_worker: usize) -> Result<Self> {
        if batches_per_worker == 0 {
            return Err(Error::invalid_argument(
                "prefetch",
                "must be at least 1 batch per worker, got 0",
            ));
        }
        self.prefetch = batches_per_worker;
        Ok(self)
    }

    /// The dataset.
    pub fn dataset(&self) -> &D {
        &self.dataset
    }

    /// Samples per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Number of background worker threads (0: loading on the caller's thread).
    pub fn workers(&self) -> usize {
        self.num_workers
    }

    /// The distributed sampler choosing this rank's samples, if one was set
    /// with [`sampler`](PrefetchLoader::sampler).
    pub fn distributed_sampler(&self) -> Option<&DistributedSampler> {
        self.sampler.as_ref()
    }

    /// Most batches loaded ahead of the consumer: `num_workers * prefetch`.
    pub fn queue_capacity(&self) -> usize {
        self.num_workers.saturating_mul(self.prefetch)
    }

    /// The sample indices of epoch `epoch` in the order they are batched
    /// (including a tail that `drop_last` drops): the
    /// [`sampler`](PrefetchLoader::sampler)'s indices when there is one.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        match &self.order {
            Some(order) => order.order(self.dataset.len(), epoch),
            None => self.batch_sampler(epoch).sampler.indices(),
        }
    }

    /// `ai-dataloader`'s batch sampler for epoch `epoch`: iterating it gives
    /// the sample indices of each batch, in order. Its sampler is the
    /// loader's own order ([`LoaderSampler::Epoch`]), or this rank's shard
    /// when a [`sampler`](PrefetchLoader::sampler) is set
    /// ([`LoaderSampler::Shard`]). It does not describe a custom
    /// [`order`](PrefetchLoader::order) (whose indices are not a `Copy`
    /// sampler); [`batch_indices`](PrefetchLoader::batch_indices) does.
    pub fn batch_sampler(&self, epoch: u64) -> BatchSampler<LoaderSampler> {
        let len = self.dataset.len();
        let BatchSampler {
            sampler,
            batch_size,
            drop_last,
        } = batch_plan(len, self.seed, epoch, self.batch_size, self.drop_last);
        let sampler = match &self.sampler {
            Some(distributed) => LoaderSampler::Shard(distributed.shard(len, epoch)),
            None => LoaderSampler::Epoch(sampler),
        };
        BatchSampler {
            sampler,
            batch_size,
            drop_last,
        }
    }

    /// The sample indices of every batch of epoch `epoch`.
    pub fn batch_indices(&self, epoch: u64) -> Vec<Vec<usize>> {
        if self.order.is_none() {
            return self.batch_sampler(epoch).iter().collect();
        }
        let order = self.epoch_order(epoch);
        let mut batches: Vec<Vec<usize>> = order
            .chunks(self.batch_size)
            .map(<[usize]>::to_vec)
            .collect();
        if self.drop_last && batches.last().is_some_and(|b| b.len() < self.batch_size) {
            batches.pop();
        }
        batches
    }
}

impl<D, C> Clone for PrefetchLoader<D, C> {
    /// Another loader sharing the dataset and the collate function.
    fn clone(&self) -> Self {
        PrefetchLoader {
            dataset: Arc::clone(&self.dataset),
            collate: Arc::clone(&self.collate),
            batch_size: self.batch_size,
            seed: self.seed,
            drop_last: self.drop_last,
            sampler: self.sampler,
            num_workers: self.num_workers,
            prefetch: self.prefetch,
            order: self.order.clone(),
            skip_failed: self.skip_failed,
            skipped: Arc::clone(&self.skipped),
        }
    }
}

impl<D, C> fmt::Debug for PrefetchLoader<D, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefetchLoader")
            .field("dataset", &std::any::type_name::<D>())
            .field("batch_size", &self.batch_size)
            .field("seed", &self.seed)
            .field("drop_last", &self.drop_last)
            .field("sampler", &self.sampler)
            .field("num_workers", &self.num_workers)
            .field("prefetch", &self.prefetch)
            .field("custom_order", &self.order.is_some())
            .field("skip_failed_samples", &self.skip_failed)
            .finish()
    }
}

impl<D, C> DataLoader for PrefetchLoader<D, C>
where
    D: Dataset + 'static,
    C: Collate<D::Item, Output = Result<Batch>> + Send + Sync + 'static,
{
    fn num_batches(&self) -> usize {
        match &self.order {
            Some(order) => {
                let n = order.num_samples(self.dataset.len());
                if self.drop_last {
                    n / self.batch_size
                } else {
                    n.div_ceil(self.batch_size)
                }
            }
            None => Len::len(&self.batch_sampler(0)),
        }
    }

    fn batches(&self, epoch: u64) -> Box<dyn Iterator<Item = Result<Batch>> + Send + '_> {
        self.batches_from(epoch, 0)
    }

    fn skipped_samples(&self) -> u64 {
        PrefetchLoader::skipped_samples(self)
    }

    /// Skips the first `first` batches without reading their samples: a run
    /// resumed mid-epoch decodes nothing it already trained on.
    fn batches_from(
        &self,
        epoch: u64,
        first: usize,
    ) -> Box<dyn Iterator<Item = Result<Batch>> + Send + '_> {
        let mut plan: Vec<Vec<usize>> = self.batch_indices(epoch);
        plan.drain(..first.min(plan.len()));
        log::debug!(
            "PrefetchLoader epoch {epoch}: {} batches of up to {} samples from batch {first}, {} workers",
            plan.len(),
            self.batch_size,
            self.num_workers
        );
        let job = Job {
            dataset: Arc::clone(&self.dataset),
            collate: Arc::clone(&self.collate),
            plan: Arc::new(plan),
            epoch,
            first,
            skip: self.skip_failed.then(|| Arc::clone(&self.skipped)),
        };
        if self.num_workers > 0 && !job.plan.is_empty() {
            if let Some(iter) = WorkerIter::start(&job, self.num_workers, self.queue_capacity()) {
                return Box::new(iter);
            }
        }
        Box::new(InlineIter::new(job))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::InMemoryDataset;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts the samples read, to show that skipped batches are not loaded.
    struct Counting {
        inner: InMemoryDataset,
        reads: AtomicUsize,
    }

    impl Dataset for Counting {
        type Item = (HostTensor, HostTensor);
        fn len(&self) -> usize {
            self.inner.len()
        }
        fn get(&self, index: usize) -> Result<Self::Item> {
            self.reads.fetch_add(1, Ordering::Relaxed);
            self.inner.get(index)
        }
    }

    #[test]
    fn batches_from_skips_without_reading_and_matches_skip() -> Result<()> {
        let x = HostTensor::new((0..46).map(|v| v as f32).collect(), [23, 2])?;
        let y = HostTensor::new((0..23).collect::<Vec<i64>>(), [23])?;
        for workers in [0, 2] {
            let loader = PrefetchLoader::new(
                Counting {
                    inner: InMemoryDataset::new(x.clone(), y.clone())?,
                    reads: AtomicUsize::new(0),
                },
                4,
            )?
            .shuffle(3)
            .num_workers(workers);
            let all: Vec<Batch> = loader.batches(1).collect::<Result<_>>()?;
            let before = loader.dataset().reads.load(Ordering::Relaxed);
            let rest: Vec<Batch> = loader.batches_from(1, 4).collect::<Result<_>>()?;
            assert_eq!(rest, all[4..], "{workers} workers");
            assert_eq!(
                loader.dataset().reads.load(Ordering::Relaxed) - before,
                23 - 16,
                "only the remaining samples are read"
            );
            assert_eq!(loader.batches_from(1, 99).count(), 0);
        }
        Ok(())
    }
}
