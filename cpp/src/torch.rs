//! The fused ops on libtorch tensors, with autograd (`backward()` flows through them).

use kiln_core::Result;
use kiln_torch::cxx_tensor::{as_at, from_at};
use tch::Tensor;

use crate::bridge::ffi;
use crate::cxx_error;

/// The shared library holding the `kiln` ops for Python:
/// `torch.ops.load_library(kiln_fused_ops::TORCH_LIBRARY)` makes them
/// `torch.ops.kiln.bias_gelu`, `torch.ops.kiln.softmax_xent` and `torch.ops.kiln.swish`.
pub const TORCH_LIBRARY: &str = env!("KILN_FUSED_OPS_TORCH_LIBRARY");

/// Makes sure the `kiln` ops are registered with libtorch in this process (they
/// register when the library loads; this keeps the linker from dropping them).
/// Call it before loading a TorchScript model that uses `torch.ops.kiln.*`.
pub fn register() -> bool {
    ffi::torch_ops_registered() == 1
}

/// Wraps a tensor the bridge returned.
fn adopt(
    op: &str,
    result: std::result::Result<cxx::UniquePtr<ffi::Tensor>, cxx::Exception>,
) -> Result<Tensor> {
    from_at(result.map_err(|e| cxx_error(op, e))?)
}

/// `gelu(x + bias)` (exact GELU) as one kernel; `bias` has `x`'s last dimension.
/// float32 or float64, CPU or CUDA; differentiable in `x` and `bias`.
///
/// ```no_run
/// let x = tch::Tensor::randn([4, 8], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
/// let b = tch::Tensor::zeros([8], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
/// let y = kiln_fused_ops::bias_gelu(&x, &b)?;
/// y.sum(tch::Kind::Float).backward();
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn bias_gelu(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    adopt("bias_gelu", ffi::bias_gelu(as_at(x), as_at(bias)))
}

/// Per-row softmax cross-entropy with label smoothing, as one kernel:
/// `logits [N, C]`, int64 `target [N]`, result `[N]` (take its mean for
/// `F.cross_entropy(logits, target, label_smoothing=...)`). Differentiable in `logits`.
pub fn softmax_cross_entropy(
    logits: &Tensor,
    target: &Tensor,
    label_smoothing: f64,
) -> Result<Tensor> {
    adopt(
        "softmax_xent",
        ffi::softmax_xent(as_at(logits), as_at(target), label_smoothing),
    )
}

/// Swish-β, `x * sigmoid(beta * x)`, with a learned one-element `beta`;
/// differentiable in `x` and `beta`.
pub fn swish(x: &Tensor, beta: &Tensor) -> Result<Tensor> {
    adopt("swish", ffi::swish(as_at(x), as_at(beta)))
}
