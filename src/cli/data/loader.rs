//! A split's loader: in memory or prefetched by workers, shuffled by epoch,
//! and sharded per rank as `DistributedSampler` does; and `RecordTargets`,
//! which keeps the labels `predict` writes.

use std::sync::Mutex;

use crate::config::RunConfig;
use anyhow::Result;
use kiln_data::{Batch, DataLoader, InMemoryDataset, PrefetchLoader};

use super::Split;

/// The loader of one split; `shard` (rank, world size) gives this rank its
/// share of every epoch, in `torch.utils.data.DistributedSampler`'s order (a
/// webdataset: a block of the epoch's shard stream per rank).
pub(crate) fn loader(
    split: Split,
    config: &RunConfig,
    shuffle: bool,
    shard: Option<(usize, usize)>,
) -> Result<Box<dyn DataLoader>> {
    let data = &config.data;
    let sampler = |shuffle: bool| -> Result<Option<kiln_data::DistributedSampler>> {
        let Some((rank, world_size)) = shard else {
            return Ok(None);
        };
        let sampler = kiln_data::DistributedSampler::new(world_size, rank)?;
        // Training: the order of one process (`kiln train`), dealt out to the
        // ranks. With `drop_last` the sampler drops the uneven tail too rather
        // than padding it with samples from the start of the order, so the
        // ranks' k-th batches together are one process's k-th batch of
        // `world_size` times the size. Evaluation: every sample once, the
        // metrics added up across ranks.
        Ok(Some(if shuffle {
            sampler
                .shuffle(config.seed)
                .drop_last(data.loader.drop_last)
        } else {
            sampler.without_padding()
        }))
    };
    match split {
        Split::Tensors(x, y) => {
            let loader = PrefetchLoader::new(InMemoryDataset::new(x, y)?, data.loader.batch_size)?;
            Ok(Box::new(ordered(
                loader,
                config,
                shuffle,
                sampler(shuffle)?,
            )))
        }
        #[cfg(feature = "text")]
        Split::Text(split) => {
            let collate = kiln_text::PadCollate::new(split.pad_id)
                .flatten_targets(split.causal)
                .with_attention_mask(split.attention_mask);
            let loader =
                PrefetchLoader::with_collate(split.dataset, data.loader.batch_size, collate)?;
            Ok(Box::new(ordered(
                loader,
                config,
                shuffle,
                sampler(shuffle)?,
            )))
        }
        #[cfg(feature = "vision")]
        Split::Images(split) => {
            let mut loader = PrefetchLoader::new(split.dataset, data.loader.batch_size)?
                .num_workers(data.loader.workers)
                .drop_last(shuffle && data.loader.drop_last)
                .skip_failed_samples(
                    config.data.images().on_error == Some(kiln_vision::OnError::Skip),
                );
            match &split.shards {
                // Training on shards: each epoch the shards are shuffled, the
                // stream goes through the shuffle buffer, and each rank takes a block.
                // (Validation reads the shards in order, as a folder is read.)
                Some(shards) if shuffle => {
                    let (rank, world_size) = shard.unwrap_or((0, 1));
                    let buffer = match &data.source {
                        crate::config::DataSource::Webdataset(s) => s.shuffle_buffer,
                        _ => None,
                    }
                    .unwrap_or(DEFAULT_SHUFFLE_BUFFER);
                    loader =
                        loader.order(shards.epoch_order(config.seed, buffer, rank, world_size)?);
                }
                _ => {
                    if shuffle {
                        loader = loader.shuffle(config.seed);
                    }
                    if let Some(sampler) = sampler(shuffle)? {
                        loader = loader.sampler(sampler);
                    }
                }
            }
            match split.mix {
                // Each rank mixes its own batches with its own draws.
                Some(mix) if shuffle => {
                    let rank = shard.map_or(0, |(rank, _)| rank as u64);
                    let seed = config.seed ^ MIX_SEED ^ rank.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    Ok(Box::new(kiln_vision::transforms::BatchTransformed::new(
                        loader, mix, seed,
                    )))
                }
                _ => Ok(Box::new(loader)),
            }
        }
    }
}

/// `loader` with the config's workers and last batch, the seeded shuffle
/// when training, and the rank's share.
fn ordered<D: kiln_data::Dataset, C>(
    loader: PrefetchLoader<D, C>,
    config: &RunConfig,
    shuffle: bool,
    sampler: Option<kiln_data::DistributedSampler>,
) -> PrefetchLoader<D, C> {
    let mut loader = loader
        .num_workers(config.data.loader.workers)
        .drop_last(shuffle && config.data.loader.drop_last);
    if shuffle {
        loader = loader.shuffle(config.seed);
    }
    if let Some(sampler) = sampler {
        loader = loader.sampler(sampler);
    }
    loader
}

/// Told apart from the samples' transforms' seed, for the batches' MixUp and CutMix draws.
#[cfg(feature = "vision")]
const MIX_SEED: u64 = 0x6d69_7875_705f_6375;

/// `data.shuffle_buffer` when not set: webdataset's common choice.
#[cfg(feature = "vision")]
pub(crate) const DEFAULT_SHUFFLE_BUFFER: usize = 1000;

/// A loader that keeps the targets of the batches it gives, in order: the
/// labels `predict` writes beside each prediction.
pub(crate) struct RecordTargets {
    inner: Box<dyn DataLoader>,
    targets: Mutex<Vec<i64>>,
}

impl RecordTargets {
    pub(crate) fn new(inner: Box<dyn DataLoader>) -> Self {
        RecordTargets {
            inner,
            targets: Mutex::new(Vec::new()),
        }
    }

    /// The targets seen so far, as class indices (-1 where a target is not one).
    pub(crate) fn targets(&self) -> Vec<i64> {
        self.targets.lock().map(|t| t.clone()).unwrap_or_default()
    }
}

impl DataLoader for RecordTargets {
    fn num_batches(&self) -> usize {
        self.inner.num_batches()
    }

    fn skipped_samples(&self) -> u64 {
        self.inner.skipped_samples()
    }

    fn batches(
        &self,
        epoch: u64,
    ) -> Box<dyn Iterator<Item = kiln_core::Result<Batch>> + Send + '_> {
        let targets = &self.targets;
        Box::new(self.inner.batches(epoch).inspect(move |batch| {
            if let (Ok(batch), Ok(mut targets)) = (batch, targets.lock()) {
                let n = batch.targets.dims().first().copied().unwrap_or(0);
                let classes = batch.targets.to_dtype(kiln_core::DType::I64);
                match classes.as_slice::<i64>() {
                    Ok(values) if values.len() == n && !batch.targets.dtype().is_float() => {
                        targets.extend_from_slice(values)
                    }
                    _ => targets.extend(std::iter::repeat_n(-1, n)),
                }
            }
        }))
    }
}
