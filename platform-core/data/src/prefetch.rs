//! A data loader with background worker threads (PyTorch's `DataLoader`
//! with `num_workers > 0`).

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};

use ai_dataloader::sampler::BatchSampler;
use ai_dataloader::Len;

use crate::collate::{Collate, StackCollate};
use crate::indexable::batch_plan;
use crate::sampler::{DistributedSampler, LoaderSampler};
use crate::{Batch, DataLoader, Dataset};
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// Batches [`prefetch`](PrefetchLoader::prefetch) keeps ready per worker unless told otherwise.
const DEFAULT_PREFETCH: usize = 2;
/// Sample indices an error message lists before abbreviating.
const LISTED_INDICES: usize = 8;

/// A loader's own sample order per epoch, replacing its shuffling and
/// sampler ([`PrefetchLoader::order`]); e.g. [`ShardOrder`](crate::ShardOrder),
/// which visits a [`WebDataset`](crate::WebDataset)'s shards in a shuffled order.
///
/// Contract: the order depends only on `(len, epoch)` and the implementor's
/// configuration, never on the thread or the number of workers, and every
/// index is below `len`. Indices may repeat (padding for ranks).
///
/// ```
/// use kiln_data::EpochOrder;
///
/// /// Visits the samples backwards, every epoch.
/// struct Reversed;
/// impl EpochOrder for Reversed {
///     fn order(&self, len: usize, _epoch: u64) -> Vec<usize> {
///         (0..len).rev().collect()
///     }
/// }
/// assert_eq!(Reversed.order(3, 0), [2, 1, 0]);
/// assert_eq!(Reversed.num_samples(3), 3);
/// ```
pub trait EpochOrder: Send + Sync {
    /// The sample indices of epoch `epoch` of a dataset of `len` samples, in
    /// the order they are batched.
    fn order(&self, len: usize, epoch: u64) -> Vec<usize>;

    /// Number of indices per epoch; the default computes epoch 0's order.
    fn num_samples(&self, len: usize) -> usize {
        self.order(len, 0).len()
    }
}

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
        Box::new(InlineIter {
            job,
            next: 0,
            done: false,
        })
    }
}

/// The dataset indices a loader skipped because they failed to load.
#[derive(Debug, Default)]
struct SkippedSamples(std::sync::Mutex<std::collections::BTreeSet<usize>>);

impl SkippedSamples {
    /// Records `index`; whether it is new.
    fn insert(&self, index: usize) -> bool {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(index)
    }

    fn count(&self) -> u64 {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len() as u64
    }
}

/// What every worker needs to load any batch of one epoch.
struct Job<D, C> {
    dataset: Arc<D>,
    collate: Arc<C>,
    plan: Arc<Vec<Vec<usize>>>,
    epoch: u64,
    /// The epoch's batch number of `plan[0]`, for messages.
    first: usize,
    /// When failed samples are skipped: the loader's record of them.
    skip: Option<Arc<SkippedSamples>>,
}

impl<D, C> Clone for Job<D, C> {
    fn clone(&self) -> Self {
        Job {
            dataset: Arc::clone(&self.dataset),
            collate: Arc::clone(&self.collate),
            plan: Arc::clone(&self.plan),
            epoch: self.epoch,
            first: self.first,
            skip: self.skip.clone(),
        }
    }
}

