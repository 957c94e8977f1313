//! PrefetchLoader: order, determinism across worker counts, errors, panics,
//! bounded prefetching and prompt shutdown.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use kiln_core::{Error, HostTensor, Result};
use kiln_data::{Batch, DataLoader, Dataset, InMemoryDataset, PrefetchLoader, SequentialLoader};

/// `n` samples: input `[i, 10 i]` (f32), target `i` (i64).
fn indexed(n: usize) -> InMemoryDataset {
    let x = (0..n).flat_map(|i| [i as f32, 10.0 * i as f32]).collect();
    InMemoryDataset::new(
        HostTensor::new(x, [n, 2]).expect("shape"),
        HostTensor::new((0..n as i64).collect::<Vec<_>>(), [n]).expect("shape"),
    )
    .expect("dataset")
}

/// All batches of one epoch, failing on the first error.
fn collect(loader: &impl DataLoader, epoch: u64) -> Result<Vec<Batch>> {
    loader.batches(epoch).collect()
}

/// The targets of each batch.
fn targets(batches: &[Batch]) -> Vec<Vec<i64>> {
    batches
        .iter()
        .map(|b| b.targets.as_slice::<i64>().expect("i64").to_vec())
        .collect()
}

/// Checks that every input row is `[t, 10 t]` for its target `t`.
fn assert_paired(batches: &[Batch]) {
    for b in batches {
        let x = b.inputs.as_slice::<f32>().expect("f32");
        let y = b.targets.as_slice::<i64>().expect("i64");
        assert_eq!(b.inputs.dims(), &[y.len(), 2]);
        for (row, &t) in x.chunks(2).zip(y) {
            assert_eq!(row, &[t as f32, 10.0 * t as f32]);
        }
    }
}

#[test]
fn same_seed_gives_the_same_batches_for_0_1_and_4_workers() -> Result<()> {
    let reference = SequentialLoader::new(indexed(37), 5)?.shuffle(11);
    let expected = collect(&reference, 3)?;
    assert_eq!(expected.len(), 8);
    for workers in [0, 1, 4] {
        let loader = PrefetchLoader::new(indexed(37), 5)?
            .shuffle(11)
            .num_workers(workers);
        assert_eq!(loader.num_batches(), 8);
        let got = collect(&loader, 3)?;
        // identical order and contents, and the same as the sequential loader's
        assert_eq!(got, expected, "{workers} workers");
        let planned: Vec<Vec<i64>> = loader
            .batch_indices(3)
            .into_iter()
            .map(|b| b.into_iter().map(|i| i as i64).collect())
            .collect();
        assert_eq!(targets(&got), planned);
        assert_paired(&got);
        // a second pass over the same epoch repeats it
        assert_eq!(collect(&loader, 3)?, expected);
    }
    Ok(())
}

#[test]
fn epochs_differ_and_visit_every_index_once() -> Result<()> {
    let loader = PrefetchLoader::new(indexed(50), 8)?
        .shuffle(2024)
        .num_workers(3);
    let mut orders = Vec::new();
    for epoch in 0..4 {
        let batches = collect(&loader, epoch)?;
        let sizes: Vec<usize> = batches.iter().map(|b| b.targets.numel()).collect();
        assert_eq!(sizes, [8, 8, 8, 8, 8, 8, 2]);
        let order: Vec<i64> = targets(&batches).concat();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<i64>>(), "epoch {epoch}");
        assert_paired(&batches);
        orders.push(order);
    }
    for a in 0..orders.len() {
        for b in a + 1..orders.len() {
            assert_ne!(orders[a], orders[b], "epochs {a} and {b}");
        }
    }
    // without shuffle the order is 0..n every epoch
    let plain = PrefetchLoader::new(indexed(10), 4)?.num_workers(2);
    assert_eq!(
        targets(&collect(&plain, 5)?),
        vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]
    );
    Ok(())
}

#[test]
fn drop_last_drops_only_the_short_batch() -> Result<()> {
    let loader = PrefetchLoader::new(indexed(37), 5)?
        .shuffle(1)
        .drop_last(true)
        .num_workers(2);
    assert_eq!(loader.num_batches(), 7);
    let batches = collect(&loader, 0)?;
    assert_eq!(batches.len(), 7);
    assert!(batches.iter().all(|b| b.targets.numel() == 5));
    // the samples are the first 35 of the epoch's order
    let order: Vec<i64> = loader.epoch_order(0).iter().map(|&i| i as i64).collect();
    assert_eq!(targets(&batches).concat(), order[..35]);

    let exact = PrefetchLoader::new(indexed(20), 5)?
        .drop_last(true)
        .num_workers(2);
    assert_eq!(exact.num_batches(), 4);
    assert_eq!(collect(&exact, 0)?.len(), 4);
    let too_big = PrefetchLoader::new(indexed(4), 5)?
        .drop_last(true)
        .num_workers(2);
    assert_eq!(too_big.num_batches(), 0);
    assert_eq!(too_big.batches(0).count(), 0);
    Ok(())
}

/// Wraps `indexed(n)`; sample `bad` fails (or panics).
struct Faulty {
    inner: InMemoryDataset,
    bad: usize,
    panic: bool,
}

