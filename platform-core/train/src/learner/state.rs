//! Where training stands: the model, its optimizer and schedule, and the
//! position in the data; what a checkpoint saves and `fit` advances.

use crate::checkpoint::Checkpoint;
use crate::learner::averaging::{AveragingConfig, WeightAveraging};
use crate::metric::LossMetric;
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::error::{Error, Result};
use kiln_core::optim::{check_state_after_steps, Optimizer};
use kiln_core::schedule::LrScheduler;
use kiln_core::state_tensors::WritableState;

/// A model, its optimizer and schedule, and where training stands: what a
/// checkpoint saves and `fit` advances. `M` is the module, as for [`Trainer`](crate::Trainer).
pub struct TrainingState<B: TrainBackend, M: Trainable<B> = <B as TrainBackend>::Model> {
    /// The model.
    pub model: M,
    /// Its optimizer.
    pub optimizer: M::Optim,
    /// The learning-rate schedule, if any.
    pub scheduler: Option<Box<dyn LrScheduler + Send>>,
    /// Optimizer steps taken.
    pub step: u64,
    /// The epoch in progress (0-based).
    pub epoch: u64,
    /// Micro-batches of `epoch` already consumed.
    pub batch_in_epoch: u64,
    /// The training loss of those micro-batches, for the epoch's record.
    pub epoch_loss: LossMetric,
    /// The objective's metrics over those micro-batches, in its order
    /// ([`Objective::metric_names`](kiln_core::objective::Objective::metric_names)).
    pub epoch_metrics: Vec<LossMetric>,
    /// A moving average of the weights, if the run keeps one
    /// ([`with_weight_averaging`](Self::with_weight_averaging)): the trainer
    /// updates it after the optimizer steps its config names, checkpoints it,
    /// and validates with it when the config says so.
    pub averaging: Option<WeightAveraging<B>>,
    /// The callbacks' states from the checkpoint this state was restored
    /// from, by [`state_key`](crate::Callback::state_key): `fit` gives each
    /// callback its own ([`Callback::load_state_dict`](crate::Callback::load_state_dict))
    /// before the first step.
    pub callback_states: std::collections::BTreeMap<String, serde_json::Value>,
}

impl<B: TrainBackend, M: Trainable<B>> std::fmt::Debug for TrainingState<B, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainingState")
            .field("step", &self.step)
            .field("epoch", &self.epoch)
            .field("batch_in_epoch", &self.batch_in_epoch)
            .finish_non_exhaustive()
    }
}

impl<B: TrainBackend, M: Trainable<B>> TrainingState<B, M> {
    /// A fresh state at step 0.
    pub fn new(
        model: M,
        optimizer: M::Optim,
        scheduler: Option<Box<dyn LrScheduler + Send>>,
    ) -> Self {
        Self {
            model,
            optimizer,
            scheduler,
            step: 0,
            epoch: 0,
            batch_in_epoch: 0,
            epoch_loss: LossMetric::new("loss"),
            epoch_metrics: Vec::new(),
            averaging: None,
            callback_states: Default::default(),
        }
    }

    /// Keeps a weight average of the model ([`EmaConfig`](crate::EmaConfig)
    /// or [`SwaConfig`](crate::SwaConfig)), starting from its current weights.
    pub fn with_weight_averaging(mut self, config: impl Into<AveragingConfig>) -> Result<Self> {
        self.averaging = Some(WeightAveraging::new(config, &self.model)?);
        Ok(self)
    }

