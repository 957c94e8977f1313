// Kiln's C++ ops. Every function that can throw is declared `Result<T>` in the
// cxx bridge (src/bridge.rs), so an exception comes back to Rust as an error.
#pragma once

#include <cstdint>
#include "rust/cxx.h"

namespace kiln::ops {

// The _GLIBCXX_USE_CXX11_ABI value this library was compiled with; it must match
// libtorch's (1 for the torch 2.11 wheels) for C++ objects to cross between them.
std::int32_t cxx11_abi();

// Number of elements of a shape; throws std::invalid_argument for a negative
// dimension and std::overflow_error when the product does not fit in int64.
std::int64_t checked_numel(rust::Slice<const std::int64_t> dims);

}  // namespace kiln::ops
