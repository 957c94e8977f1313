//! [`TfBackend`]'s [`TrainBackend`]: models and optimizers as TensorFlow graphs,
//! and training and evaluation steps as one session run each of a program
//! compiled in [`crate::step`], or, data-parallel, two
//! (`optim/data_parallel.rs`).

use std::sync::Arc;

use kiln_core::{
    backend::{StepPlan, TrainBackend, Trainable},
    distributed::{Collectives, DistributedOptions},
    loss::Loss,
    model::Layer,
    module::Module,
    optim::{OptimizerConfig, ParamGroup},
    precision::FloatPrecision,
    Device, Error, HostTensor, Result,
};

use crate::backend::TfBackend;
use crate::convert::TfTensor;
use crate::distributed::DataParallel;
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

    /// Data-parallel training over any [`Collectives`] group (kiln-torch's
    /// c10d Gloo group in the `kiln` CLI): every rank checks that it built rank
    /// 0's model (names, dtypes, shapes) and takes rank 0's parameters and
    /// buffers, of any dtype, bit for bit (one broadcast); from then on
    /// [`train_step`](TrainBackend::train_step) averages gradients and losses
    /// over the ranks, and, with `options.broadcast_buffers` (the default),
    /// gives every rank rank 0's buffers before each training forward pass.
    ///
    /// Of the options, `backend` must not be NCCL (TensorFlow trains on the CPU
    /// here); `bucket_cap_mb` does not apply (the gradients of a step travel as
    /// one buffer, after the session run that computes them), nor does
    /// `find_unused_parameters` (the graph says which parameters have a
    /// gradient, the same on every rank: the others are left out of the buffer
    /// and not updated, as PyTorch skips parameters without a gradient).
    ///
    /// With `broadcast_buffers` off, a micro-batch skipped because the loss of
    /// another rank was not finite still updated the batch-norm statistics of
    /// the ranks whose own loss was finite (as PyTorch's forward pass always
    /// does); with it on, they are restored.
    fn distribute(
        model: &mut TfModel,
        group: Arc<dyn Collectives>,
        options: &DistributedOptions,
    ) -> Result<()> {
        let job = DataParallel::new(model, group, options)?;
        model.data_parallel = Some(Arc::new(job));
        Ok(())
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
    ///
    /// Data-parallel ([`distribute`](kiln_core::backend::TrainBackend::distribute)): one session run
    /// fetches the micro-batch's gradients and loss as one flat float32 vector;
    /// the loss is averaged over the ranks, and on the micro-batch that applies
    /// the vector (plus the gradients that earlier micro-batches accumulated on
    /// this rank) is averaged over the ranks in place, in TensorFlow's memory,
    /// and fed to a second run that clips and applies it. The result is the
    /// single-process step's on the global batch.
    fn train_step(
        &mut self,
        optimizer: &mut TfOptimizer,
        inputs: &TfTensor,
        targets: &TfTensor,
        plan: &StepPlan<'_>,
    ) -> Result<f64> {
        match &self.data_parallel {
            Some(job) => optimizer.data_parallel_step(self, job, inputs, targets, plan),
            None => optimizer.train_step(self, inputs, targets, plan),
        }
    }

    /// [`TfModel::sync_buffers`].
    fn sync_buffers(&mut self) -> Result<()> {
        TfModel::sync_buffers(self)
    }

    /// Forward and loss as one session run.
    fn eval_step(
        &self,
        loss: &Loss,
        inputs: &TfTensor,
        targets: &TfTensor,
    ) -> Result<(f64, HostTensor)> {
        let key = ProgramKey {
            kind: ProgramKind::Eval { loss: loss.clone() },
            train: Module::<TfBackend>::mode(self).is_train(),
            input: Some(Signature::of(inputs)),
            target: Some(Signature::of(targets)),
        };
        let batch = inputs.shape();
        let mut graph = lock(&self.graph)?;
        let program = step::program(&mut graph, &key, Some(self.model_graph(batch.dims())), None)?;
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
    fn predict_step(&self, inputs: &TfTensor) -> Result<HostTensor> {
        Module::<TfBackend>::forward(self, inputs)?.to_host()
    }
}