impl<D, C> Job<D, C>
where
    D: Dataset,
    C: Collate<D::Item, Output = Result<Batch>>,
{
    /// Loads batch `k`, turning a panic into an error. `None` if `stop` was
    /// raised before it was complete.
    fn load(&self, k: usize, stop: Option<&AtomicBool>) -> Option<Result<Batch>> {
        let indices = self.plan.get(k).map(Vec::as_slice).unwrap_or_default();
        match panic::catch_unwind(AssertUnwindSafe(|| self.load_unguarded(k, indices, stop))) {
            Ok(result) => result,
            Err(payload) => Some(Err(Error::backend(
                "data loader",
                format!(
                    "batch {} (dataset indices {}) on thread `{}`",
                    k + self.first,
                    list_indices(indices),
                    thread::current().name().unwrap_or("unnamed")
                ),
                format!("panicked: {}", panic_message(payload.as_ref())),
            ))),
        }
    }

    fn load_unguarded(
        &self,
        k: usize,
        indices: &[usize],
        stop: Option<&AtomicBool>,
    ) -> Option<Result<Batch>> {
        let mut samples = Vec::with_capacity(indices.len());
        let mut last_failure = None;
        for &index in indices {
            if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
                return None;
            }
            match self.dataset.get_for_epoch(index, self.epoch) {
                Ok(sample) => samples.push(sample),
                Err(e) => {
                    let context = format!("batch {}, dataset index {index}", k + self.first);
                    let Some(skipped) = &self.skip else {
                        return Some(Err(with_context(e, &context)));
                    };
                    // Named once; met again in a later epoch or pass, it is not news.
                    if skipped.insert(index) {
                        log::warn!("PrefetchLoader: skipping {context}: {}", e.display_chain());
                    } else {
                        log::debug!("PrefetchLoader: skipping {context} again");
                    }
                    last_failure = Some((e, context));
                }
            }
        }
        if let (true, Some((e, context))) = (samples.is_empty(), last_failure) {
            return Some(Err(with_context(
                e,
                &format!(
                    "every one of the batch's {} samples failed to load; the last, {context}",
                    indices.len()
                ),
            )));
        }
        Some(self.collate.collate(samples).map_err(|e| {
            with_context(
                e,
                &format!(
                    "batch {}, collating dataset indices {}",
                    k + self.first,
                    list_indices(indices)
                ),
            )
        }))
    }
}

/// `[3, 9, 4]`, or the first few indices and a count.
fn list_indices(indices: &[usize]) -> String {
    if indices.len() <= LISTED_INDICES {
        format!("{indices:?}")
    } else {
        format!(
            "{:?} and {} more",
            &indices[..LISTED_INDICES],
            indices.len() - LISTED_INDICES
        )
    }
}

/// The message of a panic payload (`panic!("...")` gives a `&str` or a `String`).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_string()
    }
}

/// `err` with `context` (`"batch 3, dataset index 17"`) prepended to the
/// free-text part of its message, keeping its variant and source.
///
/// Variants without a free-text field are returned unchanged and the
/// context is logged instead.
fn with_context(err: Error, context: &str) -> Error {
    let prefix = |s: String| format!("{context}: {s}");
    match err {
        Error::ShapeMismatch {
            context: c,
            expected,
            actual,
        } => Error::ShapeMismatch {
            context: prefix(c),
            expected,
            actual,
        },
        Error::DTypeMismatch {
            context: c,
            expected,
            actual,
        } => Error::DTypeMismatch {
            context: prefix(c),
            expected,
            actual,
        },
        Error::DeviceMismatch {
            context: c,
            expected,
            actual,
        } => Error::DeviceMismatch {
            context: prefix(c),
            expected,
            actual,
        },
        Error::Io { path, source } => Error::Io {
            path,
            source: io::Error::new(
                source.kind(),
                ContextError {
                    context: context.to_string(),
                    source,
                },
            ),
        },
        Error::Checkpoint {
            path,
            reason,
            source,
        } => Error::Checkpoint {
            path,
            reason: prefix(reason),
            source,
        },
        Error::Data {
            path,
            offset,
            reason,
            source,
        } => Error::Data {
            path,
            offset,
            reason: prefix(reason),
            source,
        },
        Error::Backend {
            backend,
            context: c,
            source,
        } => Error::Backend {
            backend,
            context: prefix(c),
            source,
        },
        Error::Unsupported { what } => Error::Unsupported { what: prefix(what) },
        Error::InvalidArgument { name, reason } => Error::InvalidArgument {
            name,
            reason: prefix(reason),
        },
        other => {
            log::error!("data loader: {context}: {}", other.display_chain());
            other
        }
    }
}

/// The batch and sample an I/O error happened for; the I/O error is its
/// source, and is not repeated in its message.
#[derive(Debug)]
struct ContextError {
    context: String,
    source: io::Error,
}

impl fmt::Display for ContextError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.context)
    }
}

