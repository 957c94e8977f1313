// Kiln's C++ ops. Every function that can throw is declared `Result<T>` in the
// cxx bridge (src/bridge.rs), so an exception comes back to Rust as an error.
#pragma once

#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>

#include "rust/cxx.h"

namespace kiln::ops {

// The _GLIBCXX_USE_CXX11_ABI value this library was compiled with; it must match
// libtorch's (1 for the torch 2.11 wheels) for C++ objects to cross between them.
std::int32_t cxx11_abi();

// Number of elements of a shape; throws std::invalid_argument for a negative
// dimension and std::overflow_error when the product does not fit in int64.
std::int64_t checked_numel(rust::Slice<const std::int64_t> dims);

// 1; calling it keeps the object file with the TORCH_LIBRARY registrations linked.
int torch_ops_registered();

// The `kiln::` ops through libtorch's dispatcher (CPU or CUDA kernel, autograd).
// They return a new tensor the caller owns (Rust's UniquePtr<Tensor>, which
// kiln_torch::cxx_tensor::from_at makes a tch::Tensor); a c10::Error becomes a
// std::runtime_error with the message (without libtorch's backtrace).
std::unique_ptr<at::Tensor> bias_gelu(const at::Tensor& x, const at::Tensor& bias);
std::unique_ptr<at::Tensor> softmax_xent(const at::Tensor& logits, const at::Tensor& target,
                                         double label_smoothing);
std::unique_ptr<at::Tensor> swish(const at::Tensor& x, const at::Tensor& beta);

}  // namespace kiln::ops
