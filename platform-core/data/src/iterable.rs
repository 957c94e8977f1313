//! Iterable (stream-style) datasets, PyTorch's `IterableDataset`: examples come as
//! a stream, not by index (files larger than memory, generators, network shards).

use crate::{Batch, Collate, DataLoader, StackCollate, TransformRng};
use kiln_core::error::{Error, Result};

/// A dataset read in order, once per epoch.
pub trait IterableDataset: Send + Sync {
    /// One example.
    type Item: Send;

    /// The examples of `epoch`, in order. An `Err` item stops the epoch there.
    fn stream(&self, epoch: u64) -> Box<dyn Iterator<Item = Result<Self::Item>> + Send + '_>;
}

/// Batches an [`IterableDataset`]: batch size, drop-last, a custom collate, and an
/// optional seeded shuffle buffer (like `tf.data`'s `shuffle(buffer_size)`): the
/// order depends only on the seed, the epoch and the stream.
///
/// ```
/// use kiln_data::{DataLoader, IterableDataset, IterableLoader};
/// use kiln_core::{HostTensor, Result};
///
/// struct Squares;
/// impl IterableDataset for Squares {
///     type Item = (HostTensor, HostTensor);
///     fn stream(&self, _epoch: u64) -> Box<dyn Iterator<Item = Result<Self::Item>> + Send + '_> {
///         Box::new((0..10).map(|i| {
///             Ok((HostTensor::new(vec![i as f32], [1])?, HostTensor::new(vec![(i * i) as f32], [1])?))
///         }))
///     }
/// }
///
/// let loader = IterableLoader::new(Squares, 4)?;
/// let sizes: Vec<usize> = loader.batches(0).map(|b| b.map(|b| b.inputs.dims()[0])).collect::<Result<_>>()?;
/// assert_eq!(sizes, [4, 4, 2]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct IterableLoader<D, C = StackCollate> {
    dataset: D,
    batch_size: usize,
    drop_last: bool,
    shuffle: Option<(usize, u64)>,
    len_hint: usize,
    collate: C,
}

impl<D: IterableDataset> IterableLoader<D, StackCollate> {
    /// Batches of `batch_size` examples, stacked by [`StackCollate`].
    pub fn new(dataset: D, batch_size: usize) -> Result<Self> {
        Self::with_collate(dataset, batch_size, StackCollate)
    }
}

impl<D: IterableDataset, C> IterableLoader<D, C> {
    /// Batches of `batch_size` examples put together by `collate`.
    pub fn with_collate(dataset: D, batch_size: usize, collate: C) -> Result<Self> {
        if batch_size == 0 {
            return Err(Error::invalid_argument("batch_size", "must be at least 1"));
        }
        Ok(Self {
            dataset,
            batch_size,
            drop_last: false,
            shuffle: None,
            len_hint: 0,
            collate,
        })
    }

    /// Shuffles through a buffer of `buffer` examples, seeded by `seed` and the epoch.
    pub fn shuffle(mut self, buffer: usize, seed: u64) -> Self {
        self.shuffle = (buffer > 1).then_some((buffer, seed));
        self
    }

    /// Drops a last batch smaller than `batch_size`.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Declares how many batches an epoch has, for progress bars (a stream cannot
    /// tell; without this [`DataLoader::num_batches`] is 0, meaning unknown).
    pub fn with_num_batches(mut self, batches: usize) -> Self {
        self.len_hint = batches;
        self
    }
}

