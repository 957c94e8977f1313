//! [`TfBackend`]'s [`TrainBackend`]: models and optimizers as TensorFlow graphs,
//! and training and evaluation steps as one session run each of a program
//! compiled in [`crate::step`], or, under a strategy that needs the gradients
//! (data parallelism), two (`optim/data_parallel.rs`).

use kiln_core::{
    backend::{
        objective_unsupported, supervised_objective_step, StepLoss, StepPlan, TrainBackend,
        Trainable, UpdatePlan,
    },
    loss::Loss,
    model::Layer,
    module::Module,
    objective::{Objective, ObjectiveBatch, ObjectiveEval, ObjectiveStep},
    optim::{OptimizerConfig, ParamGroup},
    precision::FloatPrecision,
    strategy::StepHooks,
    Device, Error, HostTensor, Result,
};

use crate::backend::TfBackend;
use crate::convert::TfTensor;
use crate::model::{lock, TfModel};
use crate::optim::TfOptimizer;
use crate::step::{self, ProgramKey, ProgramKind, Signature};

impl TrainBackend for TfBackend {
    type Model = TfModel;
    type Optim = TfOptimizer;

    fn build_model(spec: &Layer, device: Device) -> Result<TfModel> {
        TfModel::new(spec, device)
    }

    /// [`crate::TfProfiler`]: the step stats of every session run in the window.
    fn profiler(_device: Device) -> Result<Box<dyn kiln_core::profile::StepProfiler>> {
        Ok(Box::new(crate::TfProfiler::new()))
    }

    /// Only `32-true`: TensorFlow's C API has no autocast, and Kiln's TensorFlow
    /// graphs are float32 (bfloat16 and float16 training run on the torch backend).
    fn set_precision(_model: &mut TfModel, precision: FloatPrecision) -> Result<()> {
        match precision {
            FloatPrecision::F32 => Ok(()),
            other => Err(Error::unsupported(format!(
                "precision {other} on the TensorFlow backend (it trains in 32-true; \
                 bf16-mixed, bf16-true, 16-mixed and 16-true run on the torch backend)"
            ))),
        }
    }
}

impl Trainable<TfBackend> for TfModel {
    type Optim = TfOptimizer;

    fn build_optimizer(
        &self,
        config: &OptimizerConfig,
        groups: &[ParamGroup],
    ) -> Result<TfOptimizer> {
        TfOptimizer::new(config.clone(), self, groups)
    }

    /// Forward, loss, gradients, clipping and the optimizer update as one session run.
    fn train_step(
        &mut self,
        optimizer: &mut TfOptimizer,
        inputs: &TfTensor,
        targets: &TfTensor,
        plan: &StepPlan<'_>,
    ) -> Result<f64> {
        optimizer.train_step(self, inputs, targets, plan)
    }

    fn takes_step_hooks(&self) -> bool {
        true
    }

    /// Under a strategy that needs the gradients ([`StepHooks::needs_gradients`],
    /// data parallelism): one session run fetches the micro-batch's gradients
    /// and loss as one flat float32 vector; the hooks reduce it (on the
    /// micro-batch that applies, with the gradients that earlier micro-batches
    /// accumulated on this rank; otherwise only the loss) in place, in
    /// TensorFlow's memory, and a second run clips and applies it. The result
    /// is the single-process step's on the global batch. Otherwise the fused
    /// step, between [`StepHooks::before_forward`] and [`StepHooks::agreed_loss`].
    /// The loss is always read (`deferred` changes nothing here).
    fn train_step_hooked(
        &mut self,
        optimizer: &mut TfOptimizer,
        inputs: &TfTensor,
        targets: &TfTensor,
        plan: &StepPlan<'_>,
        hooks: &mut dyn StepHooks<TfBackend>,
        _deferred: bool,
    ) -> Result<StepLoss<TfTensor>> {
        let (loss, _) = self.hooked_step_with_metrics(optimizer, inputs, targets, plan, hooks)?;
        Ok(StepLoss::Host(loss))
    }

    /// A supervised loss, as [`train_step`](Trainable::train_step) computes
    /// it, with the model's router losses (`aux_loss`, `router_z_loss`) as
    /// its metrics, fetched by the same session run.
    fn train_objective_step(
        &mut self,
        optimizer: &mut TfOptimizer,
        objective: &dyn Objective<TfBackend>,
        batch: &ObjectiveBatch<'_, TfTensor>,
        plan: &UpdatePlan<'_>,
        _deferred: bool,
    ) -> Result<ObjectiveStep<TfTensor>> {
        let kind = self.kind();
        with_metrics(objective, &kind, plan, |plan| {
            let loss = optimizer.train_step(self, batch.inputs, batch.targets, plan)?;
            Ok((loss, optimizer.take_metrics()))
        })
    }

