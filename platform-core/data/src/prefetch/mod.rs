//! A data loader with background worker threads (PyTorch's `DataLoader`
//! with `num_workers > 0`).
//!
//! * `loader`: [`PrefetchLoader`], its builder, its order (its own, a
//!   [`DistributedSampler`](crate::DistributedSampler)'s, or an
//!   [`EpochOrder`]) and its [`DataLoader`](crate::DataLoader) implementation;
//! * `job`: loading one batch (reading its samples, collating them, skipping
//!   failed samples and counting them, catching panics);
//! * `context`: the batch and sample an error happened for, added to its message;
//! * `workers`: the iterators over an epoch's batches, on the caller's thread
//!   or on worker threads with a bounded queue and a reorder buffer.

mod context;
mod job;
mod loader;
mod workers;

pub use loader::PrefetchLoader;

/// A loader's own sample order per epoch, replacing its shuffling and
/// sampler ([`PrefetchLoader::order`]); e.g. kiln-vision's `ShardOrder`,
/// which visits a `WebDataset`'s shards in a shuffled order.
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
