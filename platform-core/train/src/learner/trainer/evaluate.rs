//! Evaluation: an epoch's validation (with its callbacks), `evaluate` and
//! `predict`, across ranks when the model trains across several.

use super::fit::each_callback;
use super::Trainer;
use crate::learner::callback::{Callback, ValidationBatch};
use crate::learner::state::TrainingState;
use crate::metric::{LossMetric, Metric};
use kiln_core::backend::{Mode, TrainBackend, Trainable};
use kiln_core::distributed::{Collectives, ReduceOp};
use kiln_core::error::{Error, Result};
use kiln_core::objective::ObjectiveBatch;
use kiln_core::tensor::HostTensor;
use kiln_data::DataLoader;

/// Adds up the states of `metrics` over the ranks of `group` (see
/// [`Metric::state`]): one all-reduce of the state lengths, one of the states.
fn reduce_metrics(group: &dyn Collectives, metrics: &mut [&mut dyn Metric]) -> Result<()> {
    let mut states = Vec::with_capacity(metrics.len());
    for metric in metrics.iter() {
        states.push(metric.state().ok_or_else(|| {
            Error::unsupported(format!(
                "data-parallel evaluation of metric `{}`: it has no additive state \
                 (Metric::state) to add up across ranks",
                metric.name()
            ))
        })?);
    }
    let mut lengths: Vec<f64> = states.iter().map(|s| s.len() as f64).collect();
    group.all_reduce_f64(&mut lengths, ReduceOp::Max)?;
    let mut flat = Vec::new();
    for (state, &len) in states.iter_mut().zip(&lengths) {
        state.resize(len as usize, 0.0);
        flat.extend_from_slice(state);
    }
    group.all_reduce_f64(&mut flat, ReduceOp::Sum)?;
    let mut rest = flat.as_slice();
    for (metric, &len) in metrics.iter_mut().zip(&lengths) {
        let (mine, tail) = rest.split_at(len as usize);
        metric.load_state(mine)?;
        rest = tail;
    }
    Ok(())
}

/// What is told of each evaluated batch: nothing, or the callbacks.
type OnBatch<'a, B, M> = Option<&'a mut [Box<dyn Callback<B, M>>]>;

impl<B: TrainBackend, M: Trainable<B>> Trainer<B, M> {
    /// The epoch's validation: [`evaluate`](Self::evaluate) between the
    /// callbacks' `on_validation_start` and `on_validation_end`, each batch
    /// given to their `on_validation_batch_end` (the
    /// [`WeightAverager`](crate::WeightAverager) puts the average into the
    /// model for it).
    pub(super) fn validate_epoch(
        &mut self,
        state: &mut TrainingState<B, M>,
        val: &dyn DataLoader,
    ) -> Result<Vec<(String, f64)>> {
        each_callback(&mut self.callbacks, state, &mut self.sinks, |cb, cx| {
            cb.on_validation_start(cx)
        })?;
        // Out of `self` while the batches are evaluated (and put back before
        // any error returns).
        let mut callbacks = std::mem::take(&mut self.callbacks);
        let metrics = self.evaluate_with(&mut state.model, val, Some(&mut callbacks));
        self.callbacks = callbacks;
        let metrics = metrics?;
        each_callback(&mut self.callbacks, state, &mut self.sinks, |cb, cx| {
            cb.on_validation_end(cx, &metrics)
        })?;
        Ok(metrics)
    }

    /// The loss and every metric over `loader`, in eval mode and without
    /// gradients; the model's mode is restored afterwards.
    ///
    /// A model that trains across ranks (under
    /// [`DataParallel`](kiln_core::strategy::DataParallel), which says so
    /// through [`Trainable::collectives`]) evaluates rank 0's buffers on every
    /// rank, and the loss and metric states are added up over the ranks: each
    /// rank gives its share of the validation data (a sampler
    /// [`without_padding`](kiln_data::DistributedSampler::without_padding)) and
    /// every rank gets the values over the whole split. Checkpoints record the
    /// world size (each rank counts only its own batches). Only rank 0 should be
    /// given sinks and a checkpointer.
    pub fn evaluate(&self, model: &mut M, loader: &dyn DataLoader) -> Result<Vec<(String, f64)>> {
        self.evaluate_with(model, loader, None)
    }

    /// [`evaluate`](Self::evaluate), giving each batch to `on_batch`.
    fn evaluate_with(
        &self,
        model: &mut M,
        loader: &dyn DataLoader,
        on_batch: OnBatch<'_, B, M>,
    ) -> Result<Vec<(String, f64)>> {
        if model.collectives().is_some() {
            // Every rank evaluates rank 0's batch-norm statistics.
            model.sync_buffers()?;
        }
        let mode = model.mode();
        model.set_mode(Mode::Eval);
        let result = self.evaluate_inner(model, loader, on_batch);
        model.set_mode(mode);
        result
    }

