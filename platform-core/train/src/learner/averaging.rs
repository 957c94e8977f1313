//! Weight averaging, kept on the model's device beside it as
//! `torch.optim.swa_utils.AveragedModel` keeps one: an exponential moving
//! average (EMA; `get_ema_multi_avg_fn`, Lightning's `EMAWeightAveraging`) or
//! stochastic weight averaging (SWA; the equal-weight average with `SWALR`,
//! Lightning's `StochasticWeightAveraging`).

use std::f64::consts::PI;

use serde::{Deserialize, Serialize};

use crate::checkpoint::{Averaged, AveragingMethod};
use kiln_core::backend::TrainBackend;
use kiln_core::error::{Error, Result};
use kiln_core::module::Module;
use kiln_core::schedule::{AnnealStrategy, PerGroup};
use kiln_core::state_dict::StateDict;
use kiln_core::state_tensors::StateTensors;

/// How an exponential moving average of the weights is kept
/// (`[training] ema = { decay = 0.999 }` in a CLI config).
///
/// After every `every_n_steps`-th optimizer step from `start_step` on, each
/// averaged tensor moves towards the model's: `average = decay * average +
/// (1 - decay) * weight`. The first update copies the weights, as
/// `AveragedModel.update_parameters` does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmaConfig {
    /// The weight of the past, in (0, 1): 0.999 by default (Lightning's).
    #[serde(default = "default_decay")]
    pub decay: f64,
    /// Update after every this many optimizer steps (1 by default).
    #[serde(default = "one")]
    pub every_n_steps: u64,
    /// The first optimizer step (1-based) that updates the average (0 by
    /// default: from the first step), as Lightning's `update_starting_at_step`.
    #[serde(default)]
    pub start_step: u64,
    /// Ramp the decay up over the first updates, as timm's `ModelEmaV3`:
    /// update `n` (0-based) uses `min(decay, (1 + n) / (10 + n))`, so early,
    /// still-moving weights are not held back for thousands of steps.
    #[serde(default)]
    pub warmup: bool,
    /// Average the floating-point buffers too (batch norm's running
    /// statistics), as `AveragedModel(use_buffers=True)` and Lightning do
    /// (`true` by default); otherwise the averaged model uses the model's buffers.
    #[serde(default = "yes")]
    pub buffers: bool,
    /// Validate with the averaged weights (`true` by default, as Lightning's
    /// `WeightAveraging`); the training weights are put back afterwards.
    #[serde(default = "yes")]
    pub validate: bool,
}

fn default_decay() -> f64 {
    0.999
}

fn one() -> u64 {
    1
}

fn yes() -> bool {
    true
}

impl Default for EmaConfig {
    fn default() -> Self {
        Self::new(default_decay())
    }
}

impl EmaConfig {
    /// An average with this decay, updated after every step from the first.
    pub fn new(decay: f64) -> Self {
        Self {
            decay,
            every_n_steps: 1,
            start_step: 0,
            warmup: false,
            buffers: true,
            validate: true,
        }
    }

    /// Checks the values: a decay in (0, 1) and `every_n_steps` >= 1.
    pub fn validate(&self) -> Result<()> {
        if !(self.decay > 0.0 && self.decay < 1.0) {
            return Err(Error::invalid_argument(
                "training.ema.decay",
                format!("must be in (0, 1), got {}", self.decay),
            ));
        }
        if self.every_n_steps == 0 {
            return Err(Error::invalid_argument(
                "training.ema.every_n_steps",
                "must be at least 1",
            ));
        }
        Ok(())
    }

    /// The decay of update `n` (0-based), the warm-up applied.
    pub fn decay_at(&self, n: u64) -> f64 {
        if self.warmup {
            self.decay.min((1.0 + n as f64) / (10.0 + n as f64))
        } else {
            self.decay
        }
    }

    /// The first optimizer step (1-based) that updates the average.
    ///
    /// ```
    /// use kiln_train::EmaConfig;
    ///
    /// let ema = EmaConfig { start_step: 5, every_n_steps: 4, ..EmaConfig::default() };
    /// assert_eq!(ema.first_update(), 8);
    /// ```
    pub fn first_update(&self) -> u64 {
        let every = self.every_n_steps.max(1);
        self.start_step.max(1).div_ceil(every).saturating_mul(every)
    }

