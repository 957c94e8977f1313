// libtorch's tensor for the cxx bridges of every Kiln crate (src/cxx_tensor.rs):
// Rust's `kiln_torch::cxx_tensor::AtTensor` is this `at::Tensor`. The bridge there
// compiles the `std::unique_ptr<at::Tensor>` glue that `UniquePtr<Tensor>` needs.
#pragma once

#include <ATen/core/Tensor.h>