    fn evaluate_inner(
        &self,
        model: &M,
        loader: &dyn DataLoader,
        mut on_batch: OnBatch<'_, B, M>,
    ) -> Result<Vec<(String, f64)>> {
        let mut loss = LossMetric::new("loss");
        let mut metrics: Vec<Box<dyn Metric>> = self.metrics.iter().map(|make| make()).collect();
        // Under full sharding every forward pass is a collective: a rank with
        // fewer batches than another runs its last one again, uncounted.
        let lockstep = match model.collectives() {
            Some(group) if model.shards_parameters() => Some(group),
            _ => None,
        };
        let mut rounds = None;
        if let Some(group) = &lockstep {
            let mut most = [loader.num_batches() as f64];
            let mut fewest = most;
            group.all_reduce_f64(&mut most, ReduceOp::Max)?;
            group.all_reduce_f64(&mut fewest, ReduceOp::Min)?;
            if fewest[0] == 0.0 && most[0] > 0.0 {
                // Every rank refuses alike: one with no batch has none to repeat.
                return Err(Error::invalid_argument(
                    "data",
                    format!(
                        "a rank's share of the validation split is empty, but the model's \
                         parameters are sharded: every rank must run each of the {} evaluation \
                         batches; use a smaller batch size or more validation data",
                        most[0]
                    ),
                ));
            }
            rounds = Some(most[0] as usize);
        }
        let mut objective_metrics: Vec<LossMetric> = self
            .objective
            .metric_names(model)
            .into_iter()
            .map(LossMetric::new)
            .collect();
        let mut ran = 0;
        let mut last = None;
        for batch in loader.batches(0) {
            let batch = batch?;
            let inputs = B::from_host(&batch.inputs, self.config.device)?;
            let targets = B::from_host(&batch.targets, self.config.device)?;
            let on_device = ObjectiveBatch {
                inputs: &inputs,
                targets: &targets,
            };
            let evaluated = model.eval_objective(self.objective.as_ref(), &on_device)?;
            let rows = batch.targets.dims().first().copied().unwrap_or(1);
            loss.update_value(evaluated.loss, rows);
            for (mean, value) in objective_metrics.iter_mut().zip(&evaluated.metrics) {
                mean.update_value(*value, rows);
            }
            match &evaluated.outputs {
                Some(output) => {
                    for metric in &mut metrics {
                        metric.update(output, &batch.targets)?;
                    }
                }
                None if !metrics.is_empty() => {
                    return Err(Error::invalid_argument(
                        "metrics",
                        format!(
                            "the {} objective gives no predictions to compute `{}` on",
                            self.objective.name(),
                            metrics[0].name()
                        ),
                    ));
                }
                None => {}
            }
            if let (Some(callbacks), Some(output)) =
                (on_batch.as_deref_mut(), evaluated.outputs.as_ref())
            {
                let seen = ValidationBatch {
                    inputs: &batch.inputs,
                    targets: &batch.targets,
                    outputs: output,
                };
                for callback in callbacks.iter_mut() {
                    callback.on_validation_batch_end(&seen)?;
                }
            }
            ran += 1;
            if lockstep.is_some() {
                last = Some((inputs, targets));
            }
        }
        if let (Some(rounds), Some((inputs, targets))) = (rounds, &last) {
            let on_device = ObjectiveBatch { inputs, targets };
            for _ in ran..rounds {
                drop(model.eval_objective(self.objective.as_ref(), &on_device)?);
            }
        }
        if let Some(group) = model.collectives() {
            let mut all: Vec<&mut dyn Metric> = vec![&mut loss];
            all.extend(objective_metrics.iter_mut().map(|m| m as &mut dyn Metric));
            all.extend(metrics.iter_mut().map(|m| m.as_mut() as &mut dyn Metric));
            reduce_metrics(group.as_ref(), &mut all)?;
        }
        let mut out = vec![("loss".to_owned(), loss.compute()?)];
        for mean in &objective_metrics {
            out.push((mean.name().to_owned(), mean.compute()?));
        }
        for metric in &metrics {
            out.push((metric.name().to_owned(), metric.compute()?));
        }
        Ok(out)
    }

    /// The model's outputs for every batch of `loader`, in eval mode.
    pub fn predict(&self, model: &mut M, loader: &dyn DataLoader) -> Result<Vec<HostTensor>> {
        let mode = model.mode();
        model.set_mode(Mode::Eval);
        let result = loader
            .batches(0)
            .map(|batch| {
                let batch = batch?;
                model.predict_step(&B::from_host(&batch.inputs, self.config.device)?)
            })
            .collect();
        model.set_mode(mode);
        result
    }
}
