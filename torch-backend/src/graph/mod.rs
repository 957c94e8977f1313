//! CUDA graphs (kiln-torch's feature `cuda`): record libtorch's kernel launches once, replay them
//! with one launch. For small models, where launching kernels costs more than
//! running them, a captured training step ([`GraphedTrainStep`]) removes the host
//! from the step almost entirely, as PyTorch's `torch.cuda.graph` does.
//!
//! [`CudaGraph`] is libtorch's `at::cuda::CUDAGraph` with the stream handling of
//! `torch.cuda.graph`: capture runs on a side stream, into the graph's private
//! memory pool, and a failed capture (an op that synchronises with the host, say)
//! is an error that leaves the device usable.
//!
//! ```no_run
//! use kiln_core::{
//!     loss::Loss, model::{Layer, LinearConfig}, optim::{AdamConfig, OptimizerConfig}, Device,
//! };
//! use kiln_torch::graph::GraphedTrainStep;
//! use kiln_torch::{TorchModel, TorchOptimizer};
//! use kiln_core::module::Module;
//!
//! let device = Device::Cuda(0);
//! let net = Layer::sequential([LinearConfig::new(784, 10).into()]);
//! let model = TorchModel::new(&net, device)?;
//! let optimizer = TorchOptimizer::new(
//!     OptimizerConfig::Adam(AdamConfig::new(1e-3)),
//!     model.named_parameters()?,
//!     &[],
//! )?;
//! let cuda = (tch::Kind::Float, tch::Device::Cuda(0));
//! let x = tch::Tensor::randn([64, 784], cuda);
//! let y = tch::Tensor::zeros([64], (tch::Kind::Int64, tch::Device::Cuda(0)));
//! let mut step = GraphedTrainStep::new(model, optimizer, &Loss::cross_entropy(), None, &x, &y)?;
//! for _ in 0..100 {
//!     let loss = step.step(&x, &y)?; // forward, backward and Adam: one graph launch
//!     let _ = loss;
//! }
//! let (model, optimizer) = step.into_parts();
//! # Ok::<(), kiln_core::Error>(())
//! ```

#[allow(unsafe_code)]
mod bridge;

use std::pin::Pin;

use crate::{train_step, TorchBackend, TorchOptimizer};
use kiln_core::{
    backend::{StepLoss, StepPlan},
    loss::Loss,
    module::Module,
    optim::{GradClip, Optimizer},
    strategy::NoHooks,
    Device, Error, Result,
};
use tch::Tensor;

/// libtorch's `at::cuda::CUDAGraph` on one device.
pub struct CudaGraph {
    inner: cxx::UniquePtr<bridge::ffi::CudaGraph>,
    device: Device,
}

impl std::fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaGraph")
            .field("device", &self.device)
            .field("captured", &self.is_captured())
            .finish()
    }
}

impl CudaGraph {
    /// An empty graph on `device`, which must be a CUDA device that exists.
    pub fn new(device: Device) -> Result<Self> {
        let Device::Cuda(index) = device else {
            return Err(Error::invalid_argument(
                "device",
                format!("CUDA graphs need a CUDA device, got {device}"),
            ));
        };
        let index = i8::try_from(index).map_err(|_| {
            Error::invalid_argument("device", format!("CUDA device {index} does not exist"))
        })?;
        let inner = bridge::ffi::new_cuda_graph(index).map_err(|e| graph_error("creating", e))?;
        Ok(Self { inner, device })
    }

    /// The device the graph runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether a capture has succeeded (only then can it [`replay`](Self::replay)).
    pub fn is_captured(&self) -> bool {
        self.inner.as_ref().is_some_and(|g| g.is_captured())
    }

    /// Runs `work` eagerly on the stream the capture will use (warm-up: libtorch
    /// creates its cuBLAS handles and workspaces on first use, which a capture
    /// cannot do).
    pub fn on_capture_stream<T>(&mut self, work: impl FnOnce() -> Result<T>) -> Result<T> {
        self.pin()?
            .enter_side_stream()
            .map_err(|e| graph_error("warming up", e))?;
        let result = work();
        let left = self
            .pin()?
            .leave_side_stream()
            .map_err(|e| graph_error("warming up", e));
        let value = result?;
        left.map(|()| value)
    }

