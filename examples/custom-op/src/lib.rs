//! Adding a custom op to Kiln from scratch: squared ReLU (`max(x, 0)^2`), a C++
//! kernel with its gradient, bridged with cxx and usable from Rust (autograd
//! included), TorchScript and Python.
//!
//! The four steps, each in its own file: `build.rs` (compile with kiln-build),
//! `cpp/squared_relu.cc` (kernel, gradient, `TORCH_LIBRARY`), `cpp/bridge.{h,cc}`
//! and `src/ffi.rs` (the bridge), and this file (the safe Rust API).

mod ffi;

use kiln_core::{Error, Result};
use tch::Tensor;

/// The shared library for Python: `torch.ops.load_library(LIBRARY)` gives
/// `torch.ops.example.squared_relu`.
pub const LIBRARY: &str = env!("SQUARED_RELU_LIBRARY");

/// Step 4: the safe API. `max(x, 0)^2` for float32 or float64 `x`, differentiable.
pub fn squared_relu(x: &Tensor) -> Result<Tensor> {
    // SAFETY: `x` is a live tensor borrowed for the call; tch's `C_tensor` is an `at::Tensor`.
    #[allow(unsafe_code)]
    let result = unsafe { ffi::bridge::squared_relu(x.as_ptr().cast()) };
    let ptr = result.map_err(|e| Error::backend("example", "squared_relu", e.what()))?;
    // SAFETY: the C++ side returned `new at::Tensor(...)`; the new `Tensor` owns it.
    #[allow(unsafe_code)]
    Ok(unsafe { Tensor::from_ptr(ptr.cast()) })
}
