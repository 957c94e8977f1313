//! Optimizers and learning-rate schedules.

use crate::backend::Backend;
use crate::error::Result;
use crate::state_dict::StateDict;

/// Updates a module's parameters from their gradients.
///
/// An optimizer holds handles to the parameters it was built from (see
/// [`Module::named_parameters`](crate::Module::named_parameters)) and updates
/// them in place. A typical step:
///
/// ```
/// use kiln_core::{Backend, Optimizer, Result};
///
/// fn train_step<B: Backend, O: Optimizer<B>>(opt: &mut O, loss: &B::Tensor) -> Result<()> {
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

    /// The learning rate the next [`step`](Optimizer::step) uses.
    fn learning_rate(&self) -> f64;

    /// Sets the learning rate for subsequent steps (used by [`LrScheduler`]s).
    fn set_learning_rate(&mut self, lr: f64);

    /// Host copies of the optimizer's internal state (moments, step counts),
    /// with PyTorch-style names, for checkpoints.
    fn state_dict(&self) -> Result<StateDict>;

    /// Restores state saved by [`state_dict`](Optimizer::state_dict);
    /// all-or-nothing like [`Module::load_state_dict`](crate::Module::load_state_dict).
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()>;
}

/// A learning-rate schedule, kept separate from the optimizer as in
/// `torch.optim.lr_scheduler`: call [`step`](LrScheduler::step) once per epoch
/// (or per batch) and pass the result to
/// [`Optimizer::set_learning_rate`].
///
/// ```
/// use kiln_core::LrScheduler;
///
/// /// Multiplies the rate by `gamma` every step (`ExponentialLR`).
/// struct Exponential {
///     lr: f64,
///     gamma: f64,
/// }
///
/// impl LrScheduler for Exponential {
///     fn step(&mut self) -> f64 {
///         self.lr *= self.gamma;
///         self.lr
///     }
///     fn current_lr(&self) -> f64 {
///         self.lr
///     }
/// }
///
/// let mut s = Exponential { lr: 0.1, gamma: 0.5 };
/// assert_eq!(s.step(), 0.05);
/// assert_eq!(s.current_lr(), 0.05);
/// ```
pub trait LrScheduler {
    /// Advances the schedule by one step and returns the new learning rate.
    fn step(&mut self) -> f64;

    /// The learning rate for the current step.
    fn current_lr(&self) -> f64;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::error::Error;
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

        fn set_learning_rate(&mut self, lr: f64) {
            self.lr = lr;
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

    /// `StepLR`: multiplies the rate by `gamma` every `period` steps.
    struct StepLr {
        base: f64,
        gamma: f64,
        period: u32,
        count: u32,
    }

    impl LrScheduler for StepLr {
        fn step(&mut self) -> f64 {
            self.count += 1;
            self.current_lr()
        }

        fn current_lr(&self) -> f64 {
            self.base * self.gamma.powf(f64::from(self.count / self.period))
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
        let mut sched = StepLr {
            base: 0.1,
            gamma: 0.5,
            period: 2,
            count: 0,
        };
        opt.step()?;
        // 1 - 0.1 * 0.5 and -1 - 0.1 * 0.25
        assert!((opt.param[0] - 0.95).abs() < 1e-6 && (opt.param[1] + 1.025).abs() < 1e-6);
        opt.set_learning_rate(sched.step()); // count 1 -> 0.1
        assert_eq!(opt.learning_rate(), 0.1);
        opt.set_learning_rate(sched.step()); // count 2 -> 0.05
        assert_eq!(opt.learning_rate(), 0.05);
        opt.step()?;
        // 0.95 - 0.05 * 0.5
        assert!((opt.param[0] - 0.925).abs() < 1e-6);

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
}
