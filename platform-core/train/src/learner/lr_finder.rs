//! The learning-rate range test of Lightning's `LearningRateFinder`
//! (`Tuner.lr_find`): train for a number of steps while the learning rate grows
//! from `min_lr` to `max_lr`, record the smoothed loss, stop when it diverges,
//! and suggest the rate where the loss falls fastest. The model is put back
//! afterwards.

use serde::{Deserialize, Serialize};

use kiln_core::backend::{StepPlan, TrainBackend, Trainable};
use kiln_core::device::Device;
use kiln_core::error::{Error, Result};
use kiln_core::loss::Loss;
use kiln_core::optim::{Optimizer, OptimizerConfig, ParamGroup};
use kiln_data::DataLoader;

/// How the learning rate grows between the steps of the range test.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrSweep {
    /// `min_lr * (max_lr / min_lr) ** r` (the default).
    #[default]
    Exponential,
    /// `min_lr + r * (max_lr - min_lr)`.
    Linear,
}

/// The fewest steps from which a rate can be suggested (10 skipped at the
/// start, 1 at the end, 2 to take a slope between).
const MIN_NUM_TRAINING: usize = 13;

/// The range test's settings, with Lightning's defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrFinderConfig {
    /// The first learning rate (1e-8).
    pub min_lr: f64,
    /// The last learning rate (1.0).
    pub max_lr: f64,
    /// Optimizer steps, one learning rate each (100).
    pub num_training: usize,
    /// How the rate grows.
    pub mode: LrSweep,
    /// Stop once the smoothed loss exceeds this many times the best one (4.0);
    /// `None` runs every step.
    pub early_stop_threshold: Option<f64>,
    /// The smoothing of the recorded loss (0.98): a running average, bias-corrected.
    pub beta: f64,
}

impl Default for LrFinderConfig {
    fn default() -> Self {
        Self {
            min_lr: 1e-8,
            max_lr: 1.0,
            num_training: 100,
            mode: LrSweep::Exponential,
            early_stop_threshold: Some(4.0),
            beta: 0.98,
        }
    }
}

impl LrFinderConfig {
    /// Checks the values.
    pub fn validate(&self) -> Result<()> {
        if !(self.min_lr > 0.0 && self.min_lr < self.max_lr && self.max_lr.is_finite()) {
            return Err(Error::invalid_argument(
                "min_lr/max_lr",
                format!(
                    "need 0 < min_lr < max_lr, got {} and {}",
                    self.min_lr, self.max_lr
                ),
            ));
        }
        // Lightning's suggestion leaves out the first 10 steps and the last
        // one and needs two points between: fewer steps can never suggest.
        if self.num_training < MIN_NUM_TRAINING {
            return Err(Error::invalid_argument(
                "num_training",
                format!(
                    "must be at least {MIN_NUM_TRAINING} (the suggestion skips the first 10 steps \
                     and the last, and needs 2 between), got {}",
                    self.num_training
                ),
            ));
        }
        if !(0.0..1.0).contains(&self.beta) {
            return Err(Error::invalid_argument(
                "beta",
                format!("must be in [0, 1), got {}", self.beta),
            ));
        }
        if self
            .early_stop_threshold
            .is_some_and(|t| t.is_nan() || t <= 0.0)
        {
            return Err(Error::invalid_argument(
                "early_stop_threshold",
                "must be positive",
            ));
        }
        Ok(())
    }

    /// The learning rate of step `i` (0-based), as Lightning's `_ExponentialLR`
    /// and `_LinearLR` give it: `min_lr` first, then `r = (i + 1) / num_training`.
    pub fn lr_at(&self, i: usize) -> f64 {
        if i == 0 {
            return self.min_lr;
        }
        let r = (i + 1) as f64 / self.num_training as f64;
        match self.mode {
            LrSweep::Exponential => self.min_lr * (self.max_lr / self.min_lr).powf(r),
            LrSweep::Linear => self.min_lr + r * (self.max_lr - self.min_lr),
        }
    }
}

/// What the range test recorded: one learning rate and smoothed loss per step.
#[derive(Clone, Debug, PartialEq)]
pub struct LrFinderResult {
    /// The learning rate of each step.
    pub lrs: Vec<f64>,
    /// The smoothed loss after each step.
    pub losses: Vec<f64>,
    /// Whether the loss diverged and the test stopped before `num_training` steps.
    pub stopped_early: bool,
}