impl Dataset for Faulty {
    type Item = (HostTensor, HostTensor);

    fn len(&self) -> usize {
        self.inner.len()
    }

    fn get(&self, index: usize) -> Result<Self::Item> {
        if index == self.bad {
            if self.panic {
                panic!("boom at sample {index}");
            }
            return Err(Error::data("images/broken.png", Some(17), "bad pixel"));
        }
        self.inner.get(index)
    }
}

#[test]
fn a_failing_item_is_an_error_at_its_batch_then_the_epoch_ends() -> Result<()> {
    for (seed, workers) in [(None, 4), (Some(5), 4), (None, 0), (Some(5), 1)] {
        let dataset = Faulty {
            inner: indexed(40),
            bad: 13,
            panic: false,
        };
        let mut loader = PrefetchLoader::new(dataset, 4)?.num_workers(workers);
        if let Some(seed) = seed {
            loader = loader.shuffle(seed);
        }
        let plan = loader.batch_indices(0);
        let position = plan
            .iter()
            .position(|b| b.contains(&13))
            .expect("13 is in some batch");
        if seed.is_none() {
            assert_eq!(position, 3);
        }
        let mut it = loader.batches(0);
        for planned in &plan[..position] {
            let batch = it.next().expect("batch before the failure")?;
            let want: Vec<i64> = planned.iter().map(|&i| i as i64).collect();
            assert_eq!(batch.targets.as_slice::<i64>()?, want.as_slice());
        }
        let err = it
            .next()
            .expect("an item for the failing batch")
            .expect_err("batch with sample 13 fails");
        match &err {
            Error::Data {
                path,
                offset,
                reason,
                ..
            } => {
                assert_eq!(path.to_str(), Some("images/broken.png"));
                assert_eq!(*offset, Some(17));
                assert_eq!(
                    reason,
                    &format!("batch {position}, dataset index 13: bad pixel")
                );
            }
            other => panic!("unexpected error {other:?}"),
        }
        assert!(it.next().is_none(), "the epoch ends after the error");
        assert!(it.next().is_none());
    }
    Ok(())
}

#[test]
fn a_panicking_get_is_an_error_not_a_hang() -> Result<()> {
    for workers in [4, 0] {
        let dataset = Faulty {
            inner: indexed(30),
            bad: 6,
            panic: true,
        };
        let loader = PrefetchLoader::new(dataset, 4)?.num_workers(workers);
        let results: Vec<Result<Batch>> = loader.batches(0).collect();
        // batches 0 and 1 load, batch 1 holds sample 6, nothing follows
        assert_eq!(results.len(), 2, "{workers} workers");
        assert!(results[0].is_ok());
        let err = results[1].as_ref().expect_err("panic reported");
        // The panic message is the source: read the whole chain, as a user sees it.
        let msg = err.display_chain().to_string();
        assert!(matches!(err, Error::Backend { .. }), "{msg}");
        assert!(
            msg.starts_with("data loader failed in batch 1 (dataset indices [4, 5, 6, 7])"),
            "{msg}"
        );
        assert!(msg.ends_with("panicked: boom at sample 6"), "{msg}");
    }
    Ok(())
}

/// `n` samples whose `get` sleeps `delay` and counts its calls.
struct Slow {
    inner: InMemoryDataset,
    delay: Duration,
    calls: Arc<AtomicUsize>,
}

impl Dataset for Slow {
    type Item = (HostTensor, HostTensor);

    fn len(&self) -> usize {
        self.inner.len()
    }

    fn get(&self, index: usize) -> Result<Self::Item> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        thread::sleep(self.delay);
        self.inner.get(index)
    }
}

fn slow(n: usize, delay_ms: u64) -> (Slow, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    (
        Slow {
            inner: indexed(n),
            delay: Duration::from_millis(delay_ms),
            calls: Arc::clone(&calls),
        },
        calls,
    )
}

