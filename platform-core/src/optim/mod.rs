//! Optimizers: the [`Optimizer`] trait backends implement, and the
//! backend-neutral configurations ([`OptimizerConfig`], [`ParamGroup`],
//! [`GradClip`]) they are built from. The update rules live in the backends.

mod adagrad;
mod adam;
mod adamw;
mod clip;
mod group;
mod rmsprop;
mod sgd;
mod state;

use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::state_dict::StateDict;
use crate::state_tensors::StateTensors;

pub use adagrad::AdagradConfig;
pub use adam::AdamConfig;
pub use adamw::AdamWConfig;
pub use clip::GradClip;
pub use group::{
    assign_groups, load_group_hypers, resolve_groups, save_group_hypers, set_group_learning_rates,
    GroupHyper, ParamGroup, ParamSelector,
};
pub use rmsprop::RmsPropConfig;
pub use sgd::SgdConfig;
pub use state::{
    check_state_after_steps, optimizer_state_key, read_optimizer_state, ParamState, StateBuffer,
};

/// Updates a module's parameters from their gradients.
///
/// An optimizer holds handles to the parameters it was built from (see
/// [`Module::named_parameters`](crate::module::Module::named_parameters)) and updates
/// them in place. A typical step:
///
/// ```
/// use kiln_core::{backend::EagerBackend, optim::Optimizer, Result};
///
/// fn train_step<B: EagerBackend, O: Optimizer<B>>(opt: &mut O, loss: &B::Tensor) -> Result<()> {
///     opt.zero_grad()?;
///     B::backward(loss)?;
///     opt.step()
/// }
/// ```
pub trait Optimizer<B: Backend> {
    /// Applies one update to every parameter from its accumulated gradient.
    ///
    /// Contract: on error, parameters are unchanged.
    fn step(&mut self) -> Result<()>;

    /// Clears the accumulated gradients of every parameter.
    fn zero_grad(&mut self) -> Result<()>;

    /// The learning rate the next [`step`](Optimizer::step) uses (of the
    /// first parameter group, where there are several).
    fn learning_rate(&self) -> f64;

    /// Sets the learning rate of every parameter group for subsequent steps.
    /// An optimizer whose rate lives in the native library (a variable, a
    /// device tensor) returns the error of writing it; nothing is swallowed.
    fn set_learning_rate(&mut self, lr: f64) -> Result<()>;

