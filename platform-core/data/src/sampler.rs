//! Sharding an epoch across the ranks of a distributed run, in PyTorch's order.

use ai_dataloader::sampler::Sampler;
use ai_dataloader::Len;

use crate::indexable::EpochSampler;
use kiln_core::error::{Error, Result};
use kiln_core::rng::epoch_order;
#[cfg(test)]
use kiln_core::rng::torch_randperm;

/// The samples one rank of a data-parallel run visits each epoch, exactly as
/// PyTorch's `torch.utils.data.DistributedSampler(dataset, num_replicas,
/// rank, shuffle, seed, drop_last)` after `set_epoch(epoch)`.
///
/// For a dataset of `n` samples, epoch `epoch`:
///
/// 1. the order is `0..n`, or with [`shuffle`](DistributedSampler::shuffle)`(seed)`
///    the permutation `torch.randperm(n)` draws from a generator seeded with
///    `seed + epoch` ([`epoch_order`], the order every Kiln loader shuffles
///    with: at world size 1 this sampler visits what a loader with
///    `.shuffle(seed)` visits);
/// 2. it is cut or padded to [`total_size`](DistributedSampler::total_size)`(n)`,
///    a multiple of `num_replicas`: with [`drop_last`](DistributedSampler::drop_last)
///    the tail beyond `(n / num_replicas) * num_replicas` is dropped, without
///    it the order is repeated from its start up to
///    `ceil(n / num_replicas) * num_replicas` (several times over when
///    `n < num_replicas`). This is [`global_order`](DistributedSampler::global_order);
/// 3. rank `r` takes every `num_replicas`-th entry from entry `r`:
///    [`indices`](DistributedSampler::indices), [`num_samples`](DistributedSampler::num_samples)
///    of them.
///
/// Every rank computes the same global order from the same seed and epoch,
/// so together the ranks visit each sample once per epoch (a few twice when
/// padded), and no two ranks need to communicate. Unlike PyTorch, shuffling
/// is off until [`shuffle`](DistributedSampler::shuffle) is called.
///
/// Loaders take one with `.sampler(...)`
/// ([`SequentialLoader::sampler`](crate::SequentialLoader::sampler),
/// [`PrefetchLoader::sampler`](crate::PrefetchLoader::sampler)) and then
/// batch the rank's indices instead of the whole dataset.
///
/// ```
/// use kiln_data::DistributedSampler;
///
/// // 10 samples over 4 ranks: padded to 12 with samples 0 and 1.
/// let rank1 = DistributedSampler::new(4, 1)?;
/// assert_eq!(rank1.total_size(10), 12);
/// assert_eq!(rank1.indices(10, 0), [1, 5, 9]);
/// assert_eq!(DistributedSampler::new(4, 3)?.indices(10, 0), [3, 7, 1]);
///
/// // drop_last: 10 samples over 4 ranks give 2 each; samples 8 and 9 are left out.
/// let dropping = DistributedSampler::new(4, 1)?.drop_last(true);
/// assert_eq!(dropping.indices(10, 0), [1, 5]);
///
/// // Shuffled: torch.randperm(10, generator=torch.Generator().manual_seed(0 + 0))
/// // is [4, 1, 7, 5, 3, 9, 0, 8, 6, 2].
/// let shuffled = DistributedSampler::new(2, 0)?.shuffle(0);
/// assert_eq!(shuffled.indices(10, 0), [4, 7, 3, 0, 6]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DistributedSampler {
    num_replicas: usize,
    rank: usize,
    seed: Option<u64>,
    drop_last: bool,
    pad: bool,
}

impl DistributedSampler {
    /// The sampler of rank `rank` of `num_replicas`, in index order, padding
    /// rather than dropping. `num_replicas` must be positive and `rank` below it.
    pub fn new(num_replicas: usize, rank: usize) -> Result<Self> {
        if num_replicas == 0 {
            return Err(Error::invalid_argument(
                "num_replicas",
                format!("must be at least 1, got 0 (with rank {rank})"),
            ));
        }
        if rank >= num_replicas {
            return Err(Error::invalid_argument(
                "rank",
                format!(
                    "must be in 0..{num_replicas} for num_replicas = {num_replicas}, got {rank}"
                ),
            ));
        }
        Ok(DistributedSampler {
            num_replicas,
            rank,
            seed: None,
            drop_last: false,
            pad: true,
        })
    }

