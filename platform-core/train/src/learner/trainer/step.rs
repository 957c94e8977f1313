//! One epoch's batches: each micro-batch through the model (seeding and
//! zeroing at a step's first, gradient accumulation, the loss read now or
//! deferred), and what follows each optimizer step (the schedule, the
//! step's log, callbacks, a checkpoint).

use super::fit::{any_stops, each_callback};
use super::{step_seed, EpochRecord, LossReads, ScheduleInterval, Trainer};
use crate::learner::callback::Flow;
use crate::learner::state::TrainingState;
use crate::metric::Metric;
use kiln_core::backend::{StepLoss, TrainBackend, Trainable, UpdatePlan};
use kiln_core::error::{Error, Result};
use kiln_core::objective::{ObjectiveBatch, ObjectiveStep};
use kiln_core::optim::Optimizer;
use kiln_data::DataLoader;

/// A training micro-batch's loss not yet read: the optimizer step it belongs
/// to, its rows, the loss and the objective's metrics.
pub(super) struct PendingLoss<T> {
    step: u64,
    rows: usize,
    loss: StepLoss<T>,
    metrics: Vec<StepLoss<T>>,
}

/// The numbers of the last micro-batch read: its loss and the objective's
/// metrics (NaN before any is read).
#[derive(Clone, Debug)]
pub(super) struct StepValues {
    loss: f64,
    metrics: Vec<f64>,
}

impl StepValues {
    fn unread() -> Self {
        Self {
            loss: f64::NAN,
            metrics: Vec::new(),
        }
    }
}

impl<B: TrainBackend, M: Trainable<B>> Trainer<B, M> {
    /// Reads the pending losses in order into the epoch's loss (and the
    /// objective's metrics into theirs) and the sinks' batch records; a
    /// non-finite loss is [`Error::NonFiniteLoss`] naming its step. Returns
    /// the last values read.
    pub(super) fn read_losses(
        &mut self,
        state: &mut TrainingState<B, M>,
        pending: &mut Vec<PendingLoss<B::Tensor>>,
    ) -> Result<Option<StepValues>> {
        let mut last = None;
        for p in pending.drain(..) {
            let value = p.loss.value::<B>()?;
            if !value.is_finite() {
                return Err(Error::NonFiniteLoss {
                    step: p.step,
                    value,
                });
            }
            state.epoch_loss.update_value(value, p.rows);
            let mut metrics = Vec::with_capacity(p.metrics.len());
            for (metric, mean) in p.metrics.iter().zip(&mut state.epoch_metrics) {
                let value = metric.value::<B>()?;
                mean.update_value(value, p.rows);
                metrics.push(value);
            }
            for sink in &mut self.sinks {
                sink.log_batch(p.rows, value)?;
            }
            last = Some(StepValues {
                loss: value,
                metrics,
            });
        }
        Ok(last)
    }

