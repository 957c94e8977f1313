// Gradients of the Kiln ops for TensorFlow's symbolic differentiation
// (`TF_AddGradients` -> `tensorflow::AddSymbolicGradients`), registered in the C++
// gradient registry (`tensorflow::ops::GradOpRegistry`, in libtensorflow_cc.so.2).
// Each gradient is one node of the matching `Kiln*Grad` op, whose kernel runs the
// backward math of include/kernels.h; adding the node and registering go through
// kiln/tf_gradient.h (build-support/include), shared with kiln-tf-op. Compiled
// against the wheel's C++ headers with its flags (`tf.sysconfig.get_compile_flags()`);
// see kiln_build::TfOps.

#include "gradients.h"

#include <string>
#include <vector>

#include "kiln/tf_gradient.h"

namespace kiln::ops::tf {
namespace {

using tensorflow::Operation;
using tensorflow::Output;
using tensorflow::Scope;
using tf_gradient::add_node;
using tf_gradient::forward_attrs;

// d/dx and d/dbias of gelu(x + bias).
absl::Status bias_gelu_grad(const Scope& scope, const Operation& op,
                            const std::vector<Output>& grad_inputs,
                            std::vector<Output>* grad_outputs) {
  return add_node(scope, "KilnBiasGeluGrad", {grad_inputs.at(0), op.input(0), op.input(1)},
                  forward_attrs(op), 2, grad_outputs);
}

// d/dlogits; the integer target has none.
absl::Status softmax_xent_grad(const Scope& scope, const Operation& op,
                               const std::vector<Output>& grad_inputs,
                               std::vector<Output>* grad_outputs) {
  const absl::Status status =
      add_node(scope, "KilnSoftmaxXentGrad", {grad_inputs.at(0), op.input(0), op.input(1)},
               forward_attrs(op), 1, grad_outputs);
  if (status.ok()) grad_outputs->push_back(tensorflow::NoGradient());
  return status;
}

// d/dx and d/dbeta of x * sigmoid(beta * x).
absl::Status swish_grad(const Scope& scope, const Operation& op,
                        const std::vector<Output>& grad_inputs,
                        std::vector<Output>* grad_outputs) {
  return add_node(scope, "KilnSwishGrad", {grad_inputs.at(0), op.input(0), op.input(1)},
                  forward_attrs(op), 2, grad_outputs);
}

}  // namespace

std::string register_gradients() {
  struct Entry {
    const char* op;
    tensorflow::ops::GradFunc grad;
  };
  const Entry entries[] = {
      {"KilnBiasGelu", &bias_gelu_grad},
      {"KilnSoftmaxXent", &softmax_xent_grad},
      {"KilnSwish", &swish_grad},
  };
  for (const Entry& entry : entries) {
    // Another copy of these ops in the process (a second library linking
    // kiln-fused-ops) keeps its gradient.
    if (tf_gradient::register_gradient(entry.op, entry.grad) ==
        tf_gradient::Registration::kRefused) {
      return std::string("kiln: could not register the gradient of ") + entry.op;
    }
  }
  return {};
}

}  // namespace kiln::ops::tf
