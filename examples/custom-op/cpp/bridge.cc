#include "kiln-example-custom-op/cpp/bridge.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <stdexcept>

namespace example {

std::unique_ptr<at::Tensor> squared_relu(const at::Tensor& x) {
  try {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("example::squared_relu", "")
                         .typed<at::Tensor(const at::Tensor&)>();
    return std::make_unique<at::Tensor>(op.call(x));
  } catch (const c10::Error& e) {
    // cxx turns std::exception into Err on the Rust side; drop libtorch's backtrace.
    throw std::runtime_error(e.what_without_backtrace());
  }
}

}  // namespace example
