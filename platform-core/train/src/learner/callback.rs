//! Hooks into the training loop, with Lightning's reach: the training state
//! and the model at every boundary, the run's sinks, a validation batch's
//! outputs, and a place in the checkpoint.

use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::device::Device;
use kiln_core::error::{Error, Result};
use kiln_core::loss::Loss;
use kiln_core::tensor::HostTensor;

use super::config::{EpochRecord, TrainerConfig};
use super::state::TrainingState;
use crate::logger::{LoggedImage, MetricSink};

/// Whether training goes on after a callback ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Keep training.
    Continue,
    /// Stop after this step or epoch (a clean stop, not an error).
    Stop,
}

/// What a hook sees: where training stands (the model, its optimizer and
/// schedule, the step and epoch: [`TrainingState`]) and the run's sinks.
pub struct Context<'a, B: TrainBackend, M: Trainable<B> = <B as TrainBackend>::Model> {
    /// The training state, which a hook may change (the weight average swaps
    /// its weights into the model to validate them).
    pub state: &'a mut TrainingState<B, M>,
    /// The run's metric sinks (CSV, TensorBoard, progress, log).
    pub sinks: Sinks<'a>,
}

/// The run's metric sinks, for a callback that logs more than numbers
/// (histograms, a graph, images, text): each call goes to every sink.
pub struct Sinks<'a>(&'a mut [Box<dyn MetricSink>]);

impl<'a> Sinks<'a> {
    /// The sinks of a run.
    pub fn new(sinks: &'a mut [Box<dyn MetricSink>]) -> Self {
        Self(sinks)
    }

    /// Whether the run has no sink (a rank other than 0 has none).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Histograms of `tensors` at `step` ([`MetricSink::log_histograms`]).
    pub fn log_histograms(&mut self, step: u64, tensors: &[(String, HostTensor)]) -> Result<()> {
        self.0
            .iter_mut()
            .try_for_each(|s| s.log_histograms(step, tensors))
    }

    /// The model's dataflow graph ([`MetricSink::log_graph`]).
    pub fn log_graph(&mut self, graph_def: &[u8]) -> Result<()> {
        self.0.iter_mut().try_for_each(|s| s.log_graph(graph_def))
    }

    /// Images at `step` ([`MetricSink::log_images`]).
    pub fn log_images(&mut self, step: u64, images: &[LoggedImage]) -> Result<()> {
        self.0
            .iter_mut()
            .try_for_each(|s| s.log_images(step, images))
    }

    /// A Markdown text under `tag` at `step` ([`MetricSink::log_text`]).
    pub fn log_text(&mut self, step: u64, tag: &str, markdown: &str) -> Result<()> {
        self.0
            .iter_mut()
            .try_for_each(|s| s.log_text(step, tag, markdown))
    }
}

/// What [`Callback::on_fit_start`] is told about the run, before its first step.
#[derive(Clone, Copy, Debug)]
pub struct FitInfo<'a> {
    /// The supervised loss the run minimises, if its objective is one.
    pub loss: Option<&'a Loss>,
    /// The objective's name ([`Objective::name`](kiln_core::objective::Objective::name)).
    pub objective: &'a str,
    /// Where the model and batches live.
    pub device: Device,
    /// The trainer's configuration (epochs, `max_steps`, accumulation...).
    pub config: &'a TrainerConfig,
    /// Whether the run writes sharded checkpoints
    /// ([`Trainer::with_sharded_checkpoints`](super::Trainer::with_sharded_checkpoints)).
    pub sharded_checkpoints: bool,
    /// Whether `fit` was given validation data.
    pub has_validation: bool,
    /// The training loader's batches per epoch.
    pub batches_per_epoch: u64,
    /// The run's last optimizer step, as far as the data and the config tell
    /// before it starts (early stopping may end it sooner).
    pub last_step: u64,
}

/// One validation batch, as [`Callback::on_validation_batch_end`] sees it.
#[derive(Clone, Copy, Debug)]
pub struct ValidationBatch<'a> {
    /// The batch's inputs, as the loader gave them.
    pub inputs: &'a HostTensor,
    /// Its targets.
    pub targets: &'a HostTensor,
    /// The model's outputs for it.
    pub outputs: &'a HostTensor,
}

