//! DistributedSampler and torch_randperm against PyTorch's
//! `torch.utils.data.DistributedSampler` and `torch.randperm`, and the loaders
//! batching a sampler's indices.

use kiln_core::rng::{torch_randperm, TORCH_RANDPERM_SMALL_LIMIT};
use kiln_core::{HostTensor, Result};
use kiln_data::{
    DataLoader, DistributedSampler, InMemoryDataset, PrefetchLoader, SequentialLoader,
};
use serde_json::{json, Value};

/// One `DistributedSampler(range(n), num_replicas, rank, shuffle, seed,
/// drop_last)` after `set_epoch(epoch)`.
#[derive(Clone, Copy, Debug)]
struct Case {
    n: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    epoch: u64,
    drop_last: bool,
}

impl Case {
    fn json(&self) -> Value {
        json!({
            "n": self.n,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epoch": self.epoch,
            "drop_last": self.drop_last,
        })
    }

    fn sampler(&self) -> Result<DistributedSampler> {
        let sampler =
            DistributedSampler::new(self.num_replicas, self.rank)?.drop_last(self.drop_last);
        Ok(if self.shuffle {
            sampler.shuffle(self.seed)
        } else {
            sampler
        })
    }
}

/// Every combination of the sizes (an empty dataset, one sample, fewer
/// samples than ranks, uneven and even splits, 10,000), ranks, shuffling,
/// seeds, epochs and drop_last.
fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for n in [0, 1, 3, 10, 12, 10_000] {
        for (num_replicas, rank) in [(1, 0), (2, 1), (4, 0), (4, 3), (3, 2)] {
            for shuffle in [false, true] {
                for seed in [0, 12_345] {
                    for epoch in [0, 3] {
                        for drop_last in [false, true] {
                            cases.push(Case {
                                n,
                                num_replicas,
                                rank,
                                shuffle,
                                seed,
                                epoch,
                                drop_last,
                            });
                        }
                    }
                }
            }
        }
    }
    cases
}

/// The sizes and seeds of the `torch.randperm` comparisons.
const RANDPERMS: [(usize, u64); 10] = [
    (0, 0),
    (1, 0),
    (2, 0),
    (2, 7),
    (10, 0),
    (10, 12_345),
    (1000, 3),
    (100_000, 0),
    (100_000, 12_345),
    // Seeds differing above bit 31 seed PyTorch's generator alike.
    (1000, (1 << 32) + 3),
];

fn usizes(value: &Value, what: &str) -> Vec<usize> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("{what}: not an array: {value}"))
        .iter()
        .map(|v| {
            v.as_u64()
                .unwrap_or_else(|| panic!("{what}: not an index: {v}")) as usize
        })
        .collect()
}

#[test]
fn sampler_and_randperm_match_pytorch() -> Result<()> {
    let Some(python) = kiln_testkit::python("sampler_and_randperm_match_pytorch") else {
        return Ok(());
    };
    let cases = cases();
    let request = json!({
        "samplers": cases.iter().map(Case::json).collect::<Vec<_>>(),
        "randperm": RANDPERMS.iter().map(|&(n, seed)| json!({"n": n, "seed": seed})).collect::<Vec<_>>(),
    });
    let out = kiln_testkit::run_reference_script!(
        &python,
        "distributed_sampler.py",
        &[request.to_string()]
    );
    let reference: Value = serde_json::from_str(&out).expect("JSON from the script");
    let torch = reference["torch"].as_str().unwrap_or("?");

    let expected = reference["samplers"].as_array().expect("samplers");
    assert_eq!(expected.len(), cases.len());
    for (case, expected) in cases.iter().zip(expected) {
        let sampler = case.sampler()?;
        let want = usizes(&expected["indices"], "indices");
        assert_eq!(
            sampler.indices(case.n, case.epoch),
            want,
            "{case:?} against PyTorch {torch}"
        );
        assert_eq!(
            Some(sampler.num_samples(case.n) as u64),
            expected["len"].as_u64(),
            "len of {case:?}"
        );
    }

    let expected = reference["randperm"].as_array().expect("randperm");
    assert_eq!(expected.len(), RANDPERMS.len());
    for (&(n, seed), expected) in RANDPERMS.iter().zip(expected) {
        assert_eq!(
            torch_randperm(n, seed),
            usizes(expected, "randperm"),
            "torch.randperm({n}) with seed {seed}, PyTorch {torch}"
        );
    }
    Ok(())
}

