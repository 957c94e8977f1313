#include "kiln-fused-ops/include/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <limits>
#include <memory>
#include <stdexcept>
#include <string>

namespace kiln::ops {

std::int32_t cxx11_abi() { return _GLIBCXX_USE_CXX11_ABI; }

std::int64_t checked_numel(rust::Slice<const std::int64_t> dims) {
  std::int64_t numel = 1;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    const std::int64_t d = dims[i];
    if (d < 0) {
      throw std::invalid_argument("dimension " + std::to_string(i) + " is " +
                                  std::to_string(d) + ", expected >= 0");
    }
    if (d != 0 && numel > std::numeric_limits<std::int64_t>::max() / d) {
      throw std::overflow_error("element count overflows int64 at dimension " +
                                std::to_string(i));
    }
    numel *= d;
  }
  return numel;
}

namespace {

c10::OperatorHandle find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Runs `f`, returning its tensor on the heap; libtorch's errors lose their backtrace.
template <typename F>
std::unique_ptr<at::Tensor> owned(F&& f) {
  try {
    return std::make_unique<at::Tensor>(f());
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  }
}

}  // namespace

std::unique_ptr<at::Tensor> bias_gelu(const at::Tensor& x, const at::Tensor& bias) {
  return owned([&] {
    static auto op =
        find("kiln::bias_gelu").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    return op.call(x, bias);
  });
}

std::unique_ptr<at::Tensor> softmax_xent(const at::Tensor& logits, const at::Tensor& target,
                                         double label_smoothing) {
  return owned([&] {
    static auto op = find("kiln::softmax_xent")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
    return op.call(logits, target, label_smoothing);
  });
}

std::unique_ptr<at::Tensor> swish(const at::Tensor& x, const at::Tensor& beta) {
  return owned([&] {
    static auto op = find("kiln::swish").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    return op.call(x, beta);
  });
}

}  // namespace kiln::ops
