//! [`TorchBackend`]: the core [`Backend`] trait on libtorch.

use kiln_core::{backend::Backend, DType, Device, HostTensor, Result, Shape};
use tch::Tensor;

use crate::convert::{dtype_from_kind, from_tch, shape_of, to_tch};
use crate::device::{cuda_device_count, device_from_tch, device_to_tch};
use crate::error::torch_error;

/// The libtorch backend: tensors are `tch::Tensor`, on the CPU or a CUDA device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchBackend;

impl Backend for TorchBackend {
    type Tensor = Tensor;
    const NAME: &'static str = "torch";

    fn from_host(host: &HostTensor, device: Device) -> Result<Tensor> {
        to_tch(host, device)
    }

    fn to_host(tensor: &Tensor) -> Result<HostTensor> {
        from_tch(tensor)
    }

    /// Lends a contiguous CPU tensor's own memory; copies other tensors to the host.
    fn with_host_bytes<R>(tensor: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        crate::host_view::with_host_bytes(tensor, f)
    }

    fn shape(tensor: &Tensor) -> Shape {
        shape_of(tensor).unwrap_or_default()
    }

    fn dtype(tensor: &Tensor) -> Result<DType> {
        let kind = tensor
            .f_kind()
            .map_err(|e| torch_error("reading a tensor's dtype", e))?;
        dtype_from_kind(kind)
    }

    fn device(tensor: &Tensor) -> Device {
        device_from_tch(tensor.device()).unwrap_or(Device::Cpu)
    }

    fn to_device(tensor: &Tensor, device: Device) -> Result<Tensor> {
        let target = device_to_tch(device)?;
        if tensor.device() == target {
            return Ok(tensor.shallow_clone());
        }
        tensor
            .f_to_device(target)
            .map_err(|e| torch_error(&format!("moving a tensor to {device}"), e))
    }

    fn is_available(device: Device) -> bool {
        match device {
            Device::Cpu => true,
            Device::Cuda(index) => index < cuda_device_count(),
        }
    }

    fn cuda_device_count() -> usize {
        cuda_device_count()
    }

    fn manual_seed(seed: u64) {
        // tch seeds the CPU generator with an i64; the bit pattern is what matters.
        tch::manual_seed(seed as i64);
        if cuda_device_count() > 0 {
            tch::Cuda::manual_seed_all(seed);
        }
    }
}