impl std::error::Error for ContextError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// Loads each batch on the caller's thread when it is asked for.
struct InlineIter<D, C> {
    job: Job<D, C>,
    next: usize,
    done: bool,
}

impl<D, C> Iterator for InlineIter<D, C>
where
    D: Dataset,
    C: Collate<D::Item, Output = Result<Batch>>,
{
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done || self.next >= self.job.plan.len() {
            return None;
        }
        let k = self.next;
        self.next += 1;
        // Without a stop flag a load always completes.
        let result = self.job.load(k, None)?;
        self.done = result.is_err();
        Some(result)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = if self.done {
            0
        } else {
            self.job.plan.len() - self.next
        };
        (left.min(1), Some(left))
    }
}

/// What the consumer and the workers share.
struct Shared {
    control: Mutex<Control>,
    /// Signalled when a worker may claim another batch or must stop.
    wake: Condvar,
    /// Mirrors `Control::stop` for cheap checks between samples.
    stop: AtomicBool,
}

/// Which batches the workers may claim.
struct Control {
    /// The next batch no worker has claimed yet.
    next_claim: usize,
    /// Workers may claim batches below this; the consumer raises it by one
    /// for every batch it takes, which bounds the batches held in memory.
    limit: usize,
    stop: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Control> {
        // No code that can panic runs under this lock, so poisoning cannot
        // leave `Control` inconsistent.
        self.control.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn request_stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.lock().stop = true;
        self.wake.notify_all();
    }
}

/// Receives batches from worker threads and hands them out in order.
struct WorkerIter {
    shared: Arc<Shared>,
    results: Receiver<(usize, Result<Batch>)>,
    workers: Vec<JoinHandle<()>>,
    /// Loaded batches that arrived before an earlier one.
    pending: BTreeMap<usize, Result<Batch>>,
    next: usize,
    total: usize,
    done: bool,
}