    /// Shuffles every epoch as PyTorch does with `shuffle=True, seed=seed`:
    /// epoch `e`'s order is [`epoch_order`]`(n, Some(seed), e)`, that is
    /// [`torch_randperm`](kiln_core::rng::torch_randperm)`(n, seed + e)` (the sum
    /// wrapping at 2^64, where PyTorch would raise; only its low 32 bits
    /// matter to PyTorch's generator).
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Without padding (and without `drop_last`): every sample exactly once,
    /// the ranks' shares differing by at most one. Not PyTorch's training
    /// sampler (whose ranks must take the same number of steps), but what
    /// evaluation over a whole split needs: Kiln's trainer shards validation
    /// this way and adds the ranks' metric states up.
    pub fn without_padding(mut self) -> Self {
        self.pad = false;
        self
    }

    /// Whether to drop the tail of the order that does not divide evenly
    /// among the ranks (`true`), or to pad the order by repeating it (`false`,
    /// the default).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Number of ranks sharing each epoch.
    pub fn num_replicas(&self) -> usize {
        self.num_replicas
    }

    /// This sampler's rank, in `0..num_replicas`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The shuffling seed, or `None` for index order.
    pub fn shuffle_seed(&self) -> Option<u64> {
        self.seed
    }

    /// Whether the uneven tail is dropped rather than padded.
    pub fn drops_last(&self) -> bool {
        self.drop_last
    }

    /// Number of indices each rank visits per epoch of a dataset of `n`
    /// samples: `n / num_replicas` with `drop_last`, else
    /// `ceil(n / num_replicas)` (PyTorch's `len(sampler)`).
    ///
    /// PyTorch writes the `drop_last` case as
    /// `ceil((n - num_replicas) / num_replicas)` when `n % num_replicas != 0`,
    /// which is the same number, 0 when `n < num_replicas`.
    pub fn num_samples(&self, n: usize) -> usize {
        if !self.pad && !self.drop_last {
            return n.saturating_sub(self.rank).div_ceil(self.num_replicas);
        }
        if self.drop_last {
            n / self.num_replicas
        } else {
            n.div_ceil(self.num_replicas)
        }
    }

    /// Length of the [`global_order`](DistributedSampler::global_order) all
    /// ranks share: `num_samples(n) * num_replicas`.
    pub fn total_size(&self, n: usize) -> usize {
        if !self.pad && !self.drop_last {
            return n;
        }
        self.num_samples(n) * self.num_replicas
    }

    /// The order of epoch `epoch` over `0..n` before it is cut or padded:
    /// the loaders' own [`epoch_order`].
    fn base_order(&self, n: usize, epoch: u64) -> Vec<usize> {
        epoch_order(n, self.seed, epoch)
    }

    /// The order of epoch `epoch` that all ranks share, cut or padded to
    /// [`total_size`](DistributedSampler::total_size)`(n)` entries; rank `r`
    /// visits its entries `r, r + num_replicas, ...`.
    pub fn global_order(&self, n: usize, epoch: u64) -> Vec<usize> {
        let total = self.total_size(n);
        let mut order = self.base_order(n, epoch);
        if total <= order.len() {
            order.truncate(total);
        } else {
            // total > n >= 1 here: pad by repeating the order from its
            // start, as many times as needed.
            let base = order.len();
            while order.len() < total {
                let take = base.min(total - order.len());
                order.extend_from_within(..take);
            }
        }
        order
    }

    /// The dataset indices this rank visits in epoch `epoch` of a dataset of
    /// `n` samples, in order (PyTorch's `list(sampler)` after `set_epoch(epoch)`).
    pub fn indices(&self, n: usize, epoch: u64) -> Vec<usize> {
        self.global_order(n, epoch)
            .into_iter()
            .skip(self.rank)
            .step_by(self.num_replicas)
            .collect()
    }

