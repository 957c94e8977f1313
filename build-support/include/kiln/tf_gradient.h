// TensorFlow gradient glue shared by Kiln's two kinds of TensorFlow op:
// kiln-fused-ops' C++ ops (cpp/src/tf/gradients.cc: one GradFunc per op) and the
// ops written in Rust (tf-backend/op/src/glue/gradient.cc: one generic GradFunc
// driven by a table). Both add one node of a gradient op to the graph and put a
// GradFunc into TensorFlow's C++ gradient registry (`ops::GradOpRegistry`, in
// libtensorflow_cc.so.2), which `TF_AddGradients` (the `tensorflow` crate's
// `Graph::add_gradients`) consults; the C API cannot do either. Every build
// through kiln_build::TfOps has this directory on its include path.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "tensorflow/cc/framework/grad_op_registry.h"
#include "tensorflow/cc/framework/gradients.h"
#include "tensorflow/cc/framework/ops.h"
#include "tensorflow/cc/framework/scope.h"
#include "tensorflow/core/framework/node_def.pb.h"
#include "tensorflow/core/graph/graph.h"
#include "tensorflow/core/graph/node_builder.h"

namespace kiln::tf_gradient {

// Attribute name and value, as a node's definition holds them.
using Attrs = std::vector<std::pair<std::string, tensorflow::AttrValue>>;

// The attributes of `op`'s node that its op declares (`T`, `label_smoothing`, ...),
// without TensorFlow's internal ones (`_class`, ...): what a gradient op that
// declares the same attributes is given.
inline Attrs forward_attrs(const tensorflow::Operation& op) {
  Attrs attrs;
  for (const auto& [name, value] : op.node()->def().attr()) {
    if (!name.empty() && name[0] != '_') attrs.emplace_back(name, value);
  }
  return attrs;
}

// Adds one `op_type` node fed by `inputs` with `attrs` and appends its first
// `num_outputs` outputs to `outputs`. Errors are recorded in `scope`, as
// TensorFlow's generated op wrappers do, and returned.
inline absl::Status add_node(const tensorflow::Scope& scope, const std::string& op_type,
                             const std::vector<tensorflow::Output>& inputs, const Attrs& attrs,
                             int num_outputs, std::vector<tensorflow::Output>* outputs) {
  if (!scope.ok()) return scope.status();
  tensorflow::NodeBuilder builder(scope.GetUniqueNameForOp(op_type), op_type);
  for (const tensorflow::Output& input : inputs) builder.Input(input.node(), input.index());
  for (const auto& [name, value] : attrs) builder.Attr(name, value);
  scope.UpdateBuilder(&builder);
  tensorflow::Node* node = nullptr;
  scope.UpdateStatus(builder.Finalize(scope.graph(), &node));
  if (!scope.ok()) return scope.status();
  scope.UpdateStatus(scope.DoShapeInference(node));
  if (!scope.ok()) return scope.status();
  for (int i = 0; i < num_outputs; ++i) outputs->emplace_back(node, i);
  return absl::OkStatus();
}

// What register_gradient did.
enum class Registration { kAdded, kAlreadyRegistered, kRefused };

// Puts `grad` into the gradient registry as the gradient of `op_type`, unless the
// op type already has one: GradOpRegistry::Register CHECK-fails (aborts the
// process) on a duplicate, so the caller decides what an existing one means.
inline Registration register_gradient(const std::string& op_type,
                                      tensorflow::ops::GradFunc grad) {
  auto* registry = tensorflow::ops::GradOpRegistry::Global();
  tensorflow::ops::GradFunc existing = nullptr;
  if (registry->Lookup(op_type, &existing).ok()) return Registration::kAlreadyRegistered;
  return registry->Register(op_type, grad) ? Registration::kAdded : Registration::kRefused;
}

}  // namespace kiln::tf_gradient
