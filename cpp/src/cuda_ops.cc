// Kiln's fused ops on CUDA tensors: libtorch wrappers around the kernels of
// cuda/kernels.cu, registered for the `kiln` ops' CUDA dispatch key. The autograd
// functions of torch_ops.cc call the ops through the dispatcher, so autograd,
// TorchScript and the Rust API work on CUDA tensors through these.
//
// Compiled only with kiln-fused-ops' `cuda` feature, by the host C++ compiler (the
// kernels by nvcc). Like torch_ops.cc it has no Rust dependency: the same object
// links into the shared library Python loads.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../include/checks.h"
#include "cuda/launch.h"

namespace kiln::ops {
namespace {

using namespace checks;

// Every tensor of an op is on one CUDA device (the checks say so); kernels run
// on that device, on its current stream.
cudaStream_t stream_of(const at::Tensor& t) {
  return at::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// ----- bias + GELU -----

at::Tensor bias_gelu_cuda(const at::Tensor& x, const at::Tensor& bias) {
  check_bias_gelu(x, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous();
  const auto bc = bias.contiguous();
  auto y = at::empty_like(xc);
  const std::int64_t cols = bias.size(0);
  const std::int64_t rows = cols == 0 ? 0 : xc.numel() / cols;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "kiln::bias_gelu (CUDA)", [&] {
    cuda::bias_gelu_forward<scalar_t>(xc.data_ptr<scalar_t>(), bc.data_ptr<scalar_t>(),
                                      y.data_ptr<scalar_t>(), rows, cols, stream_of(x));
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward_cuda(const at::Tensor& grad,
                                                           const at::Tensor& x,
                                                           const at::Tensor& bias) {
  check_bias_gelu(x, bias);
  check_grad("bias_gelu_backward", grad, x, "x", x.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  const auto gc = grad.contiguous().to(x.scalar_type());
  const auto xc = x.contiguous();
  const auto bc = bias.contiguous();
  auto dx = at::empty_like(xc);
  const std::int64_t cols = bias.size(0);
  const std::int64_t rows = cols == 0 ? 0 : xc.numel() / cols;
  if (rows == 0) return {dx, at::zeros_like(bc)};
  auto db = at::empty_like(bc);
  auto workspace = at::empty({cuda::bias_gelu_backward_chunks(rows, cols), cols}, bc.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "kiln::bias_gelu_backward (CUDA)", [&] {
    cuda::bias_gelu_backward<scalar_t>(gc.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(),
                                       bc.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(),
                                       db.data_ptr<scalar_t>(), workspace.data_ptr<scalar_t>(),
                                       rows, cols, stream_of(x));
  });
  return {dx, db};
}

// ----- softmax cross-entropy with label smoothing -----

// The CPU op refuses a target outside [0, C) before computing anything. Here the
// kernel flags such rows on the device, and the one synchronisation this costs
// (reading back the first bad row) buys the same error instead of a device-side
// assert, which would leave the CUDA context unusable for the rest of the process.
at::Tensor softmax_xent_cuda(const at::Tensor& logits, const at::Tensor& target, double eps) {
  check_softmax_xent(logits, target, eps);
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto lc = logits.contiguous();
  const auto tc = target.contiguous();
  const std::int64_t n = lc.size(0);
  const std::int64_t c = lc.size(1);
  auto loss = at::empty({n}, logits.options());
  if (n == 0) return loss;
  // unsigned long long for atomicMin; stored in an int64 tensor (n < 2^63).
  auto first_bad = at::full({1}, n, target.options());
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "kiln::softmax_xent (CUDA)", [&] {
    cuda::softmax_xent_forward<scalar_t>(
        lc.data_ptr<scalar_t>(), tc.data_ptr<std::int64_t>(), static_cast<scalar_t>(eps),
        loss.data_ptr<scalar_t>(), n, c,
        reinterpret_cast<unsigned long long*>(first_bad.data_ptr<std::int64_t>()),
        stream_of(logits));
  });
  const std::int64_t row = first_bad.item<std::int64_t>();
  if (row < n) {
    const std::int64_t value = tc[row].item<std::int64_t>();
    TORCH_CHECK_INDEX(false, "kiln::softmax_xent: target ", value, " at row ", row,
                      " is outside [0, ", c, ")");
  }
  return loss;
}

at::Tensor softmax_xent_backward_cuda(const at::Tensor& grad, const at::Tensor& logits,
                                      const at::Tensor& target, double eps) {
  check_softmax_xent(logits, target, eps);
  check_grad("softmax_xent_backward", grad, logits, "logits", {logits.size(0)});
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto gc = grad.contiguous().to(logits.scalar_type());
  const auto lc = logits.contiguous();
  const auto tc = target.contiguous();
  auto dlogits = at::empty_like(lc);
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "kiln::softmax_xent_backward (CUDA)", [&] {
    cuda::softmax_xent_backward<scalar_t>(
        gc.data_ptr<scalar_t>(), lc.data_ptr<scalar_t>(), tc.data_ptr<std::int64_t>(),
        static_cast<scalar_t>(eps), dlogits.data_ptr<scalar_t>(), lc.size(0), lc.size(1),
        stream_of(logits));
  });
  return dlogits;
}

// ----- Swish-beta -----

at::Tensor swish_cuda(const at::Tensor& x, const at::Tensor& beta) {
  check_swish(x, beta);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous();
  const auto bc = beta.contiguous();
  auto y = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "kiln::swish (CUDA)", [&] {
    cuda::swish_forward<scalar_t>(xc.data_ptr<scalar_t>(), bc.data_ptr<scalar_t>(),
                                  y.data_ptr<scalar_t>(), xc.numel(), stream_of(x));
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> swish_backward_cuda(const at::Tensor& grad,
                                                       const at::Tensor& x,
                                                       const at::Tensor& beta) {
  check_swish(x, beta);
  check_grad("swish_backward", grad, x, "x", x.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  const auto gc = grad.contiguous().to(x.scalar_type());
  const auto xc = x.contiguous();
  const auto bc = beta.contiguous();
  auto dx = at::empty_like(xc);
  const std::int64_t n = xc.numel();
  if (n == 0) return {dx, at::zeros_like(bc)};
  auto db = at::empty_like(bc);
  auto workspace = at::empty({cuda::swish_backward_blocks(n)}, bc.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "kiln::swish_backward (CUDA)", [&] {
    cuda::swish_backward<scalar_t>(gc.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(),
                                   bc.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(),
                                   db.data_ptr<scalar_t>(), workspace.data_ptr<scalar_t>(), n,
                                   stream_of(x));
  });
  return {dx, db};
}

}  // namespace
}  // namespace kiln::ops

TORCH_LIBRARY_IMPL(kiln, CUDA, m) {
  m.impl("bias_gelu", &kiln::ops::bias_gelu_cuda);
  m.impl("bias_gelu_backward", &kiln::ops::bias_gelu_backward_cuda);
  m.impl("softmax_xent", &kiln::ops::softmax_xent_cuda);
  m.impl("softmax_xent_backward", &kiln::ops::softmax_xent_backward_cuda);
  m.impl("swish", &kiln::ops::swish_cuda);
  m.impl("swish_backward", &kiln::ops::swish_backward_cuda);
}
