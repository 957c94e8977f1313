//! The training loop: `fit`, `evaluate`, `predict`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::averaging::{AveragingConfig, EmaConfig, SwaConfig, WeightAveraging};
use super::batch_norm::batch_norm_layers;
use super::callback::{Callback, Flow};
use super::state::TrainingState;
use crate::checkpoint::{Checkpoint, CheckpointPolicy, Checkpointer};
use crate::logger::{History, MetricSink};
use crate::metric::{LossMetric, Metric};
use kiln_core::backend::Mode;
use kiln_core::backend::{StepLoss, StepPlan, TrainBackend, Trainable};
use kiln_core::device::Device;
use kiln_core::distributed::{Collectives, ReduceOp};
use kiln_core::error::{Error, Result};
use kiln_core::loss::Loss;
use kiln_core::model::Layer;
use kiln_core::optim::{GradClip, Optimizer};
use kiln_core::precision::FloatPrecision;
use kiln_core::rng::SplitMix64;
use kiln_core::tensor::HostTensor;
use kiln_data::DataLoader;

mod misclassified;
mod profiling;
mod saving;
mod tools;

use misclassified::Collector;
pub use misclassified::{MisclassifiedImages, MISCLASSIFIED_TAG};
pub use profiling::ProfileConfig;
use profiling::ProfileRun;
pub use tools::StepViews;

/// An epoch's validation: the metrics, and the misclassified samples when the
/// run logs them.
type Validation = (Vec<(String, f64)>, Option<Collector>);

/// When the learning-rate schedule advances.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleInterval {
    /// After every optimizer step (warm-up, one-cycle).
    Step,
    /// After every epoch (PyTorch's usual `scheduler.step()` per epoch).
    #[default]
    Epoch,
}

/// How to train, independent of the model and the data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerConfig {
    /// Epochs to train for.
    #[serde(default = "ten")]
    pub epochs: u64,
    /// Stop after this many optimizer steps, if reached before `epochs`.
    #[serde(default)]
    pub max_steps: Option<u64>,
    /// Micro-batches whose gradients add up before each optimizer step (>= 1).
    #[serde(default = "one")]
    pub accumulate: u64,
    /// Gradient clipping before each optimizer step.
    #[serde(default)]
    pub clip: Option<GradClip>,
    /// The run's seed: initial weights, data order and dropout derive from it
    /// (in a config file: the top-level `seed`).
    #[serde(skip)]
    pub seed: u64,
    /// Where the model and batches live (in a config file: the top-level `device`).
    #[serde(skip)]
    pub device: Device,
    /// When the schedule advances.
    #[serde(default)]
    pub schedule_interval: ScheduleInterval,
    /// Log the step's training loss and learning rate (`steps.csv`, TensorBoard)
    /// every this many optimizer steps, as Lightning's `log_every_n_steps`
    /// (0: only the per-epoch record).
    #[serde(default = "fifty")]
    pub log_every: u64,
    /// Keep host memory that tensors free for the next step instead of
    /// returning it to the OS (see [`host_memory`](kiln_core::host_memory); on by
    /// default, glibc only). `fit` applies it process-wide.
    #[serde(default = "yes")]
    pub retain_host_memory: bool,
    /// The dtype of parameters and of the forward pass, like Lightning's
    /// `precision` (`32-true`, `bf16-mixed`, `bf16-true`). The model must have
    /// been given it ([`TrainBackend::set_precision`]) before its optimizer was
    /// built; `fit` checks.
    #[serde(default)]
    pub precision: FloatPrecision,
    /// Keep an exponential moving average of the weights
    /// (`ema = { decay = 0.999 }`; see [`EmaConfig`]). `fit` starts one from
    /// the model's weights when the state has none
    /// ([`TrainingState::with_weight_averaging`] gives one before a resume, so
    /// that the checkpoint's average is restored).
    #[serde(default)]
    pub ema: Option<EmaConfig>,
    /// Stochastic weight averaging (`swa = { lrs = 0.05 }`; see [`SwaConfig`]),
    /// instead of `ema`: its learning-rate schedule replaces the run's from
    /// its first epoch on, and [`Trainer::apply_average`] ends the run with
    /// the average and its batch-norm statistics.
    #[serde(default)]
    pub swa: Option<SwaConfig>,
}