/// The smallest `n` for which ATen's randperm switches to 64-bit draws and the
/// inside-out shuffle: 1.7 GB of indices on each side, and a few seconds of
/// PyTorch (about 90 s in all in a debug build), so it runs only when asked for:
/// `cargo test -p kiln-data --release --test data_sampler -- --ignored`.
#[test]
#[ignore = "3.4 GB and about 90 s in a debug build; run with --ignored"]
fn randperm_matches_pytorch_for_very_large_n() {
    let Some(python) = kiln_testkit::python("randperm_matches_pytorch_for_very_large_n") else {
        return;
    };
    let n = TORCH_RANDPERM_SMALL_LIMIT;
    let seed = 12_345u64;
    let out = kiln_testkit::run_reference_script!(
        &python,
        "distributed_sampler.py",
        &[
            "--large-randperm".to_string(),
            n.to_string(),
            seed.to_string()
        ]
    );
    let reference: Value = serde_json::from_str(&out).expect("JSON from the script");
    let perm = torch_randperm(n, seed);
    assert_eq!(perm.len(), n);
    assert_eq!(perm[..1000], usizes(&reference["head"], "head")[..]);
    assert_eq!(perm[n - 1000..], usizes(&reference["tail"], "tail")[..]);
    let strided: Vec<usize> = perm.iter().copied().step_by(1_000_003).collect();
    assert_eq!(strided, usizes(&reference["strided"], "strided"));
}

/// `n` samples: input `[i, 10 i]` (f32), target `i` (i64).
fn indexed(n: usize) -> Result<InMemoryDataset> {
    let x = (0..n).flat_map(|i| [i as f32, 10.0 * i as f32]).collect();
    InMemoryDataset::new(
        HostTensor::new(x, [n, 2])?,
        HostTensor::new((0..n as i64).collect::<Vec<_>>(), [n])?,
    )
}

/// The targets of each batch of `epoch`, checking inputs stay paired with them.
fn targets(loader: &impl DataLoader, epoch: u64) -> Result<Vec<Vec<usize>>> {
    loader
        .batches(epoch)
        .map(|batch| {
            let batch = batch?;
            let x = batch.inputs.as_slice::<f32>()?.to_vec();
            let y = batch.targets.into_vec::<i64>()?;
            for (row, &t) in x.chunks(2).zip(&y) {
                assert_eq!(row, [t as f32, 10.0 * t as f32]);
            }
            Ok(y.into_iter().map(|t| t as usize).collect())
        })
        .collect()
}

/// `order` in batches of `batch_size`, the last one dropped if short and `drop_last`.
fn chunked(order: &[usize], batch_size: usize, drop_last: bool) -> Vec<Vec<usize>> {
    order
        .chunks(batch_size)
        .filter(|c| !drop_last || c.len() == batch_size)
        .map(<[usize]>::to_vec)
        .collect()
}

