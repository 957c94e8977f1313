#include "kiln-ops/include/ops.h"

#include <limits>
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

}  // namespace kiln::ops
