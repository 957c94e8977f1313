// The TensorFlow side, as Rust sees it (declared in src/tf_ffi.rs). Names no
// TensorFlow type, so the bridge compiles without TensorFlow's headers.
#pragma once

namespace example {

// Registers the ops ExampleSquaredRelu and ExampleSquaredReluGrad, their CPU
// kernels (float, double) and the gradient of ExampleSquaredRelu, skipping whatever
// is already registered (by an earlier call, or another copy of this library):
// TensorFlow would abort on a duplicate. Any number of calls, from any thread.
// Throws std::runtime_error with TensorFlow's message when registration fails.
void register_tf_ops();

}  // namespace example
