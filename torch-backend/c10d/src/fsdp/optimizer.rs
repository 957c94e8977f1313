//! The optimizer of full sharding: an ordinary [`TorchOptimizer`] over this
//! rank's parameter shards, whose state is gathered into the whole
//! parameters' layout for a checkpoint and cut back into shards on resume.

use std::collections::BTreeMap;
use std::sync::Arc;

use kiln_core::optim::{Optimizer, OptimizerConfig};
use kiln_core::state_dict::StateDict;
use kiln_core::state_tensors::{ShardState, StateTensor, StateTensors};
use kiln_core::Result;
use kiln_torch::{TorchBackend, TorchOptimizer};

use super::prefetch::GatherSchedule;
use super::shards::ParamShard;
use crate::ProcessGroup;

/// An optimizer over fully sharded parameters: this rank's
/// [`TorchOptimizer`] updates its shards, so every per-element state (Adam's
/// moments, momentum) is a shard too, of the parameter's shard's shape.
///
/// Its [`state_tensors`](Optimizer::state_tensors) is a collective (see
/// [`Optimizer::state_is_collective`]): every rank calls it at the same
/// point and gets the whole state, in the layout a single process's optimizer
/// has. [`load_state_dict`](Optimizer::load_state_dict) takes such a whole
/// state (of any strategy or number of ranks) and keeps this rank's rows.
#[derive(Debug)]
pub struct FsdpOptimizer {
    pub(super) inner: TorchOptimizer,
    group: Arc<ProcessGroup>,
    params: BTreeMap<String, Arc<ParamShard>>,
    /// The units' gathers: one started before the shards change is dropped.
    schedule: Arc<GatherSchedule>,
}

impl FsdpOptimizer {
    pub(super) fn new(
        inner: TorchOptimizer,
        group: Arc<ProcessGroup>,
        params: &[Arc<ParamShard>],
        schedule: Arc<GatherSchedule>,
    ) -> Self {
        FsdpOptimizer {
            inner,
            group,
            params: params
                .iter()
                .map(|p| (p.name.clone(), Arc::clone(p)))
                .collect(),
            schedule,
        }
    }

    /// This rank's optimizer, over its shards.
    pub fn shard(&self) -> &TorchOptimizer {
        &self.inner
    }

    /// The parameter of a `state.<param>.<buffer>` key whose buffer is per
    /// element (not the step count).
    fn sharded_param(&self, key: &str) -> Option<&ParamShard> {
        let (param, buffer) = key.strip_prefix("state.")?.rsplit_once('.')?;
        if buffer == "step" {
            return None;
        }
        self.params.get(param).map(Arc::as_ref)
    }
}

impl Optimizer<TorchBackend> for FsdpOptimizer {
    /// This rank's update of its shards. The gradients must already be
    /// reduced: train through
    /// [`Trainable::train_step`](kiln_core::backend::Trainable::train_step).
    fn step(&mut self) -> Result<()> {
        self.schedule.cancel()?;
        self.inner.step()
    }

    fn zero_grad(&mut self) -> Result<()> {
        self.inner.zero_grad()
    }

    fn learning_rate(&self) -> f64 {
        self.inner.learning_rate()
    }

    fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        self.inner.set_learning_rate(lr)
    }

    fn kind(&self) -> Option<&'static str> {
        Optimizer::kind(&self.inner)
    }

    fn config(&self) -> Option<&OptimizerConfig> {
        Optimizer::config(&self.inner)
    }

    fn learning_rates(&self) -> Vec<f64> {
        self.inner.learning_rates()
    }

    fn set_learning_rates(&mut self, lrs: &[f64]) -> Result<()> {
        self.inner.set_learning_rates(lrs)
    }

    fn state_is_collective(&self) -> bool {
        true
    }

    fn state_dict(&self) -> Result<StateDict> {
        self.state_tensors()?.to_state_dict()
    }

    /// The whole state, on every rank: each per-element buffer all-gathered
    /// from the ranks' shards (every rank holds the same keys), the rest as
    /// it is. A collective.
    fn state_tensors(&self) -> Result<StateTensors<TorchBackend>> {
        let mut whole = StateTensors::<TorchBackend>::from(StateDict::new());
        for (key, tensor) in self.inner.state_tensors()?.iter() {
            let value = match (self.sharded_param(key), tensor) {
                (Some(p), StateTensor::Backend(t)) if t.size() == p.shard_shape() => {
                    StateTensor::Backend(p.gather_whole(&self.group, t)?)
                }
                (_, StateTensor::Backend(t)) => StateTensor::Backend(t.shallow_clone()),
                (_, StateTensor::Host(h)) => StateTensor::Host(h.clone()),
            };
            whole.insert(key.clone(), value)?;
        }
        Ok(whole)
    }

    /// This rank's rows of each per-element buffer (its padding left out);
    /// rank 0 also holds the step counts and group hyperparameters, which
    /// are the same on every rank. Not a collective.
    fn shard_state_tensors(&self) -> Result<Option<ShardState<TorchBackend>>> {
        let rank = self.group.rank();
        let mut part = ShardState::default();
        for (key, tensor) in self.inner.state_tensors()?.iter() {
            match (self.sharded_param(key), tensor) {
                (Some(p), StateTensor::Backend(t)) if t.size() == p.shard_shape() => {
                    if let Some((rows, slice)) = p.local_rows(t, rank)? {
                        part.tensors
                            .insert(key.clone(), StateTensor::Backend(rows))?;
                        if let Some(slice) = slice {
                            part.rows.insert(key.clone(), slice);
                        }
                    }
                }
                _ if rank != 0 => {}
                (_, StateTensor::Backend(t)) => part
                    .tensors
                    .insert(key.clone(), StateTensor::Backend(t.shallow_clone()))?,
                (_, StateTensor::Host(h)) => part
                    .tensors
                    .insert(key.clone(), StateTensor::Host(h.clone()))?,
            }
        }
        Ok(Some(part))
    }

    /// Keeps this rank's rows of `state`'s per-element buffers (a whole
    /// state, of any strategy or number of ranks); this rank's optimizer then
    /// checks and loads it all or nothing.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.schedule.cancel()?;
        let rank = self.group.rank();
        let mut share = StateDict::new();
        for (key, value) in state.iter() {
            let value = match self.sharded_param(key) {
                Some(p) => p.cut_host(key, value, rank)?,
                None => value.clone(),
            };
            share.insert(key.clone(), value);
        }
        self.inner.load_state_dict(&share)
    }
}