    /// The epoch's batches from `state`'s position: [`Flow::Stop`] when
    /// training ends inside it (`max_steps`, or a callback stopped it), which
    /// leaves the epoch's end out.
    pub(super) fn train_epoch(
        &mut self,
        state: &mut TrainingState<B, M>,
        train: &dyn DataLoader,
        pending: &mut Vec<PendingLoss<B::Tensor>>,
    ) -> Result<Flow> {
        let deferred = self.loss_reads() == LossReads::WhenLogged;
        let accumulate = self.config.accumulate;
        let device = self.config.device;
        let batches = train.num_batches() as u64;
        let mut micro = 0u64;
        let skip = state.batch_in_epoch as usize;
        let mut pulls = train.batches_from(state.epoch, skip);
        loop {
            // The wait for the batch is part of the step (a profiler records
            // it as such); the pull that ends the epoch belongs to no step.
            let expected = state.batch_in_epoch < batches;
            let step = state.step + 1;
            if expected {
                for cb in &mut self.callbacks {
                    cb.on_train_batch_start(step, micro)?;
                }
            }
            let next = pulls.next();
            if expected {
                for cb in &mut self.callbacks {
                    cb.on_train_batch_fetched(step)?;
                }
            }
            let Some(batch) = next else { break };
            if self.config.max_steps.is_some_and(|m| state.step >= m) {
                return Ok(Flow::Stop);
            }
            let batch = batch?;
            if micro == 0 {
                B::manual_seed(step_seed(self.config.seed, state.step));
                state.optimizer.zero_grad()?;
            }
            let inputs = B::from_host(&batch.inputs, device)?;
            let targets = B::from_host(&batch.targets, device)?;
            let apply = micro + 1 >= accumulate;
            let plan = UpdatePlan {
                scale: if accumulate > 1 {
                    1.0 / accumulate as f64
                } else {
                    1.0
                },
                apply,
                clip: self.config.clip.as_ref(),
            };
            let batch_on_device = ObjectiveBatch {
                inputs: &inputs,
                targets: &targets,
            };
            let ObjectiveStep { loss, metrics } = state.model.train_objective_step(
                &mut state.optimizer,
                self.objective.as_ref(),
                &batch_on_device,
                &plan,
                deferred,
            )?;
            pending.push(PendingLoss {
                step: state.step + 1,
                rows: batch.targets.dims().first().copied().unwrap_or(1),
                loss,
                metrics,
            });
            // The last values read: this micro-batch's unless reads are deferred.
            let mut value = StepValues::unread();
            if !deferred {
                value = self
                    .read_losses(state, pending)?
                    .unwrap_or_else(StepValues::unread);
            }
            micro += 1;
            state.batch_in_epoch += 1;
            if !apply {
                continue;
            }
            micro = 0;
            if self.end_step(state, pending, value, deferred)? == Flow::Stop {
                return Ok(Flow::Stop);
            }
        }
        Ok(Flow::Continue)
    }

    /// After an optimizer step: the schedule advances (unless a callback
    /// holds it), the step is logged (every `log_every`), callbacks see it,
    /// and a checkpoint due after it is written. `value` is the step's loss when read already.
    fn end_step(
        &mut self,
        state: &mut TrainingState<B, M>,
        pending: &mut Vec<PendingLoss<B::Tensor>>,
        mut value: StepValues,
        deferred: bool,
    ) -> Result<Flow> {
        state.step += 1;
        if self.config.schedule_interval == ScheduleInterval::Step && !self.schedule_held() {
            if let Some(s) = state.scheduler.as_mut() {
                let lrs = s.step()?;
                state.optimizer.set_learning_rates(&lrs)?;
            }
        }
        let log_every = self.config.log_every;
        let logged = log_every > 0 && state.step.is_multiple_of(log_every);
        let checkpoint_due = self
            .checkpointer
            .as_ref()
            .is_some_and(|c| c.due_after_step(state.step))
            || self
                .checkpoint_turns
                .as_ref()
                .is_some_and(|p| p.due_after_step(state.step));
        if deferred && (logged || checkpoint_due) {
            value = self
                .read_losses(state, pending)?
                .unwrap_or_else(StepValues::unread);
        }
        if logged {
            let mut row = vec![
                ("loss".to_owned(), value.loss),
                ("lr".to_owned(), state.optimizer.learning_rate()),
            ];
            for (metric, v) in state.epoch_metrics.iter().zip(&value.metrics) {
                row.push((Metric::name(metric).to_owned(), *v));
            }
            each_callback(&mut self.callbacks, state, &mut self.sinks, |cb, cx| {
                cb.on_log_step(cx, &mut row)
            })?;
            for sink in &mut self.sinks {
                sink.log_step(state.step, &row)?;
            }
        }
        for sink in &mut self.sinks {
            sink.end_step(state.step)?;
        }
        let stop = any_stops(&mut self.callbacks, state, &mut self.sinks, |cb, cx| {
            cb.on_step_end(cx, value.loss)
        })?;
        if checkpoint_due {
            self.save_checkpoint(state, &EpochRecord::new())?;
        }
        Ok(if stop { Flow::Stop } else { Flow::Continue })
    }
}
