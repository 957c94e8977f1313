// Autocast (include/autocast.h): libtorch's `at::autocast` state for one device
// type on the calling thread, entered and restored as Python's `torch.autocast`
// does. tch 0.24 exposes only the CUDA float16 switch; bfloat16, and CPU autocast,
// need these.
#pragma once

#include <cstdint>

namespace kiln::torch {

// Defined by the cxx bridge (src/autocast.rs).
struct AutocastState;

// Turns autocast on for `device_type` (c10::DeviceType's code) with
// `dtype` (c10::ScalarType's code) on this thread, and returns the state to
// restore. Throws std::runtime_error on an invalid device type or dtype.
AutocastState autocast_enter(std::int8_t device_type, std::int8_t dtype);

// Leaves an autocast region entered by autocast_enter: clears the cast cache
// when it was the outermost, and restores `previous`.
void autocast_exit(std::int8_t device_type, const AutocastState& previous);

}  // namespace kiln::torch