fn ten() -> u64 {
    10
}
fn one() -> u64 {
    1
}
fn fifty() -> u64 {
    50
}
fn yes() -> bool {
    true
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            epochs: 10,
            max_steps: None,
            accumulate: 1,
            clip: None,
            seed: 0,
            device: Device::Cpu,
            schedule_interval: ScheduleInterval::Epoch,
            log_every: 50,
            retain_host_memory: true,
            precision: FloatPrecision::F32,
            ema: None,
            swa: None,
        }
    }
}

impl TrainerConfig {
    /// Rejects settings that cannot work, naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.accumulate == 0 {
            return Err(Error::invalid_argument("accumulate", "must be at least 1"));
        }
        if self.epochs == 0 && self.max_steps.is_none() {
            return Err(Error::invalid_argument("epochs", "must be at least 1"));
        }
        if let Some(clip) = &self.clip {
            clip.validate()?;
        }
        if let Some(ema) = &self.ema {
            ema.validate()?;
        }
        if let Some(swa) = &self.swa {
            if self.ema.is_some() {
                return Err(Error::invalid_argument(
                    "training.swa",
                    "a run keeps one weight average: set training.ema or training.swa, not both",
                ));
            }
            swa.validate()?;
            swa.start_epoch(self.epochs)?;
        }
        Ok(())
    }

    /// The weight average the run keeps, if any.
    pub fn averaging(&self) -> Option<AveragingConfig> {
        match (&self.ema, &self.swa) {
            (Some(ema), _) => Some(ema.clone().into()),
            (None, Some(swa)) => Some(swa.clone().into()),
            (None, None) => None,
        }
    }
}

/// The metrics of one epoch, by name.
pub type EpochRecord = BTreeMap<String, f64>;

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

/// A training micro-batch's loss not yet read: the optimizer step it belongs
/// to, its rows, and the loss.
struct PendingLoss<T> {
    step: u64,
    rows: usize,
    loss: StepLoss<T>,
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
    loss: Loss,
    metrics: Vec<Box<dyn Fn() -> Box<dyn Metric> + Send>>,
    callbacks: Vec<Box<dyn Callback>>,
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
    views: StepViews,
    misclassified: Option<MisclassifiedImages>,
    profile: Option<ProfileConfig>,
    _backend: std::marker::PhantomData<fn() -> (B, M)>,
}

impl<B: TrainBackend, M: Trainable<B>> std::fmt::Debug for Trainer<B, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("config", &self.config)
            .field("loss", &self.loss)
            .finish_non_exhaustive()
    }
}

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

