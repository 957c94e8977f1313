// Gradient functions of the Kiln ops in TensorFlow's C++ gradient registry, which
// `TF_AddGradients` (the `tensorflow` crate's `Graph::add_gradients`) consults.
// The C API has no way to register a gradient; this file is the one place where
// Kiln uses TensorFlow's C++ API (src/tf/gradients.cc).
#pragma once

#include <string>

namespace kiln::ops::tf {

// Registers the gradients of KilnBiasGelu, KilnSoftmaxXent and KilnSwish, skipping
// any op that already has one. Returns an empty string on success, else the error.
std::string register_gradients();

}  // namespace kiln::ops::tf