    /// This rank's share of epoch `epoch` of a dataset of `n` samples, as an
    /// `ai-dataloader` [`Sampler`].
    pub fn shard(&self, n: usize, epoch: u64) -> ShardSampler {
        ShardSampler {
            sampler: *self,
            len: n,
            epoch,
        }
    }
}

/// One rank's share of one epoch under a [`DistributedSampler`], as an
/// `ai-dataloader` [`Sampler`]: iterating it gives
/// [`DistributedSampler::indices`], so `ai-dataloader`'s `BatchSampler` cuts
/// it into batches.
///
/// ```
/// use ai_dataloader::sampler::BatchSampler;
/// use kiln_data::DistributedSampler;
///
/// let sampler = DistributedSampler::new(2, 1)?.shard(9, 0);
/// let batches = BatchSampler { sampler, batch_size: 2, drop_last: false };
/// assert_eq!(batches.iter().collect::<Vec<_>>(), [vec![1, 3], vec![5, 7], vec![0]]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShardSampler {
    sampler: DistributedSampler,
    len: usize,
    epoch: u64,
}

impl ShardSampler {
    /// The distributed sampler this shard comes from.
    pub fn sampler(&self) -> &DistributedSampler {
        &self.sampler
    }

    /// The epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Number of samples in the whole dataset (not in this shard).
    pub fn dataset_len(&self) -> usize {
        self.len
    }

    /// The indices in the order visited.
    pub fn indices(&self) -> Vec<usize> {
        self.sampler.indices(self.len, self.epoch)
    }
}

impl Len for ShardSampler {
    /// Number of indices in this shard.
    fn len(&self) -> usize {
        self.sampler.num_samples(self.len)
    }
}

impl IntoIterator for ShardSampler {
    type Item = usize;
    type IntoIter = std::vec::IntoIter<usize>;

    fn into_iter(self) -> Self::IntoIter {
        self.indices().into_iter()
    }
}

impl Sampler for ShardSampler {
    /// The whole dataset in index order: one replica, no shuffling.
    fn new(data_source_len: usize) -> Self {
        ShardSampler {
            sampler: DistributedSampler {
                num_replicas: 1,
                rank: 0,
                seed: None,
                drop_last: false,
                pad: true,
            },
            len: data_source_len,
            epoch: 0,
        }
    }
}

/// The order of one epoch of a loader, as an `ai-dataloader` [`Sampler`]: the
/// loader's own order ([`EpochSampler`]), or a rank's share under a
/// [`DistributedSampler`] ([`ShardSampler`]).
///
/// [`PrefetchLoader::batch_sampler`](crate::PrefetchLoader::batch_sampler)
/// wraps it in `ai-dataloader`'s `BatchSampler`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LoaderSampler {
    /// The whole dataset, in index order or shuffled by the loader's seed.
    Epoch(EpochSampler),
    /// One rank's share, in PyTorch's `DistributedSampler` order.
    Shard(ShardSampler),
}

impl LoaderSampler {
    /// The indices in the order visited.
    pub fn indices(&self) -> Vec<usize> {
        match self {
            LoaderSampler::Epoch(s) => s.indices(),
            LoaderSampler::Shard(s) => s.indices(),
        }
    }
}

impl From<EpochSampler> for LoaderSampler {
    fn from(sampler: EpochSampler) -> Self {
        LoaderSampler::Epoch(sampler)
    }
}

impl From<ShardSampler> for LoaderSampler {
    fn from(sampler: ShardSampler) -> Self {
        LoaderSampler::Shard(sampler)
    }
}

impl Len for LoaderSampler {
    /// Number of indices visited.
    fn len(&self) -> usize {
        match self {
            LoaderSampler::Epoch(s) => Len::len(s),
            LoaderSampler::Shard(s) => Len::len(s),
        }
    }
}

impl IntoIterator for LoaderSampler {
    type Item = usize;
    type IntoIter = std::vec::IntoIter<usize>;

