//! How the trainer writes its checkpoints: one file from rank 0, or under a
//! sharded strategy, each rank's part of a sharded set.

use crate::metric::Metric;
use std::collections::BTreeMap;
use std::path::Path;

use super::{EpochRecord, Trainer};
use crate::checkpoint::Checkpoint;
use crate::learner::state::TrainingState;
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::error::{Error, Result};
use kiln_core::optim::Optimizer;
use kiln_core::state_tensors::{ShardState, StateTensors};

impl<B: TrainBackend, M: Trainable<B>> Trainer<B, M> {
    /// The checkpoint of `state`, holding the model's and optimizer's own tensors
    /// (written in place, not copied to the host first).
    pub(super) fn checkpoint(
        &self,
        state: &TrainingState<B, M>,
        metrics: &EpochRecord,
    ) -> Result<Checkpoint<StateTensors<B>>> {
        let model = state.model.state_tensors()?;
        let optimizer = state.optimizer.state_tensors()?;
        self.checkpoint_of(state, metrics, model, optimizer)
    }

    /// The checkpoint of `state` holding `model` and `optimizer` (the whole
    /// state, or this rank's part of a sharded one).
    fn checkpoint_of(
        &self,
        state: &TrainingState<B, M>,
        metrics: &EpochRecord,
        model: StateTensors<B>,
        optimizer: StateTensors<B>,
    ) -> Result<Checkpoint<StateTensors<B>>> {
        Ok(Checkpoint {
            model,
            optimizer,
            step: state.step,
            epoch: state.epoch,
            batch_in_epoch: state.batch_in_epoch,
            seed: self.config.seed,
            world_size: state
                .model
                .collectives()
                .map_or(1, |g| g.world_size() as u64),
            backend: B::NAME.to_owned(),
            optimizer_kind: state.optimizer.kind().map(str::to_owned),
            model_definition: self.model_definition.clone(),
            lora: self.lora.clone(),
            data: self.data_identity.clone(),
            data_order: Some(kiln_core::rng::EPOCH_ORDER.to_owned()),
            scheduler: state.scheduler.as_ref().map(|s| s.state()).transpose()?,
            metrics: metrics.clone(),
            epoch_loss: Some((state.epoch_loss.sum(), state.epoch_loss.samples())),
            epoch_metrics: state
                .epoch_metrics
                .iter()
                .map(|m| (Metric::name(m).to_owned(), (m.sum(), m.samples())))
                .collect(),
            averaged: state
                .averaging
                .as_ref()
                .map(|a| a.checkpoint_part())
                .transpose()?,
            callbacks: self.callback_states()?,
        })
    }

    /// Every callback's state, by its key; two callbacks that keep state
    /// under one key are refused (by `fit`, before the first step).
    pub(super) fn callback_states(&self) -> Result<BTreeMap<String, serde_json::Value>> {
        let mut states = BTreeMap::new();
        for callback in &self.callbacks {
            let Some(state) = callback.state_dict()? else {
                continue;
            };
            let key = callback.state_key();
            if states.insert(key.clone(), state).is_some() {
                return Err(Error::invalid_argument(
                    "callbacks",
                    format!(
                        "two callbacks keep their state under the key `{key}`: give one of \
                         them another (Callback::state_key)"
                    ),
                ));
            }
        }
        Ok(states)
    }

    pub(super) fn save_checkpoint(
        &mut self,
        state: &TrainingState<B, M>,
        metrics: &EpochRecord,
    ) -> Result<()> {
        if let Some(dir) = self.sharded_checkpoints.clone() {
            return self.save_sharded(state, metrics, &dir);
        }
        if self.checkpointer.is_none() {
            if self.checkpoint_turns.is_some() {
                // Rank 0 gathers the state now; this rank's part is to send its
                // share, in the order `checkpoint` reads them: model, optimizer.
                if state.model.shards_parameters() {
                    drop(state.model.state_tensors()?);
                }
                if state.optimizer.state_is_collective() {
                    drop(state.optimizer.state_tensors()?);
                }
            }
            return Ok(());
        }
        // Everything logged up to this step is on disk before the checkpoint that
        // a resumed run continues from.
        for sink in &mut self.sinks {
            sink.flush()?;
        }
        let checkpoint = self.checkpoint(state, metrics)?;
        if let Some(checkpointer) = self.checkpointer.as_mut() {
            checkpointer.save(&checkpoint)?;
        }
        Ok(())
    }

    /// Every rank's part of a sharded checkpoint, written into `dir`.
    fn save_sharded(
        &mut self,
        state: &TrainingState<B, M>,
        metrics: &EpochRecord,
        dir: &Path,
    ) -> Result<()> {
        let group = state.model.collectives().ok_or_else(|| {
            Error::invalid_argument(
                "checkpoint",
                "sharded checkpoints are written by the ranks of a strategy that trains \
                 across several; this model trains in one process",
            )
        })?;
        let rank = group.rank();
        if self.checkpointer.is_some() {
            for sink in &mut self.sinks {
                sink.flush()?;
            }
        }
        // A state every rank holds whole is rank 0's to write (gathered by
        // every rank where gathering it is a collective).
        let part = |sharded: Option<ShardState<B>>,
                    whole: &dyn Fn() -> Result<StateTensors<B>>,
                    collective: bool|
         -> Result<ShardState<B>> {
            match sharded {
                Some(part) => Ok(part),
                None if rank == 0 => Ok(ShardState::whole(whole()?)),
                None => {
                    if collective {
                        drop(whole()?);
                    }
                    Ok(ShardState::default())
                }
            }
        };
        let model = part(
            state.model.shard_state_tensors()?,
            &|| state.model.state_tensors(),
            state.model.shards_parameters(),
        )?;
        let optimizer = part(
            state.optimizer.shard_state_tensors()?,
            &|| state.optimizer.state_tensors(),
            state.optimizer.state_is_collective(),
        )?;
        let rows = (model
            .rows
            .into_iter()
            .map(|(k, r)| (format!("model.{k}"), r)))
        .chain(
            optimizer
                .rows
                .into_iter()
                .map(|(k, r)| (format!("optimizer.{k}"), r)),
        )
        .collect();
        let checkpoint = self.checkpoint_of(state, metrics, model.tensors, optimizer.tensors)?;
        crate::save_sharded_checkpoint(
            dir,
            &checkpoint,
            rows,
            group.as_ref(),
            self.checkpointer.as_mut(),
        )?;
        Ok(())
    }
}
