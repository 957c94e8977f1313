// The CUDA kernels of Kiln's fused ops, as host-side launchers on raw device
// buffers (contiguous, row-major). Defined in kernels.cu (compiled by nvcc) for
// T = float and double; called by the libtorch wrappers in ../cuda_ops.cc
// (compiled by the host C++ compiler), which own the tensors, the checks and
// the device guard. Every launcher enqueues on `stream` and returns without
// synchronising; a failed launch throws c10::Error (C10_CUDA_KERNEL_LAUNCH_CHECK).
//
// The formulas are those of include/kernels.h (the CPU kernels).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kiln::ops::cuda {

// y = gelu(x + bias[col]) (exact, erf), x and y [rows, cols].
template <typename T>
void bias_gelu_forward(const T* x, const T* bias, T* y, std::int64_t rows, std::int64_t cols,
                       cudaStream_t stream);

// Rows of x per partial sum of dbias: the backward needs a workspace of
// bias_gelu_backward_chunks(rows, cols) * cols elements of T.
std::int64_t bias_gelu_backward_chunks(std::int64_t rows, std::int64_t cols);

// dx = dy * gelu'(x + bias); dbias[j] = sum_i dx[i, j] (deterministic: partial sums
// per chunk of rows in `workspace`, then one ordered sum per column). rows > 0.
template <typename T>
void bias_gelu_backward(const T* dy, const T* x, const T* bias, T* dx, T* dbias,
                        T* workspace, std::int64_t rows, std::int64_t cols,
                        cudaStream_t stream);

// loss[i] = logsumexp(z_i) - (1 - eps) z_i[t_i] - eps mean_j z_ij. A row whose
// target is outside [0, c) gets NaN and lowers *first_bad_row (initialised by the
// caller to n) to its index, so the caller can report it like the CPU op does.
template <typename T>
void softmax_xent_forward(const T* logits, const std::int64_t* target, T eps, T* loss,
                          std::int64_t n, std::int64_t c,
                          unsigned long long* first_bad_row, cudaStream_t stream);

// dlogits[i, j] = dloss[i] * (softmax(z_i)_j - q_ij); NaN rows for out-of-range
// targets (the forward has already refused them).
template <typename T>
void softmax_xent_backward(const T* dloss, const T* logits, const std::int64_t* target, T eps,
                           T* dlogits, std::int64_t n, std::int64_t c, cudaStream_t stream);

// y = x * sigmoid(beta[0] x), n elements.
template <typename T>
void swish_forward(const T* x, const T* beta, T* y, std::int64_t n, cudaStream_t stream);

// Blocks of the swish backward: it needs a workspace of swish_backward_blocks(n)
// elements of T (one partial sum of dbeta per block).
std::int64_t swish_backward_blocks(std::int64_t n);

// dx = dy * (s + beta x s (1 - s)); dbeta[0] = sum dy x^2 s (1 - s), s = sigmoid(beta x),
// deterministic (per-block partial sums, then one block sums them in order). n > 0.
template <typename T>
void swish_backward(const T* dy, const T* x, const T* beta, T* dx, T* dbeta, T* workspace,
                    std::int64_t n, cudaStream_t stream);

}  // namespace kiln::ops::cuda