    /// Checks that a run ending at optimizer step `last` updates the average
    /// at least once, naming the key that prevents it.
    pub fn check_updates_within(&self, last: u64, run: &str) -> Result<()> {
        let first = self.first_update();
        if first <= last {
            return Ok(());
        }
        let key = if self.start_step > last {
            "training.ema.start_step"
        } else {
            "training.ema.every_n_steps"
        };
        Err(Error::invalid_argument(
            key,
            format!(
                "the average would first update after step {first}, but {run} ends at step \
                 {last}, so it would never update: start earlier or train longer"
            ),
        ))
    }

    /// Checks, before the first step, that a run of `epochs` epochs of
    /// `batches` batches each, `accumulate` batches a step (an epoch's tail of
    /// fewer takes none), ending at `max_steps` if set, updates the average.
    pub fn check_run(
        &self,
        batches: u64,
        accumulate: u64,
        epochs: u64,
        max_steps: Option<u64>,
    ) -> Result<()> {
        let per_epoch = batches / accumulate.max(1);
        let (last, run) = match max_steps {
            Some(m) if epochs == 0 || m < epochs.saturating_mul(per_epoch) => {
                (m, format!("the run (max_steps = {m})"))
            }
            _ => (
                epochs.saturating_mul(per_epoch),
                format!("the run ({epochs} epochs of {per_epoch} optimizer steps)"),
            ),
        };
        self.check_updates_within(last, &run)
    }

    /// Whether optimizer step `step` (1-based) updates the average.
    pub fn updates_after(&self, step: u64) -> bool {
        step >= self.start_step && step.is_multiple_of(self.every_n_steps)
    }
}

/// When stochastic weight averaging begins: an epoch (0-based, as Lightning's
/// `swa_epoch_start` given as an int) or a fraction of the run's epochs
/// (`int(fraction * epochs)`, as Lightning's float).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SwaStart {
    /// This epoch (0-based; at least 1).
    Epoch(u64),
    /// This fraction of the epochs, in (0, 1).
    Fraction(f64),
}

impl Default for SwaStart {
    fn default() -> Self {
        SwaStart::Fraction(0.8)
    }
}

/// How stochastic weight averaging is kept (`[training] swa = { lrs = 0.05 }`
/// in a CLI config), as Lightning's `StochasticWeightAveraging` and the
/// `torch.optim.swa_utils` recipe define it.
///
/// From epoch `epoch_start` on, the learning rate of each parameter group
/// anneals from its rate then to `lrs` over `annealing_epochs` epochs (`SWALR`;
/// the run's own schedule stops), and after each of those epochs the
/// parameters join an equal-weight average (`AveragedModel`'s default). At the
/// end, [`Trainer::apply_average`](crate::Trainer::apply_average) puts the
/// average in the model and recomputes its batch-norm statistics with one pass
/// over the training data (`update_bn`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwaConfig {
    /// The learning rate SWA anneals to: one for every group, or one per group
    /// (Lightning's `swa_lrs`).
    pub lrs: PerGroup,
    /// When averaging begins (0.8 of the epochs by default).
    #[serde(default)]
    pub epoch_start: SwaStart,
    /// Epochs the rate takes to reach `lrs` (10 by default; 0: at once).
    #[serde(default = "ten")]
    pub annealing_epochs: u64,
    /// `cos` (the default) or `linear`.
    #[serde(default)]
    pub annealing_strategy: AnnealStrategy,
    /// Recompute batch norm's running statistics for the averaged weights at
    /// the end (`true` by default), as `update_bn`.
    #[serde(default = "yes")]
    pub update_bn: bool,
    /// Validate with the average while it is kept (`false` by default: until
    /// the end its batch-norm statistics are the training weights').
    #[serde(default)]
    pub validate: bool,
}

fn ten() -> u64 {
    10
}

impl SwaConfig {
    /// SWA to the rate `lr`, with the other settings Lightning's defaults.
    pub fn new(lr: impl Into<PerGroup>) -> Self {
        Self {
            lrs: lr.into(),
            epoch_start: SwaStart::default(),
            annealing_epochs: 10,
            annealing_strategy: AnnealStrategy::Cos,
            update_bn: true,
            validate: false,
        }
    }

