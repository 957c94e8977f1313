//! [`TfBackend`]'s [`TrainBackend`]: models and optimizers as TensorFlow graphs,
//! and training and evaluation steps as one session run each of a program
//! compiled in [`crate::step`].

use kiln_core::{
    backend::{StepPlan, TrainBackend},
    loss::Loss,
    model::Layer,
    module::Module,
    optim::{OptimizerConfig, ParamGroup},
    precision::FloatPrecision,
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

    /// Only `32-true`: TensorFlow's C API has no autocast, and Kiln's TensorFlow
    /// graphs are float32 (bfloat16 training runs on the torch backend).
    fn set_precision(_model: &mut TfModel, precision: FloatPrecision) -> Result<()> {
        match precision {
            FloatPrecision::F32 => Ok(()),
            other => Err(Error::unsupported(format!(
                "precision {other} on the TensorFlow backend (it trains in 32-true; \
                 bf16-mixed and bf16-true run on the torch backend)"
            ))),
        }
    }

    fn build_optimizer(
        config: &OptimizerConfig,
        model: &TfModel,
        groups: &[ParamGroup],
    ) -> Result<TfOptimizer> {
        TfOptimizer::new(config.clone(), model, groups)
    }

    /// Forward, loss, gradients, clipping and the optimizer update as one session run.
    fn train_step(
        model: &mut TfModel,
        optimizer: &mut TfOptimizer,
        inputs: &TfTensor,
        targets: &TfTensor,
        plan: &StepPlan<'_>,
    ) -> Result<f64> {
        optimizer.train_step(model, inputs, targets, plan)
    }

    /// Forward and loss as one session run.
    fn eval_step(
        model: &TfModel,
        loss: &Loss,
        inputs: &TfTensor,
        targets: &TfTensor,
    ) -> Result<(f64, HostTensor)> {
        let key = ProgramKey {
            kind: ProgramKind::Eval { loss: loss.clone() },
            train: Module::<TfBackend>::mode(model).is_train(),
            input: Some(Signature::of(inputs)),
            target: Some(Signature::of(targets)),
        };
        let batch = inputs.shape();
        let mut graph = lock(&model.graph)?;
        let program = step::program(
            &mut graph,
            &key,
            Some(model.model_graph(batch.dims())),
            None,
        )?;
        let fetched = step::run(
            &mut graph.engine,
            &program,
            Some(inputs),
            Some(targets),
            &[],
            "running an evaluation step",
        )?;
        let value = fetched.loss_value()?;
        match fetched.output {
            Some(output) => Ok((value, output.to_host()?)),
            None => Err(Error::backend(
                "tensorflow",
                "evaluation",
                "missing outputs",
            )),
        }
    }

    /// The forward pass as one session run.
    fn predict_step(model: &TfModel, inputs: &TfTensor) -> Result<HostTensor> {
        Module::<TfBackend>::forward(model, inputs)?.to_host()
    }
}
