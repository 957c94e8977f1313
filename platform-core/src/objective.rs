//! What a training step minimises: an [`Objective`], the seam between the
//! training loop and the method being trained.
//!
//! The loop (`kiln-train`'s `Trainer`) owns the batches, the accumulation,
//! the optimizer step, the schedule, checkpoints and callbacks; an objective
//! owns the loss: a micro-batch in, through the model and whatever else the
//! objective holds (a frozen reference or teacher model, a generator, a reward
//! function), a differentiable loss and the objective's own metrics out. The
//! supervised loss of a classifier or a language model is the first
//! ([`Supervised`]); a method that needs another model or another loss is
//! a new type implementing [`Objective`], and the loop stays as it is.
//!
//! Objectives are planned for the methods that come next:
//!
//! * **knowledge distillation** (`kiln_torch::Distillation`): the student's
//!   logits against a frozen teacher's, softened by a temperature;
//! * **preference training without a reference model** (`kiln_torch::Simpo`,
//!   TRL's SimPO): a batch holds pairs, `[pairs, 2, length]` (chosen,
//!   rejected), and both completions of every pair go through the model in
//!   one forward pass (TRL's `concatenated_forward`); `rewards_chosen`,
//!   `rewards_margins` and the accuracy are among its metrics;
//! * **preference training against a reference** (DPO): the same pairs, and
//!   the objective holds the frozen reference model whose log-probabilities
//!   the loss compares with the policy's;
//! * **policy gradients over sampled groups** (GRPO): the batch holds the
//!   prompts, and the objective holds the generator and the reward
//!   functions, samples the group's completions inside
//!   [`compute`](Objective::compute) and returns the clipped surrogate loss;
//! * **a language-model loss chunked over the vocabulary**: the objective
//!   asks the model for its last hidden states and computes the
//!   cross-entropy chunk by chunk, so the full logits never exist.
//!
//! An eager engine (libtorch) runs any objective: it calls
//! [`compute`](Objective::compute) inside its step, then differentiates the
//! loss, clips and steps the optimizer as for a supervised loss, under every
//! strategy's hooks. A graph engine (TensorFlow) compiles the loss with the
//! model into one program, and so trains the objectives that are a
//! supervised loss ([`Objective::supervised_loss`]); any other is refused
//! before the first step, naming the objective and the engine.

use crate::backend::{Backend, TrainBackend};
use crate::error::Result;
use crate::loss::Loss;
use crate::module::Module;
use crate::tensor::HostTensor;

/// One micro-batch on the device, as an objective reads it: the loader's
/// inputs and targets, `[batch, ...]` each.
#[derive(Debug)]
pub struct ObjectiveBatch<'a, T> {
    /// The model's inputs (token ids, pixels, features).
    pub inputs: &'a T,
    /// The targets (labels; `-100` where a language model's loss ignores a
    /// position). An objective with none reads the inputs only.
    pub targets: &'a T,
}

/// What an objective computes for one micro-batch.
#[derive(Debug)]
pub struct ObjectiveOutput<T> {
    /// The loss to minimise: a one-element tensor that the engine
    /// differentiates (in training) or reads (in evaluation).
    pub loss: T,
    /// What the model predicts for the batch, for the run's metrics
    /// (accuracy...) and the callbacks that see validation outputs; `None`
    /// when the objective has no single prediction to give.
    pub outputs: Option<T>,
    /// The objective's own numbers, one-element tensors detached from
    /// autograd, in the order of [`Objective::metric_names`]: logged beside
    /// the loss as `train_<name>` and `val_<name>` (batch-size-weighted means).
    pub metrics: Vec<T>,
}

