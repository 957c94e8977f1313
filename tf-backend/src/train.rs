//! [`TfBackend`]'s [`TrainBackend`]: models and optimizers as TensorFlow graphs,
//! and training and evaluation steps as one session run each of a program
//! compiled in [`crate::step`].

use std::sync::{Mutex, OnceLock};

use kiln_core::{
    Device, Error, FloatPrecision, GradClip, HostTensor, Layer, Loss, Module, OptimizerConfig,
    ParamGroup, Result, StepPlan, TrainBackend,
};

use crate::backend::TfBackend;
use crate::convert::TfTensor;
use crate::engine::Engine;
use crate::model::{lock, TfModel};
use crate::optim::TfOptimizer;
use crate::step::{self, CompiledGraph, ProgramKey, ProgramKind, Signature};

/// The graph of free-standing [`TrainBackend::loss`] calls, which have no model.
fn loss_graph() -> &'static Mutex<CompiledGraph> {
    static GRAPH: OnceLock<Mutex<CompiledGraph>> = OnceLock::new();
    GRAPH.get_or_init(|| Mutex::new(CompiledGraph::new(Engine::new())))
}

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

    /// Computes a loss on values (one session run of a cached loss graph).
    fn loss(loss: &Loss, output: &TfTensor, target: &TfTensor) -> Result<TfTensor> {
        let key = ProgramKey {
            kind: ProgramKind::Loss { loss: loss.clone() },
            train: false,
            input: Some(Signature::of(output)),
            target: Some(Signature::of(target)),
        };
        let mut graph = lock(loss_graph())?;
        let program = step::program(&mut graph, &key, None, None)?;
        step::run(
            &mut graph.engine,
            &program,
            Some(output),
            Some(target),
            &[],
            "computing the loss",
        )?
        .loss
        .ok_or_else(|| Error::backend("tensorflow", "computing the loss", "no output"))
    }

    fn scale(tensor: &TfTensor, factor: f64) -> Result<TfTensor> {
        let host = tensor.to_host()?;
        let values: Vec<f64> = host.to_f64_vec().into_iter().map(|v| v * factor).collect();
        let scaled = HostTensor::new(values, host.shape().clone())?.to_dtype(host.dtype());
        TfTensor::from_host(&scaled)
    }

    fn item(tensor: &TfTensor) -> Result<f64> {
        step::scalar(tensor)
    }

    fn clip_gradients(_params: &[(String, TfTensor)], _clip: &GradClip) -> Result<()> {
        Err(Error::unsupported(
            "clip_gradients() on the TensorFlow backend: clipping runs inside the compiled \
             training step; pass it in the StepPlan (TrainerConfig's `clip`)",
        ))
    }

    fn no_grad<T>(f: impl FnOnce() -> T) -> T {
        f()
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
}
