// Step 5: the same op in TensorFlow, for graphs built with the `tensorflow` crate.
//
//   ExampleSquaredRelu(x: T) -> y: T                 y = max(x, 0)^2
//   ExampleSquaredReluGrad(grad: T, x: T) -> dx: T   dx = 2 max(x, 0) * grad
//   T in {float, double}
//
// Four parts: the CPU kernels and the shape functions, through TensorFlow's C op
// and kernel API (tensorflow/c/kernels.h, tensorflow/c/ops.h); the gradient, in
// TensorFlow's C++ gradient registry, which `Graph::add_gradients` consults (the C
// API cannot register a gradient); and the registration, which never aborts.
// A C++ exception must never reach TensorFlow: kernel errors become the op's
// failure status, which the session run returns.

#include "squared_relu_tf.h"

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tensorflow/c/c_api.h"
#include "tensorflow/c/kernels.h"
#include "tensorflow/c/ops.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/c/tf_tensor.h"
#include "tensorflow/cc/framework/grad_op_registry.h"
#include "tensorflow/cc/framework/ops.h"
#include "tensorflow/cc/framework/scope.h"
#include "tensorflow/core/graph/node_builder.h"

namespace example {
namespace {

constexpr char kOp[] = "ExampleSquaredRelu";
constexpr char kGradOp[] = "ExampleSquaredReluGrad";

// ----- 1. the kernels -----

struct StatusDeleter {
  void operator()(TF_Status* s) const { TF_DeleteStatus(s); }
};
using Status = std::unique_ptr<TF_Status, StatusDeleter>;

struct TensorDeleter {
  void operator()(TF_Tensor* t) const { TF_DeleteTensor(t); }
};
using Tensor = std::unique_ptr<TF_Tensor, TensorDeleter>;

// An error the session run reports, with TensorFlow's error code.
struct OpError : std::runtime_error {
  OpError(TF_Code code, const std::string& message) : std::runtime_error(message), code(code) {}
  TF_Code code;
};

void check(const TF_Status* status) {
  if (TF_GetCode(status) != TF_OK) throw OpError(TF_GetCode(status), TF_Message(status));
}

Tensor input(TF_OpKernelContext* ctx, int i) {
  Status status(TF_NewStatus());
  TF_Tensor* t = nullptr;
  TF_GetInput(ctx, i, &t, status.get());
  Tensor owned(t);
  check(status.get());
  return owned;
}

std::vector<std::int64_t> dims(const TF_Tensor* t) {
  std::vector<std::int64_t> d(static_cast<std::size_t>(TF_NumDims(t)));
  for (std::size_t i = 0; i < d.size(); ++i) d[i] = TF_Dim(t, static_cast<int>(i));
  return d;
}

// "[2, 3]", as libtorch prints sizes, so both front ends word errors alike.
std::string show(const std::vector<std::int64_t>& d) {
  std::string s = "[";
  for (std::size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Output 0, shaped and typed like `like`. TensorFlow owns the buffer; we own the handle.
Tensor output_like(TF_OpKernelContext* ctx, const TF_Tensor* like) {
  Status status(TF_NewStatus());
  const auto d = dims(like);
  Tensor out(TF_AllocateOutput(ctx, 0, TF_TensorType(like), d.data(), static_cast<int>(d.size()),
                               TF_TensorByteSize(like), status.get()));
  check(status.get());
  return out;
}

template <typename T>
T* data(const Tensor& t) {
  return static_cast<T*>(TF_TensorData(t.get()));
}

// Runs a kernel body and turns any exception into the op's failure status.
template <typename Body>
void guarded(TF_OpKernelContext* ctx, const Body& body) {
  TF_Code code = TF_INTERNAL;
  std::string message = "example: unknown C++ exception";
  try {
    body();
    return;
  } catch (const OpError& e) {
    code = e.code;
    message = e.what();
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
  }
  Status status(TF_NewStatus());
  TF_SetStatus(status.get(), code, message.c_str());
  TF_OpKernelContext_Failure(ctx, status.get());
}

// One thread: TensorFlow's own thread pool is not in the C API, and the session
// already runs independent ops in parallel.
template <typename T>
void squared_relu_kernel(void*, TF_OpKernelContext* ctx) {
  guarded(ctx, [&] {
    const Tensor x = input(ctx, 0);
    const Tensor y = output_like(ctx, x.get());
    const T* in = data<T>(x);
    T* out = data<T>(y);
    for (std::int64_t i = 0, n = TF_TensorElementCount(x.get()); i < n; ++i) {
      const T r = in[i] > 0 ? in[i] : T(0);
      out[i] = r * r;
    }
  });
}

template <typename T>
void squared_relu_grad_kernel(void*, TF_OpKernelContext* ctx) {
  guarded(ctx, [&] {
    const Tensor grad = input(ctx, 0);
    const Tensor x = input(ctx, 1);
    if (dims(grad.get()) != dims(x.get())) {
      throw OpError(TF_INVALID_ARGUMENT, "example::squared_relu_backward: grad has shape " +
                                             show(dims(grad.get())) + ", expected " +
                                             show(dims(x.get())));
    }
    const Tensor dx = output_like(ctx, x.get());
    const T* g = data<T>(grad);
    const T* in = data<T>(x);
    T* out = data<T>(dx);
    for (std::int64_t i = 0, n = TF_TensorElementCount(x.get()); i < n; ++i) {
      out[i] = in[i] > 0 ? T(2) * in[i] * g[i] : T(0);
    }
  });
}

// ----- 2. the shape functions: the output has the shape of input `i` (x) -----

template <int i>
void shape_of_input(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  TF_ShapeHandle* shape = TF_NewShapeHandle();
  TF_ShapeInferenceContextGetInput(ctx, i, shape, status);
  if (TF_GetCode(status) == TF_OK) TF_ShapeInferenceContextSetOutput(ctx, 0, shape, status);
  TF_DeleteShapeHandle(shape);
}

// ----- 3. the gradient: one ExampleSquaredReluGrad node -----

// Called by TF_AddGradients for each ExampleSquaredRelu node `op` on the path:
// adds ExampleSquaredReluGrad(incoming gradient, op's x) and returns it as d/dx.
// T is inferred from the inputs.
absl::Status squared_relu_gradient(const tensorflow::Scope& scope,
                                   const tensorflow::Operation& op,
                                   const std::vector<tensorflow::Output>& grad_inputs,
                                   std::vector<tensorflow::Output>* grad_outputs) {
  if (!scope.ok()) return scope.status();
  const tensorflow::Output grad = grad_inputs[0];
  const tensorflow::Output x = op.input(0);
  tensorflow::NodeBuilder builder(scope.GetUniqueNameForOp(kGradOp), kGradOp);
  builder.Input(grad.node(), grad.index()).Input(x.node(), x.index());
  scope.UpdateBuilder(&builder);
  tensorflow::Node* node = nullptr;
  scope.UpdateStatus(builder.Finalize(scope.graph(), &node));
  if (scope.ok()) scope.UpdateStatus(scope.DoShapeInference(node));
  if (!scope.ok()) return scope.status();
  grad_outputs->emplace_back(node, 0);
  return absl::OkStatus();
}

// ----- 4. the registration -----

using ShapeFn = void (*)(TF_ShapeInferenceContext*, TF_Status*);
using ComputeFn = void (*)(void*, TF_OpKernelContext*);

// Whether TensorFlow already knows `op` (from an earlier call, or another copy of
// this library): TF_RegisterOpDefinition would abort the process on a duplicate.
bool registered(const char* op) {
  TF_Graph* graph = TF_NewGraph();
  TF_Buffer* def = TF_NewBuffer();
  Status status(TF_NewStatus());
  TF_GraphGetOpDef(graph, op, def, status.get());
  TF_DeleteBuffer(def);
  TF_DeleteGraph(graph);
  return TF_GetCode(status.get()) == TF_OK;
}

// The op `name(inputs) -> output` with attribute T, and its float and double CPU kernels.
void register_op(const char* name, const std::vector<const char*>& inputs, const char* output,
                 ShapeFn shape, ComputeFn float_kernel, ComputeFn double_kernel) {
  Status status(TF_NewStatus());
  TF_OpDefinitionBuilder* op = TF_NewOpDefinitionBuilder(name);
  TF_OpDefinitionBuilderAddAttr(op, "T: {float, double}");
  for (const char* in : inputs) TF_OpDefinitionBuilderAddInput(op, in);
  TF_OpDefinitionBuilderAddOutput(op, output);
  TF_OpDefinitionBuilderSetShapeInferenceFunction(op, shape);
  TF_RegisterOpDefinition(op, status.get());  // takes the builder
  check(status.get());

  const std::string kernel_name = std::string(name) + "Op";
  const std::pair<TF_DataType, ComputeFn> kernels[] = {{TF_FLOAT, float_kernel},
                                                       {TF_DOUBLE, double_kernel}};
  for (const auto& [dtype, compute] : kernels) {
    TF_KernelBuilder* kernel = TF_NewKernelBuilder(name, "CPU", nullptr, compute, nullptr);
    TF_KernelBuilder_TypeConstraint(kernel, "T", dtype, status.get());
    if (TF_GetCode(status.get()) != TF_OK) TF_DeleteKernelBuilder(kernel);
    check(status.get());
    TF_RegisterKernelBuilder(kernel_name.c_str(), kernel, status.get());  // takes the builder
    check(status.get());
  }
}

void register_all() {
  if (!registered(kOp)) {
    register_op(kOp, {"x: T"}, "y: T", shape_of_input<0>, squared_relu_kernel<float>,
                squared_relu_kernel<double>);
  }
  if (!registered(kGradOp)) {
    register_op(kGradOp, {"grad: T", "x: T"}, "dx: T", shape_of_input<1>,
                squared_relu_grad_kernel<float>, squared_relu_grad_kernel<double>);
  }
  // Register() also aborts on a duplicate: look first.
  auto* gradients = tensorflow::ops::GradOpRegistry::Global();
  tensorflow::ops::GradFunc existing = nullptr;
  if (!gradients->Lookup(kOp, &existing).ok() &&
      !gradients->Register(kOp, squared_relu_gradient)) {
    throw std::runtime_error(std::string("could not register the gradient of ") + kOp);
  }
}

}  // namespace

void register_tf_ops() {
  // One caller at a time: two could both find an op missing and register it twice.
  static std::mutex mutex;
  const std::lock_guard<std::mutex> lock(mutex);
  try {
    register_all();
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("example: registering the TensorFlow ops failed: ") +
                             e.what());
  }
}

}  // namespace example