impl WorkerIter {
    /// Starts `num_workers` threads (fewer if the system refuses some);
    /// `None` if none could be started.
    fn start<D, C>(job: &Job<D, C>, num_workers: usize, capacity: usize) -> Option<Self>
    where
        D: Dataset + 'static,
        C: Collate<D::Item, Output = Result<Batch>> + Send + Sync + 'static,
    {
        let total = job.plan.len();
        let shared = Arc::new(Shared {
            control: Mutex::new(Control {
                next_claim: 0,
                limit: capacity.max(1),
                stop: false,
            }),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let (sender, results) = mpsc::channel();
        let mut workers = Vec::with_capacity(num_workers.min(total));
        for id in 0..num_workers.min(total) {
            let job = job.clone();
            let shared_for_worker = Arc::clone(&shared);
            let sender = sender.clone();
            let spawned = thread::Builder::new()
                .name(format!("kiln-loader-{id}"))
                .spawn(move || work(&job, &shared_for_worker, &sender));
            match spawned {
                Ok(handle) => workers.push(handle),
                Err(e) => {
                    log::warn!(
                        "PrefetchLoader: cannot start worker thread {id}: {e}; \
                         continuing with {} workers",
                        workers.len()
                    );
                    break;
                }
            }
        }
        // Only the workers hold senders now, so the channel disconnects if
        // they all end.
        drop(sender);
        if workers.is_empty() {
            log::warn!("PrefetchLoader: no worker thread started; loading on the caller's thread");
            return None;
        }
        Some(WorkerIter {
            shared,
            results,
            workers,
            pending: BTreeMap::new(),
            next: 0,
            total,
            done: false,
        })
    }

    /// Stops the workers and waits for them.
    fn finish(&mut self) {
        self.done = true;
        if self.workers.is_empty() {
            return;
        }
        self.shared.request_stop();
        for handle in self.workers.drain(..) {
            let name = handle.thread().name().unwrap_or("unnamed").to_string();
            if handle.join().is_err() {
                // Panics in user code are caught inside the worker; this is
                // a panic in the loader itself, already reported as an item.
                log::error!("PrefetchLoader: worker thread `{name}` panicked");
            }
        }
    }
}

/// The loop of one worker thread: claim the next batch allowed, load it,
/// send it; until every batch is claimed or the consumer stops.
fn work<D, C>(job: &Job<D, C>, shared: &Shared, results: &Sender<(usize, Result<Batch>)>)
where
    D: Dataset,
    C: Collate<D::Item, Output = Result<Batch>>,
{
    let total = job.plan.len();
    loop {
        let k = {
            let control = shared.lock();
            let mut control = shared
                .wake
                .wait_while(control, |c| {
                    !c.stop && c.next_claim < total && c.next_claim >= c.limit
                })
                .unwrap_or_else(PoisonError::into_inner);
            if control.stop || control.next_claim >= total {
                return;
            }
            control.next_claim += 1;
            control.next_claim - 1
        };
        let Some(result) = job.load(k, Some(&shared.stop)) else {
            return;
        };
        log::trace!("PrefetchLoader: batch {k} loaded");
        if results.send((k, result)).is_err() {
            return;
        }
    }
}

impl Iterator for WorkerIter {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done || self.next >= self.total {
            self.finish();
            return None;
        }
        loop {
            if let Some(result) = self.pending.remove(&self.next) {
                self.next += 1;
                if result.is_err() {
                    self.finish();
                } else {
                    self.shared.lock().limit += 1;
                    self.shared.wake.notify_one();
                }
                return Some(result);
            }
            match self.results.recv() {
                Ok((k, result)) => {
                    self.pending.insert(k, result);
                }
                Err(mpsc::RecvError) => {
                    // Every worker ended without sending batch `next`: only a
                    // panic outside the guarded loading can do that.
                    let k = self.next;
                    self.finish();
                    return Some(Err(Error::backend(
                        "data loader",
                        format!("batch {k}"),
                        "every worker thread ended before loading it",
                    )));
                }
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = if self.done { 0 } else { self.total - self.next };
        (left.min(1), Some(left))
    }
}

impl Drop for WorkerIter {
    fn drop(&mut self) {
        if !self.workers.is_empty() {
            log::debug!(
                "PrefetchLoader: stopping {} workers at batch {} of {}",
                self.workers.len(),
                self.next,
                self.total
            );
        }
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::InMemoryDataset;
    use std::path::PathBuf;
    use std::sync::atomic::AtomicUsize;

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

    #[test]
    fn context_is_prepended_and_source_kept() {
        let e = with_context(
            Error::data(PathBuf::from("x.bin"), Some(4), "bad byte"),
            "batch 2, dataset index 9",
        );
        assert_eq!(
            e.to_string(),
            "malformed data file x.bin at byte 4: batch 2, dataset index 9: bad byte"
        );

        let e = with_context(
            Error::io("img/7.png", io::Error::new(io::ErrorKind::NotFound, "gone")),
            "batch 0, dataset index 7",
        );
        assert_eq!(
            e.display_chain().to_string(),
            "img/7.png: batch 0, dataset index 7: gone"
        );
        match &e {
            Error::Io { source, .. } => assert_eq!(source.kind(), io::ErrorKind::NotFound),
            other => panic!("unexpected {other:?}"),
        }
        assert!(std::error::Error::source(&e).is_some());

        let e = with_context(Error::unsupported("float16"), "batch 1, dataset index 3");
        assert_eq!(
            e.to_string(),
            "unsupported: batch 1, dataset index 3: float16"
        );
    }

    #[test]
    fn index_lists_are_abbreviated() {
        assert_eq!(list_indices(&[3, 1]), "[3, 1]");
        let many: Vec<usize> = (0..10).collect();
        assert_eq!(list_indices(&many), "[0, 1, 2, 3, 4, 5, 6, 7] and 2 more");
    }

    #[test]
    fn panic_messages_are_extracted() {
        let p = panic::catch_unwind(|| panic!("static {}", "text")).expect_err("panics");
        assert_eq!(panic_message(p.as_ref()), "static text");
        let p = panic::catch_unwind(|| std::panic::panic_any(5u8)).expect_err("panics");
        assert_eq!(
            panic_message(p.as_ref()),
            "a panic with a non-string payload"
        );
    }
}