#[test]
fn loaders_batch_the_sampler_s_indices() -> Result<()> {
    let n = 23;
    for (num_replicas, rank) in [(1, 0), (3, 0), (3, 2), (4, 1), (30, 29)] {
        for shuffle in [None, Some(12_345)] {
            let mut sampler = DistributedSampler::new(num_replicas, rank)?;
            if let Some(seed) = shuffle {
                sampler = sampler.shuffle(seed);
            }
            for sampler in [sampler, sampler.drop_last(true)] {
                for (batch_size, drop_last) in [(4, false), (4, true), (1, false), (50, false)] {
                    let what =
                        format!("{sampler:?}, batches of {batch_size}, drop_last {drop_last}");
                    let sequential = SequentialLoader::new(indexed(n)?, batch_size)?
                        .shuffle(99)
                        .drop_last(drop_last)
                        .sampler(sampler);
                    let prefetch = PrefetchLoader::new(indexed(n)?, batch_size)?
                        .shuffle(99)
                        .drop_last(drop_last)
                        .sampler(sampler);
                    assert_eq!(prefetch.distributed_sampler(), Some(&sampler));
                    for epoch in [0, 3] {
                        let order = sampler.indices(n, epoch);
                        let expected = chunked(&order, batch_size, drop_last);
                        assert_eq!(sequential.epoch_order(epoch), order, "{what}");
                        assert_eq!(prefetch.epoch_order(epoch), order, "{what}");
                        assert_eq!(prefetch.batch_indices(epoch), expected, "{what}");
                        assert_eq!(sequential.num_batches(), expected.len(), "{what}");
                        assert_eq!(prefetch.num_batches(), expected.len(), "{what}");
                        assert_eq!(targets(&sequential, epoch)?, expected, "{what}");
                        for workers in [0, 2] {
                            let loader = prefetch.clone().num_workers(workers);
                            assert_eq!(
                                targets(&loader, epoch)?,
                                expected,
                                "{what}, {workers} workers"
                            );
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

#[test]
fn loaders_without_a_sampler_keep_their_own_order() -> Result<()> {
    let sequential = SequentialLoader::new(indexed(10)?, 3)?.shuffle(5);
    let prefetch = PrefetchLoader::new(indexed(10)?, 3)?.shuffle(5);
    assert_eq!(sequential.distributed_sampler(), None);
    assert_eq!(prefetch.distributed_sampler(), None);
    let order = kiln_core::rng::epoch_order(10, Some(5), 2);
    assert_eq!(sequential.epoch_order(2), order);
    assert_eq!(prefetch.epoch_order(2), order);
    assert_eq!(prefetch.batch_indices(2), chunked(&order, 3, false));
    Ok(())
}

#[test]
fn plain_loaders_shuffle_in_the_order_of_one_rank() -> Result<()> {
    for n in [0, 1, 7, 23, 100] {
        for seed in [0, 99, 12_345] {
            let one_rank = DistributedSampler::new(1, 0)?.shuffle(seed);
            let sequential = SequentialLoader::new(indexed(n)?, 4)?.shuffle(seed);
            let prefetch = PrefetchLoader::new(indexed(n)?, 4)?.shuffle(seed);
            for epoch in [0, 1, 5] {
                let order = one_rank.indices(n, epoch);
                assert_eq!(order, torch_randperm(n, seed + epoch), "{n} {seed} {epoch}");
                assert_eq!(one_rank.drop_last(true).indices(n, epoch), order);
                assert_eq!(sequential.epoch_order(epoch), order, "{n} {seed} {epoch}");
                assert_eq!(prefetch.epoch_order(epoch), order, "{n} {seed} {epoch}");
                assert_eq!(targets(&sequential, epoch)?.concat(), order);
                let workers = prefetch.clone().num_workers(2);
                assert_eq!(targets(&workers, epoch)?.concat(), order);
            }
        }
    }
    Ok(())
}

/// The k-th batch of each of two ranks of batch `b`, put together, is the
/// k-th batch of one process of batch `2b` (as sets): both loaders and the
/// samplers drop the short tail (the sampler's `drop_last` too, so that no
/// rank pads its share with samples from the start of the order).
#[test]
fn two_ranks_of_b_batch_together_what_one_process_of_2b_batches() -> Result<()> {
    let sorted = |mut v: Vec<usize>| {
        v.sort_unstable();
        v
    };
    for (n, b) in [
        (23, 4),
        (24, 3),
        (7, 2),
        (10, 5),
        (9, 1),
        (100, 8),
        (31, 8),
        (3, 2),
    ] {
        for seed in [0, 12_345] {
            let what = format!("n {n}, b {b}, seed {seed}");
            let one = SequentialLoader::new(indexed(n)?, 2 * b)?
                .shuffle(seed)
                .drop_last(true);
            let one_rank = PrefetchLoader::new(indexed(n)?, 2 * b)?
                .drop_last(true)
                .sampler(DistributedSampler::new(1, 0)?.shuffle(seed).drop_last(true));
            let ranks = (0..2)
                .map(|rank| {
                    let sampler = DistributedSampler::new(2, rank)?
                        .shuffle(seed)
                        .drop_last(true);
                    Ok(PrefetchLoader::new(indexed(n)?, b)?
                        .drop_last(true)
                        .sampler(sampler)
                        .num_workers(1))
                })
                .collect::<Result<Vec<_>>>()?;
            assert_eq!(one.num_batches(), n / (2 * b), "{what}");
            assert_eq!(one_rank.num_batches(), one.num_batches(), "{what}");
            for epoch in [0, 2] {
                let whole = targets(&one, epoch)?;
                assert_eq!(targets(&one_rank, epoch)?, whole, "{what}");
                let (r0, r1) = (targets(&ranks[0], epoch)?, targets(&ranks[1], epoch)?);
                assert_eq!(r0.len(), whole.len(), "{what}: rank 0's batches");
                assert_eq!(r1.len(), whole.len(), "{what}: rank 1's batches");
                for (k, batch) in whole.iter().enumerate() {
                    let union = [r0[k].clone(), r1[k].clone()].concat();
                    assert_eq!(sorted(union), sorted(batch.clone()), "{what}, batch {k}");
                }
            }
        }
    }
    // Padding instead of dropping in the sampler: 7 samples over 2 ranks are
    // padded to 8, so each rank has 2 batches of 2, one process of batch 4
    // only 1 (the second rank batch holds a padded sample).
    let padded = PrefetchLoader::new(indexed(7)?, 2)?
        .drop_last(true)
        .sampler(DistributedSampler::new(2, 1)?.shuffle(0));
    assert_eq!(padded.num_batches(), 2);
    Ok(())
}