    /// The algorithm ([`OptimizerConfig::kind`]: `adamw`, ...), recorded in
    /// checkpoints so that resuming with another optimizer is refused; `None`
    /// (the default) for an optimizer that does not say.
    fn kind(&self) -> Option<&'static str> {
        None
    }

    /// The configuration the optimizer was built from, when it was built
    /// from one: what a restored state is checked against
    /// ([`check_state_after_steps`]). `None` (the default) for an optimizer
    /// whose state follows another layout (a SavedModel's own optimizer).
    fn config(&self) -> Option<&OptimizerConfig> {
        None
    }

    /// The learning rate of each parameter group, in group order (the
    /// default group last; see [`assign_groups`]).
    ///
    /// The default suits an optimizer with one group; optimizers with several
    /// override it together with [`set_learning_rates`](Optimizer::set_learning_rates).
    fn learning_rates(&self) -> Vec<f64> {
        vec![self.learning_rate()]
    }

    /// Whether [`gradient_norms`](Optimizer::gradient_norms) and
    /// [`gradients`](Optimizer::gradients) can read the gradients of the last
    /// step (an eager backend keeps them until the next `zero_grad`; a graph
    /// engine computes them inside its step and keeps none). `false` by default.
    fn keeps_gradients(&self) -> bool {
        false
    }

    /// The L2 norm of each group's gradients as the last step left them
    /// (after unscaling and clipping), one read for all groups.
    fn gradient_norms(&self) -> Result<Vec<f64>> {
        Err(Error::unsupported(
            "reading gradients from this optimizer (it keeps none)",
        ))
    }

    /// Host copies of the gradients the last step left, by parameter name
    /// (parameters without one are left out).
    fn gradients(&self) -> Result<StateDict> {
        Err(Error::unsupported(
            "reading gradients from this optimizer (it keeps none)",
        ))
    }

    /// Sets each group's learning rate, as an
    /// [`LrScheduler`](crate::schedule::LrScheduler) step returns them.
    ///
    /// Fails with [`Error::InvalidArgument`] unless there is one rate per group.
    fn set_learning_rates(&mut self, lrs: &[f64]) -> Result<()> {
        match lrs {
            [lr] => self.set_learning_rate(*lr),
            _ => Err(Error::invalid_argument(
                "lrs",
                format!(
                    "this optimizer has 1 parameter group, got {} learning rates",
                    lrs.len()
                ),
            )),
        }
    }

    /// Whether [`state_dict`](Optimizer::state_dict) and
    /// [`state_tensors`](Optimizer::state_tensors) are collectives that every
    /// rank of a job must call at the same point (an optimizer whose state is
    /// sharded across the ranks gathers it): the trainer of a rank that writes
    /// no checkpoint then calls them too whenever rank 0 writes one.
    fn state_is_collective(&self) -> bool {
        false
    }

    /// This rank's part of the state when it is sharded over the ranks, for
    /// a sharded checkpoint: read locally, not a collective. `None` (the
    /// default) for an optimizer whose state is whole on every rank.
    fn shard_state_tensors(&self) -> Result<Option<crate::state_tensors::ShardState<B>>> {
        Ok(None)
    }

    /// Host copies of the optimizer's internal state (moments, step counts),
    /// with PyTorch-style names, for checkpoints.
    fn state_dict(&self) -> Result<StateDict>;

    /// The state as a checkpoint writes it, named as in
    /// [`state_dict`](Optimizer::state_dict): handles to the backend's tensors
    /// where the optimizer keeps them (moments), read in place by the writer.
    ///
    /// The default wraps [`state_dict`](Optimizer::state_dict)'s host copies.
    fn state_tensors(&self) -> Result<StateTensors<B>> {
        Ok(self.state_dict()?.into())
    }

    /// Restores state saved by [`state_dict`](Optimizer::state_dict);
    /// all-or-nothing like [`Module::load_state_dict`](crate::module::Module::load_state_dict).
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()>;
}

fn default_lr_sgd() -> f64 {
    1e-3
}

fn default_lr_adam() -> f64 {
    1e-3
}

fn default_betas() -> (f64, f64) {
    (0.9, 0.999)
}

fn default_eps() -> f64 {
    1e-8
}

fn check_non_negative(name: &str, value: f64) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(Error::invalid_argument(
            name,
            format!("must be finite and >= 0, got {value}"),
        ))
    }
}

fn check_betas(betas: (f64, f64)) -> Result<()> {
    for (i, beta) in [betas.0, betas.1].into_iter().enumerate() {
        if !(0.0..1.0).contains(&beta) {
            return Err(Error::invalid_argument(
                "betas",
                format!("beta {i} must be in [0, 1), got {beta}"),
            ));
        }
    }
    Ok(())
}

/// Which optimizer to build, with its options; backends implement the
/// update rules with PyTorch's semantics.
///
/// In a config file: `optimizer = { type = "adamw", lr = 3e-4, weight_decay = 0.05 }`.
/// Types: `"sgd"`, `"adam"`, `"adamw"`, `"rmsprop"`, `"adagrad"`; omitted
/// options take PyTorch's defaults.
///
/// ```
/// use kiln_core::optim::{AdamWConfig, OptimizerConfig};
///
/// let opt: OptimizerConfig = serde_json::from_str(r#"{"type": "adamw", "lr": 3e-4}"#).expect("valid");
/// assert_eq!(opt, OptimizerConfig::AdamW(AdamWConfig::new(3e-4)));
/// assert_eq!((opt.lr(), opt.weight_decay()), (3e-4, 0.01));
/// opt.validate()?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[non_exhaustive]
pub enum OptimizerConfig {
    /// `torch.optim.SGD`.
    Sgd(SgdConfig),
    /// `torch.optim.Adam`.
    Adam(AdamConfig),
    /// `torch.optim.AdamW`.
    #[serde(rename = "adamw")]
    AdamW(AdamWConfig),
    /// `torch.optim.RMSprop`.
    #[serde(rename = "rmsprop")]
    RmsProp(RmsPropConfig),
    /// `torch.optim.Adagrad`.
    Adagrad(AdagradConfig),
}

