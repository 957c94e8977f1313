// kiln-torch-op's C++ glue: what libtorch 2.11's stable C ABI does not cover.
//
// - Autograd. The stable C ABI (torch/csrc/stable/c/shim.h and the AOTI shim it
//   includes) registers schemas and boxed kernels for dispatch keys, but has no
//   autograd interface: no way to record a graph node or to say what backward
//   computes. So the Autograd-key kernel of every Kiln op is this file's, written
//   once for all ops: it runs the op below autograd and records a node whose
//   backward calls the op's gradient op through the dispatcher.
// - Throwing c10::Error from a Rust kernel, with the kernel's message.
// - Calling an op with the error message kept: the shim's torch_call_dispatcher
//   only logs it.
//
// Nothing here is specific to an op. Every function callable from Rust catches
// every C++ exception, except kiln_torch_op_throw, whose purpose is to throw.

#include "kiln_torch_op.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Copies `msg` into `err` (NUL-terminated, truncated to `len`).
void write_error(const std::string& msg, char* err, size_t len) {
  if (err == nullptr || len == 0) {
    return;
  }
  const size_t n = std::min(msg.size(), len - 1);
  std::memcpy(err, msg.data(), n);
  err[n] = '\0';
}

// The message of a c10::Error without the C++ backtrace libtorch appends.
std::string message_of(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) {
    return c10->what_without_backtrace();
  }
  return e.what();
}

// What the autograd kernel of one op knows. Allocated once per registered op
// and never freed: libtorch keeps the kernel (and graph nodes keep a pointer
// to it) for the life of the process.
struct OpInfo {
  std::string ns;
  std::string op;
  std::string grad_op;  // empty: the op has no gradient
  size_t n_inputs;
  size_t n_outputs;
  bool save_outputs;
  c10::OperatorHandle handle;

  std::string qualified() const { return ns + "::" + op; }
};

// The graph node: forward runs the op below the Autograd key, backward calls
// the gradient op. Undefined output gradients reach backward as zeros (the
// Function's default, materialize_grads).
class KilnFunction : public torch::autograd::Function<KilnFunction> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
      at::TensorList inputs,
      std::vector<c10::IValue> attrs,
      const OpInfo* info) {
    torch::jit::Stack stack;
    stack.reserve(inputs.size() + attrs.size());
    for (const auto& t : inputs) {
      stack.emplace_back(t);
    }
    for (const auto& a : attrs) {
      stack.push_back(a);
    }
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      info->handle.callBoxed(stack);
    }
    variable_list outputs;
    outputs.reserve(stack.size());
    for (auto& v : stack) {
      outputs.push_back(std::move(v).toTensor());
    }
    variable_list saved(inputs.begin(), inputs.end());
    if (info->save_outputs) {
      saved.insert(saved.end(), outputs.begin(), outputs.end());
    }
    ctx->save_for_backward(std::move(saved));
    c10::impl::GenericList attr_list(c10::AnyType::get());
    for (auto& a : attrs) {
      attr_list.push_back(std::move(a));
    }
    ctx->saved_data["attrs"] = std::move(attr_list);
    ctx->saved_data["info"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(info));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* info = reinterpret_cast<const OpInfo*>(
        static_cast<intptr_t>(ctx->saved_data["info"].toInt()));
    TORCH_CHECK(
        !info->grad_op.empty(),
        "`", info->qualified(), "` is not differentiable: its schema names no gradient op");
    const std::string grad_name = info->ns + "::" + info->grad_op;
    auto handle = c10::Dispatcher::singleton().findSchema({grad_name, ""});
    TORCH_CHECK(
        handle.has_value(),
        "the backward of `", info->qualified(), "` calls its gradient op: register `",
        grad_name, "`");
    torch::jit::Stack stack;
    for (auto& g : grads) {
      stack.emplace_back(std::move(g));
    }
    for (auto& s : ctx->get_saved_variables()) {
      stack.emplace_back(std::move(s));
    }
    for (const auto& a : ctx->saved_data["attrs"].toList()) {
      stack.push_back(a);
    }
    handle->callBoxed(stack);
    TORCH_CHECK(
        stack.size() == info->n_inputs,
        "`", grad_name, "` returned ", stack.size(), " tensors, expected ", info->n_inputs,
        " (a gradient for each input of `", info->qualified(), "`)");
    variable_list out;
    out.reserve(info->n_inputs + 2);
    for (auto& v : stack) {
      out.push_back(std::move(v).toTensor());
    }
    // forward's non-tensor arguments (attrs, info) have no gradient.
    out.emplace_back();
    out.emplace_back();
    return out;
  }
};

// The boxed kernel registered for the Autograd key of one op.
class AutogradKernel final : public c10::OperatorKernel {
 public:
  explicit AutogradKernel(const OpInfo* info) : info_(info) {}