    /// Records the kernels that `work` launches on the device instead of running
    /// them. Nothing in `work` may synchronise with the host (no `.item()`, no copy
    /// to the CPU, no op whose output shape depends on the data): libtorch then
    /// fails the capture, and this returns the error. Tensors `work` creates live in
    /// the graph's memory pool; each [`replay`](Self::replay) rewrites them.
    pub fn capture<T>(&mut self, work: impl FnOnce() -> Result<T>) -> Result<T> {
        self.pin()?
            .capture_begin()
            .map_err(|e| graph_error("beginning the capture", e))?;
        // Ends the capture even if `work` panics, so the device is not left capturing.
        struct EndCapture<'a>(&'a mut CudaGraph);
        impl Drop for EndCapture<'_> {
            fn drop(&mut self) {
                if std::thread::panicking() {
                    if let Ok(graph) = self.0.pin() {
                        let _ = graph.capture_end();
                    }
                }
            }
        }
        let guard = EndCapture(self);
        let result = work();
        let ended = guard
            .0
            .pin()?
            .capture_end()
            .map_err(|e| graph_error("capturing", e));
        match (result, ended) {
            (Ok(value), Ok(())) => Ok(value),
            // The work's own error says more than "capture invalidated".
            (Err(e), _) => Err(Error::backend_with_source(
                "torch",
                "CUDA graph: capturing (nothing in a captured step may synchronise with the host)",
                e,
            )),
            (Ok(_), Err(e)) => Err(e),
        }
    }

    /// Launches the captured work on the device's current stream (asynchronously,
    /// like any CUDA op).
    pub fn replay(&mut self) -> Result<()> {
        self.pin()?
            .replay()
            .map_err(|e| graph_error("replaying", e))
    }

    fn pin(&mut self) -> Result<Pin<&mut bridge::ffi::CudaGraph>> {
        self.inner
            .as_mut()
            .ok_or_else(|| Error::backend("torch", "CUDA graph", "the graph is gone"))
    }
}

fn graph_error(what: &str, e: cxx::Exception) -> Error {
    Error::backend_with_source("torch", format!("CUDA graph: {what}"), e)
}

/// A whole training step (forward, loss, backward, gradient clipping, optimizer
/// step) captured in a [`CudaGraph`] and replayed on each batch, like PyTorch's
/// whole-network capture with `Adam(capturable=True)`.
///
/// It owns the model and the optimizer, because the graph keeps using their
/// tensors: [`model`](Self::model) and [`optimizer`](Self::optimizer) read them
/// (a `state_dict` for a checkpoint, say), [`set_learning_rate`](Self::set_learning_rate)
/// changes the rate the next replays use, and [`into_parts`](Self::into_parts) gives
/// both back. The optimizer is switched to capturable mode
/// ([`TorchOptimizer::set_capturable`]).
///
/// Differences from the eager
/// [`train_step`]: the loss comes back as
/// a tensor on the device (reading it synchronises, so read it only when you log),
/// and a step with a non-finite loss is applied like any other (the eager step skips
/// it, which needs the host to look at the loss).
pub struct GraphedTrainStep<M: Module<TorchBackend>> {
    graph: CudaGraph,
    model: M,
    optimizer: TorchOptimizer,
    inputs: Tensor,
    targets: Tensor,
    loss: Tensor,
}

impl<M: Module<TorchBackend>> std::fmt::Debug for GraphedTrainStep<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphedTrainStep")
            .field("graph", &self.graph)
            .field("inputs", &self.inputs.size())
            .field("targets", &self.targets.size())
            .finish_non_exhaustive()
    }
}

impl<M: Module<TorchBackend>> GraphedTrainStep<M> {
    /// Eager training steps run on the capture stream before capturing (libtorch
    /// needs them to create the optimizer state and its CUDA handles, as PyTorch's
    /// documentation does). Their effect on the model and optimizer is undone.
    pub const WARMUP_STEPS: usize = 3;