/// What a training step minimises (see the [module docs](self)).
///
/// `compute` is called once per micro-batch inside the engine's training
/// step, with the model in training mode and autograd recording, and once
/// per validation batch with the model in eval mode and autograd off; the
/// loss it returns is what is differentiated, scaled by the accumulation and
/// (in `16-mixed`) the loss scale. The objective must not step an optimizer
/// or change the model's parameters: the loop does.
///
/// ```
/// use kiln_core::backend::TrainBackend;
/// use kiln_core::loss::Loss;
/// use kiln_core::objective::{Objective, Supervised};
///
/// /// The objective a classifier trains with, on any engine.
/// fn classifier_objective<B: TrainBackend>() -> Box<dyn Objective<B>> {
///     Box::new(Supervised::new(Loss::cross_entropy()))
/// }
/// assert_eq!(Supervised::new(Loss::mse()).loss(), &Loss::mse());
/// ```
pub trait Objective<B: Backend>: Send {
    /// What the objective is, in messages and logs (`"supervised
    /// cross_entropy"`, `"distillation"`).
    fn name(&self) -> String;

    /// The supervised loss this objective is, if it is one: what a graph
    /// engine compiles into its step, and what the evaluation of such an
    /// engine's models computes. `None` (the default) for every other
    /// objective.
    fn supervised_loss(&self) -> Option<&Loss> {
        None
    }

    /// The names of the metrics [`compute`](Self::compute) returns for
    /// `model`, in its order; none by default.
    fn metric_names(&self, model: &dyn Module<B>) -> Vec<String> {
        let _ = model;
        Vec::new()
    }

    /// The loss of one micro-batch through `model` (see the trait's docs).
    fn compute(
        &self,
        model: &dyn Module<B>,
        batch: &ObjectiveBatch<'_, B::Tensor>,
    ) -> Result<ObjectiveOutput<B::Tensor>>;
}

/// The supervised objective: the model's output on the inputs against the
/// targets, by one of Kiln's [`Loss`]es. What `Trainer::new(config, loss)`
/// trains with.
#[derive(Clone, Debug, PartialEq)]
pub struct Supervised {
    loss: Loss,
}

impl Supervised {
    /// The objective that minimises `loss`.
    pub fn new(loss: Loss) -> Self {
        Self { loss }
    }

    /// The loss it minimises.
    pub fn loss(&self) -> &Loss {
        &self.loss
    }
}

impl<B: TrainBackend> Objective<B> for Supervised {
    fn name(&self) -> String {
        format!("supervised {}", self.loss.name())
    }

    fn supervised_loss(&self) -> Option<&Loss> {
        Some(&self.loss)
    }

    /// The model's auxiliary losses ([`Module::auxiliary_loss_names`]).
    fn metric_names(&self, model: &dyn Module<B>) -> Vec<String> {
        model.auxiliary_loss_names()
    }

    /// The forward pass, then [`TrainBackend::loss`] of the output against
    /// the targets, with the model's auxiliary losses added
    /// ([`Module::add_auxiliary_losses`]: a mixture of experts' router
    /// losses), which are its metrics.
    fn compute(
        &self,
        model: &dyn Module<B>,
        batch: &ObjectiveBatch<'_, B::Tensor>,
    ) -> Result<ObjectiveOutput<B::Tensor>> {
        let output = model.forward(batch.inputs)?;
        let loss = B::loss(&self.loss, &output, batch.targets)?;
        let with = model.add_auxiliary_losses(loss)?;
        Ok(ObjectiveOutput {
            loss: with.loss,
            outputs: Some(output),
            metrics: with.values,
        })
    }
}

/// An objective's numbers for one training micro-batch, as
/// [`Trainable::train_objective_step`](crate::backend::Trainable::train_objective_step)
/// returns them: the loss and the metrics, each read now or left on the
/// device until the loop needs it.
#[derive(Debug)]
pub struct ObjectiveStep<T> {
    /// The (unscaled) loss.
    pub loss: crate::backend::StepLoss<T>,
    /// The objective's metrics, in [`Objective::metric_names`]'s order.
    pub metrics: Vec<crate::backend::StepLoss<T>>,
}

/// An objective's numbers for one evaluation batch, on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct ObjectiveEval {
    /// The loss.
    pub loss: f64,
    /// The model's predictions, when the objective gives them.
    pub outputs: Option<HostTensor>,
    /// The objective's metrics, in [`Objective::metric_names`]'s order.
    pub metrics: Vec<f64>,
}
