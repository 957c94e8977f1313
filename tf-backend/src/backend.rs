//! [`TfBackend`]: Kiln's [`Backend`] and [`TrainBackend`] on the TensorFlow C API.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use kiln_core::{
    Backend, DType, Device, Error, FloatPrecision, GradClip, HostTensor, Layer, Loss, Module,
    OptimizerConfig, ParamGroup, Result, Shape, StepPlan, TrainBackend,
};
use tensorflow::{DataType, Output};

use crate::convert::TfTensor;
use crate::engine::{seed_tensor, Engine};
use crate::model::{lock, TfModel};
use crate::optim::TfOptimizer;

/// The TensorFlow backend: graphs built once through the TensorFlow C API and
/// run in a session, on the CPU.
///
/// Training is graph mode: [`TrainBackend::train_step`] runs forward, loss,
/// gradients (`Graph::add_gradients`) and the optimizer's apply ops as **one**
/// session run of a program compiled on the first step. The eager-style
/// [`Backend::backward`] has no graph to differentiate and is
/// [`Error::Unsupported`]; write training loops with [`kiln_core::Trainer`]
/// or `train_step`, which work on both backends.
///
/// ```no_run
/// use kiln_core::{Backend, Device, HostTensor};
/// use kiln_tf::TfBackend;
///
/// let t = TfBackend::from_host(&HostTensor::new(vec![1.0f32, 2.0], [2])?, Device::Cpu)?;
/// assert_eq!(TfBackend::to_host(&t)?.as_slice::<f32>()?, &[1.0, 2.0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct TfBackend;

/// TensorFlow runs on the CPU here (the `tensorflow-cpu` wheel).
pub(crate) fn check_device(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        other => Err(Error::DeviceUnavailable {
            device: other,
            reason: "Kiln's TensorFlow backend runs on the CPU (it links the tensorflow-cpu \
                     wheel); use the torch backend for CUDA"
                .to_owned(),
        }),
    }
}

impl Backend for TfBackend {
    type Tensor = TfTensor;

    const NAME: &'static str = "tensorflow";

    fn from_host(host: &HostTensor, device: Device) -> Result<TfTensor> {
        check_device(device)?;
        TfTensor::from_host(host)
    }

    fn to_host(tensor: &TfTensor) -> Result<HostTensor> {
        tensor.to_host()
    }

    fn shape(tensor: &TfTensor) -> Shape {
        tensor.shape()
    }

    fn dtype(tensor: &TfTensor) -> Result<DType> {
        Ok(tensor.dtype())
    }

    fn device(_tensor: &TfTensor) -> Device {
        Device::Cpu
    }

    fn to_device(tensor: &TfTensor, device: Device) -> Result<TfTensor> {
        check_device(device)?;
        Ok(tensor.clone())
    }

    fn is_available(device: Device) -> bool {
        device == Device::Cpu
    }

    fn cuda_device_count() -> usize {
        0
    }

    fn manual_seed(seed: u64) {
        crate::engine::manual_seed(seed);
    }

    fn backward(_loss: &TfTensor) -> Result<()> {
        Err(Error::unsupported(
            "backward() on the TensorFlow backend: its tensors are values, and gradients are \
             computed inside the compiled training step (TrainBackend::train_step, which the \
             Trainer calls)",
        ))
    }
}

/// Loss programs for free-standing [`TrainBackend::loss`] calls, by signature.
struct LossPrograms {
    engine: Engine,
    programs: HashMap<String, (Output, Output, Output)>,
}

fn loss_programs() -> &'static Mutex<LossPrograms> {
    static PROGRAMS: OnceLock<Mutex<LossPrograms>> = OnceLock::new();
    PROGRAMS.get_or_init(|| {
        Mutex::new(LossPrograms {
            engine: Engine::new(),
            programs: HashMap::new(),
        })
    })
}

