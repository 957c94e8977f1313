//! The training loop, split by concern: the trainer here (its
//! configuration in `learner/config.rs`); `fit` and the epoch's end (`fit.rs`); one epoch's batches and what
//! follows each optimizer step (`step.rs`); validation and evaluation
//! (`evaluate.rs`); checkpoints (`saving.rs`); the weight average put into
//! the model at the end (`averaging.rs`). The training tools, the weight
//! average's upkeep among them, are callbacks (`learner/tools`).

use std::path::{Path, PathBuf};

use super::callback::Callback;
use super::state::TrainingState;
use super::tools::{
    MisclassifiedImages, MisclassifiedLogger, ProfileConfig, Profiler, StepViewLogger, StepViews,
    Timer, WeightAverager,
};
use crate::checkpoint::{Checkpoint, CheckpointPolicy, Checkpointer};
use crate::logger::MetricSink;
use crate::metric::Metric;
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::error::{Error, Result};
use kiln_core::loss::Loss;
use kiln_core::model::Layer;
use kiln_core::objective::{Objective, Supervised};
use kiln_core::rng::SplitMix64;

pub use super::config::{EpochRecord, ScheduleInterval, TrainerConfig};

mod averaging;
mod evaluate;
mod fit;
mod saving;
mod step;

/// When [`Trainer::fit`] reads each step's loss back from the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossReads {
    /// After every step ([`Trainable::train_step`]): a non-finite loss stops
    /// training before its update is applied. What the CPU does by default, where
    /// reading costs nothing.
    EveryStep,
    /// Only when a value is needed: at a logged step
    /// ([`log_every`](TrainerConfig::log_every)), before a checkpoint, at the end of
    /// an epoch and of training ([`Trainable::train_step_deferred`]), so that an
    /// asynchronous device (CUDA) runs steps ahead of the host. A non-finite loss
    /// stops training at the next read, naming its step; the steps in between
    /// have been applied, and no checkpoint is written after it. The progress bar
    /// advances at each read. The default on CUDA. A callback whose
    /// [`needs_step_loss`](Callback::needs_step_loss) is true turns it back into
    /// `EveryStep`.
    WhenLogged,
}

/// The training loop, generic over the backend: callbacks, metric sinks,
/// checkpoints, gradient accumulation and clipping, and a schedule.
///
/// `B` is the backend and `M` the module it trains: any
/// [`Trainable`] module of `B`, by default the models the backend builds from
/// Kiln definitions (`Trainer<TorchBackend>`, `Trainer<TfBackend>`: one type
/// parameter switches engine). Other modules name themselves:
/// `Trainer<TorchBackend, ScriptModule>` fine-tunes a TorchScript model,
/// `Trainer<TorchBackend, Chain>` a pretrained part with new layers,
/// `Trainer<TfBackend, SavedModelModule>` a SavedModel through its training
/// signature.
///
/// ```
/// use kiln_core::backend::{TrainBackend, Trainable};
/// use kiln_core::loss::Loss;
/// use kiln_train::{Trainer, TrainerConfig};
///
/// /// A trainer for any module of any backend.
/// fn trainer_for<B: TrainBackend, M: Trainable<B>>() -> kiln_core::Result<Trainer<B, M>> {
///     Trainer::<B, M>::new(TrainerConfig::default(), Loss::cross_entropy())
/// }
/// ```
pub struct Trainer<B: TrainBackend, M: Trainable<B> = <B as TrainBackend>::Model> {
    config: TrainerConfig,
    objective: Box<dyn Objective<B>>,
    metrics: Vec<Box<dyn Fn() -> Box<dyn Metric> + Send>>,
    callbacks: Vec<Box<dyn Callback<B, M>>>,
    sinks: Vec<Box<dyn MetricSink>>,
    checkpointer: Option<Checkpointer>,
    /// On a rank that writes no checkpoint: when rank 0 writes one.
    checkpoint_turns: Option<CheckpointPolicy>,
    /// Where every rank writes its shard of a sharded checkpoint.
    sharded_checkpoints: Option<PathBuf>,
    model_definition: Option<Layer>,
    lora: Option<kiln_core::lora::LoraConfig>,
    data_identity: Option<serde_json::Value>,
    loss_reads: Option<LossReads>,
    _backend: std::marker::PhantomData<fn() -> (B, M)>,
}

impl<B: TrainBackend, M: Trainable<B>> std::fmt::Debug for Trainer<B, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("config", &self.config)
            .field("objective", &self.objective.name())
            .finish_non_exhaustive()
    }
}