    /// Captures the training step of `model` and `optimizer` for batches shaped like
    /// `inputs` and `targets` (their dtype and device too), which must be on the
    /// model's CUDA device. The model should be in training mode.
    ///
    /// Runs [`WARMUP_STEPS`](Self::WARMUP_STEPS) steps on this batch, then restores
    /// the model's and optimizer's state as it was, then captures one step (which
    /// runs nothing). On error, the model and optimizer are dropped with it; the
    /// error says what failed (an op that cannot be captured, an optimizer without
    /// a capturable mode, inputs on the wrong device).
    pub fn new(
        mut model: M,
        mut optimizer: TorchOptimizer,
        loss: &Loss,
        clip: Option<GradClip>,
        inputs: &Tensor,
        targets: &Tensor,
    ) -> Result<Self> {
        let device = crate::device_from_tch(inputs.device())?;
        if !device.is_cuda() {
            return Err(Error::invalid_argument(
                "inputs",
                format!("a captured step runs on a CUDA device, the inputs are on {device}"),
            ));
        }
        if optimizer.loss_scaling().is_some() {
            return Err(Error::unsupported(
                "loss scaling (16-mixed) in a captured step: its skip decision is taken \
                 outside the graph; capture bf16-mixed or 32-true steps, or train 16-mixed eagerly",
            ));
        }
        let mut graph = CudaGraph::new(device)?;
        optimizer.set_capturable(true)?;
        // The capture reads its inputs from these buffers; `step` copies into them.
        let static_inputs = inputs
            .f_detach_copy()
            .map_err(|e| crate::torch_error("copying the inputs", e))?;
        let static_targets = targets
            .f_detach_copy()
            .map_err(|e| crate::torch_error("copying the targets", e))?;

        let model_state = model.state_dict()?;
        let optimizer_state = optimizer.state_dict()?;
        // The one torch step (`train_step`), reading nothing back: what is
        // captured is exactly what an eager run does.
        let plan = StepPlan {
            loss,
            scale: 1.0,
            apply: true,
            clip: clip.as_ref(),
        };
        let run_step = |model: &mut M, optimizer: &mut TorchOptimizer| -> Result<Tensor> {
            match train_step(
                model,
                optimizer,
                &static_inputs,
                &static_targets,
                &plan,
                &mut NoHooks,
                true,
            )? {
                StepLoss::Device(loss) => Ok(loss),
                StepLoss::Host(_) => Err(Error::backend(
                    "torch",
                    "capturing a training step",
                    "the step read its loss back to the host",
                )),
            }
        };
        graph.on_capture_stream(|| {
            for _ in 0..Self::WARMUP_STEPS {
                optimizer.zero_grad()?;
                let _loss = run_step(&mut model, &mut optimizer)?;
            }
            Ok(())
        })?;
        model.load_state_dict(&model_state)?;
        optimizer.load_state_dict(&optimizer_state)?;
        // Gradients set to none: the captured backward allocates them in the graph's
        // pool, and every replay writes them afresh.
        optimizer.zero_grad()?;
        let loss = graph.capture(|| run_step(&mut model, &mut optimizer))?;
        Ok(Self {
            graph,
            model,
            optimizer,
            inputs: static_inputs,
            targets: static_targets,
            loss,
        })
    }

    /// One training step on `inputs` and `targets` (shaped and typed as at capture;
    /// on any device: they are copied into the graph's input buffers), launched as
    /// one graph. Returns the loss, a 0-dim tensor on the device that the next step
    /// overwrites.
    pub fn step(&mut self, inputs: &Tensor, targets: &Tensor) -> Result<&Tensor> {
        check_like("inputs", inputs, &self.inputs)?;
        check_like("targets", targets, &self.targets)?;
        self.inputs
            .f_copy_(inputs)
            .map_err(|e| crate::torch_error("copying the inputs", e))?;
        self.targets
            .f_copy_(targets)
            .map_err(|e| crate::torch_error("copying the targets", e))?;
        self.graph.replay()?;
        Ok(&self.loss)
    }

    /// The model (its parameters as of the last replay that has finished).
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The optimizer, in capturable mode.
    pub fn optimizer(&self) -> &TorchOptimizer {
        &self.optimizer
    }

    /// Sets every group's learning rate for the following steps (a device-side
    /// write the replays read; no new capture).
    pub fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        self.optimizer.set_learning_rate(lr)
    }

    /// Sets each group's learning rate, as an `LrScheduler` returns them.
    pub fn set_learning_rates(&mut self, lrs: &[f64]) -> Result<()> {
        self.optimizer.set_learning_rates(lrs)
    }

    /// The model and the optimizer (still in capturable mode), without the graph.
    pub fn into_parts(self) -> (M, TorchOptimizer) {
        (self.model, self.optimizer)
    }
}

/// `given` must have `captured`'s shape and dtype.
fn check_like(what: &str, given: &Tensor, captured: &Tensor) -> Result<()> {
    if given.size() != captured.size() {
        return Err(Error::ShapeMismatch {
            context: format!("{what} of a captured training step"),
            expected: format!("{:?}", captured.size()),
            actual: format!("{:?}", given.size()),
        });
    }
    if given.kind() != captured.kind() {
        return Err(Error::DTypeMismatch {
            context: format!("{what} of a captured training step"),
            expected: crate::dtype_from_kind(captured.kind())?,
            actual: crate::dtype_from_kind(given.kind())?,
        });
    }
    Ok(())
}
