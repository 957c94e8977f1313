// The C++ half of kiln-tf-op (declared in kiln_tf_op.h): the parts of
// TensorFlow that its C API does not reach.
//
// - Gradients: TF_AddGradients (the `tensorflow` crate's `Graph::add_gradients`)
//   consults TensorFlow's C++ gradient registry (`ops::GradOpRegistry`, in
//   libtensorflow_cc.so.2), which holds plain function pointers. One generic
//   GradFunc serves every Rust op: it finds the op type's entry in a table and
//   adds one node of the gradient op, following kiln_custom_op::Saved's convention.
//   Adding the node and registering go through kiln/tf_gradient.h
//   (build-support/include), shared with kiln-fused-ops' C++ ops.
// - Whether an op type is registered (TF_RegisterOpDefinition aborts on a
//   duplicate once TensorFlow's op registry is initialised).
// - Attribute values in a shape function.
//
// Compiled with the wheel's flags by kiln_build::TfOps. No C++ exception leaves
// this file: the C functions catch everything and report it as a message, and
// the GradFunc turns it into an error status.

#include "kiln_tf_op.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kiln/tf_gradient.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace {

using tensorflow::Operation;
using tensorflow::Output;
using tensorflow::Scope;
using kiln::tf_gradient::add_node;

// What the gradient of one Rust op needs to know.
struct GradEntry {
  std::string grad_op_type;
  int n_inputs;
  int n_outputs;
  bool save_outputs;
};

std::mutex& table_mutex() {
  static std::mutex m;
  return m;
}

// Op type -> its gradient. Entries are never removed.
std::unordered_map<std::string, GradEntry>& table() {
  static auto* t = new std::unordered_map<std::string, GradEntry>();
  return *t;
}

// Copies `message` into `err` (at most `err_len` bytes with the NUL) and returns 1.
int fail(const std::string& message, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) {
    const size_t n = std::min(message.size(), err_len - 1);
    std::memcpy(err, message.data(), n);
    err[n] = '\0';
  }
  return 1;
}

absl::Status grad_body(const Scope& scope, const Operation& op,
                       const std::vector<Output>& grad_inputs,
                       std::vector<Output>* grad_outputs) {
  const std::string& type = op.node()->type_string();
  GradEntry entry;
  {
    std::lock_guard<std::mutex> lock(table_mutex());
    auto it = table().find(type);
    if (it == table().end()) {
      return absl::InternalError("kiln-tf-op: no gradient entry for op type " + type);
    }
    entry = it->second;
  }
  if (op.num_inputs() != entry.n_inputs || op.num_outputs() != entry.n_outputs ||
      static_cast<int>(grad_inputs.size()) != entry.n_outputs) {
    return absl::InvalidArgumentError(
        "kiln-tf-op: node " + op.node()->name() + " (" + type + ") has " +
        std::to_string(op.num_inputs()) + " inputs, " + std::to_string(op.num_outputs()) +
        " outputs and " + std::to_string(grad_inputs.size()) + " output gradients; its op was " +
        "registered with " + std::to_string(entry.n_inputs) + " inputs and " +
        std::to_string(entry.n_outputs) + " outputs");
  }
  std::vector<Output> inputs;
  for (int i = 0; i < entry.n_outputs; ++i) {
    if (grad_inputs[i].node() != nullptr) {
      inputs.push_back(grad_inputs[i]);
      continue;
    }
    // No gradient reached this output (nobody used it): zeros, as kiln_custom_op::Saved says.
    std::vector<Output> zeros;
    absl::Status s = add_node(scope, "ZerosLike",
                              {op.output(i)}, {}, 1, &zeros);
    if (!s.ok()) return s;
    inputs.push_back(zeros[0]);
  }
  for (int i = 0; i < entry.n_inputs; ++i) inputs.push_back(op.input(i));
  if (entry.save_outputs) {
    for (int i = 0; i < entry.n_outputs; ++i) inputs.push_back(op.output(i));
  }
  return add_node(scope, entry.grad_op_type, inputs, kiln::tf_gradient::forward_attrs(op),
                  entry.n_inputs, grad_outputs);
}