/// `splitmix64(seed ^ step)`: the seed of one step's randomness (dropout), so a
/// resumed run draws exactly what an uninterrupted one would.
fn step_seed(seed: u64, step: u64) -> u64 {
    SplitMix64::new(seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64()
}

impl<B: TrainBackend, M: Trainable<B>> Trainer<B, M> {
    /// A trainer minimising `loss`.
    pub fn new(config: TrainerConfig, loss: Loss) -> Result<Self> {
        config.validate()?;
        loss.validate()?;
        Ok(Self {
            config,
            loss,
            metrics: Vec::new(),
            callbacks: Vec::new(),
            sinks: Vec::new(),
            checkpointer: None,
            checkpoint_turns: None,
            sharded_checkpoints: None,
            model_definition: None,
            lora: None,
            data_identity: None,
            loss_reads: None,
            views: StepViews::default(),
            misclassified: None,
            profile: None,
            _backend: std::marker::PhantomData,
        })
    }

    /// Logs the [`StepViews`] beside each step's loss; `fit` refuses views the
    /// optimizer cannot give before the first step.
    pub fn with_step_views(mut self, views: StepViews) -> Self {
        self.views = views;
        self
    }

    /// Logs the first misclassified validation samples of each epoch to the
    /// sinks, as images ([`MisclassifiedImages`]); `fit` checks the loss and
    /// that there is validation data before the first step.
    pub fn with_misclassified_images(mut self, view: MisclassifiedImages) -> Self {
        self.misclassified = Some(view);
        self
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

    /// Reads the pending losses in order into the epoch's loss and the sinks'
    /// batch records; a non-finite one is [`Error::NonFiniteLoss`] naming its
    /// step. Returns the last value read.
    fn read_losses(
        &mut self,
        state: &mut TrainingState<B, M>,
        pending: &mut Vec<PendingLoss<B::Tensor>>,
    ) -> Result<Option<f64>> {
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
            for sink in &mut self.sinks {
                sink.log_batch(p.rows, value)?;
            }
            last = Some(value);
        }
        Ok(last)
    }

    /// The configuration.
    pub fn config(&self) -> &TrainerConfig {
        &self.config
    }

    /// Adds a metric computed on validation (and `evaluate`) batches; `make`
    /// creates a fresh one per evaluation.
    pub fn with_metric(mut self, make: impl Fn() -> Box<dyn Metric> + Send + 'static) -> Self {
        self.metrics.push(Box::new(make));
        self
    }

    /// Adds a callback.
    pub fn with_callback(mut self, callback: impl Callback + 'static) -> Self {
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
                if monitor.starts_with("val_") && val.is_none() {
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
        if let (Some(config), None) = (self.config.averaging(), &state.averaging) {
            state.averaging = Some(WeightAveraging::new(config, &state.model)?);
        }
        if let (Some(averaging), Some(config)) = (&state.averaging, self.config.averaging()) {
            if *averaging.config() != config {
                return Err(Error::invalid_argument(
                    "training state",
                    format!(
                        "keeps a weight average by {:?}, but the trainer is configured for {config:?}",
                        averaging.config(),
                    ),
                ));
            }
        }
        if let Some(AveragingConfig::Swa(swa)) = state.averaging.as_ref().map(|a| a.config()) {
            // One rate per parameter group, checked before the first epoch.
            swa.lrs_at(0, &state.optimizer.learning_rates())?;
            if swa.update_bn {
                // Refused now rather than after the last epoch.
                batch_norm_layers::<B, M>(&state.model)?;
            }
        }
        if let Some(averaging) = state
            .averaging
            .as_ref()
            .filter(|_| state.model.shards_parameters() || self.sharded_checkpoints.is_some())
        {
            return Err(Error::invalid_argument(
                format!("training.{}", averaging.config().method().name()),
                "weight averaging keeps whole tensors and checkpoints them whole: it trains \
                 one process, or ranks that hold whole parameters and write full checkpoints \
                 (ddp, or zero1/zero2 with [distributed] checkpoint = \"full\"), not fsdp or \
                 sharded checkpoints",
            ));
        }
        if self.views.graph && state.model.graph_def()?.is_none() {
            return Err(Error::invalid_argument(
                "logging.graph",
                format!(
                    "the {} engine runs eagerly and keeps no dataflow graph for TensorBoard's \
                     Graphs view (TensorFlow does)",
                    B::NAME
                ),
            ));
        }
        if self.views.grad_norms && !state.optimizer.keeps_gradients() {
            return Err(Error::invalid_argument(
                "logging.grad_norms",
                format!(
                    "the {} optimizer keeps no gradients after its step (a graph engine \
                     computes them inside it), so their norms cannot be logged",
                    B::NAME
                ),
            ));
        }
        if let Some(view) = &self.misclassified {
            view.validate(&self.loss)?;
            if val.is_none() {
                return Err(Error::invalid_argument(
                    "logging.misclassified_images",
                    "draws from the validation data, and there is none (give fit a validation \
                     loader)",
                ));
            }
        }
        if self.config.retain_host_memory {
            kiln_core::host_memory::retain_freed_memory();
        }
        let mut history = History::new();
        let mut pending: Vec<PendingLoss<B::Tensor>> = Vec::new();
        let mut profile = match &self.profile {
            Some(config) => Some(ProfileRun::new::<B>(
                config,
                self.config.device,
                state.step + 1,
                self.last_step(state, train.num_batches() as u64),
            )?),
            None => None,
        };
        let mut result =
            self.fit_epochs(state, train, val, &mut history, &mut pending, &mut profile);
        if let (Ok(()), Some(profile)) = (&result, profile.as_mut()) {
            result = profile.end_of_run(state.step);
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

    /// `fit`'s loop over epochs and batches.
    fn fit_epochs(
        &mut self,
        state: &mut TrainingState<B, M>,
        train: &dyn DataLoader,
        val: Option<&dyn DataLoader>,
        history: &mut History,
        pending: &mut Vec<PendingLoss<B::Tensor>>,
        profile: &mut Option<ProfileRun>,
    ) -> Result<()> {
        let deferred = self.loss_reads() == LossReads::WhenLogged;
        let mut graph_logged = false;
        let accumulate = self.config.accumulate;
        let device = self.config.device;
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
        let swa_start = match state.averaging.as_ref().map(|a| a.config()) {
            Some(AveragingConfig::Swa(swa)) => Some(swa.start_epoch(self.config.epochs)?),
            Some(AveragingConfig::Ema(ema))
                if state.averaging.as_ref().is_some_and(|a| a.updates() == 0) =>
            {
                ema.check_run(
                    train.num_batches() as u64,
                    accumulate,
                    self.config.epochs,
                    self.config.max_steps,
                )?;
                None
            }
            _ => None,
        };
        'epochs: while state.epoch < self.config.epochs {
            let averaging_epoch = swa_start.is_some_and(|start| state.epoch >= start);
            if let (Some(start), true) = (swa_start, averaging_epoch) {
                Self::set_swa_rates(state, state.epoch - start)?;
            }
            state.model.set_mode(Mode::Train);
            let batches = train.num_batches() as u64;
            for sink in &mut self.sinks {
                sink.start_epoch(
                    state.epoch,
                    Some(batches.saturating_sub(state.batch_in_epoch)),
                )?;
            }
            let mut micro = 0u64;
            let skip = state.batch_in_epoch as usize;
            let mut pulls = train.batches_from(state.epoch, skip);
            loop {
                // The wait for the batch is part of the step, and profiled as such;
                // the pull that ends the epoch belongs to no step.
                let next = match profile.as_mut() {
                    Some(p) if state.batch_in_epoch < batches => {
                        if micro == 0 {
                            p.before_step(state.step + 1)?;
                        }
                        p.wait(|| pulls.next())?
                    }
                    _ => pulls.next(),
                };
                let Some(batch) = next else { break };
                if self.config.max_steps.is_some_and(|m| state.step >= m) {
                    break 'epochs;
                }
                let batch = batch?;
                if micro == 0 {
                    B::manual_seed(step_seed(self.config.seed, state.step));
                    state.optimizer.zero_grad()?;
                }
                let inputs = B::from_host(&batch.inputs, device)?;
                let targets = B::from_host(&batch.targets, device)?;
                let apply = micro + 1 >= accumulate;
                let plan = StepPlan {
                    loss: &self.loss,
                    scale: if accumulate > 1 {
                        1.0 / accumulate as f64
                    } else {
                        1.0
                    },
                    apply,
                    clip: self.config.clip.as_ref(),
                };
                let loss = if deferred {
                    state.model.train_step_deferred(
                        &mut state.optimizer,
                        &inputs,
                        &targets,
                        &plan,
                    )?
                } else {
                    StepLoss::Host(state.model.train_step(
                        &mut state.optimizer,
                        &inputs,
                        &targets,
                        &plan,
                    )?)
                };
                pending.push(PendingLoss {
                    step: state.step + 1,
                    rows: batch.targets.dims().first().copied().unwrap_or(1),
                    loss,
                });
                // The last value read: this micro-batch's unless reads are deferred.
                let mut value = f64::NAN;
                if !deferred {
                    value = self.read_losses(state, pending)?.unwrap_or(f64::NAN);
                }
                micro += 1;
                state.batch_in_epoch += 1;
                if !apply {
                    continue;
                }
                micro = 0;
                state.step += 1;
                if let Some(averaging) = state.averaging.as_mut() {
                    averaging.after_step(&state.model, state.step)?;
                }
                if self.config.schedule_interval == ScheduleInterval::Step && !averaging_epoch {
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
                    value = self.read_losses(state, pending)?.unwrap_or(f64::NAN);
                }
                if logged {
                    let mut row = vec![
                        ("loss".to_owned(), value),
                        ("lr".to_owned(), state.optimizer.learning_rate()),
                    ];
                    self.views_row(state, &mut row)?;
                    for sink in &mut self.sinks {
                        sink.log_step(state.step, &row)?;
                    }
                }
                let every = self.views.histograms_every;
                if every > 0 && state.step.is_multiple_of(every) && !self.sinks.is_empty() {
                    let histograms = Self::histograms(state)?;
                    for sink in &mut self.sinks {
                        sink.log_histograms(state.step, &histograms)?;
                    }
                }
                if self.views.graph && !graph_logged {
                    self.log_graph(state)?;
                    graph_logged = true;
                }
                for sink in &mut self.sinks {
                    sink.end_step(state.step)?;
                }
                let mut stop = false;
                for cb in &mut self.callbacks {
                    stop |= cb.on_step_end(state.step, value)? == Flow::Stop;
                }
                if checkpoint_due {
                    self.save_checkpoint(state, &EpochRecord::new())?;
                }
                if let Some(p) = profile.as_mut() {
                    p.after_step(state.step)?;
                }
                if stop {
                    break 'epochs;
                }
            }
            // The epoch is over: metrics, schedule, callbacks, checkpoint.
            self.read_losses(state, pending)?;
            if averaging_epoch {
                if let Some(averaging) = state.averaging.as_mut() {
                    averaging.update(&state.model)?;
                }
            }
            let mut record = EpochRecord::new();
            record.insert("loss".to_owned(), state.epoch_loss.compute()?);
            record.insert("lr".to_owned(), state.optimizer.learning_rate());
            if let Some(val) = val {
                let (metrics, misclassified) = self.validate_epoch(state, val)?;
                for (name, value) in metrics {
                    record.insert(format!("val_{name}"), value);
                }
                if let Some(found) = misclassified {
                    self.log_misclassified(state.epoch, found)?;
                }
            }
            if self.config.schedule_interval == ScheduleInterval::Epoch && !averaging_epoch {
                if let Some(s) = state.scheduler.as_mut() {
                    let lrs = match s.monitor() {
                        Some(monitor) => {
                            let metric = record.get(monitor).copied().ok_or_else(|| {
                                unknown_metric("schedule.monitor", monitor, &record)
                            })?;
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
            let mut stop = false;
            for cb in &mut self.callbacks {
                stop |= cb.on_epoch_end(state.epoch, &record)? == Flow::Stop;
            }
            let finished_epoch = state.epoch;
            state.epoch += 1;
            state.batch_in_epoch = 0;
            state.epoch_loss = LossMetric::new("loss");
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
            if stop {
                break;
            }
        }
        Ok(())
    }

    /// The epoch's validation: [`evaluate`](Self::evaluate), with the averaged
    /// weights in the model when the run keeps an average that validates
    /// (the training weights are put back afterwards, also on error), and the
    /// misclassified samples when the run logs them.
    fn validate_epoch(
        &self,
        state: &mut TrainingState<B, M>,
        val: &dyn DataLoader,
    ) -> Result<Validation> {
        let mut found = self.misclassified_collector(&state.model);
        let Some(averaging) = state
            .averaging
            .as_ref()
            .filter(|a| a.config().validates() && a.updates() > 0)
        else {
            let metrics = self.evaluate_collecting(&mut state.model, val, found.as_mut())?;
            return Ok((metrics, found));
        };
        let training = averaging.swap_into(&mut state.model)?;
        let metrics = self.evaluate_collecting(&mut state.model, val, found.as_mut());
        state.model.load_state_dict(&training)?;
        Ok((metrics?, found))
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
        self.evaluate_collecting(model, loader, None)
    }

    /// [`evaluate`](Self::evaluate), giving each batch to `found`.
    fn evaluate_collecting(
        &self,
        model: &mut M,
        loader: &dyn DataLoader,
        found: Option<&mut Collector>,
    ) -> Result<Vec<(String, f64)>> {
        if model.collectives().is_some() {
            // Every rank evaluates rank 0's batch-norm statistics.
            model.sync_buffers()?;
        }
        let mode = model.mode();
        model.set_mode(Mode::Eval);
        let result = self.evaluate_inner(model, loader, found);
        model.set_mode(mode);
        result
    }

    fn evaluate_inner(
        &self,
        model: &M,
        loader: &dyn DataLoader,
        mut found: Option<&mut Collector>,
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
        let mut ran = 0;
        let mut last = None;
        for batch in loader.batches(0) {
            let batch = batch?;
            let inputs = B::from_host(&batch.inputs, self.config.device)?;
            let targets = B::from_host(&batch.targets, self.config.device)?;
            let (value, output) = model.eval_step(&self.loss, &inputs, &targets)?;
            loss.update_value(value, batch.targets.dims().first().copied().unwrap_or(1));
            for metric in &mut metrics {
                metric.update(&output, &batch.targets)?;
            }
            if let Some(found) = found.as_deref_mut() {
                found.add(&batch.inputs, &output, &batch.targets)?;
            }
            ran += 1;
            if lockstep.is_some() {
                last = Some((inputs, targets));
            }
        }
        if let (Some(rounds), Some((inputs, targets))) = (rounds, &last) {
            for _ in ran..rounds {
                drop(model.eval_step(&self.loss, inputs, targets)?);
            }
        }
        if let Some(group) = model.collectives() {
            let mut all: Vec<&mut dyn Metric> = vec![&mut loss];
            all.extend(metrics.iter_mut().map(|m| m.as_mut() as &mut dyn Metric));
            reduce_metrics(group.as_ref(), &mut all)?;
        }
        let mut out = vec![("loss".to_owned(), loss.compute()?)];
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