impl LrFinderResult {
    /// The step with the steepest fall of the loss against the learning rate,
    /// leaving out the first `skip_begin` and last `skip_end` steps and
    /// non-finite losses (Lightning's `suggestion(skip_begin=10, skip_end=1)`,
    /// `torch.gradient` with the rates as coordinates); `None` with fewer than
    /// two points. With `log_scale`, the slope is taken against the rate's
    /// logarithm instead, the steepest stretch of the curve as a log-scale plot
    /// shows it.
    pub fn suggestion_index(
        &self,
        skip_begin: usize,
        skip_end: usize,
        log_scale: bool,
    ) -> Option<usize> {
        let end = self.losses.len().checked_sub(skip_end)?;
        if skip_begin >= end {
            return None;
        }
        let coordinate = |lr: f64| if log_scale { lr.log10() } else { lr };
        let points: Vec<(usize, f64, f64)> = (skip_begin..end)
            .filter(|&i| self.losses[i].is_finite())
            .map(|i| (i, coordinate(self.lrs[i]), self.losses[i]))
            .collect();
        if points.len() < 2 {
            return None;
        }
        let n = points.len();
        let gradient = |k: usize| -> f64 {
            let (x, f) = (|j: usize| points[j].1, |j: usize| points[j].2);
            if k == 0 {
                (f(1) - f(0)) / (x(1) - x(0))
            } else if k == n - 1 {
                (f(k) - f(k - 1)) / (x(k) - x(k - 1))
            } else {
                // Second-order differences on uneven spacing, as torch.gradient.
                let (h0, h1) = (x(k) - x(k - 1), x(k + 1) - x(k));
                (h0 * h0 * f(k + 1) - h1 * h1 * f(k - 1) + (h1 * h1 - h0 * h0) * f(k))
                    / (h0 * h1 * (h0 + h1))
            }
        };
        let mut best = 0;
        let mut best_gradient = f64::INFINITY;
        for k in 0..n {
            let g = gradient(k);
            // argmin: the first of equal minima; NaN never wins.
            if g < best_gradient {
                best_gradient = g;
                best = k;
            }
        }
        Some(points[best].0)
    }

    /// The suggested learning rate, with Lightning's rule and defaults (the
    /// steepest slope against the rate itself, skipping the first 10 steps and
    /// the last one).
    ///
    /// On an exponential sweep from a tiny `min_lr`, Lightning's slope favours
    /// the smallest rates, where a tiny dip of the loss over a tiny step of the
    /// rate is steep; [`suggestion_log`](Self::suggestion_log) is the steepest
    /// stretch of the curve as plotted.
    pub fn suggestion(&self) -> Option<f64> {
        self.suggestion_index(10, 1, false).map(|i| self.lrs[i])
    }

    /// The rate where the loss falls fastest against the rate's logarithm
    /// (the same window and gradient as [`suggestion`](Self::suggestion)).
    pub fn suggestion_log(&self) -> Option<f64> {
        self.suggestion_index(10, 1, true).map(|i| self.lrs[i])
    }
}

/// Runs the range test on `model` with an optimizer of its own, built from
/// `optimizer` and `groups` as a run would build it, over batches of `loader`
/// (epoch after epoch as needed), then puts the model's state back as it was,
/// also on error. The optimizer is dropped: build the run's afterwards, with
/// the learning rate chosen.
///
/// Every parameter group takes the test's learning rate. `device` is where
/// the batches go (the model's).
pub fn find_lr<B: TrainBackend, M: Trainable<B>>(
    model: &mut M,
    optimizer: &OptimizerConfig,
    groups: &[ParamGroup],
    loss: &Loss,
    loader: &dyn DataLoader,
    device: Device,
    config: &LrFinderConfig,
) -> Result<LrFinderResult> {
    config.validate()?;
    if loader.num_batches() == 0 {
        return Err(Error::invalid_argument(
            "data",
            "the learning-rate finder needs at least one training batch",
        ));
    }
    let before = model.state_dict()?;
    let mut optimizer = model.build_optimizer(optimizer, groups)?;
    let result = sweep(model, &mut optimizer, loss, loader, device, config);
    drop(optimizer);
    let restored = model.load_state_dict(&before);
    let result = result?;
    restored?;
    Ok(result)
}

/// The steps of [`find_lr`].
fn sweep<B: TrainBackend, M: Trainable<B>>(
    model: &mut M,
    optimizer: &mut M::Optim,
    loss: &Loss,
    loader: &dyn DataLoader,
    device: Device,
    config: &LrFinderConfig,
) -> Result<LrFinderResult> {
    let groups = optimizer.learning_rates().len();
    let plan = StepPlan {
        loss,
        scale: 1.0,
        apply: true,
        clip: None,
    };
    let mut result = LrFinderResult {
        // Grown as the steps come: `num_training` is the user's number, and
        // reserving it up front would allocate for steps never run.
        lrs: Vec::new(),
        losses: Vec::new(),
        stopped_early: false,
    };
    let (mut average, mut best) = (0.0f64, 0.0f64);
    let mut epoch = 0u64;
    'epochs: loop {
        for batch in loader.batches(epoch) {
            let i = result.lrs.len();
            if i == config.num_training {
                break 'epochs;
            }
            let batch = batch?;
            let lr = config.lr_at(i);
            optimizer.set_learning_rates(&vec![lr; groups])?;
            optimizer.zero_grad()?;
            let inputs = B::from_host(&batch.inputs, device)?;
            let targets = B::from_host(&batch.targets, device)?;
            let value = model.train_step(optimizer, &inputs, &targets, &plan)?;
            // Lightning's _LRCallback: its step count is the optimizer steps
            // taken (i + 1), and the bias correction uses one more.
            let step = (i + 1) as i32;
            average = config.beta * average + (1.0 - config.beta) * value;
            let smoothed = average / (1.0 - config.beta.powi(step + 1));
            result.lrs.push(lr);
            result.losses.push(smoothed);
            let diverged = config
                .early_stop_threshold
                .is_some_and(|t| step > 1 && smoothed > t * best);
            if smoothed < best || step == 1 {
                best = smoothed;
            }
            if diverged || !value.is_finite() {
                result.stopped_early = true;
                break 'epochs;
            }
        }
        epoch += 1;
    }
    Ok(result)
}
