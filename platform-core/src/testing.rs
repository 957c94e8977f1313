//! Test-only reference backend: tensors are host tensors on the CPU.

use crate::backend::Backend;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::Shape;
use crate::tensor::HostTensor;

/// A backend whose tensors are plain [`HostTensor`]s on [`Device::Cpu`].
#[derive(Debug)]
pub(crate) struct RefBackend;

impl Backend for RefBackend {
    type Tensor = HostTensor;
    const NAME: &'static str = "reference";

    fn from_host(host: &HostTensor, device: Device) -> Result<HostTensor> {
        Self::to_device(host, device)
    }

    fn to_host(tensor: &HostTensor) -> Result<HostTensor> {
        Ok(tensor.clone())
    }

    fn shape(tensor: &HostTensor) -> Shape {
        tensor.shape().clone()
    }

    fn dtype(tensor: &HostTensor) -> Result<DType> {
        Ok(tensor.dtype())
    }

    fn device(_tensor: &HostTensor) -> Device {
        Device::Cpu
    }

    fn to_device(tensor: &HostTensor, device: Device) -> Result<HostTensor> {
        if Self::is_available(device) {
            Ok(tensor.clone())
        } else {
            Err(Error::DeviceUnavailable {
                device,
                reason: "the reference backend only has a CPU".into(),
            })
        }
    }

    fn is_available(device: Device) -> bool {
        device == Device::Cpu
    }

    fn cuda_device_count() -> usize {
        0
    }

    fn manual_seed(_seed: u64) {}
}

#[test]
fn reference_backend_round_trip() -> Result<()> {
    let h = HostTensor::new(vec![1.0f32, 2.0], [2])?;
    let t = RefBackend::from_host(&h, Device::Cpu)?;
    assert_eq!(RefBackend::to_host(&t)?, h);
    assert_eq!(RefBackend::shape(&t), Shape::from([2]));
    assert_eq!(RefBackend::dtype(&t)?, DType::F32);
    assert_eq!(RefBackend::device(&t), Device::Cpu);
    assert_eq!(RefBackend::cuda_device_count(), 0);
    let err = RefBackend::from_host(&h, Device::Cuda(0)).expect_err("no cuda");
    assert_eq!(
        err.to_string(),
        "device cuda:0 is unavailable: the reference backend only has a CPU"
    );
    Ok(())
}