    /// Checks the values: positive rates, and a start that is an epoch >= 1
    /// or a fraction in (0, 1).
    pub fn validate(&self) -> Result<()> {
        let rates = match &self.lrs {
            PerGroup::Same(lr) => vec![*lr],
            PerGroup::Each(lrs) => lrs.clone(),
        };
        if rates.is_empty() || rates.iter().any(|lr| !(lr.is_finite() && *lr > 0.0)) {
            return Err(Error::invalid_argument(
                "training.swa.lrs",
                format!("must be positive rates, got {rates:?}"),
            ));
        }
        match self.epoch_start {
            SwaStart::Epoch(0) => Err(Error::invalid_argument(
                "training.swa.epoch_start",
                "an epoch must be at least 1 (0-based: 1 is the second epoch); \
                 a fraction of the epochs is written as 0.8",
            )),
            SwaStart::Fraction(f) if !(f > 0.0 && f < 1.0) => Err(Error::invalid_argument(
                "training.swa.epoch_start",
                format!("a fraction of the epochs must be in (0, 1), got {f}"),
            )),
            _ => Ok(()),
        }
    }

    /// The first averaging epoch (0-based) of a run of `epochs` epochs; fails
    /// when that leaves no epoch to average.
    pub fn start_epoch(&self, epochs: u64) -> Result<u64> {
        let start = match self.epoch_start {
            SwaStart::Epoch(e) => e,
            SwaStart::Fraction(f) => (f * epochs as f64) as u64,
        };
        if start >= epochs {
            return Err(Error::invalid_argument(
                "training.swa.epoch_start",
                format!(
                    "averaging would begin at epoch {start} (0-based), but the run has {epochs} \
                     epochs: start earlier or train longer"
                ),
            ));
        }
        Ok(start)
    }

    /// Each group's rate for the `k`-th averaging epoch (0-based), annealing
    /// from `from` (the rates when averaging began), as `SWALR` stepped once
    /// per epoch: `lrs * a + from * (1 - a)`, `a` the annealing function at
    /// `k / annealing_epochs` (1 from the start without annealing epochs).
    pub fn lrs_at(&self, k: u64, from: &[f64]) -> Result<Vec<f64>> {
        let to = self.lrs.resolve("training.swa.lrs", from.len())?;
        let step = if self.annealing_epochs == 0 {
            k.max(1)
        } else {
            k
        };
        let t = (step as f64 / self.annealing_epochs.max(1) as f64).clamp(0.0, 1.0);
        let alpha = match self.annealing_strategy {
            AnnealStrategy::Cos => (1.0 - (PI * t).cos()) / 2.0,
            AnnealStrategy::Linear => t,
        };
        Ok(to
            .iter()
            .zip(from)
            .map(|(swa, lr)| swa * alpha + lr * (1.0 - alpha))
            .collect())
    }
}

/// Which weight average a run keeps.
#[derive(Clone, Debug, PartialEq)]
pub enum AveragingConfig {
    /// An exponential moving average, updated after optimizer steps.
    Ema(EmaConfig),
    /// Stochastic weight averaging, updated after epochs.
    Swa(SwaConfig),
}

impl From<EmaConfig> for AveragingConfig {
    fn from(config: EmaConfig) -> Self {
        AveragingConfig::Ema(config)
    }
}

impl From<SwaConfig> for AveragingConfig {
    fn from(config: SwaConfig) -> Self {
        AveragingConfig::Swa(config)
    }
}

impl AveragingConfig {
    /// EMA or SWA.
    pub fn method(&self) -> AveragingMethod {
        match self {
            AveragingConfig::Ema(_) => AveragingMethod::Ema,
            AveragingConfig::Swa(_) => AveragingMethod::Swa,
        }
    }

    /// Whether validation uses the average.
    pub fn validates(&self) -> bool {
        match self {
            AveragingConfig::Ema(c) => c.validate,
            AveragingConfig::Swa(c) => c.validate,
        }
    }

    /// Whether the average holds buffers too (EMA's `buffers`; SWA averages
    /// parameters only, and recomputes batch-norm statistics at the end).
    fn buffers(&self) -> bool {
        match self {
            AveragingConfig::Ema(c) => c.buffers,
            AveragingConfig::Swa(_) => false,
        }
    }

    fn validate(&self) -> Result<()> {
        match self {
            AveragingConfig::Ema(c) => c.validate(),
            AveragingConfig::Swa(c) => c.validate(),
        }
    }
}