/// A hook into [`Trainer::fit`](super::Trainer::fit), as Lightning's
/// `Callback`: every method has a default that does nothing, so a callback
/// implements only what it needs. `B` is the backend and `M` the module
/// trained, as for the [`Trainer`](super::Trainer); a callback that works
/// with any says so with `impl<B: TrainBackend, M: Trainable<B>> Callback<B, M> for ...`.
///
/// The hooks run in this order:
/// - [`on_fit_start`](Self::on_fit_start), once, before the first step (after
///   a resumed run's callbacks got their state back,
///   [`load_state_dict`](Self::load_state_dict)): check what cannot work here;
/// - per epoch: [`on_train_epoch_start`](Self::on_train_epoch_start); per
///   micro-batch, [`on_train_batch_start`](Self::on_train_batch_start) before it
///   is fetched and [`on_train_batch_fetched`](Self::on_train_batch_fetched) after;
///   after each optimizer step, [`on_log_step`](Self::on_log_step) at a logged
///   step (add values to the step's row), then [`on_step_end`](Self::on_step_end)
///   (before the step's checkpoint, if one is due);
///   after the epoch's last step, [`on_train_epoch_end`](Self::on_train_epoch_end);
///   the epoch's validation, [`on_validation_start`](Self::on_validation_start),
///   [`on_validation_batch_end`](Self::on_validation_batch_end) per batch and
///   [`on_validation_end`](Self::on_validation_end);
///   then [`on_epoch_end`](Self::on_epoch_end) with the epoch's record;
/// - [`on_fit_end`](Self::on_fit_end), once, when training ended without error,
///   or [`on_exception`](Self::on_exception) when it ended with one.
///
/// While a callback [`holds_schedule`](Self::holds_schedule), the run's
/// learning-rate schedule does not step (the callback sets the rates).
///
/// Every checkpoint the trainer writes holds each callback's
/// [`state_dict`](Self::state_dict) under its [`state_key`](Self::state_key).
///
/// A callback need not be `Send`: the [`Profiler`](crate::Profiler) holds the
/// engine's profiler, which records on the thread that started it. A trainer
/// is made on the thread that trains with it.
///
/// ```
/// use kiln_core::backend::{TrainBackend, Trainable};
/// use kiln_train::prelude::*;
///
/// /// Stops training after 100 steps.
/// struct StopAt100;
///
/// impl<B: TrainBackend, M: Trainable<B>> Callback<B, M> for StopAt100 {
///     fn on_step_end(&mut self, cx: &mut Context<'_, B, M>, _loss: f64) -> kiln_core::Result<Flow> {
///         Ok(if cx.state.step >= 100 { Flow::Stop } else { Flow::Continue })
///     }
/// }
/// ```
pub trait Callback<B: TrainBackend, M: Trainable<B> = <B as TrainBackend>::Model> {
    /// Before the first step: refuse what cannot work in this run (a view the
    /// engine cannot give, a window past the run's last step), so that the
    /// run fails before it trains.
    fn on_fit_start(&mut self, _cx: &mut Context<'_, B, M>, _run: &FitInfo<'_>) -> Result<()> {
        Ok(())
    }

    /// When an epoch starts (or a resumed one goes on), `cx.state.epoch` its number.
    fn on_train_epoch_start(&mut self, _cx: &mut Context<'_, B, M>) -> Result<()> {
        Ok(())
    }

    /// Before a training micro-batch is fetched from the loader, for optimizer
    /// step `step` (the next one), `micro` the micro-batch's place in it (0 for
    /// its first; see [`TrainerConfig::accumulate`](super::TrainerConfig::accumulate)).
    fn on_train_batch_start(&mut self, _step: u64, _micro: u64) -> Result<()> {
        Ok(())
    }

    /// After that micro-batch came from the loader.
    fn on_train_batch_fetched(&mut self, _step: u64) -> Result<()> {
        Ok(())
    }

    /// At a logged step ([`TrainerConfig::log_every`](super::TrainerConfig::log_every)),
    /// before the sinks get the step's `row` (its `loss` and `lr`): a callback
    /// adds its own values to it (Lightning's `self.log`).
    fn on_log_step(
        &mut self,
        _cx: &mut Context<'_, B, M>,
        _row: &mut Vec<(String, f64)>,
    ) -> Result<()> {
        Ok(())
    }

