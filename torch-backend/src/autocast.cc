// The C++ side of src/autocast.rs (see include/autocast.h).

#include "kiln-torch/include/autocast.h"

#include <stdexcept>
#include <string>

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

#include "kiln/rethrowing.h"

#include "kiln-torch/src/autocast.rs.h"

namespace kiln::torch {
namespace {

c10::DeviceType device_from_code(std::int8_t code) {
  const auto device = static_cast<c10::DeviceType>(code);
  if (!at::autocast::is_autocast_available(device)) {
    throw std::invalid_argument("autocast is not available for device type " +
                                c10::DeviceTypeName(device, /*lower_case=*/true));
  }
  return device;
}

}  // namespace

AutocastState autocast_enter(std::int8_t device_type, std::int8_t dtype) {
  return rethrowing("entering autocast", [&] {
    const auto device = device_from_code(device_type);
    const auto scalar = static_cast<c10::ScalarType>(dtype);
    if (scalar != at::kBFloat16 && scalar != at::kHalf) {
      throw std::invalid_argument(std::string("autocast runs in bfloat16 or float16, not ") +
                                  c10::toString(scalar));
    }
    AutocastState previous{at::autocast::is_autocast_enabled(device),
                           static_cast<std::int8_t>(at::autocast::get_autocast_dtype(device)),
                           at::autocast::is_autocast_cache_enabled()};
    at::autocast::set_autocast_enabled(device, true);
    at::autocast::set_autocast_dtype(device, scalar);
    at::autocast::increment_nesting();
    at::autocast::set_autocast_cache_enabled(true);
    return previous;
  });
}

void autocast_exit(std::int8_t device_type, const AutocastState& previous) {
  rethrowing("leaving autocast", [&] {
    const auto device = device_from_code(device_type);
    if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    at::autocast::set_autocast_enabled(device, previous.enabled);
    at::autocast::set_autocast_dtype(device, static_cast<c10::ScalarType>(previous.dtype));
    at::autocast::set_autocast_cache_enabled(previous.cache_enabled);
  });
}

}  // namespace kiln::torch