/// A weight average of a model, on the model's device: an exponential moving
/// average ([`EmaConfig`]) or an equal-weight one ([`SwaConfig`]).
///
/// ```no_run
/// # use kiln_core::{backend::TrainBackend, Result};
/// # use kiln_train::{EmaConfig, WeightAveraging};
/// # fn f<B: TrainBackend>(model: &mut B::Model) -> Result<()> {
/// let mut ema = WeightAveraging::<B>::new(EmaConfig::new(0.999), &*model)?;
/// // after each optimizer step:
/// ema.update(&*model)?;
/// // evaluate or save the averaged model:
/// let training_weights = ema.swap_into(model)?;
/// # Ok(()) }
/// ```
pub struct WeightAveraging<B: TrainBackend> {
    config: AveragingConfig,
    names: Vec<String>,
    averages: Vec<B::Tensor>,
    updates: u64,
    swa_lrs_from: Option<Vec<f64>>,
}

impl<B: TrainBackend> std::fmt::Debug for WeightAveraging<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightAveraging")
            .field("config", &self.config)
            .field("tensors", &self.names.len())
            .field("updates", &self.updates)
            .finish()
    }
}

/// The tensors of `model` an average keeps: its floating-point parameters, and
/// with `buffers` its floating-point buffers, by name.
fn averaged_tensors<B: TrainBackend, M: Module<B> + ?Sized>(
    model: &M,
    buffers: bool,
) -> Result<Vec<(String, B::Tensor)>> {
    let mut tensors = model.named_parameters()?;
    if buffers {
        tensors.extend(model.named_buffers()?);
    }
    let mut kept = Vec::with_capacity(tensors.len());
    for (name, tensor) in tensors {
        if B::dtype(&tensor)?.is_float() {
            kept.push((name, tensor));
        }
    }
    Ok(kept)
}

