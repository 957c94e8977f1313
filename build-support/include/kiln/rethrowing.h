// Shared by Kiln's C++ bridges to libtorch (kiln-torch's autocast, fused Adam and
// CUDA graphs): every build through kiln_build::TorchOps has this directory on its
// include path.
#pragma once

#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>

namespace kiln {

// Runs f, turning a c10::Error into a std::runtime_error without the C++ backtrace
// (cxx passes what() to Rust as the error's message).
template <typename F>
auto rethrowing(const char* what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    throw std::runtime_error(std::string(what) + ": " + e.what_without_backtrace());
  }
}

}  // namespace kiln
