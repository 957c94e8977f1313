// Argument checks of Kiln's fused ops, shared by the libtorch front ends (the
// CPU wrappers in src/torch_ops.cc and the CUDA ones in src/cuda_ops.cc). Each failure is a c10::Error (TORCH_CHECK) whose message names the op
// and the argument, and comes back to Rust as an Err.
#pragma once

#include <ATen/ATen.h>

namespace kiln::ops::checks {

inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, "kiln::", op,
              ": ", name, " must be float32 or float64, got ", t.scalar_type());
}

inline void check_same(const char* op, const at::Tensor& a, const char* an, const at::Tensor& b,
                       const char* bn) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "kiln::", op, ": ", an, " is ",
              a.scalar_type(), " but ", bn, " is ", b.scalar_type());
  TORCH_CHECK(a.device() == b.device(), "kiln::", op, ": ", an, " is on ", a.device(), " but ",
              bn, " is on ", b.device());
}

inline void check_bias_gelu(const at::Tensor& x, const at::Tensor& bias) {
  check_float("bias_gelu", "x", x);
  check_same("bias_gelu", x, "x", bias, "bias");
  TORCH_CHECK(x.dim() >= 1 && bias.dim() == 1 && bias.size(0) == x.size(-1),
              "kiln::bias_gelu: bias must have shape [", (x.dim() >= 1 ? x.size(-1) : 0),
              "] (x's last dimension), got ", bias.sizes(), " for x of shape ", x.sizes());
}

inline void check_softmax_xent(const at::Tensor& logits, const at::Tensor& target, double eps) {
  check_float("softmax_xent", "logits", logits);
  TORCH_CHECK(logits.dim() == 2, "kiln::softmax_xent: logits must be [N, C], got shape ",
              logits.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong,
              "kiln::softmax_xent: target must be int64 class indices, got ",
              target.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0),
              "kiln::softmax_xent: target must have shape [", logits.size(0), "], got ",
              target.sizes());
  TORCH_CHECK(target.device() == logits.device(), "kiln::softmax_xent: target is on ",
              target.device(), " but logits are on ", logits.device());
  TORCH_CHECK(eps >= 0.0 && eps <= 1.0,
              "kiln::softmax_xent: label_smoothing must be in [0, 1], got ", eps);
}

inline void check_swish(const at::Tensor& x, const at::Tensor& beta) {
  check_float("swish", "x", x);
  check_same("swish", x, "x", beta, "beta");
  TORCH_CHECK(beta.numel() == 1, "kiln::swish: beta must have one element, got shape ",
              beta.sizes());
}

// The incoming gradient of a backward op: on the input's device (a kernel must
// never read memory of another device) and of the expected shape; its dtype is
// converted by the caller.
inline void check_grad(const char* op, const at::Tensor& grad, const at::Tensor& input,
                       const char* input_name, at::IntArrayRef expected) {
  TORCH_CHECK(grad.device() == input.device(), "kiln::", op, ": grad is on ", grad.device(),
              " but ", input_name, " is on ", input.device());
  TORCH_CHECK(grad.sizes() == expected, "kiln::", op, ": grad has shape ", grad.sizes(),
              ", expected ", expected);
}

}  // namespace kiln::ops::checks
