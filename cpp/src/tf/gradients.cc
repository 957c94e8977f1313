// Gradients of the Kiln ops for TensorFlow's symbolic differentiation
// (`TF_AddGradients` -> `tensorflow::AddSymbolicGradients`), registered in the C++
// gradient registry (`tensorflow::ops::GradOpRegistry`, in libtensorflow_cc.so.2).
// Each gradient is one node of the matching `Kiln*Grad` op, whose kernel runs the
// backward math of include/kernels.h. Compiled against the wheel's C++ headers
// with its flags (`tf.sysconfig.get_compile_flags()`); see kiln_build::TfOps.

#include "gradients.h"

#include <string>
#include <vector>

#include "tensorflow/cc/framework/grad_op_registry.h"
#include "tensorflow/cc/framework/gradients.h"
#include "tensorflow/cc/framework/ops.h"
#include "tensorflow/cc/framework/scope.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/graph/graph.h"
#include "tensorflow/core/graph/node_builder.h"

namespace kiln::ops::tf {
namespace {

using tensorflow::Operation;
using tensorflow::Output;
using tensorflow::Scope;

// Adds one `op_type` node fed by `inputs`, with the attributes `attrs` copied from
// the forward node `forward`, and returns its `num_outputs` outputs. Errors are
// recorded in `scope` (as generated `tensorflow::ops` wrappers do) and returned.
absl::Status add_backward_node(const Scope& scope, const char* op_type, const Operation& forward,
                               const std::vector<Output>& inputs,
                               const std::vector<const char*>& attrs, int num_outputs,
                               std::vector<Output>* outputs) {
  if (!scope.ok()) return scope.status();
  tensorflow::NodeBuilder builder(scope.GetUniqueNameForOp(op_type), op_type);
  for (const Output& input : inputs) {
    builder.Input(input.node(), input.index());
  }
  const tensorflow::AttrSlice forward_attrs = forward.node()->attrs();
  for (const char* name : attrs) {
    const tensorflow::AttrValue* value = forward_attrs.Find(name);
    if (value == nullptr) {
      return absl::InvalidArgumentError(std::string("kiln: ") + forward.node()->type_string() +
                                        " node " + forward.node()->name() +
                                        " has no attribute " + name);
    }
    builder.Attr(name, *value);
  }
  scope.UpdateBuilder(&builder);
  tensorflow::Node* node = nullptr;
  scope.UpdateStatus(builder.Finalize(scope.graph(), &node));
  if (!scope.ok()) return scope.status();
  scope.UpdateStatus(scope.DoShapeInference(node));
  if (!scope.ok()) return scope.status();
  for (int i = 0; i < num_outputs; ++i) outputs->emplace_back(node, i);
  return absl::OkStatus();
}

// d/dx and d/dbias of gelu(x + bias).
absl::Status bias_gelu_grad(const Scope& scope, const Operation& op,
                            const std::vector<Output>& grad_inputs,
                            std::vector<Output>* grad_outputs) {
  return add_backward_node(scope, "KilnBiasGeluGrad", op,
                           {grad_inputs.at(0), op.input(0), op.input(1)}, {"T"}, 2,
                           grad_outputs);
}

// d/dlogits; the integer target has none.
absl::Status softmax_xent_grad(const Scope& scope, const Operation& op,
                               const std::vector<Output>& grad_inputs,
                               std::vector<Output>* grad_outputs) {
  const absl::Status status =
      add_backward_node(scope, "KilnSoftmaxXentGrad", op,
                        {grad_inputs.at(0), op.input(0), op.input(1)},
                        {"T", "label_smoothing"}, 1, grad_outputs);
  if (status.ok()) grad_outputs->push_back(tensorflow::NoGradient());
  return status;
}

// d/dx and d/dbeta of x * sigmoid(beta * x).
absl::Status swish_grad(const Scope& scope, const Operation& op,
                        const std::vector<Output>& grad_inputs,
                        std::vector<Output>* grad_outputs) {
  return add_backward_node(scope, "KilnSwishGrad", op,
                           {grad_inputs.at(0), op.input(0), op.input(1)}, {"T"}, 2,
                           grad_outputs);
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
  auto* registry = tensorflow::ops::GradOpRegistry::Global();
  for (const Entry& entry : entries) {
    tensorflow::ops::GradFunc existing = nullptr;
    // Register() CHECK-fails (aborts) on a duplicate: another copy of these ops
    // in the process (a second library linking kiln-fused-ops) keeps its gradient.
    if (registry->Lookup(entry.op, &existing).ok()) continue;
    if (!registry->Register(entry.op, entry.grad)) {
      return std::string("kiln: could not register the gradient of ") + entry.op;
    }
  }
  return {};
}

}  // namespace kiln::ops::tf