/// `splitmix64(seed ^ step)`: the seed of one step's randomness (dropout), so a
/// resumed run draws exactly what an uninterrupted one would.
fn step_seed(seed: u64, step: u64) -> u64 {
    SplitMix64::new(seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64()
}

impl<B: TrainBackend, M: Trainable<B>> Trainer<B, M> {
    /// A trainer minimising `loss` (the [`Supervised`] objective).
    pub fn new(config: TrainerConfig, loss: Loss) -> Result<Self> {
        loss.validate()?;
        Self::with_objective(config, Supervised::new(loss))
    }

    /// A trainer minimising `objective`: what the step computes, of which a
    /// supervised loss ([`Trainer::new`]) is one (see
    /// [`kiln_core::objective`]). `fit` refuses, before the first step, an
    /// objective the model's step cannot compute (any but a supervised loss
    /// on TensorFlow).
    ///
    /// ```
    /// use kiln_core::backend::{TrainBackend, Trainable};
    /// use kiln_core::loss::Loss;
    /// use kiln_core::objective::Supervised;
    /// use kiln_train::{Trainer, TrainerConfig};
    ///
    /// fn trainer_for<B: TrainBackend, M: Trainable<B>>() -> kiln_core::Result<Trainer<B, M>> {
    ///     Trainer::<B, M>::with_objective(TrainerConfig::default(), Supervised::new(Loss::mse()))
    /// }
    /// ```
    pub fn with_objective(
        config: TrainerConfig,
        objective: impl Objective<B> + 'static,
    ) -> Result<Self> {
        config.validate()?;
        // The weight average's upkeep is the first callback, so that the
        // others validate and log with the average where it validates.
        let mut callbacks: Vec<Box<dyn Callback<B, M>>> = match config.averaging() {
            Some(averaging) => vec![Box::new(WeightAverager::new(averaging))],
            None => Vec::new(),
        };
        if let Some(max_time) = config.max_time {
            callbacks.push(Box::new(Timer::new(max_time.duration())));
        }
        Ok(Self {
            config,
            objective: Box::new(objective),
            metrics: Vec::new(),
            callbacks,
            sinks: Vec::new(),
            checkpointer: None,
            checkpoint_turns: None,
            sharded_checkpoints: None,
            model_definition: None,
            lora: None,
            data_identity: None,
            loss_reads: None,
            _backend: std::marker::PhantomData,
        })
    }

    /// Logs the [`StepViews`] beside each step's loss (the [`StepViewLogger`]
    /// callback); `fit` refuses views the optimizer cannot give before the
    /// first step.
    pub fn with_step_views(self, views: StepViews) -> Self {
        if views == StepViews::default() {
            return self;
        }
        self.with_callback(StepViewLogger::new(views))
    }

    /// Logs the first misclassified validation samples of each epoch to the
    /// sinks, as images ([`MisclassifiedImages`], the [`MisclassifiedLogger`]
    /// callback); `fit` checks the loss and that there is validation data
    /// before the first step.
    pub fn with_misclassified_images(self, view: MisclassifiedImages) -> Self {
        self.with_callback(MisclassifiedLogger::new(view))
    }

    /// Records steps `profile.steps` with the backend's profiler and writes the
    /// trace and the operator tables (see [`ProfileConfig`]; the [`Profiler`]
    /// callback). The window is checked before the first step; a backend that
    /// cannot profile fails there too.
    pub fn with_profiler(self, profile: ProfileConfig) -> Self {
        self.with_callback(Profiler::new(profile))
    }

    /// When `fit` reads the step losses back (see [`LossReads`]); by default
    /// [`LossReads::WhenLogged`] on CUDA and [`LossReads::EveryStep`] on the CPU.
    pub fn with_loss_reads(mut self, reads: LossReads) -> Self {
        self.loss_reads = Some(reads);
        self
    }

    /// The [`LossReads`] `fit` uses: the one given, else the device's default;
    /// `EveryStep` when a callback needs every step's loss.
    pub fn loss_reads(&self) -> LossReads {
        if self.callbacks.iter().any(|c| c.needs_step_loss()) {
            return LossReads::EveryStep;
        }
        self.loss_reads.unwrap_or(if self.config.device.is_cuda() {
            LossReads::WhenLogged
        } else {
            LossReads::EveryStep
        })
    }

    /// Whether a callback holds the learning-rate schedule now
    /// ([`Callback::holds_schedule`]).
    fn schedule_held(&self) -> bool {
        self.callbacks.iter().any(|c| c.holds_schedule())
    }

    /// The configuration.
    pub fn config(&self) -> &TrainerConfig {
        &self.config
    }

    /// What the steps minimise.
    pub fn objective(&self) -> &dyn Objective<B> {
        self.objective.as_ref()
    }

    /// Adds a metric computed on validation (and `evaluate`) batches; `make`
    /// creates a fresh one per evaluation.
    pub fn with_metric(mut self, make: impl Fn() -> Box<dyn Metric> + Send + 'static) -> Self {
        self.metrics.push(Box::new(make));
        self
    }

    /// Adds a callback; hooks run in the order callbacks were added.
    pub fn with_callback(mut self, callback: impl Callback<B, M> + 'static) -> Self {
        self.callbacks.push(Box::new(callback));
        self
    }

    /// Adds a metric sink (CSV, TensorBoard, progress, log).
    pub fn with_sink(mut self, sink: impl MetricSink + 'static) -> Self {
        self.sinks.push(Box::new(sink));
        self
    }

    /// Saves checkpoints with `checkpointer`; `definition` is recorded in them.
    pub fn with_checkpointer(
        mut self,
        checkpointer: Checkpointer,
        definition: Option<Layer>,
    ) -> Self {
        self.checkpointer = Some(checkpointer);
        self.model_definition = definition;
        self
    }

    /// On a rank that writes no checkpoint (every rank but 0): takes part in
    /// each checkpoint rank 0 writes under `policy`, which an optimizer whose
    /// state is sharded over the ranks needs
    /// ([`Optimizer::state_is_collective`](kiln_core::optim::Optimizer::state_is_collective):
    /// its state is gathered by every rank at once). For any other optimizer
    /// it does nothing.
    pub fn with_checkpoint_turns(mut self, policy: CheckpointPolicy) -> Self {
        self.checkpoint_turns = Some(policy);
        self
    }

    /// Writes sharded checkpoints into `dir` (on every rank, the same
    /// directory): each rank writes its part of the model's and optimizer's
    /// state ([`Trainable::shard_state_tensors`],
    /// [`Optimizer::shard_state_tensors`](kiln_core::optim::Optimizer::shard_state_tensors);
    /// a state every rank holds whole is written by rank 0), and rank 0,
    /// whose [`with_checkpointer`](Self::with_checkpointer) decides when,
    /// the index ([`save_sharded_checkpoint`](crate::save_sharded_checkpoint)).
    /// The other ranks save on the policy given to
    /// [`with_checkpoint_turns`](Self::with_checkpoint_turns).
    pub fn with_sharded_checkpoints(mut self, dir: impl Into<PathBuf>) -> Self {
        self.sharded_checkpoints = Some(dir.into());
        self
    }

    /// Records the LoRA adapters the model trains with in every checkpoint
    /// ([`Checkpoint::lora`]), so that exports and generation can apply them.
    pub fn with_lora(mut self, lora: Option<kiln_core::lora::LoraConfig>) -> Self {
        self.lora = lora;
        self
    }

    /// Records `identity` (what identifies the training data: its kind, path,
    /// size, a fingerprint) in every checkpoint, as [`Checkpoint::data`], so
    /// that a resume can check it trains on the same data.
    pub fn with_data_identity(mut self, identity: serde_json::Value) -> Self {
        self.data_identity = Some(identity);
        self
    }

    /// Loads the checkpoint at `path` into `state` (see [`TrainingState::restore`]);
    /// a checkpoint of another model is [`Error::Checkpoint`] naming the file, with
    /// the error naming the first key or shape that does not fit as its source.
    pub fn resume(state: &mut TrainingState<B, M>, path: &Path) -> Result<Checkpoint> {
        let checkpoint = Checkpoint::load(path)?;
        Self::resume_from(state, &checkpoint, path)?;
        Ok(checkpoint)
    }

    /// As [`resume`](Self::resume), from a checkpoint already read from `path`
    /// (for a caller that checks it first, as the CLI checks its definition and seed).
    /// A checkpoint holding NaN or infinite values is refused, naming them
    /// ([`Checkpoint::check_finite`]), and so is one written mid-epoch under
    /// another data order than this Kiln's, or by a Kiln that recorded none
    /// ([`Checkpoint::check_data_order`]); `state` is then left as it was.
    pub fn resume_from(
        state: &mut TrainingState<B, M>,
        checkpoint: &Checkpoint,
        path: &Path,
    ) -> Result<()> {
        checkpoint.check_finite(path)?;
        checkpoint.check_data_order(path)?;
        state.restore(checkpoint).map_err(|e| {
            Error::checkpoint_caused_by(path, "does not fit this model and optimizer", e)
        })?;
        log::info!(
            "resumed from {} at step {} (epoch {}, batch {})",
            path.display(),
            checkpoint.step,
            checkpoint.epoch,
            checkpoint.batch_in_epoch
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_seeds_differ_per_step_and_repeat_per_seed() {
        // The mix written out, as it was before it went through SplitMix64: the
        // same seeds, so runs resume as before.
        let written_out = |seed: u64, step: u64| {
            let golden = 0x9E37_79B9_7F4A_7C15u64;
            let mut z = (seed ^ step.wrapping_mul(golden)).wrapping_add(golden);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        for (seed, step) in [(0, 0), (7, 3), (u64::MAX, 12_345)] {
            assert_eq!(step_seed(seed, step), written_out(seed, step));
        }
        assert_eq!(step_seed(7, 3), step_seed(7, 3));
        assert_ne!(step_seed(7, 3), step_seed(7, 4));
        assert_ne!(step_seed(7, 3), step_seed(8, 3));
    }
}
