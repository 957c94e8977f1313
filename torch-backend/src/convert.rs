//! [`HostTensor`] to and from `tch::Tensor`: one copy each way, shape and dtype kept.

use kiln_core::{dtype::Element, DType, Device, Error, HostTensor, Result, Shape};
use tch::{Kind, Tensor};

use crate::device::device_to_tch;
use crate::error::torch_error;

/// The libtorch kind of a Kiln dtype.
pub fn kind_from_dtype(dtype: DType) -> Result<Kind> {
    match dtype {
        DType::U8 => Ok(Kind::Uint8),
        DType::I32 => Ok(Kind::Int),
        DType::I64 => Ok(Kind::Int64),
        DType::F32 => Ok(Kind::Float),
        DType::F64 => Ok(Kind::Double),
        DType::BF16 => Ok(Kind::BFloat16),
        DType::F16 => Ok(Kind::Half),
        other => Err(Error::unsupported(format!("{other} tensors in libtorch"))),
    }
}

/// The Kiln dtype of a libtorch kind; kinds Kiln has no host type for are `Unsupported`.
pub fn dtype_from_kind(kind: Kind) -> Result<DType> {
    match kind {
        Kind::Uint8 => Ok(DType::U8),
        Kind::Int => Ok(DType::I32),
        Kind::Int64 => Ok(DType::I64),
        Kind::Float => Ok(DType::F32),
        Kind::Double => Ok(DType::F64),
        Kind::BFloat16 => Ok(DType::BF16),
        Kind::Half => Ok(DType::F16),
        other => Err(Error::unsupported(format!(
            "libtorch dtype {other:?} has no host representation in Kiln \
             (uint8, int32, int64, float32, float64, bfloat16, float16)"
        ))),
    }
}

/// Whether a libtorch kind holds floating-point values.
pub(crate) fn is_float_kind(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Half | Kind::Float | Kind::Double | Kind::BFloat16
    )
}

/// Copies a host tensor into a new libtorch tensor on `device`.
pub fn to_tch(host: &HostTensor, device: Device) -> Result<Tensor> {
    let target = device_to_tch(device)?;
    let dims = host.shape().to_i64_vec()?;
    // The byte length matches shape and kind: HostTensor's constructors check it.
    let tensor = Tensor::f_from_data_size(host.as_bytes(), &dims, kind_from_dtype(host.dtype())?)
        .map_err(|e| torch_error("creating a tensor from host data", e))?;
    if target == tch::Device::Cpu {
        return Ok(tensor);
    }
    tensor
        .f_to_device(target)
        .map_err(|e| torch_error(&format!("copying a tensor to {device}"), e))
}

/// Copies a host tensor to `device` through page-locked (pinned) host memory with a
/// non-blocking copy, so the transfer overlaps with work already queued on the GPU.
/// On the CPU this is [`to_tch`].
pub fn to_tch_pinned(host: &HostTensor, device: Device) -> Result<Tensor> {
    let target = device_to_tch(device)?;
    if target == tch::Device::Cpu {
        return to_tch(host, device);
    }
    let cpu = to_tch(host, Device::Cpu)?;
    cpu.f_pin_memory(target)
        .and_then(|pinned| pinned.f_to_device_(target, pinned.kind(), true, false))
        .map_err(|e| torch_error(&format!("pinned copy to {device}"), e))
}

/// Copies a libtorch tensor (any device, any layout) into a contiguous host tensor.
pub fn from_tch(tensor: &Tensor) -> Result<HostTensor> {
    let kind = tensor
        .f_kind()
        .map_err(|e| torch_error("reading a tensor's dtype", e))?;
    let dtype = dtype_from_kind(kind)?;
    let shape = shape_of(tensor)?;
    let cpu = tensor
        .f_to_device(tch::Device::Cpu)
        .and_then(|t| t.f_contiguous())
        .map_err(|e| torch_error("copying a tensor to host memory", e))?;
    match dtype {
        DType::U8 => copy_out::<u8>(&cpu, shape),
        DType::I32 => copy_out::<i32>(&cpu, shape),
        DType::I64 => copy_out::<i64>(&cpu, shape),
        DType::F32 => copy_out::<f32>(&cpu, shape),
        DType::F64 => copy_out::<f64>(&cpu, shape),
        DType::BF16 => copy_out_16::<half::bf16>(&cpu, shape),
        DType::F16 => copy_out_16::<half::f16>(&cpu, shape),
        other => Err(Error::unsupported(format!(
            "copying {other} tensors from libtorch"
        ))),
    }
}

/// The Kiln shape of a libtorch tensor.
pub(crate) fn shape_of(tensor: &Tensor) -> Result<Shape> {
    if !tensor.defined() {
        return Err(Error::invalid_argument(
            "tensor",
            "an undefined libtorch tensor (e.g. the .grad of a parameter before backward)",
        ));
    }
    // `size` cannot fail on a defined tensor (tch has no fallible form of it).
    Shape::try_from(tensor.size().as_slice())
}

fn copy_out<T: Element + tch::kind::Element + Default>(
    cpu: &Tensor,
    shape: Shape,
) -> Result<HostTensor> {
    let numel = shape.numel();
    let mut data = vec![T::default(); numel];
    cpu.f_copy_data(&mut data, numel)
        .map_err(|e| torch_error("copying tensor data to host memory", e))?;
    HostTensor::new(data, shape)
}

/// [`copy_out`] for the 16-bit floats, through their bits: tch 0.24 declares
/// `half::bf16` as libtorch's `Half`, so its typed copy refuses bf16 tensors.
fn copy_out_16<T: Element>(cpu: &Tensor, shape: Shape) -> Result<HostTensor> {
    let numel = shape.numel();
    let mut bits = vec![0i16; numel];
    cpu.f_view_dtype(Kind::Int16)
        .and_then(|t| t.f_copy_data(&mut bits, numel))
        .map_err(|e| torch_error("copying tensor data to host memory", e))?;
    HostTensor::new(bytemuck::cast_vec::<i16, T>(bits), shape)
}
