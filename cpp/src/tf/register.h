// Registration of Kiln's fused ops with TensorFlow (see src/tf_ops.cc), as the cxx
// bridge in src/tf.rs sees it. This header names no TensorFlow type, so the
// bridge compiles without TensorFlow's include tree.
#pragma once

namespace kiln::ops::tf {

// Registers the ops, their CPU kernels and their gradients once per process (the
// first call, or the library's static initialiser, does the work; later calls
// report its outcome). Throws std::runtime_error with TensorFlow's message when
// registration failed. Ops that another library already registered are left as
// they are: registering twice never aborts.
void register_tf_ops();

// Runs the registration again, past the once-per-process guard, as a second copy
// of these ops in the process would: it must find everything registered and
// leave it alone. For tests.
void register_tf_ops_again();

}  // namespace kiln::ops::tf