impl<D, C> DataLoader for IterableLoader<D, C>
where
    D: IterableDataset,
    C: Collate<D::Item, Output = Result<Batch>> + Send + Sync,
{
    fn num_batches(&self) -> usize {
        self.len_hint
    }

    fn batches(&self, epoch: u64) -> Box<dyn Iterator<Item = Result<Batch>> + Send + '_> {
        let mut source = self.dataset.stream(epoch);
        let mut buffer: Vec<D::Item> = Vec::new();
        let mut rng = self
            .shuffle
            .map(|(_, seed)| TransformRng::for_sample(seed, epoch, 0));
        let capacity = self.shuffle.map_or(0, |(b, _)| b);
        let mut exhausted = false;
        let mut failed = false;
        // The next example: straight from the stream, or a random one from the
        // shuffle buffer, which the stream then refills.
        let mut next_item = move || -> Option<Result<D::Item>> {
            let Some(rng) = rng.as_mut() else {
                return source.next();
            };
            while !exhausted && buffer.len() < capacity {
                match source.next() {
                    Some(Ok(item)) => buffer.push(item),
                    Some(Err(e)) => return Some(Err(e)),
                    None => exhausted = true,
                }
            }
            if buffer.is_empty() {
                return None;
            }
            let pick = rng.below(buffer.len() as u64) as usize;
            Some(Ok(buffer.swap_remove(pick)))
        };
        Box::new(std::iter::from_fn(move || {
            if failed {
                return None;
            }
            let mut items = Vec::with_capacity(self.batch_size);
            while items.len() < self.batch_size {
                match next_item() {
                    Some(Ok(item)) => items.push(item),
                    Some(Err(e)) => {
                        failed = true;
                        return Some(Err(e));
                    }
                    None => break,
                }
            }
            if items.is_empty() || (self.drop_last && items.len() < self.batch_size) {
                return None;
            }
            Some(self.collate.collate(items))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::tensor::HostTensor;

    struct Counter {
        n: usize,
        fail_at: Option<usize>,
    }

    impl IterableDataset for Counter {
        type Item = (HostTensor, HostTensor);
        fn stream(&self, _epoch: u64) -> Box<dyn Iterator<Item = Result<Self::Item>> + Send + '_> {
            Box::new((0..self.n).map(move |i| {
                if Some(i) == self.fail_at {
                    return Err(Error::invalid_argument(
                        "record",
                        format!("record {i} is corrupt"),
                    ));
                }
                Ok((
                    HostTensor::scalar(i as f32).reshape([1])?,
                    HostTensor::scalar(i as i64).reshape([1])?,
                ))
            }))
        }
    }

    fn labels(loader: &dyn DataLoader, epoch: u64) -> Vec<i64> {
        loader
            .batches(epoch)
            .flat_map(|b| {
                b.expect("batch")
                    .targets
                    .as_slice::<i64>()
                    .expect("i64")
                    .to_vec()
            })
            .collect()
    }

    #[test]
    fn batches_in_stream_order_with_a_short_last_batch() {
        let loader = IterableLoader::new(
            Counter {
                n: 10,
                fail_at: None,
            },
            4,
        )
        .expect("loader");
        assert_eq!(labels(&loader, 0), (0..10).collect::<Vec<i64>>());
        let dropped = IterableLoader::new(
            Counter {
                n: 10,
                fail_at: None,
            },
            4,
        )
        .expect("loader")
        .drop_last(true);
        assert_eq!(labels(&dropped, 0), (0..8).collect::<Vec<i64>>());
    }

    #[test]
    fn shuffle_buffer_is_a_seeded_permutation_per_epoch() {
        let loader = IterableLoader::new(
            Counter {
                n: 50,
                fail_at: None,
            },
            8,
        )
        .expect("loader")
        .shuffle(16, 7);
        let (a, b, c) = (labels(&loader, 0), labels(&loader, 0), labels(&loader, 1));
        assert_eq!(a, b, "same seed and epoch, same order");
        assert_ne!(a, c, "another epoch, another order");
        assert_ne!(a, (0..50).collect::<Vec<i64>>());
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            (0..50).collect::<Vec<i64>>(),
            "every example exactly once"
        );
    }

    #[test]
    fn a_bad_record_surfaces_as_an_error_and_ends_the_epoch() {
        let loader = IterableLoader::new(
            Counter {
                n: 10,
                fail_at: Some(5),
            },
            4,
        )
        .expect("loader");
        let results: Vec<Result<Batch>> = loader.batches(0).collect();
        assert_eq!(results.len(), 2);
        assert!(results[0].is_ok());
        let err = results[1]
            .as_ref()
            .expect_err("second batch fails")
            .to_string();
        assert!(err.contains("record 5 is corrupt"), "{err}");
    }
}
