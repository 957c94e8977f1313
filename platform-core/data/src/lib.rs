//! Datasets, batches and data loaders.
//!
//! * [`Dataset`] gives random access to samples; [`InMemoryDataset`] holds
//!   them as tensor rows, [`IndexableDataset`] adapts any `ai-dataloader`
//!   dataset, [`MapDataset`] and [`TransformedDataset`] derive new ones.
//! * [`DataLoader`] turns a dataset into the mini-batches of an epoch:
//!   [`SequentialLoader`] in the calling thread, [`PrefetchLoader`] with
//!   background worker threads and a bounded queue.
//! * [`DistributedSampler`] gives each rank of a data-parallel run its share
//!   of every epoch, in exactly the order of PyTorch's `DistributedSampler`;
//!   both loaders take one.
//! * Readers: [`load_digits`], [`load_mnist`] and [`read_idx`] (IDX files,
//!   raw or gzip), [`load_csv`], [`read_npy`] (NumPy's `.npy` files).
//! * Transforms ([`Transform`], drawing from a [`TransformRng`] seeded per
//!   sample and epoch): [`Compose`], closures, and [`one_hot`].
//! * An epoch's order for a stream ([`EpochOrder`], [`IterableDataset`] and
//!   [`IterableLoader`]).
//!
//! Images (decoders, class folders, WebDataset shards, torchvision's
//! transforms) are in `kiln-vision`, text rows for language models in
//! `kiln-text`: both are datasets and transforms of this crate.
//!
//! Samples are `kiln-core` [`HostTensor`]s. The loaders shuffle with
//! [`kiln_core::rng::epoch_order`] (`torch.randperm` of `seed + epoch`, the
//! order of [`DistributedSampler`] at world size 1), so a seed gives the same
//! order everywhere, however the run is launched.

mod collate;
mod csv;
mod dataset;
mod digits;
mod indexable;
mod iterable;
mod loader;
mod map;
mod mnist;
mod npy;
mod prefetch;
mod sampler;
mod source;
mod split;
mod subset;
#[cfg(test)]
mod testing;
mod transform;

pub use collate::{Collate, StackCollate};
pub use csv::{load_csv, CsvOptions, LabelColumn, LabelKind};
pub use dataset::InMemoryDataset;
pub use digits::load_digits;
pub use indexable::{EpochSampler, IndexableDataset};
pub use iterable::{IterableDataset, IterableLoader};
pub use loader::SequentialLoader;
pub use map::{MapDataset, TransformedDataset};
pub use mnist::{load_mnist, load_mnist_images, load_mnist_labels, read_idx, Mnist};
pub use npy::read_npy;
pub use prefetch::{EpochOrder, PrefetchLoader};
pub use sampler::{DistributedSampler, LoaderSampler, ShardSampler};
pub use split::{split_indices, train_test_split, Split};
pub use subset::Subset;
pub use transform::{one_hot, Compose, Transform, TransformRng};

use std::sync::Arc;

use kiln_core::error::Result;
use kiln_core::tensor::HostTensor;

/// The data pipeline's most used names, in one `use kiln_data::prelude::*`.
pub mod prelude {
    pub use crate::{
        train_test_split, Batch, DataLoader, Dataset, DistributedSampler, InMemoryDataset,
        PrefetchLoader, SequentialLoader, Transform,
    };
}

/// Random access to a finite collection of samples.
///
/// Contract: [`get`](Dataset::get) with `index >= len()` returns
/// [`Error::InvalidArgument`](kiln_core::Error::InvalidArgument); it never panics.
pub trait Dataset: Send + Sync {
    /// One sample, e.g. an `(input, target)` pair.
    type Item: Send;

    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sample at `index`.
    fn get(&self, index: usize) -> Result<Self::Item>;

    /// The sample at `index` as seen in epoch `epoch` of a loader.
    ///
    /// Loaders call this rather than [`get`](Dataset::get) so that datasets
    /// with random augmentation ([`TransformedDataset`]) draw different but
    /// reproducible randomness every epoch, whichever thread loads the
    /// sample. The default ignores `epoch`; wrappers forward it.
    fn get_for_epoch(&self, index: usize, epoch: u64) -> Result<Self::Item> {
        let _ = epoch;
        self.get(index)
    }
}

/// A shared dataset, so that several loaders (or threads) can read one copy.
impl<D: Dataset + ?Sized> Dataset for Arc<D> {
    type Item = D::Item;

    fn len(&self) -> usize {
        (**self).len()
    }

    fn get(&self, index: usize) -> Result<Self::Item> {
        (**self).get(index)
    }

    fn get_for_epoch(&self, index: usize, epoch: u64) -> Result<Self::Item> {
        (**self).get_for_epoch(index, epoch)
    }
}

/// A mini-batch: inputs and targets with a leading batch dimension.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// Model inputs, `[batch, ...]`.
    pub inputs: HostTensor,
    /// Targets, `[batch]` or `[batch, ...]`.
    pub targets: HostTensor,
}

/// Produces the mini-batches of one epoch.
///
/// Contract:
///
/// * The order is deterministic: the same loader configuration (including
///   its seed) and the same `epoch` yield the same batches; different epochs
///   of a shuffling loader yield different orders.
/// * Every epoch visits each sample at most once (exactly once unless the
///   loader drops an incomplete last batch). A loader given a
///   [`DistributedSampler`] visits its rank's share of the samples instead.
/// * Failures, including those in worker threads of parallel loaders, surface
///   as `Err` items; the iterator never hangs or panics because of them.
///
/// ```
/// use kiln_data::{DataLoader, InMemoryDataset, SequentialLoader};
/// use kiln_core::HostTensor;
///
/// let x = HostTensor::new((0..10).map(|v| v as f32).collect(), [5, 2])?;
/// let y = HostTensor::new(vec![0i64, 1, 0, 1, 0], [5])?;
/// let loader = SequentialLoader::new(InMemoryDataset::new(x, y)?, 2)?;
/// assert_eq!(loader.num_batches(), 3);
/// let sizes: Vec<usize> = loader
///     .batches(0)
///     .map(|b| b.map(|b| b.targets.numel()))
///     .collect::<Result<_, _>>()?;
/// assert_eq!(sizes, [2, 2, 1]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub trait DataLoader {
    /// Number of batches [`batches`](DataLoader::batches) yields per epoch.
    fn num_batches(&self) -> usize;

    /// The batches of epoch `epoch`.
    fn batches(&self, epoch: u64) -> Box<dyn Iterator<Item = Result<Batch>> + Send + '_>;

    /// The batches of epoch `epoch` from batch `first` on, what a run resumed
    /// mid-epoch needs: the same batches as `batches(epoch).skip(first)`.
    ///
    /// The default loads and drops the first `first` batches; loaders that
    /// can skip without reading samples ([`PrefetchLoader`]) override it.
    fn batches_from(
        &self,
        epoch: u64,
        first: usize,
    ) -> Box<dyn Iterator<Item = Result<Batch>> + Send + '_> {
        Box::new(self.batches(epoch).skip(first))
    }

    /// Samples left out of their batches because they failed to load (a
    /// corrupt image under [`PrefetchLoader::skip_failed_samples`]), over the
    /// loader's life; 0 for loaders that never skip.
    fn skipped_samples(&self) -> u64 {
        0
    }
}
