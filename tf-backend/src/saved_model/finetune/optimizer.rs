//! [`SignatureOptimizer`]: the optimizer a SavedModel's training signature
//! applies, as Kiln's `Optimizer`.

use std::fmt;
use std::sync::Arc;

use kiln_core::{optim::Optimizer, state_dict::StateDict, Error, Result};

use super::shared::Shared;
use super::variable::VariableRole;
use crate::backend::TfBackend;
use crate::convert::TfTensor;

/// The optimizer of a [`SavedModelModule`]: the one its training signature
/// applies. [`step`](Optimizer::step) and [`zero_grad`](Optimizer::zero_grad) do
/// nothing (the signature has updated the variables in
/// [`train_step`]); its state is the exported optimizer's
/// variables (step count, moments, learning rate), so a Trainer checkpoint
/// resumes exactly; its learning rate is the Keras optimizer's `learning_rate`
/// variable, which schedules set.
///
/// [`SavedModelModule`]: crate::SavedModelModule
/// [`train_step`]: kiln_core::backend::Trainable::train_step
pub struct SignatureOptimizer {
    pub(super) shared: Arc<Shared>,
    pub(super) kind: Option<&'static str>,
}

impl fmt::Debug for SignatureOptimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SignatureOptimizer")
            .field("dir", &self.shared.model.dir())
            .field("train", &self.shared.train)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl Optimizer<TfBackend> for SignatureOptimizer {
    /// Nothing: the training signature applied the update.
    fn step(&mut self) -> Result<()> {
        Ok(())
    }

    /// Nothing: the gradients never leave the training signature.
    fn zero_grad(&mut self) -> Result<()> {
        Ok(())
    }

    /// The learning-rate variable's value; NaN when there is none or it cannot be
    /// read (logged).
    fn learning_rate(&self) -> f64 {
        let Some(var) = self.shared.learning_rate() else {
            return f64::NAN;
        };
        match self.shared.read(&[var]).and_then(|v| {
            v.first()
                .map(TfTensor::to_host)
                .transpose()?
                .ok_or_else(|| Error::backend("tensorflow", "reading the learning rate", "none"))
        }) {
            Ok(value) => value.to_f64_vec().first().copied().unwrap_or(f64::NAN),
            Err(e) => {
                log::error!("{}", e.display_chain());
                f64::NAN
            }
        }
    }

    /// Assigns the learning-rate variable; an optimizer without one is
    /// [`Error::Unsupported`].
    fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        self.shared.set_learning_rate(lr)
    }

    /// Assigns the learning-rate variable: one rate (there is one group); an
    /// optimizer without a learning-rate variable is [`Error::Unsupported`].
    fn set_learning_rates(&mut self, lrs: &[f64]) -> Result<()> {
        match lrs {
            [lr] => self.shared.set_learning_rate(*lr),
            _ => Err(Error::invalid_argument(
                "lrs",
                format!(
                    "a SavedModel's optimizer has 1 parameter group, got {} learning rates",
                    lrs.len()
                ),
            )),
        }
    }

    fn kind(&self) -> Option<&'static str> {
        self.kind
    }

    /// The optimizer's variables by name (`adam/iteration`, ...), read in one run.
    fn state_dict(&self) -> Result<StateDict> {
        let shared = &self.shared;
        shared.state_dict(&shared.of_role(&[VariableRole::Optimizer]))
    }

    /// Writes every optimizer variable in one run, after checking every key, shape
    /// and dtype: on error nothing changes.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let shared = &self.shared;
        shared.load(
            &shared.of_role(&[VariableRole::Optimizer]),
            state,
            "optimizer",
        )
    }
}
