//! `OneCycleLR`: the 1cycle policy (warm up to `max_lr`, then anneal far below the start).

use std::f64::consts::PI;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    check_base_lrs, check_positive_steps, check_state_groups, from_state, state_error, to_state,
    EpochState, LrScheduler, PerGroup,
};
use crate::error::{Error, Result};

/// How [`OneCycleLr`] moves between two rates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnnealStrategy {
    /// Half a cosine (the default).
    #[default]
    Cos,
    /// A straight line.
    Linear,
}

impl AnnealStrategy {
    /// The value `pct` of the way from `start` to `end`, as PyTorch's
    /// `_annealing_cos` / `_annealing_linear`.
    fn anneal(self, start: f64, end: f64, pct: f64) -> f64 {
        match self {
            AnnealStrategy::Cos => {
                let cos_out = (PI * pct).cos() + 1.0;
                end + (start - end) / 2.0 * cos_out
            }
            AnnealStrategy::Linear => (end - start) * pct + start,
        }
    }
}

fn default_pct_start() -> f64 {
    0.3
}

fn yes() -> bool {
    true
}

fn default_base_momentum() -> PerGroup {
    PerGroup::Same(0.85)
}

fn default_max_momentum() -> PerGroup {
    PerGroup::Same(0.95)
}

fn default_div_factor() -> f64 {
    25.0
}

fn default_final_div_factor() -> f64 {
    1e4
}

/// Options of [`OneCycleLr`] (defaults as PyTorch).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OneCycleLrConfig {
    /// The peak rate: one for all groups or one per group.
    pub max_lr: PerGroup,
    /// Steps in the cycle; stepping past it is an error.
    pub total_steps: u64,
    /// Fraction of the cycle spent warming up, in `[0, 1]` (default 0.3).
    #[serde(default = "default_pct_start")]
    pub pct_start: f64,
    /// Cosine or linear annealing (default cosine).
    #[serde(default)]
    pub anneal_strategy: AnnealStrategy,
    /// Whether momentum (or Adam's beta1) cycles inversely to the rate (default `true`).
    #[serde(default = "yes")]
    pub cycle_momentum: bool,
    /// Momentum at the peak rate (default 0.85).
    #[serde(default = "default_base_momentum")]
    pub base_momentum: PerGroup,
    /// Momentum at the start and end (default 0.95).
    #[serde(default = "default_max_momentum")]
    pub max_momentum: PerGroup,
    /// Starting rate is `max_lr / div_factor` (default 25).
    #[serde(default = "default_div_factor")]
    pub div_factor: f64,
    /// Final rate is the starting rate `/ final_div_factor` (default 1e4).
    #[serde(default = "default_final_div_factor")]
    pub final_div_factor: f64,
    /// Whether a third phase anneals to the final rate after a symmetric
    /// warm-up and cool-down, as in the paper (default `false`, fastai's two phases).
    #[serde(default)]
    pub three_phase: bool,
}

impl OneCycleLrConfig {
    /// A cycle of `total_steps` peaking at `max_lr`, with PyTorch's defaults.
    pub fn new(max_lr: impl Into<PerGroup>, total_steps: u64) -> Self {
        OneCycleLrConfig {
            max_lr: max_lr.into(),
            total_steps,
            pct_start: default_pct_start(),
            anneal_strategy: AnnealStrategy::Cos,
            cycle_momentum: true,
            base_momentum: default_base_momentum(),
            max_momentum: default_max_momentum(),
            div_factor: default_div_factor(),
            final_div_factor: default_final_div_factor(),
            three_phase: false,
        }
    }

    /// Sets the warm-up fraction.
    pub fn with_pct_start(mut self, pct_start: f64) -> Self {
        self.pct_start = pct_start;
        self
    }

    /// Sets the annealing strategy.
    pub fn with_anneal_strategy(mut self, strategy: AnnealStrategy) -> Self {
        self.anneal_strategy = strategy;
        self
    }

    /// Sets whether momentum cycles, and between which values.
    pub fn with_momentum(
        mut self,
        cycle_momentum: bool,
        base_momentum: impl Into<PerGroup>,
        max_momentum: impl Into<PerGroup>,
    ) -> Self {
        self.cycle_momentum = cycle_momentum;
        self.base_momentum = base_momentum.into();
        self.max_momentum = max_momentum.into();
        self
    }

    /// Sets the initial and final divisors.
    pub fn with_div_factors(mut self, div_factor: f64, final_div_factor: f64) -> Self {
        self.div_factor = div_factor;
        self.final_div_factor = final_div_factor;
        self
    }

    /// Sets the three-phase variant.
    pub fn with_three_phase(mut self, three_phase: bool) -> Self {
        self.three_phase = three_phase;
        self
    }