  void operator()(
      const c10::OperatorHandle& op,
      c10::DispatchKeySet /*keys*/,
      torch::jit::Stack* stack) {
    const size_t n_args = op.schema().arguments().size();
    TORCH_CHECK(
        n_args >= info_->n_inputs && stack->size() >= n_args,
        "`", info_->qualified(), "`: autograd kernel got ", stack->size(),
        " arguments, expected ", n_args);
    std::vector<c10::IValue> args = torch::jit::pop(*stack, n_args);
    std::vector<at::Tensor> inputs;
    inputs.reserve(info_->n_inputs);
    for (size_t i = 0; i < info_->n_inputs; ++i) {
      inputs.push_back(std::move(args[i]).toTensor());
    }
    std::vector<c10::IValue> attrs(
        std::make_move_iterator(args.begin() + static_cast<std::ptrdiff_t>(info_->n_inputs)),
        std::make_move_iterator(args.end()));
    variable_list outputs =
        KilnFunction::apply(at::TensorList(inputs), std::move(attrs), info_);
    for (auto& t : outputs) {
      stack->emplace_back(std::move(t));
    }
  }

 private:
  const OpInfo* info_;
};

}  // namespace

extern "C" [[noreturn]] void kiln_torch_op_throw(const char* msg, size_t len) {
  std::string message(msg, len);
  TORCH_CHECK(false, message);
}

extern "C" void kiln_torch_op_exists(const char* name, int* exists) {
  *exists = 0;
  try {
    *exists = c10::Dispatcher::singleton().findSchema({name, ""}).has_value() ? 1 : 0;
  } catch (...) {
  }
}

extern "C" int kiln_torch_op_register_autograd(
    const char* ns,
    const char* op,
    const char* grad_op,
    size_t n_inputs,
    size_t n_outputs,
    int save_outputs,
    char* err,
    size_t err_len) {
  try {
    const std::string name = std::string(ns) + "::" + op;
    auto handle = c10::Dispatcher::singleton().findSchema({name, ""});
    TORCH_CHECK(handle.has_value(), "`", name, "` has no schema in libtorch: define it first");
    auto* info = new OpInfo{ns, op, grad_op, n_inputs, n_outputs, save_outputs != 0, *handle};
    // Kept for the life of the process: dropping the Library would remove the kernel.
    auto* library = new torch::Library(
        torch::Library::IMPL, ns, c10::DispatchKey::Autograd, __FILE__, __LINE__);
    library->impl(
        op, torch::CppFunction::makeFromBoxedFunctor(std::make_unique<AutogradKernel>(info)));
    return 0;
  } catch (const std::exception& e) {
    write_error(message_of(e), err, err_len);
  } catch (...) {
    write_error("a C++ exception that is not a std::exception", err, err_len);
  }
  return 1;
}

extern "C" int kiln_torch_op_call(
    const char* name,
    const AtenTensorHandle* inputs,
    size_t n_inputs,
    const uint8_t* kinds,
    const uint64_t* bits,
    size_t n_attrs,
    AtenTensorHandle* outputs,
    size_t max_outputs,
    size_t* n_outputs,
    char* err,
    size_t err_len) {
  try {
    auto handle = c10::Dispatcher::singleton().findSchema({name, ""});
    TORCH_CHECK(handle.has_value(), "no op `", name, "` is registered in libtorch");
    const auto& arguments = handle->schema().arguments();
    TORCH_CHECK(
        n_inputs + n_attrs <= arguments.size(),
        "`", name, "` takes ", arguments.size(), " arguments, got ", n_inputs, " tensors and ",
        n_attrs, " attributes");
    torch::jit::Stack stack;
    stack.reserve(arguments.size());
    for (size_t i = 0; i < n_inputs; ++i) {
      stack.emplace_back(*reinterpret_cast<const at::Tensor*>(inputs[i]));
    }
    for (size_t i = 0; i < n_attrs; ++i) {
      switch (kinds[i]) {
        case KILN_TORCH_OP_ATTR_FLOAT: {
          double v;
          std::memcpy(&v, &bits[i], sizeof v);
          stack.emplace_back(v);
          break;
        }
        case KILN_TORCH_OP_ATTR_INT:
          stack.emplace_back(static_cast<int64_t>(bits[i]));
          break;
        case KILN_TORCH_OP_ATTR_BOOL:
          stack.emplace_back(bits[i] != 0);
          break;
        default:
          TORCH_CHECK(false, "attribute kind ", int(kinds[i]), " is not float, int or bool");
      }
    }
    for (size_t i = stack.size(); i < arguments.size(); ++i) {
      TORCH_CHECK(
          arguments[i].default_value().has_value(),
          "`", name, "`: the argument `", arguments[i].name(), "` has no default and was not given");
      stack.push_back(*arguments[i].default_value());
    }
    handle->callBoxed(stack);
    TORCH_CHECK(
        stack.size() <= max_outputs,
        "`", name, "` returned ", stack.size(), " values, expected at most ", max_outputs);
    for (const auto& v : stack) {
      TORCH_CHECK(v.isTensor(), "`", name, "` returned a ", v.tagKind(), ", expected tensors");
    }
    for (size_t i = 0; i < stack.size(); ++i) {
      outputs[i] = reinterpret_cast<AtenTensorHandle>(new at::Tensor(std::move(stack[i]).toTensor()));
    }
    *n_outputs = stack.size();
    return 0;
  } catch (const std::exception& e) {
    write_error(message_of(e), err, err_len);
  } catch (...) {
    write_error("a C++ exception that is not a std::exception", err, err_len);
  }
  return 1;
}
