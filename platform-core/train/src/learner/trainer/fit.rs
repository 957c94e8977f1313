//! `fit`: the checks before the first step, the loop over epochs, and what
//! ends an epoch (validation, the schedule, the record, checkpoints).

use super::step::PendingLoss;
use super::{EpochRecord, ScheduleInterval, Trainer};
use crate::learner::callback::{Callback, Context, FitInfo, Flow, Sinks};
use crate::learner::state::TrainingState;
use crate::logger::{History, MetricSink};
use crate::metric::{LossMetric, Metric};
use kiln_core::backend::{Mode, TrainBackend, Trainable};
use kiln_core::error::{Error, Result};
use kiln_core::optim::Optimizer;
use kiln_data::DataLoader;

/// The error for a monitored metric (at `key`) that the epoch's `record` lacks.
fn unknown_metric(key: &str, monitor: &str, record: &EpochRecord) -> Error {
    Error::invalid_argument(
        key,
        format!(
            "`{monitor}` is not a metric of this run (available: {})",
            record.keys().cloned().collect::<Vec<_>>().join(", ")
        ),
    )
}

/// Runs `hook` on every callback, in the order they were added, each with a
/// context of `state` and `sinks`; the first error ends it.
pub(super) fn each_callback<B: TrainBackend, M: Trainable<B>>(
    callbacks: &mut [Box<dyn Callback<B, M>>],
    state: &mut TrainingState<B, M>,
    sinks: &mut [Box<dyn MetricSink>],
    mut hook: impl FnMut(&mut dyn Callback<B, M>, &mut Context<'_, B, M>) -> Result<()>,
) -> Result<()> {
    for callback in callbacks.iter_mut() {
        let mut cx = Context {
            state: &mut *state,
            sinks: Sinks::new(&mut *sinks),
        };
        hook(callback.as_mut(), &mut cx)?;
    }
    Ok(())
}

/// As [`each_callback`] for a hook that may stop training: whether one did.
/// Every callback runs, whatever an earlier one returned.
pub(super) fn any_stops<B: TrainBackend, M: Trainable<B>>(
    callbacks: &mut [Box<dyn Callback<B, M>>],
    state: &mut TrainingState<B, M>,
    sinks: &mut [Box<dyn MetricSink>],
    mut hook: impl FnMut(&mut dyn Callback<B, M>, &mut Context<'_, B, M>) -> Result<Flow>,
) -> Result<bool> {
    let mut stop = false;
    each_callback(callbacks, state, sinks, |callback, cx| {
        stop |= hook(callback, cx)? == Flow::Stop;
        Ok(())
    })?;
    Ok(stop)
}

impl<B: TrainBackend, M: Trainable<B>> Trainer<B, M> {
    /// Trains `state` on `train` until `epochs` or `max_steps`, validating on
    /// `val` after every epoch; continues from `state`'s position (so a restored
    /// state resumes mid-epoch). Returns the per-epoch metrics of this call.
    ///
    /// A non-finite loss stops training with [`Error::NonFiniteLoss`] naming the
    /// step; the checkpoints already written stay as they were.
    pub fn fit(
        &mut self,
        state: &mut TrainingState<B, M>,
        train: &dyn DataLoader,
        val: Option<&dyn DataLoader>,
    ) -> Result<History> {
        self.check_fit(state, val.is_some())?;
        self.restore_callbacks(state)?;
        state.model.start_at_step(state.step)?;
        let objective = self.objective.name();
        let config = self.config.clone();
        let run = FitInfo {
            loss: self.objective.supervised_loss(),
            objective: &objective,
            device: self.config.device,
            config: &config,
            sharded_checkpoints: self.sharded_checkpoints.is_some(),
            has_validation: val.is_some(),
            batches_per_epoch: train.num_batches() as u64,
            last_step: self.last_step(state, train.num_batches() as u64),
        };
        let mut history = History::new();
        let mut pending: Vec<PendingLoss<B::Tensor>> = Vec::new();
        let mut result = each_callback(&mut self.callbacks, state, &mut self.sinks, |cb, cx| {
            cb.on_fit_start(cx, &run)
        });
        if result.is_ok() {
            if self.config.retain_host_memory {
                kiln_core::host_memory::retain_freed_memory();
            }
            result = self.fit_epochs(state, train, val, &mut history, &mut pending);
        }
        if result.is_ok() {
            result = each_callback(&mut self.callbacks, state, &mut self.sinks, |cb, cx| {
                cb.on_fit_end(cx)
            });
        }
        if let Err(error) = &result {
            // Every callback is told, whatever an earlier one answered.
            let told = each_callback(&mut self.callbacks, state, &mut self.sinks, |cb, cx| {
                if let Err(e) = cb.on_exception(cx, error) {
                    log::error!(
                        "callback `{}` failed on the run's error: {e}",
                        cb.state_key()
                    );
                }
                Ok(())
            });
            debug_assert!(told.is_ok());
        }
        // Whatever ended training, the losses of the steps taken are read (and a
        // non-finite one reported) before the sinks close.
        let read = self.read_losses(state, &mut pending);
        result?;
        read?;
        for sink in &mut self.sinks {
            sink.finish()?;
        }
        Ok(history)
    }

    /// What `fit` refuses before the first step: an objective the model's
    /// step cannot compute, a model in another precision, a schedule that
    /// cannot step as configured, a weight average the trainer does not keep
    /// (the [`WeightAverager`](crate::WeightAverager) checks the rest). Gives
    /// the state the objective's running means.
    fn check_fit(&self, state: &mut TrainingState<B, M>, has_validation: bool) -> Result<()> {
        if self.objective.supervised_loss().is_none() && !state.model.runs_any_objective() {
            return Err(kiln_core::backend::objective_unsupported(
                self.objective.as_ref(),
                &state.model.kind(),
            ));
        }
        // The epoch's means of the objective's metrics: those a checkpoint
        // restored, by name, else new ones.
        let restored = std::mem::take(&mut state.epoch_metrics);
        state.epoch_metrics = self
            .objective
            .metric_names(&state.model)
            .into_iter()
            .map(|name| {
                restored
                    .iter()
                    .find(|m| m.name() == name)
                    .cloned()
                    .unwrap_or_else(|| LossMetric::new(name))
            })
            .collect();
        let precision = state.model.precision();
        if precision != self.config.precision {
            return Err(Error::invalid_argument(
                "precision",
                format!(
                    "the trainer is configured for {} but the model computes in {precision}; \
                     give the model its precision (TrainBackend::set_precision) before \
                     building its optimizer",
                    self.config.precision
                ),
            ));
        }
        if let Some(s) = &state.scheduler {
            if let Some(monitor) = s.monitor() {
                if self.config.schedule_interval == ScheduleInterval::Step {
                    return Err(Error::invalid_argument(
                        "training.schedule_interval",
                        format!(
                            "`{}` steps on the epoch metric `{monitor}`, so it needs \
                             schedule_interval = \"epoch\"",
                            s.name()
                        ),
                    ));
                }
                if monitor.starts_with("val_") && !has_validation {
                    return Err(Error::invalid_argument(
                        "schedule.monitor",
                        format!(
                            "`{}` monitors `{monitor}`, but there is no validation data to \
                             compute it on (give fit a validation loader, or monitor `loss`)",
                            s.name()
                        ),
                    ));
                }
            }
        }
        if let (Some(averaging), None) = (&state.averaging, self.config.averaging()) {
            return Err(Error::invalid_argument(
                "training state",
                format!(
                    "keeps a weight average by {:?}, but the trainer is configured for none: \
                     set the same `ema` or `swa` in its TrainerConfig",
                    averaging.config(),
                ),
            ));
        }
        Ok(())
    }

    /// Gives each callback its state from the checkpoint `state` was restored
    /// from (once: the states are taken out of `state`).
    fn restore_callbacks(&mut self, state: &mut TrainingState<B, M>) -> Result<()> {
        let mut saved = std::mem::take(&mut state.callback_states);
        for callback in &mut self.callbacks {
            if let Some(part) = saved.remove(&callback.state_key()) {
                callback.load_state_dict(&part)?;
            }
        }
        for key in saved.keys() {
            log::info!("the checkpoint's state of callback `{key}` is left out: this run has none");
        }
        // Two callbacks keeping state under one key are refused now, not at
        // the first checkpoint.
        self.callback_states().map(drop)
    }

    /// The run's last step, as far as the data and the config tell before it starts
    /// (early stopping may end it sooner): a micro-batch left over at an epoch's end
    /// (`accumulate` not dividing the batches) makes no step.
    fn last_step(&self, state: &TrainingState<B, M>, batches: u64) -> u64 {
        let accumulate = self.config.accumulate.max(1);
        let per_epoch = batches / accumulate;
        let this_epoch = batches.saturating_sub(state.batch_in_epoch) / accumulate;
        let later = self.config.epochs.saturating_sub(state.epoch + 1) * per_epoch;
        let last = if state.epoch < self.config.epochs {
            state.step + this_epoch + later
        } else {
            state.step
        };
        self.config.max_steps.map_or(last, |m| last.min(m))
    }

    /// `fit`'s loop over epochs.
    fn fit_epochs(
        &mut self,
        state: &mut TrainingState<B, M>,
        train: &dyn DataLoader,
        val: Option<&dyn DataLoader>,
        history: &mut History,
        pending: &mut Vec<PendingLoss<B::Tensor>>,
    ) -> Result<()> {
        // A resumed position past the end of an epoch of this data: the state
        // was saved on other data (or another batch size), not this.
        if state.batch_in_epoch > train.num_batches() as u64 {
            return Err(Error::invalid_argument(
                "training state",
                format!(
                    "stands at batch {} of epoch {}, but an epoch of this data has {} batches: \
                     resume on the data and batch size it was saved with",
                    state.batch_in_epoch,
                    state.epoch,
                    train.num_batches()
                ),
            ));
        }
        while state.epoch < self.config.epochs {
            state.model.set_mode(Mode::Train);
            let batches = train.num_batches() as u64;
            for sink in &mut self.sinks {
                sink.start_epoch(
                    state.epoch,
                    Some(batches.saturating_sub(state.batch_in_epoch)),
                )?;
            }
            each_callback(&mut self.callbacks, state, &mut self.sinks, |cb, cx| {
                cb.on_train_epoch_start(cx)
            })?;
            if self.train_epoch(state, train, pending)? == Flow::Stop {
                break;
            }
            if self.end_epoch(state, val, history, pending)? == Flow::Stop {
                break;
            }
        }
        Ok(())
    }

    /// The end of an epoch: the losses read, the callbacks told, the
    /// validation, the schedule, the record to the sinks and callbacks, the
    /// checkpoint.
    fn end_epoch(
        &mut self,
        state: &mut TrainingState<B, M>,
        val: Option<&dyn DataLoader>,
        history: &mut History,
        pending: &mut Vec<PendingLoss<B::Tensor>>,
    ) -> Result<Flow> {
        self.read_losses(state, pending)?;
        each_callback(&mut self.callbacks, state, &mut self.sinks, |cb, cx| {
            cb.on_train_epoch_end(cx)
        })?;
        let mut record = EpochRecord::new();
        record.insert("loss".to_owned(), state.epoch_loss.compute()?);
        for metric in &state.epoch_metrics {
            record.insert(metric.name().to_owned(), metric.compute()?);
        }
        record.insert("lr".to_owned(), state.optimizer.learning_rate());
        if let Some(val) = val {
            for (name, value) in self.validate_epoch(state, val)? {
                record.insert(format!("val_{name}"), value);
            }
        }
        if self.config.schedule_interval == ScheduleInterval::Epoch && !self.schedule_held() {
            if let Some(s) = state.scheduler.as_mut() {
                let lrs = match s.monitor() {
                    Some(monitor) => {
                        let metric = record
                            .get(monitor)
                            .copied()
                            .ok_or_else(|| unknown_metric("schedule.monitor", monitor, &record))?;
                        s.step_with_metric(metric)?
                    }
                    None => s.step()?,
                };
                state.optimizer.set_learning_rates(&lrs)?;
            }
        }
        let flat: Vec<(String, f64)> = record.iter().map(|(k, v)| (k.clone(), *v)).collect();
        for sink in &mut self.sinks {
            sink.log_epoch(state.epoch, &flat)?;
        }
        let stop = any_stops(&mut self.callbacks, state, &mut self.sinks, |cb, cx| {
            cb.on_epoch_end(cx, &record)
        })?;
        let finished_epoch = state.epoch;
        state.epoch += 1;
        state.batch_in_epoch = 0;
        state.epoch_loss = LossMetric::new("loss");
        for metric in &mut state.epoch_metrics {
            *metric = LossMetric::new(metric.name());
        }
        if self
            .checkpointer
            .as_ref()
            .is_some_and(|c| c.due_after_epoch(finished_epoch))
            || self
                .checkpoint_turns
                .as_ref()
                .is_some_and(|p| p.due_after_epoch(finished_epoch))
        {
            self.save_checkpoint(state, &record)?;
        }
        history.record(finished_epoch, &flat)?;
        Ok(if stop { Flow::Stop } else { Flow::Continue })
    }
}
