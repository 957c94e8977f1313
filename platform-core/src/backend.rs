//! The compute-engine abstraction.

mod train;

pub use train::{
    check_lerp_pairs, objective_unsupported, supervised_objective_step, EagerBackend, StepLoss,
    StepPlan, TrainBackend, Trainable, UpdatePlan,
};

use crate::device::Device;
use crate::dtype::DType;
use crate::error::Result;
use crate::shape::Shape;
use crate::tensor::HostTensor;

/// A compute engine (libtorch, TensorFlow, ...).
///
/// Training code is generic over `B: Backend` and monomorphised; there is no
/// dynamic dispatch between backends. All functions are associated functions:
/// a backend is a type-level tag, its state lives in the native library.
///
/// Contract shared by every implementation:
///
/// * Tensors never move between devices implicitly; operations on tensors on
///   different devices fail with [`Error::DeviceMismatch`](crate::Error::DeviceMismatch).
/// * Errors from the native library are returned as
///   [`Error::Backend`](crate::Error::Backend) carrying its message; nothing panics across the FFI edge.
/// * Host round trips are exact: `to_host(&from_host(&h, d)?)? == h` for every supported dtype.
///
/// ```
/// use kiln_core::{backend::Backend, Device, HostTensor, Result};
///
/// /// Uploads a batch, runs nothing, and reads it back.
/// fn round_trip<B: Backend>(host: &HostTensor, device: Device) -> Result<HostTensor> {
///     let t = B::from_host(host, device)?;
///     assert_eq!(B::shape(&t), *host.shape());
///     B::to_host(&t)
/// }
/// ```
pub trait Backend: Sized + Send + Sync + std::fmt::Debug + 'static {
    /// A tensor that lives on one of this backend's devices.
    type Tensor: Send + std::fmt::Debug;

    /// Short name used in errors, logs and checkpoint metadata (`"torch"`, `"tensorflow"`).
    const NAME: &'static str;

    /// Copies a host tensor onto `device` (one copy across the FFI edge).
    fn from_host(host: &HostTensor, device: Device) -> Result<Self::Tensor>;

    /// Copies a tensor back to host memory (contiguous, row-major).
    fn to_host(tensor: &Self::Tensor) -> Result<HostTensor>;

    /// Calls `f` with the tensor's elements as native-endian bytes in host memory,
    /// row-major: what checkpoint writers read.
    ///
    /// The default copies the tensor to the host first ([`to_host`](Backend::to_host));
    /// a backend that keeps a tensor contiguous in host memory lends its own bytes
    /// instead, so saving a model costs no copy of its weights.
    ///
    /// ```
    /// use kiln_core::{backend::Backend, Result};
    ///
    /// /// A checksum of a tensor's bytes, computed without copying it where possible.
    /// fn checksum<B: Backend>(tensor: &B::Tensor) -> Result<u64> {
    ///     B::with_host_bytes(tensor, |bytes| bytes.iter().map(|&b| u64::from(b)).sum())
    /// }
    /// ```
    fn with_host_bytes<R>(tensor: &Self::Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        let host = Self::to_host(tensor)?;
        Ok(f(host.as_bytes()))
    }

    /// The tensor's shape.
    fn shape(tensor: &Self::Tensor) -> Shape;

    /// The tensor's element type; fails for native dtypes Kiln does not model.
    fn dtype(tensor: &Self::Tensor) -> Result<DType>;

    /// The device the tensor lives on.
    fn device(tensor: &Self::Tensor) -> Device;

    /// Moves a tensor to another device; moving to the device it is on is a cheap no-op.
    fn to_device(tensor: &Self::Tensor, device: Device) -> Result<Self::Tensor>;

    /// Whether `device` can be used by this backend in this process.
    fn is_available(device: Device) -> bool;

    /// Number of CUDA devices this backend can use (0 without CUDA).
    fn cuda_device_count() -> usize;

    /// Seeds every random generator the backend owns (CPU and all CUDA devices).
    fn manual_seed(seed: u64);
}

/// Whether a module behaves as in training (dropout active, batch-norm
/// statistics updated) or evaluation.
///
/// ```
/// use kiln_core::backend::Mode;
///
/// assert_eq!(Mode::default(), Mode::Train);
/// assert!(!Mode::Eval.is_train());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Training behaviour (the default, as in PyTorch).
    #[default]
    Train,
    /// Inference behaviour.
    Eval,
}

impl Mode {
    /// Whether this is [`Mode::Train`].
    pub const fn is_train(self) -> bool {
        matches!(self, Mode::Train)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_defaults_to_train() {
        assert_eq!(Mode::default(), Mode::Train);
        assert!(Mode::Train.is_train());
        assert!(!Mode::Eval.is_train());
    }
}