    fn into_iter(self) -> Self::IntoIter {
        self.indices().into_iter()
    }
}

impl Sampler for LoaderSampler {
    /// A sequential sampler over the whole dataset.
    fn new(data_source_len: usize) -> Self {
        LoaderSampler::Epoch(EpochSampler::sequential(data_source_len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_dataloader::sampler::BatchSampler;

    fn sampler(replicas: usize, rank: usize) -> DistributedSampler {
        DistributedSampler::new(replicas, rank).expect("valid rank")
    }

    #[test]
    fn without_shuffle_ranks_stride_through_the_indices() {
        assert_eq!(sampler(3, 0).indices(9, 0), [0, 3, 6]);
        assert_eq!(sampler(3, 1).indices(9, 0), [1, 4, 7]);
        assert_eq!(sampler(3, 2).indices(9, 5), [2, 5, 8]);
        assert_eq!(sampler(1, 0).indices(4, 2), [0, 1, 2, 3]);
        assert_eq!(sampler(3, 2).num_samples(9), 3);
        assert_eq!(sampler(3, 2).total_size(9), 9);
    }

    #[test]
    fn padding_repeats_the_order_from_its_start() {
        // 10 over 4: 12 in all, padded with 0 and 1.
        let s = sampler(4, 0);
        assert_eq!(s.num_samples(10), 3);
        assert_eq!(s.total_size(10), 12);
        assert_eq!(s.global_order(10, 0), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]);
        assert_eq!(sampler(4, 0).indices(10, 0), [0, 4, 8]);
        assert_eq!(sampler(4, 2).indices(10, 0), [2, 6, 0]);
        // 2 over 5: the order is repeated several times over.
        assert_eq!(sampler(5, 0).global_order(2, 0), [0, 1, 0, 1, 0]);
        assert_eq!(sampler(5, 3).indices(2, 0), [1]);
        assert_eq!(sampler(5, 4).indices(2, 0), [0]);
        // 1 over 3: everyone gets sample 0.
        for rank in 0..3 {
            assert_eq!(sampler(3, rank).indices(1, 7), [0]);
        }
        // An empty dataset gives nothing to anyone.
        assert_eq!(sampler(3, 1).total_size(0), 0);
        assert!(sampler(3, 1).indices(0, 0).is_empty());
    }

    #[test]
    fn drop_last_truncates_to_a_multiple_of_the_replicas() {
        let s = sampler(4, 3).drop_last(true);
        assert!(s.drops_last());
        assert_eq!(s.num_samples(10), 2);
        assert_eq!(s.total_size(10), 8);
        assert_eq!(s.global_order(10, 0), [0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(s.indices(10, 0), [3, 7]);
        // Evenly divisible: nothing is dropped.
        assert_eq!(s.indices(12, 0), [3, 7, 11]);
        // Fewer samples than ranks: nothing for anyone.
        assert_eq!(s.num_samples(3), 0);
        assert!(s.indices(3, 0).is_empty());
    }

    #[test]
    fn shuffle_uses_torch_randperm_of_seed_plus_epoch() {
        let s = sampler(3, 1).shuffle(40);
        assert_eq!(s.shuffle_seed(), Some(40));
        assert_eq!(sampler(3, 1).shuffle_seed(), None);
        let order = torch_randperm(11, 42);
        assert_eq!(s.global_order(11, 2)[..11], order[..]);
        assert_eq!(s.global_order(11, 2)[11], order[0]);
        let expected: Vec<usize> = [1, 4, 7, 10].iter().map(|&i| order[i]).collect();
        assert_eq!(s.indices(11, 2), expected);
        // The same seed and epoch agree; another epoch differs.
        assert_eq!(s.indices(11, 2), s.indices(11, 2));
        assert_ne!(s.global_order(11, 2), s.global_order(11, 3));
    }

    #[test]
    fn the_ranks_together_cover_the_global_order() {
        for (n, replicas, drop_last) in
            [(10, 4, false), (10, 4, true), (3, 5, false), (17, 3, true)]
        {
            for seed in [None, Some(12_345)] {
                let base = sampler(replicas, 0).drop_last(drop_last);
                let base = seed.map_or(base, |seed| base.shuffle(seed));
                let global = base.global_order(n, 1);
                assert_eq!(global.len(), base.total_size(n));
                let mut interleaved = vec![usize::MAX; global.len()];
                for rank in 0..replicas {
                    let mut s = sampler(replicas, rank).drop_last(drop_last);
                    if let Some(seed) = seed {
                        s = s.shuffle(seed);
                    }
                    let mine = s.indices(n, 1);
                    assert_eq!(mine.len(), s.num_samples(n), "{n} {replicas} {rank}");
                    for (k, &index) in mine.iter().enumerate() {
                        interleaved[rank + k * replicas] = index;
                    }
                }
                assert_eq!(interleaved, global, "{n} {replicas} {drop_last} {seed:?}");
                // Every sample is visited when padding; at most once when dropping.
                let mut seen = global.clone();
                seen.sort_unstable();
                seen.dedup();
                if drop_last {
                    assert_eq!(seen.len(), global.len());
                } else {
                    assert_eq!(seen, (0..n).collect::<Vec<_>>());
                }
            }
        }
    }

    #[test]
    fn rank_bounds_are_checked() {
        let err = DistributedSampler::new(0, 0).expect_err("no replicas");
        assert_eq!(
            err.to_string(),
            "invalid argument `num_replicas`: must be at least 1, got 0 (with rank 0)"
        );
        let err = DistributedSampler::new(4, 4).expect_err("rank too large");
        assert_eq!(
            err.to_string(),
            "invalid argument `rank`: must be in 0..4 for num_replicas = 4, got 4"
        );
        let s = sampler(4, 3);
        assert_eq!((s.num_replicas(), s.rank()), (4, 3));
        assert!(!s.drops_last());
    }

    #[test]
    fn samplers_plug_into_batch_sampler() {
        let shard = sampler(2, 0).shuffle(3).shard(7, 1);
        assert_eq!(Len::len(&shard), 4);
        assert_eq!(shard.epoch(), 1);
        assert_eq!(shard.dataset_len(), 7);
        assert_eq!(shard.sampler().rank(), 0);
        let indices = sampler(2, 0).shuffle(3).indices(7, 1);
        assert_eq!(shard.into_iter().collect::<Vec<_>>(), indices);
        let batches = BatchSampler {
            sampler: LoaderSampler::from(shard),
            batch_size: 3,
            drop_last: false,
        };
        assert_eq!(Len::len(&batches), 2);
        assert_eq!(
            batches.iter().collect::<Vec<_>>(),
            [indices[..3].to_vec(), indices[3..].to_vec()]
        );
        assert_eq!(<ShardSampler as Sampler>::new(3).indices(), [0, 1, 2]);
        assert_eq!(<LoaderSampler as Sampler>::new(3).indices(), [0, 1, 2]);

        let own = LoaderSampler::from(EpochSampler::shuffled(5, 9, 2));
        assert_eq!(own.indices(), EpochSampler::shuffled(5, 9, 2).indices());
        assert_eq!(Len::len(&own), 5);
        let sharded = LoaderSampler::from(sampler(2, 1).shard(5, 2));
        assert_eq!(sharded.indices(), [1, 3, 0]);
        assert_eq!(Len::len(&sharded), 3);
    }

    #[test]
    fn without_padding_every_sample_once() -> Result<()> {
        for (n, replicas) in [(0, 2), (1, 3), (10, 4), (12, 4), (7, 1)] {
            let mut seen = Vec::new();
            for rank in 0..replicas {
                let s = DistributedSampler::new(replicas, rank)?
                    .shuffle(3)
                    .without_padding();
                let mine = s.indices(n, 2);
                assert_eq!(mine.len(), s.num_samples(n), "{n} {replicas} {rank}");
                seen.extend(mine);
            }
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "{n} {replicas}");
        }
        Ok(())
    }
}