    /// After each optimizer step (`cx.state.step` its number), with the step's
    /// loss (the loss of its last micro-batch; NaN when
    /// [`needs_step_loss`](Self::needs_step_loss) is false and the trainer has
    /// not read it back at this step).
    fn on_step_end(&mut self, _cx: &mut Context<'_, B, M>, _loss: f64) -> Result<Flow> {
        Ok(Flow::Continue)
    }

    /// Whether [`on_step_end`](Self::on_step_end) needs every step's loss, which
    /// makes the trainer read each loss back from the device as it is computed
    /// ([`LossReads::EveryStep`](super::LossReads::EveryStep)). `true` by
    /// default, so a callback written for the values gets them; a callback that
    /// does not read the loss should return `false`, letting a GPU run ahead.
    fn needs_step_loss(&self) -> bool {
        true
    }

    /// After an epoch's last optimizer step (its losses read), before its
    /// validation and its schedule step.
    fn on_train_epoch_end(&mut self, _cx: &mut Context<'_, B, M>) -> Result<()> {
        Ok(())
    }

    /// Whether the run's learning-rate schedule is held now: while a callback
    /// holds it, the trainer does not step it (after steps or epochs, as
    /// [`TrainerConfig::schedule_interval`](super::TrainerConfig::schedule_interval)
    /// says), because the callback sets the rates itself, as SWA's annealing
    /// does from its first epoch on. `false` by default.
    fn holds_schedule(&self) -> bool {
        false
    }

    /// Before an epoch's validation.
    fn on_validation_start(&mut self, _cx: &mut Context<'_, B, M>) -> Result<()> {
        Ok(())
    }

    /// After each batch of an epoch's validation, with the model's outputs.
    fn on_validation_batch_end(&mut self, _batch: &ValidationBatch<'_>) -> Result<()> {
        Ok(())
    }

    /// After an epoch's validation, with its metrics (`loss`, and the run's
    /// metrics by name).
    fn on_validation_end(
        &mut self,
        _cx: &mut Context<'_, B, M>,
        _metrics: &[(String, f64)],
    ) -> Result<()> {
        Ok(())
    }

    /// After each epoch (`cx.state.epoch` is still its number) with its
    /// training and validation metrics (`loss`, `lr`, `val_loss`,
    /// `val_accuracy`, ...).
    fn on_epoch_end(&mut self, _cx: &mut Context<'_, B, M>, _record: &EpochRecord) -> Result<Flow> {
        Ok(Flow::Continue)
    }

    /// When training ended without error (also after a [`Flow::Stop`]).
    fn on_fit_end(&mut self, _cx: &mut Context<'_, B, M>) -> Result<()> {
        Ok(())
    }

    /// When training ended with `error` (Lightning's `on_exception`), before
    /// `fit` returns it: undo what must not outlive the run (weights swapped
    /// in for validation). An error this returns is logged, and `fit` returns
    /// `error`.
    fn on_exception(&mut self, _cx: &mut Context<'_, B, M>, _error: &Error) -> Result<()> {
        Ok(())
    }

    /// The name of this callback's state in a checkpoint (Lightning's
    /// `state_key`): by default the type's name, which is enough unless a
    /// run has two callbacks of one type that both keep state.
    fn state_key(&self) -> String {
        short_type_name(std::any::type_name::<Self>())
    }

    /// The state that makes a resumed run go on as an uninterrupted one (as
    /// Lightning's `state_dict`), written into each checkpoint; `None` (the
    /// default) for a callback that keeps none.
    fn state_dict(&self) -> Result<Option<serde_json::Value>> {
        Ok(None)
    }

    /// Takes back the state [`state_dict`](Self::state_dict) gave, from the
    /// checkpoint a run resumes from, before [`on_fit_start`](Self::on_fit_start).
    /// A state that does not fit is an error naming what is wrong.
    fn load_state_dict(&mut self, _state: &serde_json::Value) -> Result<()> {
        Ok(())
    }
}

/// `EarlyStopping` for `kiln_train::learner::early_stopping::EarlyStopping<T>`.
fn short_type_name(full: &str) -> String {
    let base = full.split('<').next().unwrap_or(full);
    base.rsplit("::").next().unwrap_or(base).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_keys_are_the_type_names_without_paths_or_parameters() {
        assert_eq!(
            short_type_name("kiln_train::EarlyStopping"),
            "EarlyStopping"
        );
        assert_eq!(short_type_name("a::b::Views<c::D, e::F>"), "Views");
        assert_eq!(short_type_name("Plain"), "Plain");
    }
}
