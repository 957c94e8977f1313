// Kiln's fused ops in TensorFlow: op definitions with shape functions and CPU
// kernels, through TensorFlow's C op and kernel API (tensorflow/c/ops.h,
// tensorflow/c/kernels.h, exported by libtensorflow_framework.so.2), plus the
// gradients (src/tf/gradients.cc, C++ registry). The math is include/kernels.h,
// the same code the libtorch ops run, so both front ends agree.
//
//   KilnBiasGelu(x: T [..., C], bias: T [C]) -> y: T
//   KilnBiasGeluGrad(grad, x, bias) -> (dx, dbias)
//   KilnSoftmaxXent(logits: T [N, C], target: int64 [N]; label_smoothing: float) -> loss: T [N]
//   KilnSoftmaxXentGrad(grad [N], logits, target; label_smoothing) -> dlogits
//   KilnSwish(x: T, beta: T [1]) -> y: T
//   KilnSwishGrad(grad, x, beta) -> (dx, dbeta)
//   T in {float, double}
//
// Registration runs once per process, at the first `kiln_fused_ops::tf::register()` (no
// static initialiser: a binary that links kiln-fused-ops but never reaches these ops,
// such as the `kiln` CLI, must not load TensorFlow). Nothing here lets a C++
// exception reach TensorFlow: kernel errors become `TF_OpKernelContext_Failure`
// statuses, which a session run returns.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "../include/kernels.h"
#include "tensorflow/c/c_api.h"
#include "tensorflow/c/kernels.h"
#include "tensorflow/c/ops.h"
#include "tensorflow/c/tf_datatype.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/c/tf_tensor.h"
#include "tf/gradients.h"
#include "tf/register.h"

namespace kiln::ops::tf {
namespace {

namespace k = kiln::ops::kernels;

// ----- the parallel-for of include/kernels.h -----

// Splits [begin, end) into at most hardware_concurrency() contiguous chunks of at
// least `grain` elements, runs the first on the calling thread and the others on
// new threads (serial when the range is below one grain). Mirrors
// at::parallel_for's split rule; a thread that cannot be started runs its chunk here.
struct ThreadPar {
  template <typename F>
  void operator()(std::int64_t begin, std::int64_t end, std::int64_t grain, const F& f) const {
    const std::int64_t n = end - begin;
    if (n <= 0) return;
    const std::int64_t hw = std::max<std::int64_t>(1, std::thread::hardware_concurrency());
    const std::int64_t workers =
        std::min<std::int64_t>(hw, (n + std::max<std::int64_t>(grain, 1) - 1) /
                                       std::max<std::int64_t>(grain, 1));
    if (workers <= 1) {
      f(begin, end);
      return;
    }
    const std::int64_t chunk = (n + workers - 1) / workers;
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(workers - 1));
    for (std::int64_t b = begin + chunk; b < end; b += chunk) {
      const std::int64_t e = std::min(end, b + chunk);
      try {
        threads.emplace_back([&f, b, e] { f(b, e); });
      } catch (const std::system_error&) {
        f(b, e);
      }
    }
    f(begin, std::min(end, begin + chunk));
    for (auto& t : threads) t.join();
  }
};

// ----- small RAII helpers over the C API -----

struct StatusDeleter {
  void operator()(TF_Status* s) const { TF_DeleteStatus(s); }
};
using Status = std::unique_ptr<TF_Status, StatusDeleter>;
Status new_status() { return Status(TF_NewStatus()); }

struct TensorDeleter {
  void operator()(TF_Tensor* t) const { TF_DeleteTensor(t); }
};
using Tensor = std::unique_ptr<TF_Tensor, TensorDeleter>;

// An error for TensorFlow: the kernels report it with TF_OpKernelContext_Failure.
struct OpError : std::runtime_error {
  OpError(TF_Code code, const std::string& message) : std::runtime_error(message), code(code) {}
  TF_Code code;
};

[[noreturn]] void invalid(const std::string& message) {
  throw OpError(TF_INVALID_ARGUMENT, message);
}

void throw_if_error(const TF_Status* status, const std::string& context) {
  if (TF_GetCode(status) != TF_OK) {
    throw OpError(TF_GetCode(status), context + ": " + TF_Message(status));
  }
}

std::vector<std::int64_t> dims_of(const TF_Tensor* t) {
  std::vector<std::int64_t> dims(static_cast<std::size_t>(TF_NumDims(t)));
  for (std::size_t i = 0; i < dims.size(); ++i) dims[i] = TF_Dim(t, static_cast<int>(i));
  return dims;
}

// "[2, 3]", as libtorch prints sizes, so both front ends word errors alike.
std::string show(const std::vector<std::int64_t>& dims) {
  std::ostringstream s;
  s << '[';
  for (std::size_t i = 0; i < dims.size(); ++i) s << (i ? ", " : "") << dims[i];
  s << ']';
  return s.str();
}

std::int64_t numel(const std::vector<std::int64_t>& dims) {
  std::int64_t n = 1;
  for (std::int64_t d : dims) n *= d;
  return n;
}

template <typename T>
T* data(TF_Tensor* t) {
  return static_cast<T*>(TF_TensorData(t));
}

// The inputs of one kernel call, owned for its duration.
class Inputs {
 public:
  explicit Inputs(TF_OpKernelContext* ctx) {
    const int n = TF_NumInputs(ctx);
    auto status = new_status();
    for (int i = 0; i < n; ++i) {
      TF_Tensor* t = nullptr;
      TF_GetInput(ctx, i, &t, status.get());
      throw_if_error(status.get(), "reading input " + std::to_string(i));
      tensors_.emplace_back(t);
    }
  }
  TF_Tensor* operator[](std::size_t i) const { return tensors_.at(i).get(); }

