// Kiln's declarations of Gloo's API (see ../README.md).
#pragma once

#include <chrono>

namespace gloo {

// A set of connections to the other ranks. Only held by std::shared_ptr in
// libtorch's headers; made and destroyed inside libtorch_cpu.so.
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};

}  // namespace gloo
