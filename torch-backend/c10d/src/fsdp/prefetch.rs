//! Prefetching under full sharding: while a unit computes, the next unit's
//! parameters are already being all-gathered (FSDP2's forward and backward
//! prefetch), so that the gather's time hides behind the compute.
//!
//! Which unit comes next is read from the previous pass of the same kind
//! (training, or evaluation): the units every pass gathers, in order (a
//! training pass's forward units, then, with `reshard_after_forward`, its
//! backward units in reverse). While the current pass follows that order,
//! each gather starts the next one before returning. Every rank follows the
//! same order, so every rank starts the same collectives in the same order.
//!
//! A prefetched gather is used only by the unit it was started for, in the
//! same pass: a pass that leaves the order waits for it and drops it, and so
//! does every change of the shards (the optimizer's step, a loaded state), so
//! that no gather of old shards is ever used. At most two units' whole
//! parameters exist at a time: the current one's and the next one's.

use std::sync::{Arc, Mutex, MutexGuard};

use kiln_core::{Error, Result};
use tch::Tensor;

use super::shards::{PendingUnitGather, UnitShards};

/// The kinds of pass whose gather orders are kept apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    /// A training micro-batch: forward and backward.
    Train,
    /// An evaluation or prediction: forward only.
    Eval,
}

impl Pass {
    fn index(self) -> usize {
        match self {
            Pass::Train => 0,
            Pass::Eval => 1,
        }
    }
}

/// How often prefetched gathers were used and dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Gathers a unit took already under way.
    pub used: u64,
    /// Gathers started for a unit that did not come next, waited for and
    /// dropped.
    pub dropped: u64,
}

struct State {
    /// Each pass kind's last complete order of gathered units.
    recorded: [Vec<usize>; 2],
    /// This pass's kind and the units it gathered so far.
    pass: Pass,
    current: Vec<usize>,
    /// Whether `current` is a prefix of the recorded order so far.
    following: bool,
    /// The gather started for the unit expected next.
    pending: Option<(usize, PendingUnitGather)>,
    stats: PrefetchStats,
}

/// The gather order of a model's units and the prefetched gather, shared by
/// its units (which gather through it) and its strategy (which starts each
/// pass and drops what a change of the shards would make stale).
pub(crate) struct GatherSchedule {
    units: Vec<Arc<UnitShards>>,
    enabled: bool,
    state: Mutex<State>,
}

impl std::fmt::Debug for GatherSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatherSchedule")
            .field("units", &self.units.len())
            .field("enabled", &self.enabled)
            .finish_non_exhaustive()
    }
}

impl GatherSchedule {
    /// The schedule of `units` (in their indices' order); without `enabled`,
    /// every gather runs when its unit asks for it.
    pub(crate) fn new(units: Vec<Arc<UnitShards>>, enabled: bool) -> Arc<Self> {
        let schedule = Arc::new(GatherSchedule {
            units,
            enabled,
            state: Mutex::new(State {
                recorded: [Vec::new(), Vec::new()],
                pass: Pass::Train,
                current: Vec::new(),
                following: true,
                pending: None,
                stats: PrefetchStats::default(),
            }),
        });
        for unit in &schedule.units {
            let _ = unit.schedule.set(Arc::downgrade(&schedule));
        }
        schedule
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| Error::distributed("FSDP", "the gather schedule's lock is poisoned"))
    }

    /// A new pass of `kind` begins (a collective when a gather is pending:
    /// it is waited for and dropped); the one before it becomes its kind's
    /// order.
    pub(crate) fn begin(&self, kind: Pass) -> Result<()> {
        let mut state = self.lock()?;
        Self::drop_pending(&mut state)?;
        if !state.current.is_empty() {
            let done = std::mem::take(&mut state.current);
            let slot = state.pass.index();
            state.recorded[slot] = done;
        }
        state.pass = kind;
        state.following = true;
        Ok(())
    }

    /// Waits for and drops a pending gather: the shards are about to change,
    /// or have.
    pub(crate) fn cancel(&self) -> Result<()> {
        let mut state = self.lock()?;
        Self::drop_pending(&mut state)
    }

    fn drop_pending(state: &mut State) -> Result<()> {
        if let Some((_, pending)) = state.pending.take() {
            state.stats.dropped += 1;
            // The collective must complete on every rank before its buffers go.
            drop(pending.wait()?);
        }
        Ok(())
    }

    /// Unit `unit`'s whole parameters: the prefetched gather if it is this
    /// unit's, else one now; then the next unit's gather started.
    pub(crate) fn gather(&self, unit: usize) -> Result<Vec<Tensor>> {
        let shards = self.units.get(unit).ok_or_else(|| {
            Error::distributed("FSDP", format!("no unit {unit} in the gather schedule"))
        })?;
        let mut state = self.lock()?;
        let pending = match state.pending.take() {
            Some((u, pending)) if u == unit => {
                state.stats.used += 1;
                pending
            }
            other => {
                if let Some((_, stale)) = other {
                    state.stats.dropped += 1;
                    drop(stale.wait()?);
                }
                shards.start_gather()?
            }
        };
        let position = state.current.len();
        state.current.push(unit);
        let order = &state.recorded[state.pass.index()];
        let following = state.following && order.get(position) == Some(&unit);
        let next = order.get(position + 1).copied();
        state.following = following;
        if self.enabled && following {
            if let Some(next) = next.and_then(|n| self.units.get(n).map(|s| (n, s))) {
                state.pending = Some((next.0, next.1.start_gather()?));
            }
        }
        drop(state);
        shards.finish_gather(pending)
    }

    /// How often prefetched gathers were used and dropped so far.
    pub(crate) fn stats(&self) -> PrefetchStats {
        self.state.lock().map(|s| s.stats).unwrap_or_default()
    }
}