impl<B: TrainBackend> WeightAveraging<B> {
    /// An average of `model`'s weights that starts as a copy of them (no
    /// update made yet).
    pub fn new<M: Module<B> + ?Sized>(
        config: impl Into<AveragingConfig>,
        model: &M,
    ) -> Result<Self> {
        let config = config.into();
        config.validate()?;
        let mut names = Vec::new();
        let mut averages = Vec::new();
        for (name, tensor) in averaged_tensors::<B, M>(model, config.buffers())? {
            averages.push(B::copy_tensor(&tensor)?);
            names.push(name);
        }
        Ok(Self {
            config,
            names,
            averages,
            updates: 0,
            swa_lrs_from: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &AveragingConfig {
        &self.config
    }

    /// For SWA once it has begun: each group's learning rate when it began.
    pub fn swa_lrs_from(&self) -> Option<&[f64]> {
        self.swa_lrs_from.as_deref()
    }

    /// Records the rates SWA's schedule anneals from (the trainer does, at
    /// the start of the first averaging epoch).
    pub fn set_swa_lrs_from(&mut self, lrs: Vec<f64>) {
        self.swa_lrs_from = Some(lrs);
    }

    /// Updates made so far (`AveragedModel.n_averaged`).
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// The averaged tensors' names.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// One update from `model`'s current weights: the first copies them, the
    /// others move the average by `1 - decay` (EMA) or `1 / (updates + 1)` (SWA).
    pub fn update<M: Module<B> + ?Sized>(&mut self, model: &M) -> Result<()> {
        // The averaged tensors by name, in the order the average was made in
        // (integer buffers, never averaged, are passed over).
        let mut tensors = model.named_parameters()?;
        if self.config.buffers() {
            tensors.extend(model.named_buffers()?);
        }
        let mut expected = self.names.iter().peekable();
        let mut current = Vec::with_capacity(self.names.len());
        for (name, tensor) in tensors {
            if expected.peek().is_some_and(|n| **n == name) {
                expected.next();
                current.push(tensor);
            }
        }
        if let Some(missing) = expected.next() {
            return Err(Error::invalid_argument(
                "weight averaging",
                format!("the model has no `{missing}` any more, which the average was made of"),
            ));
        }
        let weight = match &self.config {
            _ if self.updates == 0 => 1.0,
            AveragingConfig::Ema(ema) => 1.0 - ema.decay_at(self.updates),
            AveragingConfig::Swa(_) => 1.0 / (self.updates + 1) as f64,
        };
        B::lerp_in_place(&mut self.averages, &current, weight)?;
        self.updates += 1;
        Ok(())
    }

    /// [`update`](Self::update) if optimizer step `step` (1-based) is one an
    /// EMA updates after; returns whether it did (never for SWA, which
    /// updates after epochs).
    pub fn after_step<M: Module<B> + ?Sized>(&mut self, model: &M, step: u64) -> Result<bool> {
        match &self.config {
            AveragingConfig::Ema(ema) if ema.updates_after(step) => {}
            _ => return Ok(false),
        }
        self.update(model)?;
        Ok(true)
    }

    /// Copies of the averaged tensors on their device (read when a checkpoint
    /// is written).
    pub fn state_tensors(&self) -> Result<StateTensors<B>> {
        let copies = self
            .averages
            .iter()
            .map(B::copy_tensor)
            .collect::<Result<Vec<_>>>()?;
        StateTensors::from_handles(self.names.iter().cloned().zip(copies))
    }

    /// Host copies of the averaged tensors (read straight from the device, no
    /// device copy first: validation swaps them in every epoch).
    pub fn state_dict(&self) -> Result<StateDict> {
        let mut state = StateDict::new();
        for (name, tensor) in self.names.iter().zip(&self.averages) {
            state.insert(name.clone(), B::to_host(tensor)?);
        }
        Ok(state)
    }

    /// What a checkpoint holds of the average.
    pub fn checkpoint_part(&self) -> Result<Averaged<StateTensors<B>>> {
        Ok(Averaged {
            tensors: self.state_tensors()?,
            updates: self.updates,
            method: self.config.method(),
            swa_lrs_from: self.swa_lrs_from.clone(),
        })
    }

    /// Checks that a checkpoint's average is this one's: the same names,
    /// shapes and dtypes.
    pub fn check(&self, saved: &Averaged) -> Result<()> {
        if saved.method != self.config.method() {
            return Err(Error::invalid_argument(
                "checkpoint",
                format!(
                    "its weight average is kept by {}, this run keeps {} (training.{})",
                    saved.method.name().to_uppercase(),
                    self.config.method().name().to_uppercase(),
                    self.config.method().name()
                ),
            ));
        }
        if saved.tensors.len() != self.names.len() {
            return Err(Error::invalid_argument(
                "checkpoint",
                format!(
                    "its weight average holds {} tensors, this run averages {}",
                    saved.tensors.len(),
                    self.names.len()
                ),
            ));
        }
        for (name, ours) in self.names.iter().zip(&self.averages) {
            let host = saved.tensors.get(name).ok_or_else(|| {
                Error::invalid_argument("checkpoint", format!("its weight average has no `{name}`"))
            })?;
            let (dtype, shape) = (B::dtype(ours)?, B::shape(ours));
            if host.dtype() != dtype || host.dims() != shape.dims() {
                return Err(Error::invalid_argument(
                    "checkpoint",
                    format!(
                        "its weight average's `{name}` is {} {:?}, the model's is {dtype} {:?}",
                        host.dtype(),
                        host.dims(),
                        shape.dims()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Puts back an average a checkpoint held. Nothing changes if its tensors
    /// are not this average's ([`check`](Self::check)).
    pub fn restore(&mut self, saved: &Averaged) -> Result<()> {
        self.check(saved)?;
        let mut loaded = Vec::with_capacity(self.names.len());
        for (name, ours) in self.names.iter().zip(&self.averages) {
            if let Some(host) = saved.tensors.get(name) {
                loaded.push(B::from_host(host, B::device(ours))?);
            }
        }
        self.averages = loaded;
        self.updates = saved.updates;
        self.swa_lrs_from.clone_from(&saved.swa_lrs_from);
        Ok(())
    }

    /// Loads the averaged weights into `model` (its other tensors stay) and
    /// returns the state it had, for [`Module::load_state_dict`] to put back.
    pub fn swap_into<M: Module<B> + ?Sized>(&self, model: &mut M) -> Result<StateDict> {
        let before = model.state_dict()?;
        let mut averaged = before.clone();
        for (name, tensor) in self.state_dict()?.into_inner() {
            averaged.insert(name, tensor);
        }
        model.load_state_dict(&averaged)?;
        Ok(before)
    }
}
