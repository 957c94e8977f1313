//! Weight averaging: an exponential moving average (EMA) of a model's weights,
//! kept on the model's device beside it, as `torch.optim.swa_utils.AveragedModel`
//! with `get_ema_multi_avg_fn` and Lightning's `EMAWeightAveraging` keep one.

use serde::{Deserialize, Serialize};

use crate::checkpoint::Averaged;
use kiln_core::backend::TrainBackend;
use kiln_core::error::{Error, Result};
use kiln_core::module::Module;
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

    /// Whether optimizer step `step` (1-based) updates the average.
    pub fn updates_after(&self, step: u64) -> bool {
        step >= self.start_step && step.is_multiple_of(self.every_n_steps)
    }
}

/// An exponential moving average of a model's weights, on the model's device.
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
    config: EmaConfig,
    names: Vec<String>,
    averages: Vec<B::Tensor>,
    updates: u64,
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
    pub fn new<M: Module<B> + ?Sized>(config: EmaConfig, model: &M) -> Result<Self> {
        config.validate()?;
        let mut names = Vec::new();
        let mut averages = Vec::new();
        for (name, tensor) in averaged_tensors::<B, M>(model, config.buffers)? {
            averages.push(B::copy_tensor(&tensor)?);
            names.push(name);
        }
        Ok(Self {
            config,
            names,
            averages,
            updates: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EmaConfig {
        &self.config
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
    /// others move the average by `1 - decay`.
    pub fn update<M: Module<B> + ?Sized>(&mut self, model: &M) -> Result<()> {
        // The averaged tensors by name, in the order the average was made in
        // (integer buffers, never averaged, are passed over).
        let mut tensors = model.named_parameters()?;
        if self.config.buffers {
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
        let weight = if self.updates == 0 {
            1.0
        } else {
            1.0 - self.config.decay_at(self.updates)
        };
        B::lerp_in_place(&mut self.averages, &current, weight)?;
        self.updates += 1;
        Ok(())
    }

    /// [`update`](Self::update) if optimizer step `step` (1-based) is one the
    /// configuration updates after; returns whether it did.
    pub fn after_step<M: Module<B> + ?Sized>(&mut self, model: &M, step: u64) -> Result<bool> {
        if !self.config.updates_after(step) {
            return Ok(false);
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
        })
    }

    /// Checks that a checkpoint's average is this one's: the same names,
    /// shapes and dtypes.
    pub fn check(&self, saved: &Averaged) -> Result<()> {
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
