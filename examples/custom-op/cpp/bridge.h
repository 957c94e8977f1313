// Step 3: what Rust calls (declared in src/ffi.rs; cxx checks the signatures).
#pragma once

#include <memory>

#include <ATen/core/Tensor.h>

namespace example {

// torch.ops.example.squared_relu(x) through the dispatcher (autograd included);
// returns a new tensor the caller owns (Rust's UniquePtr<Tensor>); errors are
// thrown as std::runtime_error.
std::unique_ptr<at::Tensor> squared_relu(const at::Tensor& x);

}  // namespace example