impl OptimizerConfig {
    /// The algorithm's name as a config's `type` gives it: `sgd`, `adam`,
    /// `adamw`, `rmsprop` or `adagrad`.
    pub fn kind(&self) -> &'static str {
        match self {
            OptimizerConfig::Sgd(_) => "sgd",
            OptimizerConfig::Adam(_) => "adam",
            OptimizerConfig::AdamW(_) => "adamw",
            OptimizerConfig::RmsProp(_) => "rmsprop",
            OptimizerConfig::Adagrad(_) => "adagrad",
        }
    }

    /// The base learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerConfig::Sgd(c) => c.lr,
            OptimizerConfig::Adam(c) => c.lr,
            OptimizerConfig::AdamW(c) => c.lr,
            OptimizerConfig::RmsProp(c) => c.lr,
            OptimizerConfig::Adagrad(c) => c.lr,
        }
    }

    /// The same configuration with base learning rate `lr`.
    pub fn with_lr(mut self, lr: f64) -> Self {
        match &mut self {
            OptimizerConfig::Sgd(c) => c.lr = lr,
            OptimizerConfig::Adam(c) => c.lr = lr,
            OptimizerConfig::AdamW(c) => c.lr = lr,
            OptimizerConfig::RmsProp(c) => c.lr = lr,
            OptimizerConfig::Adagrad(c) => c.lr = lr,
        }
        self
    }

    /// The base weight decay.
    pub fn weight_decay(&self) -> f64 {
        match self {
            OptimizerConfig::Sgd(c) => c.weight_decay,
            OptimizerConfig::Adam(c) => c.weight_decay,
            OptimizerConfig::AdamW(c) => c.weight_decay,
            OptimizerConfig::RmsProp(c) => c.weight_decay,
            OptimizerConfig::Adagrad(c) => c.weight_decay,
        }
    }

    /// The PyTorch class (`"SGD"`, `"Adam"`, `"AdamW"`, `"RMSprop"`, `"Adagrad"`).
    pub fn torch_name(&self) -> &'static str {
        match self {
            OptimizerConfig::Sgd(_) => "SGD",
            OptimizerConfig::Adam(_) => "Adam",
            OptimizerConfig::AdamW(_) => "AdamW",
            OptimizerConfig::RmsProp(_) => "RMSprop",
            OptimizerConfig::Adagrad(_) => "Adagrad",
        }
    }

    /// Rejects the values the PyTorch optimizer rejects (negative rates,
    /// betas outside `[0, 1)`, Nesterov without momentum, ...) and
    /// non-finite values, with [`Error::InvalidArgument`] naming the field.
    pub fn validate(&self) -> Result<()> {
        match self {
            OptimizerConfig::Sgd(c) => c.validate(),
            OptimizerConfig::Adam(c) => c.validate(),
            OptimizerConfig::AdamW(c) => c.validate(),
            OptimizerConfig::RmsProp(c) => c.validate(),
            OptimizerConfig::Adagrad(c) => c.validate(),
        }
    }
}

macro_rules! optimizer_from_config {
    ($($config:ty => $variant:ident),* $(,)?) => {
        $(
            impl From<$config> for OptimizerConfig {
                fn from(config: $config) -> Self {
                    OptimizerConfig::$variant(config)
                }
            }
        )*
    };
}