// The one GradFunc of every Rust op with a gradient.
absl::Status generic_grad(const Scope& scope, const Operation& op,
                          const std::vector<Output>& grad_inputs,
                          std::vector<Output>* grad_outputs) {
  try {
    return grad_body(scope, op, grad_inputs, grad_outputs);
  } catch (const std::exception& e) {
    return absl::InternalError(std::string("kiln-tf-op: building a gradient: ") + e.what());
  } catch (...) {
    return absl::InternalError("kiln-tf-op: building a gradient: unknown C++ exception");
  }
}

}  // namespace

namespace {

// TensorFlow's own C API (tensorflow/c/ops.cc) passes the InferenceContext as
// this opaque pointer; the cast back is the one it makes.
tensorflow::shape_inference::InferenceContext* inference_context(TF_ShapeInferenceContext* ctx) {
  return reinterpret_cast<tensorflow::shape_inference::InferenceContext*>(ctx);
}

}  // namespace

extern "C" int kiln_tf_op_is_registered(const char* op_type) {
  try {
    return tensorflow::OpRegistry::Global()->LookUp(op_type) != nullptr ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

extern "C" int kiln_tf_op_register_gradient(const char* op_type, const char* grad_op_type,
                                            int n_inputs, int n_outputs, int save_outputs,
                                            char* err, size_t err_len) {
  try {
    std::lock_guard<std::mutex> lock(table_mutex());
    // The table is filled under the lock that generic_grad takes, so no gradient
    // is built from it before the entry is there.
    switch (kiln::tf_gradient::register_gradient(op_type, &generic_grad)) {
      case kiln::tf_gradient::Registration::kAdded:
        table()[op_type] = GradEntry{grad_op_type, n_inputs, n_outputs, save_outputs != 0};
        return 0;
      case kiln::tf_gradient::Registration::kAlreadyRegistered:
        return fail(std::string("the op type ") + op_type + " already has a gradient", err,
                    err_len);
      case kiln::tf_gradient::Registration::kRefused:
        break;
    }
    return fail(std::string("TensorFlow refused the gradient of ") + op_type, err, err_len);
  } catch (const std::exception& e) {
    return fail(std::string("registering the gradient of ") + op_type + ": " + e.what(), err,
                err_len);
  } catch (...) {
    return fail(std::string("registering the gradient of ") + op_type + ": unknown C++ exception",
                err, err_len);
  }
}

extern "C" int kiln_tf_op_shape_attr(TF_ShapeInferenceContext* ctx, const char* name, int kind,
                                     double* float_value, int64_t* int_value, char* err,
                                     size_t err_len) {
  try {
    auto* c = inference_context(ctx);
    absl::Status status;
    switch (kind) {
      case 0: {
        float v = 0;
        status = c->GetAttr(name, &v);
        *float_value = v;
        break;
      }
      case 1: {
        int64_t v = 0;
        status = c->GetAttr(name, &v);
        *int_value = v;
        break;
      }
      case 2: {
        bool v = false;
        status = c->GetAttr(name, &v);
        *int_value = v ? 1 : 0;
        break;
      }
      default:
        return fail("unknown attribute kind " + std::to_string(kind), err, err_len);
    }
    if (!status.ok()) return fail(std::string(status.message()), err, err_len);
    return 0;
  } catch (const std::exception& e) {
    return fail(std::string("reading attribute ") + name + ": " + e.what(), err, err_len);
  } catch (...) {
    return fail(std::string("reading attribute ") + name + ": unknown C++ exception", err,
                err_len);
  }
}

extern "C" int kiln_tf_op_set_output_shape(TF_ShapeInferenceContext* ctx, int i,
                                           const int64_t* dims, int rank, char* err,
                                           size_t err_len) {
  try {
    auto* c = inference_context(ctx);
    if (i < 0 || i >= c->num_outputs()) {
      return fail("output " + std::to_string(i) + " does not exist (the op has " +
                      std::to_string(c->num_outputs()) + ")",
                  err, err_len);
    }
    std::vector<tensorflow::shape_inference::DimensionHandle> sizes;
    for (int d = 0; d < rank; ++d) {
      sizes.push_back(dims[d] < 0 ? c->UnknownDim() : c->MakeDim(dims[d]));
    }
    c->set_output(i, c->MakeShape(sizes));
    return 0;
  } catch (const std::exception& e) {
    return fail(std::string("setting an output shape: ") + e.what(), err, err_len);
  } catch (...) {
    return fail("setting an output shape: unknown C++ exception", err, err_len);
  }
}
