//! libtorch and Kiln reading each other's host memory in place: the one module of
//! kiln-torch that uses `unsafe`, for raw pointers handed to libtorch (`from_blob`)
//! and taken from it (`data_ptr`).
#![allow(unsafe_code)]

use kiln_core::{HostTensor, Result};
use tch::Tensor;

use crate::convert::kind_from_dtype;
use crate::error::torch_error;

/// Copies `host` into `target` (any device, any dtype: libtorch converts) without
/// first copying it into a libtorch tensor of its own.
///
/// The shapes must already match; `context` names the entry in an error.
pub(crate) fn copy_host_into(target: &mut Tensor, host: &HostTensor, context: &str) -> Result<()> {
    if host.numel() == 0 {
        return Ok(());
    }
    let kind = kind_from_dtype(host.dtype())?;
    let dims = host.shape().to_i64_vec()?;
    let bytes = host.as_bytes();
    // SAFETY: `bytes` is `host`'s contiguous buffer of `numel` native-endian values of
    // `kind`, aligned for that type (a `Vec<T>` of it), and `host` is borrowed for this
    // whole function. The view wraps that memory without taking ownership (libtorch's
    // `from_blob` has no deleter), is only read (as the source of `copy_`, which is
    // synchronous from pageable host memory) and is dropped before returning, so
    // libtorch never touches the buffer after the borrow ends.
    let view = unsafe { Tensor::f_from_blob(bytes.as_ptr(), &dims, &[], kind, tch::Device::Cpu) }
        .map_err(|e| torch_error(&format!("viewing {context} in host memory"), e))?;
    let copied = target.f_copy_(&view);
    drop(view);
    copied.map_err(|e| torch_error(&format!("loading {context}"), e))
}

/// Calls `f` with `tensor`'s bytes: libtorch's own memory where the tensor is a
/// contiguous CPU tensor, a host copy otherwise (another device, a strided view).
pub(crate) fn with_host_bytes<R>(tensor: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
    let kind = tensor
        .f_kind()
        .map_err(|e| torch_error("reading a tensor's dtype", e))?;
    // Fails for dtypes Kiln does not model, as a host copy would.
    crate::convert::dtype_from_kind(kind)?;
    if tensor.device() != tch::Device::Cpu || !tensor.is_contiguous() {
        let host = crate::from_tch(tensor)?;
        return Ok(f(host.as_bytes()));
    }
    let len = tensor.numel() * kind.elt_size_in_bytes();
    if len == 0 {
        return Ok(f(&[]));
    }
    let data = tensor.data_ptr().cast::<u8>().cast_const();
    // SAFETY: `tensor` is a defined, contiguous CPU tensor (checked above), so its
    // `numel` elements of `kind` lie in one block of `len` bytes starting at
    // `data_ptr` (which includes the storage offset), and its storage is kept alive
    // by the handle borrowed for this whole call. The slice is only read, and does
    // not outlive the call. As with libtorch's own readers (`torch.save`, `copy_`),
    // an in-place write through another handle to the same storage on another thread
    // during the call would race: Kiln's trainer writes checkpoints between steps.
    let bytes = unsafe { std::slice::from_raw_parts(data, len) };
    Ok(f(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::DType;
    use tch::Kind;

    #[test]
    fn copies_values_and_converts_dtype() -> Result<()> {
        let host = HostTensor::new(vec![1.5f64, -2.25, 3.0, 0.125, 7.0, -8.5], [2, 3])?;
        let mut target = Tensor::zeros([2, 3], (Kind::Float, tch::Device::Cpu));
        copy_host_into(&mut target, &host, "w")?;
        let back = crate::from_tch(&target)?;
        assert_eq!(back, host.to_dtype(DType::F32));
        // The view did not outlive the call: changing the host copy changes nothing.
        drop(host);
        assert_eq!(crate::from_tch(&target)?.as_slice::<f32>()?[1], -2.25);
        Ok(())
    }

    #[test]
    fn empty_tensors_copy_nothing_and_read_as_no_bytes() -> Result<()> {
        let host = HostTensor::zeros(DType::F32, [0, 4])?;
        // A float64 target: the load keeps the target's dtype, shape and device.
        let mut target = Tensor::zeros([0, 4], (Kind::Double, tch::Device::Cpu));
        copy_host_into(&mut target, &host, "empty")?;
        assert_eq!(target.size(), [0, 4]);
        assert_eq!(target.kind(), Kind::Double);
        assert_eq!(target.device(), tch::Device::Cpu);
        assert_eq!(crate::from_tch(&target)?, host.to_dtype(DType::F64));
        assert_eq!(with_host_bytes(&target, <[u8]>::len)?, 0);
        Ok(())
    }
}