optimizer_from_config! {
    SgdConfig => Sgd,
    AdamConfig => Adam,
    AdamWConfig => AdamW,
    RmsPropConfig => RmsProp,
    AdagradConfig => Adagrad,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::schedule::{LrScheduler, StepLr, StepLrConfig};
    use crate::tensor::HostTensor;
    use crate::testing::RefBackend;

    /// Plain SGD on one host parameter with an externally supplied gradient.
    struct Sgd {
        param: Vec<f32>,
        grad: Option<Vec<f32>>,
        lr: f64,
        steps: i64,
    }

    impl Optimizer<RefBackend> for Sgd {
        fn step(&mut self) -> Result<()> {
            let grad = self.grad.as_ref().ok_or_else(|| {
                Error::invalid_argument("grad", "no gradient; call backward first")
            })?;
            for (p, g) in self.param.iter_mut().zip(grad) {
                *p -= self.lr as f32 * g;
            }
            self.steps += 1;
            Ok(())
        }

        fn zero_grad(&mut self) -> Result<()> {
            self.grad = None;
            Ok(())
        }

        fn learning_rate(&self) -> f64 {
            self.lr
        }

        fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
            self.lr = lr;
            Ok(())
        }

        fn state_dict(&self) -> Result<StateDict> {
            let mut sd = StateDict::new();
            sd.insert("state.0.step", HostTensor::scalar(self.steps));
            Ok(sd)
        }

        fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
            self.steps = state
                .expect_entry("state.0.step", (), DType::I64)?
                .item::<i64>()?;
            Ok(())
        }
    }

    #[test]
    fn optimizer_and_scheduler_drive_each_other() -> Result<()> {
        let mut opt = Sgd {
            param: vec![1.0, -1.0],
            grad: Some(vec![0.5, 0.25]),
            lr: 0.1,
            steps: 0,
        };
        let mut sched = StepLr::new(
            StepLrConfig {
                step_size: 2,
                gamma: 0.5,
            },
            &opt.learning_rates(),
        )?;
        opt.step()?;
        // 1 - 0.1 * 0.5 and -1 - 0.1 * 0.25
        assert!((opt.param[0] - 0.95).abs() < 1e-6 && (opt.param[1] + 1.025).abs() < 1e-6);
        opt.set_learning_rates(&sched.step()?)?; // epoch 1 -> 0.1
        assert_eq!(opt.learning_rate(), 0.1);
        opt.set_learning_rates(&sched.step()?)?; // epoch 2 -> 0.05
        assert_eq!(opt.learning_rates(), [0.05]);
        opt.step()?;
        // 0.95 - 0.05 * 0.5
        assert!((opt.param[0] - 0.925).abs() < 1e-6);
        let err = opt.set_learning_rates(&[0.1, 0.2]).expect_err("one group");
        assert_eq!(
            err.to_string(),
            "invalid argument `lrs`: this optimizer has 1 parameter group, got 2 learning rates"
        );

        opt.zero_grad()?;
        let before = opt.param.clone();
        assert!(opt.step().is_err());
        assert_eq!(opt.param, before);

        let sd = opt.state_dict()?;
        assert_eq!(sd.get("state.0.step"), Some(&HostTensor::scalar(2i64)));
        opt.steps = 0;
        opt.load_state_dict(&sd)?;
        assert_eq!(opt.steps, 2);
        Ok(())
    }

    fn parse(json: &str) -> Result<OptimizerConfig> {
        serde_json::from_str(json).map_err(|e| Error::invalid_argument("json", e.to_string()))
    }

    #[test]
    fn configs_have_torch_defaults() -> Result<()> {
        assert_eq!(
            parse(r#"{"type": "sgd"}"#)?,
            OptimizerConfig::Sgd(SgdConfig {
                lr: 1e-3,
                momentum: 0.0,
                dampening: 0.0,
                weight_decay: 0.0,
                nesterov: false
            })
        );
        assert_eq!(
            parse(r#"{"type": "adam"}"#)?,
            OptimizerConfig::Adam(AdamConfig {
                lr: 1e-3,
                betas: (0.9, 0.999),
                eps: 1e-8,
                weight_decay: 0.0,
                amsgrad: false
            })
        );
        assert_eq!(
            parse(r#"{"type": "adamw", "betas": [0.9, 0.95]}"#)?,
            OptimizerConfig::AdamW(AdamWConfig {
                lr: 1e-3,
                betas: (0.9, 0.95),
                eps: 1e-8,
                weight_decay: 1e-2,
                amsgrad: false
            })
        );
        assert_eq!(
            parse(r#"{"type": "rmsprop"}"#)?,
            OptimizerConfig::RmsProp(RmsPropConfig {
                lr: 1e-2,
                alpha: 0.99,
                eps: 1e-8,
                weight_decay: 0.0,
                momentum: 0.0,
                centered: false
            })
        );
        assert_eq!(
            parse(r#"{"type": "adagrad"}"#)?,
            OptimizerConfig::Adagrad(AdagradConfig {
                lr: 1e-2,
                lr_decay: 0.0,
                weight_decay: 0.0,
                initial_accumulator_value: 0.0,
                eps: 1e-10
            })
        );
        assert_eq!(SgdConfig::default(), SgdConfig::new(1e-3));
        assert_eq!(AdamWConfig::default(), AdamWConfig::new(1e-3));
        assert_eq!(RmsPropConfig::default(), RmsPropConfig::new(1e-2));
        assert_eq!(AdagradConfig::default(), AdagradConfig::new(1e-2));
        let err = parse(r#"{"type": "adam", "beta1": 0.9}"#).expect_err("unknown field");
        assert!(err.to_string().contains("beta1"), "{err}");
        let err = parse(r#"{"type": "lamb"}"#).expect_err("unknown optimizer");
        assert!(err.to_string().contains("lamb"), "{err}");
        Ok(())
    }

    #[test]
    fn accessors_and_round_trip() -> Result<()> {
        let configs: Vec<OptimizerConfig> = vec![
            SgdConfig::new(0.1)
                .with_momentum(0.9)
                .with_dampening(0.0)
                .with_weight_decay(1e-4)
                .with_nesterov(true)
                .into(),
            AdamConfig::new(1e-3)
                .with_betas((0.8, 0.99))
                .with_eps(1e-6)
                .with_weight_decay(0.1)
                .with_amsgrad(true)
                .into(),
            AdamWConfig::new(1e-3)
                .with_betas((0.9, 0.95))
                .with_eps(1e-7)
                .with_weight_decay(0.05)
                .with_amsgrad(true)
                .into(),
            RmsPropConfig::new(1e-2)
                .with_alpha(0.9)
                .with_eps(1e-6)
                .with_weight_decay(0.2)
                .with_momentum(0.5)
                .with_centered(true)
                .into(),
            AdagradConfig::new(1e-2)
                .with_lr_decay(0.01)
                .with_weight_decay(0.3)
                .with_initial_accumulator_value(0.1)
                .with_eps(1e-9)
                .into(),
        ];
        let expected = [
            ("SGD", 1e-4),
            ("Adam", 0.1),
            ("AdamW", 0.05),
            ("RMSprop", 0.2),
            ("Adagrad", 0.3),
        ];
        for (config, (name, wd)) in configs.into_iter().zip(expected) {
            config.validate()?;
            assert_eq!(config.torch_name(), name);
            assert_eq!(config.weight_decay(), wd);
            let json = serde_json::to_string(&config)
                .map_err(|e| Error::invalid_argument("json", e.to_string()))?;
            assert_eq!(parse(&json)?, config, "{json}");
            let changed = config.with_lr(0.5);
            assert_eq!(changed.lr(), 0.5);
        }
        Ok(())
    }

    #[test]
    fn validation_follows_torch() {
        let cases: Vec<(OptimizerConfig, &str)> = vec![
            (
                SgdConfig::new(-0.1).into(),
                "invalid argument `lr`: must be finite and >= 0, got -0.1",
            ),
            (
                SgdConfig::new(0.1).with_nesterov(true).into(),
                "invalid argument `nesterov`: Nesterov momentum requires a momentum > 0 and \
                 zero dampening, got momentum 0 and dampening 0",
            ),
            (
                SgdConfig::new(0.1)
                    .with_momentum(0.9)
                    .with_dampening(0.1)
                    .with_nesterov(true)
                    .into(),
                "invalid argument `nesterov`: Nesterov momentum requires a momentum > 0 and \
                 zero dampening, got momentum 0.9 and dampening 0.1",
            ),
            (
                SgdConfig::new(0.1).with_momentum(-0.5).into(),
                "invalid argument `momentum`: must be finite and >= 0, got -0.5",
            ),
            (
                AdamConfig::new(1e-3).with_betas((0.9, 1.0)).into(),
                "invalid argument `betas`: beta 1 must be in [0, 1), got 1",
            ),
            (
                AdamWConfig::new(1e-3).with_eps(-1.0).into(),
                "invalid argument `eps`: must be finite and >= 0, got -1",
            ),
            (
                RmsPropConfig::new(1e-2).with_alpha(-0.1).into(),
                "invalid argument `alpha`: must be finite and >= 0, got -0.1",
            ),
            (
                AdagradConfig::new(1e-2).with_lr_decay(-1.0).into(),
                "invalid argument `lr_decay`: must be finite and >= 0, got -1",
            ),
            (
                AdagradConfig::new(f64::NAN).into(),
                "invalid argument `lr`: must be finite and >= 0, got NaN",
            ),
        ];
        for (config, message) in cases {
            let err = config.validate().expect_err(message);
            assert_eq!(err.to_string(), message);
        }
    }
}
