//! [`TfBackend`]: Kiln's [`Backend`] on the TensorFlow C API (its
//! [`TrainBackend`](kiln_core::backend::TrainBackend) is in `train.rs`).

use kiln_core::{backend::Backend, DType, Device, Error, HostTensor, Result, Shape};

use crate::convert::TfTensor;

/// The TensorFlow backend: graphs built once through the TensorFlow C API and
/// run in a session, on the CPU.
///
/// Training is graph mode: [`Trainable::train_step`](kiln_core::backend::Trainable::train_step)
/// runs forward, loss, gradients (`Graph::add_gradients`) and the optimizer's
/// apply ops as **one** session run of a program compiled on the first step.
/// It is a [`TrainBackend`](kiln_core::backend::TrainBackend) but not an
/// [`EagerBackend`](kiln_core::backend::EagerBackend): its tensors are values, with no
/// autograd record to call `backward` on. Write training loops with
/// `Trainer` (in `kiln-train`) or `train_step`, which work on both backends, or
/// split a step with [`TfModel::gradients`](crate::TfModel::gradients) and
/// [`TfOptimizer::apply_gradients`](crate::TfOptimizer::apply_gradients).
///
/// ```no_run
/// use kiln_core::{backend::Backend, Device, HostTensor};
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
}