    /// Rejects what PyTorch rejects (zero `total_steps`, `pct_start` outside
    /// `[0, 1]`) and divisors that are not positive and finite.
    pub fn validate(&self) -> Result<()> {
        check_positive_steps("total_steps", self.total_steps)?;
        if !(0.0..=1.0).contains(&self.pct_start) {
            return Err(Error::invalid_argument(
                "pct_start",
                format!("must be in [0, 1], got {}", self.pct_start),
            ));
        }
        for (name, v) in [
            ("div_factor", self.div_factor),
            ("final_div_factor", self.final_div_factor),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::invalid_argument(
                    name,
                    format!("must be finite and > 0, got {v}"),
                ));
            }
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Rate {
    Initial,
    Max,
    Min,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Momentum {
    Base,
    Max,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Phase {
    end_step: f64,
    start_lr: Rate,
    end_lr: Rate,
    start_momentum: Momentum,
    end_momentum: Momentum,
}

/// The 1cycle policy, as `torch.optim.lr_scheduler.OneCycleLR`: from
/// `max_lr / div_factor` up to `max_lr` over the first `pct_start` of
/// `total_steps`, then down to `max_lr / div_factor / final_div_factor`
/// (with `three_phase`, back to the start first). Step it once per batch.
///
/// The base learning rates given to [`new`](OneCycleLr::new) only set the
/// number of groups: like PyTorch, the cycle overwrites them, and
/// [`base_lrs`](LrScheduler::base_lrs) are the starting rates. With
/// `cycle_momentum`, [`momentums`](LrScheduler::momentums) moves inversely
/// between `max_momentum` and `base_momentum`.
///
/// ```
/// use kiln_core::schedule::{LrScheduler, OneCycleLr, OneCycleLrConfig};
///
/// let mut s = OneCycleLr::new(OneCycleLrConfig::new(1.0, 10), &[0.1])?;
/// assert!((s.lrs()[0] - 0.04).abs() < 1e-12); // 1.0 / 25
/// assert_eq!(s.momentums(), Some(&[0.95][..]));
/// let lrs: Vec<f64> = (0..10).map(|_| s.step().map(|l| l[0])).collect::<Result<_, _>>()?;
/// assert_eq!(lrs[1], 1.0); // the peak, at step pct_start * total_steps - 1
/// assert!(s.step().is_err()); // past total_steps
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct OneCycleLr {
    config: OneCycleLrConfig,
    initial_lrs: Vec<f64>,
    max_lrs: Vec<f64>,
    min_lrs: Vec<f64>,
    base_momentums: Vec<f64>,
    max_momentums: Vec<f64>,
    phases: Vec<Phase>,
    last_epoch: u64,
    lrs: Vec<f64>,
    momentums: Vec<f64>,
}

const NAME: &str = "one_cycle_lr";

impl OneCycleLr {
    /// The cycle for as many groups as `base_lrs` has, at step 0.
    ///
    /// Fails for an invalid configuration, a per-group list of another
    /// length, or a cycle whose first step falls in a phase of zero length
    /// (PyTorch divides by zero there).
    pub fn new(config: OneCycleLrConfig, base_lrs: &[f64]) -> Result<Self> {
        config.validate()?;
        check_base_lrs(base_lrs)?;
        let groups = base_lrs.len();
        let max_lrs = config.max_lr.resolve("max_lr", groups)?;
        for (i, lr) in max_lrs.iter().enumerate() {
            if !(lr.is_finite() && *lr >= 0.0) {
                return Err(Error::invalid_argument(
                    "max_lr",
                    format!("group {i}: must be finite and >= 0, got {lr}"),
                ));
            }
        }
        let initial_lrs: Vec<f64> = max_lrs.iter().map(|m| m / config.div_factor).collect();
        let min_lrs = initial_lrs
            .iter()
            .map(|i| i / config.final_div_factor)
            .collect();
        let base_momentums = config.base_momentum.resolve("base_momentum", groups)?;
        let max_momentums = config.max_momentum.resolve("max_momentum", groups)?;
        for (name, values) in [
            ("base_momentum", &base_momentums),
            ("max_momentum", &max_momentums),
        ] {
            if let Some(v) = values.iter().find(|v| !v.is_finite()) {
                return Err(Error::invalid_argument(
                    name,
                    format!("must be finite, got {v}"),
                ));
            }
        }
        let total = config.total_steps as f64;
        let pct = config.pct_start;
        let phases = if config.three_phase {
            vec![
                Phase {
                    end_step: pct * total - 1.0,
                    start_lr: Rate::Initial,
                    end_lr: Rate::Max,
                    start_momentum: Momentum::Max,
                    end_momentum: Momentum::Base,
                },
                Phase {
                    end_step: 2.0 * pct * total - 2.0,
                    start_lr: Rate::Max,
                    end_lr: Rate::Initial,
                    start_momentum: Momentum::Base,
                    end_momentum: Momentum::Max,
                },
                Phase {
                    end_step: total - 1.0,
                    start_lr: Rate::Initial,
                    end_lr: Rate::Min,
                    start_momentum: Momentum::Max,
                    end_momentum: Momentum::Max,
                },
            ]
        } else {
            vec![
                Phase {
                    end_step: pct * total - 1.0,
                    start_lr: Rate::Initial,
                    end_lr: Rate::Max,
                    start_momentum: Momentum::Max,
                    end_momentum: Momentum::Base,
                },
                Phase {
                    end_step: total - 1.0,
                    start_lr: Rate::Max,
                    end_lr: Rate::Min,
                    start_momentum: Momentum::Base,
                    end_momentum: Momentum::Max,
                },
            ]
        };
        let mut scheduler = OneCycleLr {
            config,
            initial_lrs,
            max_lrs,
            min_lrs,
            base_momentums,
            max_momentums,
            phases,
            last_epoch: 0,
            lrs: Vec::new(),
            momentums: Vec::new(),
        };
        (scheduler.lrs, scheduler.momentums) = scheduler.compute(0)?;
        Ok(scheduler)
    }

    /// The configuration.
    pub fn config(&self) -> &OneCycleLrConfig {
        &self.config
    }

    /// Rates and momentums at `step`, as PyTorch's `OneCycleLR.get_lr`.
    fn compute(&self, step: u64) -> Result<(Vec<f64>, Vec<f64>)> {
        if step > self.config.total_steps {
            return Err(Error::invalid_argument(
                "step",
                format!(
                    "{NAME}: tried to step {step} times; the cycle has total_steps = {}",
                    self.config.total_steps
                ),
            ));
        }
        let step_num = step as f64;
        let mut start_step = 0.0;
        let mut chosen = None;
        for (i, phase) in self.phases.iter().enumerate() {
            if step_num <= phase.end_step || i + 1 == self.phases.len() {
                let span = phase.end_step - start_step;
                if span == 0.0 {
                    return Err(Error::invalid_argument(
                        "pct_start",
                        format!(
                            "{NAME}: step {step} falls in a phase of zero length \
                             (pct_start {} of total_steps {}); PyTorch divides by zero here",
                            self.config.pct_start, self.config.total_steps
                        ),
                    ));
                }
                chosen = Some((phase, (step_num - start_step) / span));
                break;
            }
            start_step = phase.end_step;
        }
        let Some((phase, pct)) = chosen else {
            return Err(state_error(NAME, "the cycle has no phases"));
        };
        let strategy = self.config.anneal_strategy;
        let rate = |which: Rate, group: usize| match which {
            Rate::Initial => self.initial_lrs[group],
            Rate::Max => self.max_lrs[group],
            Rate::Min => self.min_lrs[group],
        };
        let momentum = |which: Momentum, group: usize| match which {
            Momentum::Base => self.base_momentums[group],
            Momentum::Max => self.max_momentums[group],
        };
        let groups = 0..self.initial_lrs.len();
        let lrs = groups
            .clone()
            .map(|g| strategy.anneal(rate(phase.start_lr, g), rate(phase.end_lr, g), pct))
            .collect();
        let momentums = groups
            .map(|g| {
                strategy.anneal(
                    momentum(phase.start_momentum, g),
                    momentum(phase.end_momentum, g),
                    pct,
                )
            })
            .collect();
        Ok((lrs, momentums))
    }
}

impl LrScheduler for OneCycleLr {
    fn name(&self) -> &'static str {
        NAME
    }

    fn base_lrs(&self) -> &[f64] {
        &self.initial_lrs
    }

    fn lrs(&self) -> &[f64] {
        &self.lrs
    }

    fn last_epoch(&self) -> u64 {
        self.last_epoch
    }

    fn step(&mut self) -> Result<Vec<f64>> {
        let step = self
            .last_epoch
            .checked_add(1)
            .ok_or_else(|| state_error(NAME, "step counter overflow"))?;
        let (lrs, momentums) = self.compute(step)?;
        self.last_epoch = step;
        self.lrs = lrs;
        self.momentums = momentums;
        Ok(self.lrs.clone())
    }

    fn momentums(&self) -> Option<&[f64]> {
        self.config
            .cycle_momentum
            .then_some(self.momentums.as_slice())
    }

    fn state(&self) -> Result<Value> {
        to_state(
            NAME,
            &EpochState {
                scheduler: NAME.to_owned(),
                base_lrs: self.initial_lrs.clone(),
                last_epoch: self.last_epoch,
            },
        )
    }

    /// Restores the step; the rates come from this scheduler's configuration
    /// (the state's `base_lrs` only have to match in number).
    fn load_state(&mut self, state: &Value) -> Result<()> {
        let state: EpochState = from_state(NAME, state)?;
        check_state_groups(NAME, self.initial_lrs.len(), &state.base_lrs)?;
        let (lrs, momentums) = self.compute(state.last_epoch)?;
        self.last_epoch = state.last_epoch;
        self.lrs = lrs;
        self.momentums = momentums;
        Ok(())
    }
}