 private:
  std::vector<Tensor> tensors_;
};

// Allocates output `index` of shape `dims`; TensorFlow owns it, the handle is ours.
template <typename T>
Tensor allocate(TF_OpKernelContext* ctx, int index, const std::vector<std::int64_t>& dims) {
  auto status = new_status();
  TF_Tensor* t = TF_AllocateOutput(ctx, index, TF_ExpectedOutputDataType(ctx, index), dims.data(),
                                   static_cast<int>(dims.size()),
                                   static_cast<std::size_t>(numel(dims)) * sizeof(T), status.get());
  throw_if_error(status.get(), "allocating output " + std::to_string(index));
  return Tensor(t);
}

// Runs a kernel body, turning any exception into the op's failure status.
template <typename F>
void guarded(TF_OpKernelContext* ctx, F&& body) {
  TF_Code code = TF_INTERNAL;
  std::string message;
  try {
    body();
    return;
  } catch (const OpError& e) {
    code = e.code;
    message = e.what();
  } catch (const std::out_of_range& e) {  // check_targets in include/kernels.h
    code = TF_INVALID_ARGUMENT;
    message = e.what();
  } catch (const std::bad_alloc&) {
    code = TF_RESOURCE_EXHAUSTED;
    message = "kiln: out of memory";
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "kiln: unknown C++ exception";
  }
  auto status = new_status();
  TF_SetStatus(status.get(), code, message.c_str());
  TF_OpKernelContext_Failure(ctx, status.get());
}

void check_grad_shape(const char* op, const TF_Tensor* grad, const TF_Tensor* x) {
  if (dims_of(grad) != dims_of(x)) {
    invalid(std::string("kiln::") + op + ": grad has shape " + show(dims_of(grad)) +
            ", expected x's " + show(dims_of(x)));
  }
}

// ----- bias + GELU -----

void check_bias_gelu(const TF_Tensor* x, const TF_Tensor* bias) {
  const auto xd = dims_of(x);
  const auto bd = dims_of(bias);
  if (xd.empty() || bd.size() != 1 || bd[0] != xd.back()) {
    invalid("kiln::bias_gelu: bias must have shape [" +
            std::to_string(xd.empty() ? 0 : xd.back()) + "] (x's last dimension), got " +
            show(bd) + " for x of shape " + show(xd));
  }
}

template <typename T>
void bias_gelu_compute(void*, TF_OpKernelContext* ctx) {
  guarded(ctx, [&] {
    Inputs in(ctx);
    TF_Tensor* x = in[0];
    TF_Tensor* bias = in[1];
    check_bias_gelu(x, bias);
    const auto dims = dims_of(x);
    const std::int64_t cols = dims.back();
    const std::int64_t rows = cols == 0 ? 0 : numel(dims) / cols;
    Tensor y = allocate<T>(ctx, 0, dims);
    k::bias_gelu_forward<T>(data<T>(x), data<T>(bias), data<T>(y.get()), rows, cols,
                            ThreadPar{});
  });
}

template <typename T>
void bias_gelu_grad_compute(void*, TF_OpKernelContext* ctx) {
  guarded(ctx, [&] {
    Inputs in(ctx);
    TF_Tensor* grad = in[0];
    TF_Tensor* x = in[1];
    TF_Tensor* bias = in[2];
    check_bias_gelu(x, bias);
    check_grad_shape("bias_gelu_backward", grad, x);
    const auto dims = dims_of(x);
    const std::int64_t cols = dims.back();
    const std::int64_t rows = cols == 0 ? 0 : numel(dims) / cols;
    Tensor dx = allocate<T>(ctx, 0, dims);
    Tensor db = allocate<T>(ctx, 1, dims_of(bias));
    k::bias_gelu_backward<T>(data<T>(grad), data<T>(x), data<T>(bias), data<T>(dx.get()),
                             data<T>(db.get()), rows, cols, ThreadPar{});
  });
}

// ----- softmax cross-entropy with label smoothing -----

// The kernel's state: the `label_smoothing` attribute, read and checked once.
struct Smoothing {
  float eps;
};

void* smoothing_create(TF_OpKernelConstruction* ctx) {
  auto status = new_status();
  float eps = 0;
  TF_OpKernelConstruction_GetAttrFloat(ctx, "label_smoothing", &eps, status.get());
  if (TF_GetCode(status.get()) == TF_OK && !(eps >= 0.0f && eps <= 1.0f)) {
    std::ostringstream message;  // "1.5", as libtorch words it, not "1.500000"
    message << "kiln::softmax_xent: label_smoothing must be in [0, 1], got " << eps;
    TF_SetStatus(status.get(), TF_INVALID_ARGUMENT, message.str().c_str());
  }
  if (TF_GetCode(status.get()) != TF_OK) {
    TF_OpKernelConstruction_Failure(ctx, status.get());
    return nullptr;
  }
  return new Smoothing{eps};
}

void smoothing_delete(void* state) { delete static_cast<Smoothing*>(state); }

void check_softmax_xent(const TF_Tensor* logits, const TF_Tensor* target) {
  const auto ld = dims_of(logits);
  const auto td = dims_of(target);
  if (ld.size() != 2) invalid("kiln::softmax_xent: logits must be [N, C], got shape " + show(ld));
  if (td.size() != 1 || td[0] != ld[0]) {
    invalid("kiln::softmax_xent: target must have shape [" + std::to_string(ld[0]) + "], got " +
            show(td));
  }
}

template <typename T>
void softmax_xent_compute(void* state, TF_OpKernelContext* ctx) {
  guarded(ctx, [&] {
    const T eps = static_cast<T>(static_cast<const Smoothing*>(state)->eps);
    Inputs in(ctx);
    TF_Tensor* logits = in[0];
    TF_Tensor* target = in[1];
    check_softmax_xent(logits, target);
    const auto dims = dims_of(logits);
    Tensor loss = allocate<T>(ctx, 0, {dims[0]});
    k::softmax_xent_forward<T>(data<T>(logits), data<std::int64_t>(target), eps,
                               data<T>(loss.get()), dims[0], dims[1], ThreadPar{});
  });
}

template <typename T>
void softmax_xent_grad_compute(void* state, TF_OpKernelContext* ctx) {
  guarded(ctx, [&] {
    const T eps = static_cast<T>(static_cast<const Smoothing*>(state)->eps);
    Inputs in(ctx);
    TF_Tensor* grad = in[0];
    TF_Tensor* logits = in[1];
    TF_Tensor* target = in[2];
    check_softmax_xent(logits, target);
    const auto dims = dims_of(logits);
    const auto gd = dims_of(grad);
    if (gd.size() != 1 || gd[0] != dims[0]) {
      invalid("kiln::softmax_xent_backward: grad must have shape [" + std::to_string(dims[0]) +
              "], got " + show(gd));
    }
    Tensor dlogits = allocate<T>(ctx, 0, dims);
    k::softmax_xent_backward<T>(data<T>(grad), data<T>(logits), data<std::int64_t>(target), eps,
                                data<T>(dlogits.get()), dims[0], dims[1], ThreadPar{});
  });
}

// ----- Swish-beta -----

void check_swish(const TF_Tensor* beta) {
  if (numel(dims_of(beta)) != 1) {
    invalid("kiln::swish: beta must have one element, got shape " + show(dims_of(beta)));
  }
}

template <typename T>
void swish_compute(void*, TF_OpKernelContext* ctx) {
  guarded(ctx, [&] {
    Inputs in(ctx);
    TF_Tensor* x = in[0];
    TF_Tensor* beta = in[1];
    check_swish(beta);
    const auto dims = dims_of(x);
    Tensor y = allocate<T>(ctx, 0, dims);
    k::swish_forward<T>(data<T>(x), data<T>(beta), data<T>(y.get()), numel(dims), ThreadPar{});
  });
}

template <typename T>
void swish_grad_compute(void*, TF_OpKernelContext* ctx) {
  guarded(ctx, [&] {
    Inputs in(ctx);
    TF_Tensor* grad = in[0];
    TF_Tensor* x = in[1];
    TF_Tensor* beta = in[2];
    check_swish(beta);
    check_grad_shape("swish_backward", grad, x);
    const auto dims = dims_of(x);
    Tensor dx = allocate<T>(ctx, 0, dims);
    Tensor dbeta = allocate<T>(ctx, 1, dims_of(beta));
    k::swish_backward<T>(data<T>(grad), data<T>(x), data<T>(beta), data<T>(dx.get()),
                         data<T>(dbeta.get()), numel(dims), ThreadPar{});
  });
}

// ----- shape functions -----

struct Shape {
  Shape() : h(TF_NewShapeHandle()) {}
  ~Shape() { TF_DeleteShapeHandle(h); }
  Shape(const Shape&) = delete;
  Shape& operator=(const Shape&) = delete;
  TF_ShapeHandle* h;
};

// Dimension `i` of `shape`, or -1 when unknown (or the rank is unknown).
std::int64_t dim(TF_ShapeInferenceContext* ctx, const Shape& shape, std::int64_t i) {
  if (!TF_ShapeInferenceContextRankKnown(ctx, shape.h)) return -1;
  const std::int64_t rank = TF_ShapeInferenceContextRank(ctx, shape.h);
  if (i < 0) i += rank;
  if (i < 0 || i >= rank) return -1;
  TF_DimensionHandle* d = TF_NewDimensionHandle();
  TF_ShapeInferenceContextDim(ctx, shape.h, i, d);
  const std::int64_t value = TF_DimensionHandleValueKnown(d) ? TF_DimensionHandleValue(d) : -1;
  TF_DeleteDimensionHandle(d);
  return value;
}

// "[2, ?]" for error messages.
std::string show(TF_ShapeInferenceContext* ctx, const Shape& shape) {
  if (!TF_ShapeInferenceContextRankKnown(ctx, shape.h)) return "<unknown>";
  std::string s = "[";
  const std::int64_t rank = TF_ShapeInferenceContextRank(ctx, shape.h);
  for (std::int64_t i = 0; i < rank; ++i) {
    const std::int64_t d = dim(ctx, shape, i);
    s += (i ? ", " : "") + (d < 0 ? std::string("?") : std::to_string(d));
  }
  return s + "]";
}

// Input `i`, optionally required to have rank `rank` (or at least `at_least`).
bool input(TF_ShapeInferenceContext* ctx, int i, Shape& out, TF_Status* status,
           std::int64_t rank = -1, std::int64_t at_least = -1) {
  TF_ShapeInferenceContextGetInput(ctx, i, out.h, status);
  if (TF_GetCode(status) != TF_OK) return false;
  if (rank >= 0) {
    Shape checked;
    TF_ShapeInferenceContextWithRank(ctx, out.h, rank, checked.h, status);
  } else if (at_least >= 0) {
    Shape checked;
    TF_ShapeInferenceContextWithRankAtLeast(ctx, out.h, at_least, checked.h, status);
  }
  return TF_GetCode(status) == TF_OK;
}

bool fail(TF_Status* status, const std::string& message) {
  TF_SetStatus(status, TF_INVALID_ARGUMENT, message.c_str());
  return false;
}

// Known ranks and known dimensions of `a` and `b` agree.
bool same_shape(TF_ShapeInferenceContext* ctx, const Shape& a, const Shape& b) {
  if (!TF_ShapeInferenceContextRankKnown(ctx, a.h) || !TF_ShapeInferenceContextRankKnown(ctx, b.h))
    return true;
  const std::int64_t rank = TF_ShapeInferenceContextRank(ctx, a.h);
  if (rank != TF_ShapeInferenceContextRank(ctx, b.h)) return false;
  for (std::int64_t i = 0; i < rank; ++i) {
    const std::int64_t da = dim(ctx, a, i);
    const std::int64_t db = dim(ctx, b, i);
    if (da >= 0 && db >= 0 && da != db) return false;
  }
  return true;
}

bool check_bias_shape(TF_ShapeInferenceContext* ctx, const Shape& x, const Shape& bias,
                      TF_Status* status) {
  const std::int64_t cols = dim(ctx, x, -1);
  const std::int64_t b = dim(ctx, bias, 0);
  if (cols >= 0 && b >= 0 && cols != b) {
    return fail(status, "kiln::bias_gelu: bias must have shape [" + std::to_string(cols) +
                            "] (x's last dimension), got " + show(ctx, bias) +
                            " for x of shape " + show(ctx, x));
  }
  return true;
}

bool check_beta_shape(TF_ShapeInferenceContext* ctx, const Shape& beta, TF_Status* status) {
  if (!TF_ShapeInferenceContextRankKnown(ctx, beta.h)) return true;
  std::int64_t n = 1;
  for (std::int64_t i = 0; i < TF_ShapeInferenceContextRank(ctx, beta.h); ++i) {
    const std::int64_t d = dim(ctx, beta, i);
    if (d < 0) return true;
    n *= d;
  }
  if (n != 1) {
    return fail(status, "kiln::swish: beta must have one element, got shape " + show(ctx, beta));
  }
  return true;
}

bool check_grad_shape(TF_ShapeInferenceContext* ctx, const char* op, const Shape& grad,
                      const Shape& x, TF_Status* status) {
  if (!same_shape(ctx, grad, x)) {
    return fail(status, std::string("kiln::") + op + ": grad has shape " + show(ctx, grad) +
                            ", expected x's " + show(ctx, x));
  }
  return true;
}

void set_output(TF_ShapeInferenceContext* ctx, int i, const Shape& shape, TF_Status* status) {
  if (TF_GetCode(status) == TF_OK) TF_ShapeInferenceContextSetOutput(ctx, i, shape.h, status);
}

void bias_gelu_shape(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  Shape x, bias;
  if (input(ctx, 0, x, status, -1, 1) && input(ctx, 1, bias, status, 1) &&
      check_bias_shape(ctx, x, bias, status)) {
    set_output(ctx, 0, x, status);
  }
}

void bias_gelu_grad_shape(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  Shape grad, x, bias;
  if (input(ctx, 0, grad, status) && input(ctx, 1, x, status, -1, 1) &&
      input(ctx, 2, bias, status, 1) && check_bias_shape(ctx, x, bias, status) &&
      check_grad_shape(ctx, "bias_gelu_backward", grad, x, status)) {
    set_output(ctx, 0, x, status);
    set_output(ctx, 1, bias, status);
  }
}

bool check_xent_shapes(TF_ShapeInferenceContext* ctx, const Shape& logits, const Shape& target,
                       TF_Status* status) {
  const std::int64_t n = dim(ctx, logits, 0);
  const std::int64_t t = dim(ctx, target, 0);
  if (n >= 0 && t >= 0 && n != t) {
    return fail(status, "kiln::softmax_xent: target must have shape [" + std::to_string(n) +
                            "], got " + show(ctx, target));
  }
  return true;
}

void softmax_xent_shape(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  Shape logits, target;
  if (input(ctx, 0, logits, status, 2) && input(ctx, 1, target, status, 1) &&
      check_xent_shapes(ctx, logits, target, status)) {
    Shape loss;  // [N], N possibly unknown: logits' first dimension
    TF_ShapeInferenceContextSubshape(ctx, logits.h, 0, 1, loss.h, status);
    set_output(ctx, 0, loss, status);
  }
}

void softmax_xent_grad_shape(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  Shape grad, logits, target;
  if (input(ctx, 0, grad, status, 1) && input(ctx, 1, logits, status, 2) &&
      input(ctx, 2, target, status, 1) && check_xent_shapes(ctx, logits, target, status)) {
    const std::int64_t n = dim(ctx, logits, 0);
    const std::int64_t g = dim(ctx, grad, 0);
    if (n >= 0 && g >= 0 && n != g) {
      fail(status, "kiln::softmax_xent_backward: grad must have shape [" + std::to_string(n) +
                       "], got " + show(ctx, grad));
      return;
    }
    set_output(ctx, 0, logits, status);
  }
}

void swish_shape(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  Shape x, beta;
  if (input(ctx, 0, x, status) && input(ctx, 1, beta, status) &&
      check_beta_shape(ctx, beta, status)) {
    set_output(ctx, 0, x, status);
  }
}

void swish_grad_shape(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  Shape grad, x, beta;
  if (input(ctx, 0, grad, status) && input(ctx, 1, x, status) && input(ctx, 2, beta, status) &&
      check_beta_shape(ctx, beta, status) &&
      check_grad_shape(ctx, "swish_backward", grad, x, status)) {
    set_output(ctx, 0, x, status);
    set_output(ctx, 1, beta, status);
  }
}

// ----- registration -----

using ShapeFn = void (*)(TF_ShapeInferenceContext*, TF_Status*);
using CreateFn = void* (*)(TF_OpKernelConstruction*);
using ComputeFn = void (*)(void*, TF_OpKernelContext*);
using DeleteFn = void (*)(void*);

struct OpSpec {
  const char* name;
  std::vector<const char*> inputs;
  std::vector<const char*> outputs;
  std::vector<const char*> attrs;
  ShapeFn shape;
  CreateFn create;
  ComputeFn compute_float;
  ComputeFn compute_double;
  DeleteFn destroy;
};

std::vector<OpSpec> specs() {
  const char* t = "T: {float, double}";
  const char* eps = "label_smoothing: float = 0.0";
  return {
      {"KilnBiasGelu", {"x: T", "bias: T"}, {"y: T"}, {t}, bias_gelu_shape, nullptr,
       bias_gelu_compute<float>, bias_gelu_compute<double>, nullptr},
      {"KilnBiasGeluGrad", {"grad: T", "x: T", "bias: T"}, {"dx: T", "dbias: T"}, {t},
       bias_gelu_grad_shape, nullptr, bias_gelu_grad_compute<float>,
       bias_gelu_grad_compute<double>, nullptr},
      {"KilnSoftmaxXent", {"logits: T", "target: int64"}, {"loss: T"}, {t, eps},
       softmax_xent_shape, smoothing_create, softmax_xent_compute<float>,
       softmax_xent_compute<double>, smoothing_delete},
      {"KilnSoftmaxXentGrad", {"grad: T", "logits: T", "target: int64"}, {"dlogits: T"},
       {t, eps}, softmax_xent_grad_shape, smoothing_create, softmax_xent_grad_compute<float>,
       softmax_xent_grad_compute<double>, smoothing_delete},
      {"KilnSwish", {"x: T", "beta: T"}, {"y: T"}, {t}, swish_shape, nullptr,
       swish_compute<float>, swish_compute<double>, nullptr},
      {"KilnSwishGrad", {"grad: T", "x: T", "beta: T"}, {"dx: T", "dbeta: T"}, {t},
       swish_grad_shape, nullptr, swish_grad_compute<float>, swish_grad_compute<double>,
       nullptr},
  };
}

// Whether `op` is already in TensorFlow's op registry (another copy of these ops,
// or a second call): TF_RegisterOpDefinition would abort the process on a duplicate.
bool op_registered(const char* op) {
  TF_Graph* graph = TF_NewGraph();
  TF_Buffer* buffer = TF_NewBuffer();
  auto status = new_status();
  TF_GraphGetOpDef(graph, op, buffer, status.get());
  const bool found = TF_GetCode(status.get()) == TF_OK;
  TF_DeleteBuffer(buffer);
  TF_DeleteGraph(graph);
  return found;
}

void register_op(const OpSpec& spec) {
  auto status = new_status();
  TF_OpDefinitionBuilder* builder = TF_NewOpDefinitionBuilder(spec.name);
  for (const char* a : spec.attrs) TF_OpDefinitionBuilderAddAttr(builder, a);
  for (const char* i : spec.inputs) TF_OpDefinitionBuilderAddInput(builder, i);
  for (const char* o : spec.outputs) TF_OpDefinitionBuilderAddOutput(builder, o);
  TF_OpDefinitionBuilderSetShapeInferenceFunction(builder, spec.shape);
  TF_RegisterOpDefinition(builder, status.get());  // takes the builder
  throw_if_error(status.get(), std::string("registering op ") + spec.name);

  const std::string kernel = std::string(spec.name) + "Op";
  const std::pair<TF_DataType, ComputeFn> kernels[] = {{TF_FLOAT, spec.compute_float},
                                                       {TF_DOUBLE, spec.compute_double}};
  for (const auto& [dtype, compute] : kernels) {
    TF_KernelBuilder* kb =
        TF_NewKernelBuilder(spec.name, "CPU", spec.create, compute, spec.destroy);
    TF_KernelBuilder_TypeConstraint(kb, "T", dtype, status.get());
    if (TF_GetCode(status.get()) != TF_OK) {
      TF_DeleteKernelBuilder(kb);
      throw_if_error(status.get(), "constraining kernel " + kernel);
    }
    TF_RegisterKernelBuilder(kernel.c_str(), kb, status.get());  // takes the builder
    throw_if_error(status.get(), "registering kernel " + kernel);
  }
}

void register_all() {
  for (const OpSpec& spec : specs()) {
    if (!op_registered(spec.name)) register_op(spec);
  }
  const std::string error = register_gradients();
  if (!error.empty()) throw std::runtime_error(error);
}

// The outcome of the one registration of this process: empty, or the error.
const std::string& registration() {
  static const std::string outcome = [] {
    try {
      register_all();
      return std::string();
    } catch (const std::exception& e) {
      return std::string("kiln: registering the TensorFlow ops failed: ") + e.what();
    } catch (...) {
      return std::string("kiln: registering the TensorFlow ops failed");
    }
  }();
  return outcome;
}

}  // namespace

void register_tf_ops() {
  const std::string& error = registration();
  if (!error.empty()) throw std::runtime_error(error);
}

void register_tf_ops_again() {
  register_tf_ops();
  register_all();
}

}  // namespace kiln::ops::tf