    /// Restores model, optimizer, schedule and position from a checkpoint.
    ///
    /// Contract: nothing changes if any part does not fit: a model tensor
    /// missing, unexpected, or of another shape or dtype than the model's (never
    /// cast), an optimizer of another algorithm than the checkpoint's, a
    /// checkpoint past step 0 without the state its optimizer keeps by then
    /// ([`check_state_after_steps`]: its moments were removed), or optimizer or
    /// schedule state that does not load.
    pub fn restore(&mut self, checkpoint: &Checkpoint) -> Result<()> {
        if let (Some(saved), Some(ours)) =
            (checkpoint.optimizer_kind.as_deref(), self.optimizer.kind())
        {
            if saved != ours {
                return Err(Error::invalid_argument(
                    "optimizer.type",
                    format!(
                        "the checkpoint was trained with `{saved}`, this run builds `{ours}`; \
                         resume with the checkpoint's optimizer, or start a new run"
                    ),
                ));
            }
        }
        if let Some(config) = self.optimizer.config() {
            let fresh = self.optimizer.state_tensors()?;
            let keys: Vec<&str> = fresh
                .writable_tensors()
                .into_iter()
                .map(|(k, _)| k)
                .collect();
            check_state_after_steps(config, &keys, &checkpoint.optimizer, checkpoint.step)?;
        }
        if checkpoint.backend != B::NAME {
            log::info!(
                "resuming a checkpoint written by the {} backend on {}",
                checkpoint.backend,
                B::NAME
            );
        }
        let old_model = self.model.state_dict()?;
        checkpoint.model.check_dtypes(&old_model)?;
        if let (Some(averaging), Some(saved)) = (&self.averaging, &checkpoint.averaged) {
            averaging.check(saved)?;
        }
        // The schedule first: it is the one part whose state can be put back exactly.
        let old_schedule = match (self.scheduler.as_mut(), &checkpoint.scheduler) {
            (Some(scheduler), Some(state)) => {
                let old = scheduler.state()?;
                scheduler.load_state(state)?;
                Some(old)
            }
            _ => None,
        };
        let loaded = self
            .model
            .load_state_dict(&checkpoint.model)
            .and_then(|()| {
                self.optimizer
                    .load_state_dict(&checkpoint.optimizer)
                    .inspect_err(|_| {
                        if let Err(e) = self.model.load_state_dict(&old_model) {
                            log::error!(
                                "cannot put the model back after a failed restore: {}",
                                e.display_chain()
                            );
                        }
                    })
            });
        let loaded = loaded.and_then(|()| self.restore_average(checkpoint));
        if let Err(e) = loaded {
            if let (Some(scheduler), Some(old)) = (self.scheduler.as_mut(), &old_schedule) {
                scheduler.load_state(old)?;
            }
            return Err(e);
        }
        if let (Some(scheduler), Some(_)) = (self.scheduler.as_ref(), &old_schedule) {
            self.optimizer.set_learning_rates(scheduler.lrs())?;
        }
        self.step = checkpoint.step;
        self.epoch = checkpoint.epoch;
        self.batch_in_epoch = checkpoint.batch_in_epoch;
        // A checkpoint without it (from before Kiln recorded it) restarts the
        // running mean: the epoch's loss then covers the batches after it.
        let (sum, samples) = checkpoint.epoch_loss.unwrap_or_default();
        self.epoch_loss = LossMetric::with_parts("loss", sum, samples);
        self.epoch_metrics = checkpoint
            .epoch_metrics
            .iter()
            .map(|(name, (sum, samples))| LossMetric::with_parts(name.clone(), *sum, *samples))
            .collect();
        self.callback_states = checkpoint.callbacks.clone();
        Ok(())
    }

    /// The weight average's part of [`restore`](Self::restore), after the
    /// model and optimizer loaded (and put back on error): the checkpoint's
    /// average, or, from a checkpoint without one, a new average of the
    /// restored weights.
    fn restore_average(&mut self, checkpoint: &Checkpoint) -> Result<()> {
        let Some(averaging) = self.averaging.as_mut() else {
            if checkpoint.averaged.is_some() {
                log::info!("the checkpoint's weight average is left out: this run keeps none");
            }
            return Ok(());
        };
        let restored = match &checkpoint.averaged {
            Some(saved) => averaging.restore(saved),
            None => {
                log::warn!(
                    "the checkpoint holds no weight average: the average starts again from \
                     its weights"
                );
                WeightAveraging::new(averaging.config().clone(), &self.model)
                    .map(|fresh| *averaging = fresh)
            }
        };
        restored
    }
}
