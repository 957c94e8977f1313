//! EMA and SWA as a callback (Lightning's `WeightAveraging` and
//! `StochasticWeightAveraging`): the average kept in the training state is
//! started and checked before the first step, updated after the steps (EMA)
//! or epochs (SWA) its config names, swapped into the model for validation,
//! and SWA's annealed learning rates own the optimizer from its first epoch.

use crate::learner::averaging::{AveragingConfig, WeightAveraging};
use crate::learner::batch_norm::batch_norm_layers;
use crate::learner::callback::{Callback, Context, FitInfo, Flow};
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::error::{Error, Result};
use kiln_core::optim::Optimizer;
use kiln_core::state_dict::StateDict;

/// The callback that keeps a run's weight average
/// ([`TrainingState::averaging`](crate::TrainingState::averaging)), which the
/// trainer registers first when its config sets
/// [`ema`](crate::TrainerConfig::ema) or [`swa`](crate::TrainerConfig::swa).
/// The average lives in the training state, so that checkpoints hold it
/// (`averaged.*`) and [`Trainer::apply_average`](crate::Trainer::apply_average)
/// puts it into the model at the end.
#[derive(Debug)]
pub struct WeightAverager {
    config: AveragingConfig,
    /// SWA's first epoch (0-based), once the run's epochs are known.
    swa_start: Option<u64>,
    /// Whether the epoch under way is one of SWA's.
    averaging_epoch: bool,
    /// The training weights while validation runs on the average.
    training: Option<StateDict>,
}

impl WeightAverager {
    /// Keeps an average by `config`.
    pub fn new(config: impl Into<AveragingConfig>) -> Self {
        Self {
            config: config.into(),
            swa_start: None,
            averaging_epoch: false,
            training: None,
        }
    }

    /// The average's configuration.
    pub fn config(&self) -> &AveragingConfig {
        &self.config
    }

    /// Puts the training weights back after validating on the average.
    fn restore_training<B: TrainBackend, M: Trainable<B>>(
        &mut self,
        cx: &mut Context<'_, B, M>,
    ) -> Result<()> {
        match self.training.take() {
            Some(training) => cx.state.model.load_state_dict(&training),
            None => Ok(()),
        }
    }
}

impl<B: TrainBackend, M: Trainable<B>> Callback<B, M> for WeightAverager {
    /// Starts the average (or checks the one a resumed state restored), and
    /// refuses what would fail later: SWA rates that do not fit the parameter
    /// groups, `update_bn` without batch norm, an EMA that would never update,
    /// a sharded model or checkpoint.
    fn on_fit_start(&mut self, cx: &mut Context<'_, B, M>, run: &FitInfo<'_>) -> Result<()> {
        let state = &mut *cx.state;
        let averaging = match state.averaging.as_mut() {
            Some(averaging) => averaging,
            None => state
                .averaging
                .insert(WeightAveraging::new(self.config.clone(), &state.model)?),
        };
        if *averaging.config() != self.config {
            return Err(Error::invalid_argument(
                "training state",
                format!(
                    "keeps a weight average by {:?}, but the trainer is configured for {:?}",
                    averaging.config(),
                    self.config,
                ),
            ));
        }
        if state.model.shards_parameters() || run.sharded_checkpoints {
            return Err(Error::invalid_argument(
                format!("training.{}", self.config.method().name()),
                "weight averaging keeps whole tensors and checkpoints them whole: it trains \
                 one process, or ranks that hold whole parameters and write full checkpoints \
                 (ddp, or zero1/zero2 with [distributed] checkpoint = \"full\"), not fsdp or \
                 sharded checkpoints",
            ));
        }
        match &self.config {
            AveragingConfig::Swa(swa) => {
                // One rate per parameter group, checked before the first epoch.
                swa.lrs_at(0, &state.optimizer.learning_rates())?;
                if swa.update_bn {
                    // Refused now rather than after the last epoch.
                    batch_norm_layers::<B, M>(&state.model)?;
                }
                self.swa_start = Some(swa.start_epoch(run.config.epochs)?);
            }
            AveragingConfig::Ema(ema) if averaging.updates() == 0 => ema.check_run(
                run.batches_per_epoch,
                run.config.accumulate,
                run.config.epochs,
                run.config.max_steps,
            )?,
            AveragingConfig::Ema(_) => {}
        }
        Ok(())
    }

    /// From SWA's first epoch on, sets its annealed rates for the epoch,
    /// recording the rates it anneals from at the first.
    fn on_train_epoch_start(&mut self, cx: &mut Context<'_, B, M>) -> Result<()> {
        let state = &mut *cx.state;
        self.averaging_epoch = self.swa_start.is_some_and(|start| state.epoch >= start);
        let (AveragingConfig::Swa(swa), Some(start)) = (&self.config, self.swa_start) else {
            return Ok(());
        };
        let Some(averaging) = state.averaging.as_mut().filter(|_| self.averaging_epoch) else {
            return Ok(());
        };
        let from = match averaging.swa_lrs_from() {
            Some(from) => from.to_vec(),
            None => {
                let from = state.optimizer.learning_rates();
                averaging.set_swa_lrs_from(from.clone());
                from
            }
        };
        let lrs = swa.lrs_at(state.epoch - start, &from)?;
        state.optimizer.set_learning_rates(&lrs)
    }

    /// Updates an EMA after the steps its config names.
    fn on_step_end(&mut self, cx: &mut Context<'_, B, M>, _loss: f64) -> Result<Flow> {
        if let Some(averaging) = cx.state.averaging.as_mut() {
            averaging.after_step(&cx.state.model, cx.state.step)?;
        }
        Ok(Flow::Continue)
    }

    fn needs_step_loss(&self) -> bool {
        false
    }

    /// Adds an SWA epoch's weights to the average.
    fn on_train_epoch_end(&mut self, cx: &mut Context<'_, B, M>) -> Result<()> {
        if !self.averaging_epoch {
            return Ok(());
        }
        match cx.state.averaging.as_mut() {
            Some(averaging) => averaging.update(&cx.state.model),
            None => Ok(()),
        }
    }

    /// SWA's rates own the optimizer in its epochs.
    fn holds_schedule(&self) -> bool {
        self.averaging_epoch
    }

    /// Puts the average into the model for validation, when the config
    /// validates on it and it has been updated.
    fn on_validation_start(&mut self, cx: &mut Context<'_, B, M>) -> Result<()> {
        let state = &mut *cx.state;
        if let Some(averaging) = state
            .averaging
            .as_ref()
            .filter(|a| a.config().validates() && a.updates() > 0)
        {
            self.training = Some(averaging.swap_into(&mut state.model)?);
        }
        Ok(())
    }

    /// Puts the training weights back.
    fn on_validation_end(
        &mut self,
        cx: &mut Context<'_, B, M>,
        _metrics: &[(String, f64)],
    ) -> Result<()> {
        self.restore_training(cx)
    }

    /// Puts the training weights back when validation failed on the average.
    fn on_exception(&mut self, cx: &mut Context<'_, B, M>, _error: &Error) -> Result<()> {
        self.restore_training(cx)
    }
}
