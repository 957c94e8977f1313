//! Autocast: run a forward pass with libtorch choosing bfloat16 (or float16) for
//! the ops that gain from it and float32 for the ones that need it, as Python's
//! `torch.autocast` does, on CPU and CUDA.

use std::marker::PhantomData;

use kiln_core::{DType, Device, Error, Result};

#[allow(unsafe_code)]
mod bridge {
    #[cxx::bridge(namespace = "kiln::torch")]
    pub(super) mod ffi {
        /// The autocast state of one device type before `autocast_enter`.
        struct AutocastState {
            enabled: bool,
            dtype: i8,
            cache_enabled: bool,
        }

        // SAFETY: the declarations match include/autocast.h exactly (cxx checks the
        // signatures at compile time), and both functions return `Result`, so a C++
        // exception comes back as an error instead of unwinding into Rust.
        unsafe extern "C++" {
            include!("kiln-torch/include/autocast.h");

            fn autocast_enter(device_type: i8, dtype: i8) -> Result<AutocastState>;
            fn autocast_exit(device_type: i8, previous: &AutocastState) -> Result<()>;
        }
    }
}

use bridge::ffi;

/// `c10::DeviceType` codes.
const CPU: i8 = 0;
const CUDA: i8 = 1;
/// `c10::ScalarType` codes.
const HALF: i8 = 5;
const BFLOAT16: i8 = 15;

/// Runs `f` with autocast to `dtype` on `device`'s type, like Python's
/// `with torch.autocast(device_type, dtype=dtype):`. Matrix products and
/// convolutions inside run in `dtype`; reductions, normalisations and losses that
/// need the range stay in float32 (libtorch's autocast op lists); the parameters
/// themselves are not converted. Autograd records the casts, so calling
/// `backward` after `f` returns gives float32 gradients for float32 parameters.
///
/// The setting is per thread and restored when `f` returns, also on error or
/// panic; regions nest.
///
/// `dtype` must be [`DType::BF16`] or [`DType::F16`] (float16 training also needs
/// loss scaling, which Kiln does not do; prefer bfloat16).
///
/// ```no_run
/// use kiln_core::{model::{Layer, LinearConfig}, module::Module, DType, Device};
/// use kiln_torch::TorchModel;
///
/// let model = TorchModel::new(&Layer::Linear(LinearConfig::new(64, 10)), Device::Cpu)?;
/// let x = tch::Tensor::randn([8, 64], (tch::Kind::Float, tch::Device::Cpu));
/// let y = kiln_torch::autocast(Device::Cpu, DType::BF16, || model.forward(&x))??;
/// assert_eq!(y.kind(), tch::Kind::BFloat16);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn autocast<T>(device: Device, dtype: DType, f: impl FnOnce() -> T) -> Result<T> {
    let _guard = AutocastGuard::enter(device, dtype)?;
    Ok(f())
}

/// An entered autocast region, left on drop. Not `Send`: autocast is per thread.
struct AutocastGuard {
    device_type: i8,
    previous: ffi::AutocastState,
    _thread_bound: PhantomData<*const ()>,
}

impl AutocastGuard {
    fn enter(device: Device, dtype: DType) -> Result<Self> {
        let device_type = match device {
            Device::Cpu => CPU,
            Device::Cuda(_) => CUDA,
        };
        let code = match dtype {
            DType::BF16 => BFLOAT16,
            DType::F16 => HALF,
            other => {
                return Err(Error::invalid_argument(
                    "dtype",
                    format!("autocast runs in bfloat16 or float16, not {other}"),
                ))
            }
        };
        let previous = ffi::autocast_enter(device_type, code)
            .map_err(|e| Error::backend_with_source("torch", "entering autocast", e))?;
        Ok(Self {
            device_type,
            previous,
            _thread_bound: PhantomData,
        })
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        if let Err(e) = ffi::autocast_exit(self.device_type, &self.previous) {
            log::error!("leaving autocast: {}", e.what());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu_float(dims: &[i64]) -> tch::Tensor {
        tch::Tensor::ones(dims, (tch::Kind::Float, tch::Device::Cpu))
    }

    #[test]
    fn matmul_runs_in_bf16_inside_and_f32_after() {
        let (a, b) = (cpu_float(&[4, 8]), cpu_float(&[8, 3]));
        let inside = autocast(Device::Cpu, DType::BF16, || a.matmul(&b)).unwrap();
        assert_eq!(inside.kind(), tch::Kind::BFloat16);
        assert_eq!(a.matmul(&b).kind(), tch::Kind::Float);
    }

    #[test]
    fn regions_nest_and_restore_the_outer_dtype() {
        let (a, b) = (cpu_float(&[2, 2]), cpu_float(&[2, 2]));
        let (inner, after_inner) = autocast(Device::Cpu, DType::BF16, || {
            let inner = autocast(Device::Cpu, DType::F16, || a.matmul(&b)).unwrap();
            (inner.kind(), a.matmul(&b).kind())
        })
        .unwrap();
        assert_eq!(inner, tch::Kind::Half);
        assert_eq!(after_inner, tch::Kind::BFloat16);
        assert_eq!(a.matmul(&b).kind(), tch::Kind::Float);
    }

    #[test]
    fn a_panic_inside_still_leaves_autocast() {
        let caught = std::panic::catch_unwind(|| {
            autocast(Device::Cpu, DType::BF16, || panic!("inside")).unwrap();
        });
        assert!(caught.is_err());
        let (a, b) = (cpu_float(&[2, 2]), cpu_float(&[2, 2]));
        assert_eq!(a.matmul(&b).kind(), tch::Kind::Float);
    }

    #[test]
    fn float32_is_not_an_autocast_dtype() {
        let err = autocast(Device::Cpu, DType::F32, || ()).unwrap_err();
        assert!(
            err.to_string().contains("bfloat16 or float16, not float32"),
            "{err}"
        );
    }
}
