//! The fused ops on libtorch tensors, with autograd (`backward()` flows through them).

use kiln_core::Result;
use tch::Tensor;

use crate::bridge::ffi;
use crate::cxx_error;

/// The shared library holding the `kiln` ops for Python:
/// `torch.ops.load_library(kiln_ops::TORCH_LIBRARY)` makes them
/// `torch.ops.kiln.bias_gelu`, `torch.ops.kiln.softmax_xent` and `torch.ops.kiln.swish`.
pub const TORCH_LIBRARY: &str = env!("KILN_OPS_TORCH_LIBRARY");

/// Makes sure the `kiln` ops are registered with libtorch in this process (they
/// register when the library loads; this keeps the linker from dropping them).
/// Call it before loading a TorchScript model that uses `torch.ops.kiln.*`.
pub fn register() -> bool {
    ffi::torch_ops_registered() == 1
}

/// Wraps a tensor the bridge returned.
fn adopt(
    op: &str,
    result: std::result::Result<*mut ffi::Tensor, cxx::Exception>,
) -> Result<Tensor> {
    let ptr = result.map_err(|e| cxx_error(op, e))?;
    // SAFETY: the C++ side returned `new at::Tensor(...)`, which is what a tch
    // `C_tensor` pointer is; the new `Tensor` owns it and frees it with `delete`.
    #[allow(unsafe_code)]
    Ok(unsafe { Tensor::from_ptr(ptr.cast()) })
}

fn raw(t: &Tensor) -> *const ffi::Tensor {
    t.as_ptr().cast()
}

/// `gelu(x + bias)` (exact GELU) as one kernel; `bias` has `x`'s last dimension.
/// float32 or float64, CPU or CUDA; differentiable in `x` and `bias`.
///
/// ```no_run
/// let x = tch::Tensor::randn([4, 8], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
/// let b = tch::Tensor::zeros([8], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
/// let y = kiln_ops::bias_gelu(&x, &b)?;
/// y.sum(tch::Kind::Float).backward();
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn bias_gelu(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    // SAFETY: both pointers are live `at::Tensor`s borrowed for the call.
    #[allow(unsafe_code)]
    let result = unsafe { ffi::bias_gelu(raw(x), raw(bias)) };
    adopt("bias_gelu", result)
}

/// Per-row softmax cross-entropy with label smoothing, as one kernel:
/// `logits [N, C]`, int64 `target [N]`, result `[N]` (take its mean for
/// `F.cross_entropy(logits, target, label_smoothing=...)`). Differentiable in `logits`.
pub fn softmax_cross_entropy(
    logits: &Tensor,
    target: &Tensor,
    label_smoothing: f64,
) -> Result<Tensor> {
    // SAFETY: both pointers are live `at::Tensor`s borrowed for the call.
    #[allow(unsafe_code)]
    let result = unsafe { ffi::softmax_xent(raw(logits), raw(target), label_smoothing) };
    adopt("softmax_xent", result)
}

/// Swish-β, `x * sigmoid(beta * x)`, with a learned one-element `beta`;
/// differentiable in `x` and `beta`.
pub fn swish(x: &Tensor, beta: &Tensor) -> Result<Tensor> {
    // SAFETY: both pointers are live `at::Tensor`s borrowed for the call.
    #[allow(unsafe_code)]
    let result = unsafe { ffi::swish(raw(x), raw(beta)) };
    adopt("swish", result)
}
