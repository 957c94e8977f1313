//! [`ShardOrder`]: the order of an epoch over a [`WebDataset`](crate::WebDataset)'s shards.

use std::ops::Range;
use std::sync::Arc;

use kiln_core::error::{Error, Result};
use kiln_core::rng::{permutation, SplitMix64};
use kiln_data::EpochOrder;
use kiln_data::TransformRng;

/// The epoch order of a [`WebDataset`](crate::WebDataset)
/// ([`WebDataset::epoch_order`](crate::WebDataset::epoch_order)), an
/// [`EpochOrder`] for [`PrefetchLoader::order`](kiln_data::PrefetchLoader::order).
/// Epoch `e`:
///
/// 1. the shards are permuted by `(seed, e)` (a SplitMix64 permutation, the
///    loaders' order before they took PyTorch's [`kiln_core::rng::epoch_order`]);
/// 2. their samples are concatenated in file order, the order a streaming
///    reader meets them;
/// 3. that stream goes through a shuffle buffer of `shuffle_buffer`
///    samples exactly as [`IterableLoader`](kiln_data::IterableLoader)'s
///    (fill to capacity, take a uniformly drawn one with
///    [`TransformRng::for_sample`]`(seed, e, 0)`, refill), but over indices;
/// 4. the result (`n` samples) is cut into `world_size` contiguous blocks of
///    `ceil(n / world_size)`: rank `r` takes block `r`, so it reads mostly
///    its own shards. The last blocks are padded by wrapping around to the
///    start of the order, as PyTorch's `DistributedSampler` pads, so every
///    rank takes the same number of steps; with padding, `ceil(n / w) * w -
///    n` samples are seen twice in an epoch.
///
/// With one rank every sample is visited exactly once per epoch. Nothing
/// here depends on the loader's workers, which split the work by batch.
///
/// ```
/// use kiln_data::EpochOrder;
/// use kiln_vision::ShardOrder;
///
/// // Two shards of 3 and 2 samples, no shuffle buffer, two ranks.
/// let order = ShardOrder::new(vec![0..3, 3..5], 7, 0, 0, 2)?;
/// let rank1 = ShardOrder::new(vec![0..3, 3..5], 7, 0, 1, 2)?;
/// let mut all = order.order(5, 0);
/// all.extend(rank1.order(5, 0));
/// assert_eq!(all.len(), 6); // 5 samples padded to 2 * 3
/// let mut seen = all[..5].to_vec();
/// seen.sort();
/// assert_eq!(seen, [0, 1, 2, 3, 4]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardOrder {
    shards: Arc<[Range<usize>]>,
    seed: u64,
    shuffle_buffer: usize,
    rank: usize,
    world_size: usize,
}

impl ShardOrder {
    /// The order of rank `rank` of `world_size` over shards holding the
    /// sample index ranges `shards` (each shard's samples, in file order).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] unless `world_size >= 1` and `rank < world_size`.
    pub fn new(
        shards: Vec<Range<usize>>,
        seed: u64,
        shuffle_buffer: usize,
        rank: usize,
        world_size: usize,
    ) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::invalid_argument(
                "world_size",
                "must be at least 1, got 0",
            ));
        }
        if rank >= world_size {
            return Err(Error::invalid_argument(
                "rank",
                format!("must be in 0..{world_size}, got {rank}"),
            ));
        }
        Ok(ShardOrder {
            shards: shards.into(),
            seed,
            shuffle_buffer,
            rank,
            world_size,
        })
    }

    /// The order of all ranks together (steps 1 to 3, before the split).
    pub fn global_order(&self, epoch: u64) -> Vec<usize> {
        let shard_order = shard_permutation(self.shards.len(), self.seed, epoch);
        let stream = shard_order.into_iter().flat_map(|s| self.shards[s].clone());
        if self.shuffle_buffer <= 1 {
            return stream.collect();
        }
        let mut rng = TransformRng::for_sample(self.seed, epoch, 0);
        let mut stream = stream.peekable();
        let mut buffer = Vec::with_capacity(self.shuffle_buffer);
        let mut out = Vec::new();
        loop {
            while buffer.len() < self.shuffle_buffer {
                match stream.next() {
                    Some(i) => buffer.push(i),
                    None => break,
                }
            }
            if buffer.is_empty() {
                return out;
            }
            let pick = rng.below(buffer.len() as u64) as usize;
            out.push(buffer.swap_remove(pick));
        }
    }

    /// Samples each rank visits per epoch: `ceil(n / world_size)` of `n`.
    pub fn per_rank(&self, n: usize) -> usize {
        n.div_ceil(self.world_size)
    }
}

/// The order of the shards in epoch `epoch` under `seed`: a SplitMix64
/// permutation, the one Kiln's loaders used before they took PyTorch's
/// `randperm` ([`kiln_core::rng::epoch_order`]). Shard streaming keeps it, so
/// that a run on shards resumes on the order it started with.
fn shard_permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let epoch_key = SplitMix64::new(epoch).next_u64();
    permutation(n, seed ^ epoch_key)
}

impl EpochOrder for ShardOrder {
    fn order(&self, len: usize, epoch: u64) -> Vec<usize> {
        let mut global = self.global_order(epoch);
        if global.iter().any(|&i| i >= len) {
            log::error!(
                "ShardOrder: the shards index samples up to {}, but the dataset has {len}; \
                 leaving the extra indices out",
                global.iter().max().copied().unwrap_or(0)
            );
            global.retain(|&i| i < len);
        }
        let n = global.len();
        if n == 0 {
            return global;
        }
        let per_rank = self.per_rank(n);
        (self.rank * per_rank..(self.rank + 1) * per_rank)
            .map(|i| global[i % n])
            .collect()
    }

    fn num_samples(&self, len: usize) -> usize {
        let n = self
            .shards
            .iter()
            .map(|r| r.clone().filter(|&i| i < len).count())
            .sum();
        self.per_rank(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_order_blocks_cover_the_padded_order() -> Result<()> {
        let shards = vec![0..4, 4..5, 5..9];
        for buffer in [0, 3] {
            let global = ShardOrder::new(shards.clone(), 1, buffer, 0, 1)?.global_order(2);
            let mut sorted = global.clone();
            sorted.sort();
            assert_eq!(sorted, (0..9).collect::<Vec<_>>());
            let mut joined = Vec::new();
            for rank in 0..4 {
                let o = ShardOrder::new(shards.clone(), 1, buffer, rank, 4)?;
                assert_eq!(o.num_samples(9), 3);
                joined.extend(o.order(9, 2));
            }
            let padded: Vec<usize> = (0..12).map(|i| global[i % 9]).collect();
            assert_eq!(joined, padded);
        }
        assert!(ShardOrder::new(shards.clone(), 0, 0, 2, 2).is_err());
        assert!(ShardOrder::new(shards, 0, 0, 0, 0).is_err());
        Ok(())
    }
}