fn dims_of(t: &TfTensor) -> Vec<i64> {
    let mut dims: Vec<i64> = t.shape().dims().iter().map(|&d| d as i64).collect();
    if let Some(first) = dims.first_mut() {
        *first = -1;
    }
    dims
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
        let mut guard = loss_programs()
            .lock()
            .map_err(|_| Error::backend("tensorflow", "computing a loss", "lock poisoned"))?;
        let programs = &mut *guard;
        let (odims, tdims) = (dims_of(output), dims_of(target));
        let key = format!("{loss:?}|{odims:?}|{tdims:?}|{}", target.dtype());
        if !programs.programs.contains_key(&key) {
            let b = &mut programs.engine.b;
            let o = b.placeholder(DataType::Float, Some(&odims))?;
            let t = b.placeholder(target.data_type(), Some(&tdims))?;
            let l = crate::loss::build_loss(b, loss, &o, &odims, &t, target.dtype(), &tdims)?;
            programs.programs.insert(key.clone(), (o, t, l));
        }
        let (o, t, l) =
            programs.programs.get(&key).cloned().ok_or_else(|| {
                Error::backend("tensorflow", "computing a loss", "program missing")
            })?;
        let mut out = programs.engine.run(
            &[(&o, output), (&t, target)],
            &[(&l, DataType::Float)],
            &[],
            "computing the loss",
        )?;
        out.pop()
            .ok_or_else(|| Error::backend("tensorflow", "computing the loss", "no output"))
    }

    fn scale(tensor: &TfTensor, factor: f64) -> Result<TfTensor> {
        let host = tensor.to_host()?;
        let values: Vec<f64> = host.to_f64_vec().into_iter().map(|v| v * factor).collect();
        let scaled = HostTensor::new(values, host.shape().clone())?.to_dtype(host.dtype());
        TfTensor::from_host(&scaled)
    }

    fn item(tensor: &TfTensor) -> Result<f64> {
        let host = tensor.to_host()?;
        match host.to_f64_vec().as_slice() {
            [value] => Ok(*value),
            _ => Err(Error::ShapeMismatch {
                context: "item()".to_owned(),
                expected: "one element".to_owned(),
                actual: host.shape().to_string(),
            }),
        }
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
        let train = Module::<TfBackend>::mode(model).is_train();
        let engine_arc = std::sync::Arc::clone(&model.engine);
        let mut engine = lock(&engine_arc)?;
        let forward = model.forward_program(&mut engine, inputs, train)?;
        let tdims = dims_of(targets);
        let key = format!(
            "{loss:?}|{train}|{:?}|{tdims:?}|{}",
            dims_of(inputs),
            targets.dtype()
        );
        if !engine.evals.contains_key(&key) {
            let mut odims = vec![-1i64];
            odims.extend(&forward.output_dims);
            let b = &mut engine.b;
            let t = b.placeholder(targets.data_type(), Some(&tdims))?;
            let l = crate::loss::build_loss(
                b,
                loss,
                &forward.output,
                &odims,
                &t,
                targets.dtype(),
                &tdims,
            )?;
            engine.evals.insert(key.clone(), (t, l));
        }
        let (t, l) = engine
            .evals
            .get(&key)
            .cloned()
            .ok_or_else(|| Error::backend("tensorflow", "evaluation", "program missing"))?;
        let seed = forward.seed.as_ref().map(|_| seed_tensor()).transpose()?;
        let mut feeds = vec![(&forward.input, inputs), (&t, targets)];
        if let (Some(ph), Some(seed)) = (&forward.seed, &seed) {
            feeds.push((ph, seed));
        }
        let targets_ops: Vec<_> = forward.update_ops.iter().collect();
        let out = engine.run(
            &feeds,
            &[(&l, DataType::Float), (&forward.output, DataType::Float)],
            &targets_ops,
            "running an evaluation step",
        )?;
        let [value, output] = out.as_slice() else {
            return Err(Error::backend(
                "tensorflow",
                "evaluation",
                "missing outputs",
            ));
        };
        Ok((Self::item(value)?, output.to_host()?))
    }
}