    /// [`train_objective_step`](Trainable::train_objective_step) under a
    /// strategy's hooks; the metrics are this rank's, as on libtorch.
    fn train_objective_step_hooked(
        &mut self,
        optimizer: &mut TfOptimizer,
        objective: &dyn Objective<TfBackend>,
        batch: &ObjectiveBatch<'_, TfTensor>,
        plan: &UpdatePlan<'_>,
        hooks: &mut dyn StepHooks<TfBackend>,
        _deferred: bool,
    ) -> Result<ObjectiveStep<TfTensor>> {
        let kind = self.kind();
        with_metrics(objective, &kind, plan, |plan| {
            self.hooked_step_with_metrics(optimizer, batch.inputs, batch.targets, plan, hooks)
        })
    }

    /// A supervised loss and the model's router losses as its metrics, in
    /// one session run.
    fn eval_objective(
        &self,
        objective: &dyn Objective<TfBackend>,
        batch: &ObjectiveBatch<'_, TfTensor>,
    ) -> Result<ObjectiveEval> {
        let Some(loss) = objective.supervised_loss() else {
            return Err(objective_unsupported(objective, &self.kind()));
        };
        let (loss, outputs, metrics) = self.evaluate(loss, batch.inputs, batch.targets)?;
        Ok(ObjectiveEval {
            loss,
            outputs: Some(outputs),
            metrics,
        })
    }

    /// Forward and loss as one session run.
    fn eval_step(
        &self,
        loss: &Loss,
        inputs: &TfTensor,
        targets: &TfTensor,
    ) -> Result<(f64, HostTensor)> {
        let (value, output, _) = self.evaluate(loss, inputs, targets)?;
        Ok((value, output))
    }

    /// The forward pass as one session run.
    fn predict_step(&self, inputs: &TfTensor) -> Result<HostTensor> {
        Module::<TfBackend>::forward(self, inputs)?.to_host()
    }
}

impl TfModel {
    /// Under a strategy that needs the gradients, the flat-gradient step;
    /// otherwise the fused step between the hooks' `before_forward` and
    /// `agreed_loss`. The loss (agreed over the ranks) and this rank's metrics.
    fn hooked_step_with_metrics(
        &mut self,
        optimizer: &mut TfOptimizer,
        inputs: &TfTensor,
        targets: &TfTensor,
        plan: &StepPlan<'_>,
        hooks: &mut dyn StepHooks<TfBackend>,
    ) -> Result<(f64, Vec<f64>)> {
        if hooks.needs_gradients() {
            return crate::optim::hooked_step(optimizer, self, hooks, inputs, targets, plan);
        }
        hooks.before_forward(plan.apply)?;
        let local = optimizer.train_step(self, inputs, targets, plan)?;
        let metrics = optimizer.take_metrics();
        Ok((hooks.agreed_loss(local)?, metrics))
    }

    /// Forward, loss and the router losses as one session run: the loss, the
    /// output on the host, and the metrics.
    fn evaluate(
        &self,
        loss: &Loss,
        inputs: &TfTensor,
        targets: &TfTensor,
    ) -> Result<(f64, HostTensor, Vec<f64>)> {
        let key = ProgramKey {
            kind: ProgramKind::Eval { loss: loss.clone() },
            train: Module::<TfBackend>::mode(self).is_train(),
            input: Some(Signature::of(inputs)),
            target: Some(Signature::of(targets)),
        };
        let batch = inputs.shape();
        let mut graph = lock(&self.graph)?;
        let program = step::program(&mut graph, &key, Some(self.model_graph(batch.dims())), None)?;
        let mut fetched = step::run(
            &mut graph.engine,
            &program,
            Some(inputs),
            Some(targets),
            &[],
            "running an evaluation step",
        )?;
        let metrics = std::mem::take(&mut fetched.metrics);
        let value = fetched.loss_value()?;
        match fetched.output {
            Some(output) => Ok((value, output.to_host()?, metrics)),
            None => Err(Error::backend(
                "tensorflow",
                "evaluation",
                "missing outputs",
            )),
        }
    }
}

/// A supervised objective's step through `step`, which gives the loss and
/// the metrics (a mixture of experts' router losses, in
/// [`RouterLosses::NAMES`](kiln_core::model::RouterLosses::NAMES)' order);
/// any other objective is refused naming `kind`.
pub(crate) fn with_metrics(
    objective: &dyn Objective<TfBackend>,
    kind: &str,
    plan: &UpdatePlan<'_>,
    step: impl FnOnce(&StepPlan<'_>) -> Result<(f64, Vec<f64>)>,
) -> Result<ObjectiveStep<TfTensor>> {
    let mut metrics = Vec::new();
    let mut out = supervised_objective_step(objective, kind, plan, |plan| {
        let (loss, m) = step(plan)?;
        metrics = m;
        Ok(StepLoss::Host(loss))
    })?;
    out.metrics = metrics.into_iter().map(StepLoss::Host).collect();
    Ok(out)
}