/// Waits (at most 10 s) until `calls` reaches `target`.
fn wait_for(calls: &AtomicUsize, target: usize) {
    let start = Instant::now();
    while calls.load(Ordering::SeqCst) < target {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "only {} of {target} samples loaded after 10 s",
            calls.load(Ordering::SeqCst)
        );
        thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_slow_dataset_is_consumed_completely_with_4_workers() -> Result<()> {
    let (dataset, calls) = slow(26, 3);
    let loader = PrefetchLoader::new(dataset, 3)?.shuffle(8).num_workers(4);
    let batches = collect(&loader, 1)?;
    assert_eq!(batches.len(), 9);
    assert_paired(&batches);
    let expected = collect(&PrefetchLoader::new(indexed(26), 3)?.shuffle(8), 1)?;
    assert_eq!(batches, expected);
    assert_eq!(calls.load(Ordering::SeqCst), 26);
    Ok(())
}

#[test]
fn workers_prefetch_a_bounded_number_of_batches() -> Result<()> {
    let (dataset, calls) = slow(100, 1);
    let loader = PrefetchLoader::new(dataset, 2)?
        .num_workers(2)
        .prefetch(2)?;
    assert_eq!(loader.queue_capacity(), 4);
    let mut it = loader.batches(0);
    // Before anything is consumed, the workers fill the queue: 4 batches of 2.
    wait_for(&calls, 8);
    thread::sleep(Duration::from_millis(150));
    assert_eq!(calls.load(Ordering::SeqCst), 8, "the queue holds 4 batches");
    // Taking one batch frees one slot.
    let first = it.next().expect("batch 0")?;
    assert_eq!(first.targets.as_slice::<i64>()?, &[0, 1]);
    wait_for(&calls, 10);
    thread::sleep(Duration::from_millis(150));
    assert_eq!(calls.load(Ordering::SeqCst), 10);
    Ok(())
}

#[test]
fn dropping_mid_epoch_stops_and_joins_the_workers() -> Result<()> {
    // Once after one batch, once with the queue full and nothing consumed.
    for consumed in [1, 0] {
        let (dataset, calls) = slow(400, 20);
        let loader = PrefetchLoader::new(dataset, 2)?.num_workers(4);
        let mut it = loader.batches(0);
        for _ in 0..consumed {
            it.next().expect("a batch")?;
        }
        if consumed == 0 {
            wait_for(&calls, 16);
        }
        let start = Instant::now();
        drop(it);
        // Bounded only to catch a hang, not a performance assertion.
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "dropping took {:?}",
            start.elapsed()
        );
        // The workers are joined: no sample is read after the drop.
        let after_drop = calls.load(Ordering::SeqCst);
        thread::sleep(Duration::from_millis(100));
        assert_eq!(calls.load(Ordering::SeqCst), after_drop);
        assert!(after_drop < 400, "the epoch was not loaded to the end");
    }
    Ok(())
}

#[test]
fn custom_collate_and_its_errors() -> Result<()> {
    // Batch input: the sum of the sample rows; target: the batch size.
    let sum_collate = |samples: Vec<(HostTensor, HostTensor)>| -> Result<Batch> {
        let mut sum = [0f32; 2];
        for (x, _) in &samples {
            let x = x.as_slice::<f32>()?;
            sum[0] += x[0];
            sum[1] += x[1];
        }
        if sum[0] > 40.0 {
            return Err(Error::unsupported(format!("sum {}", sum[0])));
        }
        Ok(Batch {
            inputs: HostTensor::new(sum.to_vec(), [2])?,
            targets: HostTensor::scalar(samples.len() as i64),
        })
    };
    let loader = PrefetchLoader::with_collate(indexed(10), 3, sum_collate)?.num_workers(2);
    let results: Vec<Result<Batch>> = loader.batches(0).collect();
    // batches [0,1,2] (sum 3), [3,4,5] (12), [6,7,8] (21), [9] (9)
    assert_eq!(results.len(), 4);
    let sums: Vec<Vec<f32>> = results
        .iter()
        .map(|r| {
            r.as_ref()
                .expect("ok")
                .inputs
                .as_slice::<f32>()
                .expect("f32")
                .to_vec()
        })
        .collect();
    assert_eq!(
        sums,
        [[3.0, 30.0], [12.0, 120.0], [21.0, 210.0], [9.0, 90.0]]
    );

    let failing = PrefetchLoader::new(indexed(30), 5)?
        .collate(sum_collate)
        .num_workers(3);
    let results: Vec<Result<Batch>> = failing.batches(0).collect();
    // batch 1 = 5..10 sums to 35, batch 2 = 10..15 to 60
    assert_eq!(results.len(), 3);
    assert_eq!(
        results[2].as_ref().expect_err("collate fails").to_string(),
        "unsupported: batch 2, collating dataset indices [10, 11, 12, 13, 14]: sum 60"
    );
    Ok(())
}

#[test]
fn invalid_settings_are_rejected() -> Result<()> {
    let err = PrefetchLoader::new(indexed(3), 0).expect_err("batch size 0");
    assert_eq!(
        err.to_string(),
        "invalid argument `batch_size`: must be at least 1, got 0"
    );
    let err = PrefetchLoader::new(indexed(3), 1)?
        .prefetch(0)
        .expect_err("prefetch 0");
    assert_eq!(
        err.to_string(),
        "invalid argument `prefetch`: must be at least 1 batch per worker, got 0"
    );
    Ok(())
}

#[test]
fn loaders_can_share_one_dataset() -> Result<()> {
    let shared = Arc::new(indexed(9));
    let a = PrefetchLoader::new(Arc::clone(&shared), 4)?.num_workers(2);
    let b = a.clone().shuffle(4);
    assert_eq!(a.dataset().len(), 9);
    assert_eq!(
        targets(&collect(&a, 0)?),
        vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8]]
    );
    let order: Vec<i64> = b.epoch_order(0).iter().map(|&i| i as i64).collect();
    assert_eq!(targets(&collect(&b, 0)?).concat(), order);
    assert_eq!(Arc::strong_count(&shared), 2);
    let empty = PrefetchLoader::new(indexed(0), 4)?.num_workers(2);
    assert_eq!(empty.num_batches(), 0);
    assert_eq!(empty.batches(0).count(), 0);
    Ok(())
}
