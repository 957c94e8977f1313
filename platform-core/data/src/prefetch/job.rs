//! Loading one batch of an epoch's plan: reading its samples (skipping and
//! counting those that fail, when asked), collating them, and turning a
//! panic into an error.

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

use super::context::{list_indices, panic_message, with_context};
use crate::collate::Collate;
use crate::{Batch, Dataset};
use kiln_core::error::{Error, Result};

/// The dataset indices a loader skipped because they failed to load.
#[derive(Debug, Default)]
pub(super) struct SkippedSamples(std::sync::Mutex<std::collections::BTreeSet<usize>>);

impl SkippedSamples {
    /// Records `index`; whether it is new.
    pub(super) fn insert(&self, index: usize) -> bool {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(index)
    }

    pub(super) fn count(&self) -> u64 {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len() as u64
    }
}

/// What every worker needs to load any batch of one epoch.
pub(super) struct Job<D, C> {
    pub(super) dataset: Arc<D>,
    pub(super) collate: Arc<C>,
    pub(super) plan: Arc<Vec<Vec<usize>>>,
    pub(super) epoch: u64,
    /// The epoch's batch number of `plan[0]`, for messages.
    pub(super) first: usize,
    /// When failed samples are skipped: the loader's record of them.
    pub(super) skip: Option<Arc<SkippedSamples>>,
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
    pub(super) fn load(&self, k: usize, stop: Option<&AtomicBool>) -> Option<Result<Batch>> {
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
