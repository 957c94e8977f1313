//! The iterators over an epoch's batches: [`InlineIter`] loads each batch
//! on the caller's thread when asked; [`WorkerIter`] runs worker threads that
//! claim batches up to a bound (the queue), and hands their results out in
//! order through a reorder buffer.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};

use super::job::Job;
use crate::collate::Collate;
use crate::{Batch, Dataset};
use kiln_core::error::{Error, Result};

/// Loads each batch on the caller's thread when it is asked for.
pub(super) struct InlineIter<D, C> {
    job: Job<D, C>,
    next: usize,
    done: bool,
}

impl<D, C> InlineIter<D, C> {
    /// The iterator over `job`'s batches, from its first.
    pub(super) fn new(job: Job<D, C>) -> Self {
        InlineIter {
            job,
            next: 0,
            done: false,
        }
    }
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
pub(super) struct WorkerIter {
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
    pub(super) fn start<D, C>(job: &Job<D, C>, num_workers: usize, capacity: usize) -> Option<Self>
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
