// The C++ side of src/checkpoint.rs (see include/activation_checkpoint.h).

#include "kiln-torch/include/activation_checkpoint.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>
#include <utility>

#include "kiln-torch/src/checkpoint.rs.h"

namespace kiln::torch {

using ::torch::autograd::AutogradContext;
using ::torch::autograd::variable_list;

void TensorSink::set(const at::Tensor& tensor) { this->tensor = tensor; }

void ParamList::push(const at::Tensor& tensor) { tensors.push_back(tensor); }

std::unique_ptr<ParamList> new_param_list() { return std::make_unique<ParamList>(); }

namespace {

// Owns the Rust part for as long as the graph node does.
struct PartHolder : ::torch::CustomClassHolder {
  explicit PartHolder(rust::Box<Recompute> part) : part(std::move(part)) {}
  rust::Box<Recompute> part;
};

at::Tensor run_part(const Recompute& part, const at::Tensor& x) {
  TensorSink sink;
  recompute(part, x, sink);
  return sink.tensor;
}

// The default generators a part may draw from (dropout): the CPU's, and the
// CUDA device's when `x` is on one.
std::vector<at::Generator> generators(const at::Tensor& x) {
  std::vector<at::Generator> out{at::globalContext().defaultGenerator(c10::DeviceType::CPU)};
  if (x.is_cuda()) {
    out.push_back(at::globalContext().defaultGenerator(x.device()));
  }
  return out;
}

std::vector<at::Tensor> rng_states(std::vector<at::Generator>& gens) {
  std::vector<at::Tensor> states;
  for (auto& gen : gens) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    states.push_back(gen.get_state());
  }
  return states;
}

void set_rng_states(std::vector<at::Generator>& gens, const std::vector<at::Tensor>& states) {
  for (size_t i = 0; i < gens.size(); ++i) {
    std::lock_guard<std::mutex> lock(gens[i].mutex());
    gens[i].set_state(states[i]);
  }
}

class Checkpointed : public ::torch::autograd::Function<Checkpointed> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList params,
                               c10::intrusive_ptr<PartHolder> holder) {
    auto gens = generators(x);
    c10::List<at::Tensor> states;
    for (auto& s : rng_states(gens)) {
      states.push_back(std::move(s));
    }
    ctx->saved_data["rng"] = states;
    ctx->saved_data["x_requires_grad"] = x.requires_grad();
    variable_list saved{x};
    saved.insert(saved.end(), params.begin(), params.end());
    ctx->save_for_backward(saved);
    at::Tensor out = run_part(*holder->part, x);
    ctx->saved_data["part"] = c10::IValue::make_capsule(std::move(holder));
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto holder =
        c10::static_intrusive_pointer_cast<PartHolder>(ctx->saved_data["part"].toCapsule());
    at::Tensor x = saved[0].detach();
    x.requires_grad_(ctx->saved_data["x_requires_grad"].toBool());
    // The part again, drawing what it drew in the forward pass.
    auto gens = generators(x);
    auto now = rng_states(gens);
    std::vector<at::Tensor> then;
    for (const auto& s : ctx->saved_data["rng"].toTensorList()) {
      then.push_back(s);
    }
    at::Tensor out;
    set_rng_states(gens, then);
    try {
      at::AutoGradMode grad(true);
      out = run_part(*holder->part, x);
    } catch (...) {
      set_rng_states(gens, now);
      throw;
    }
    set_rng_states(gens, now);
    // One gradient per input of forward: x, each parameter, the part (none).
    variable_list result(saved.size() + 1);
    variable_list wrt;
    std::vector<size_t> slots;
    for (size_t i = 0; i < saved.size(); ++i) {
      const at::Tensor& t = i == 0 ? x : saved[i];
      if (t.requires_grad()) {
        wrt.push_back(t);
        slots.push_back(i);
      }
    }
    if (!wrt.empty() && out.requires_grad()) {
      auto computed = ::torch::autograd::grad({out}, wrt, {grads[0]}, /*retain_graph=*/false,
                                              /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t k = 0; k < slots.size(); ++k) {
        result[slots[k]] = computed[k];
      }
    }
    return result;
  }
};

}  // namespace

std::unique_ptr<at::Tensor> checkpointed(const at::Tensor& x, const ParamList& params,
                                         rust::Box<Recompute> part) {
  if (!at::GradMode::is_enabled()) {
    return std::make_unique<at::Tensor>(run_part(*part, x));
  }
  auto holder = c10::make_intrusive<PartHolder>(std::move(part));
  auto out = Checkpointed::apply(x, at::TensorList(params.tensors), std::move(holder));
  return std::make_unique<at::Tensor>(out[0]);
}

}  // namespace kiln::torch
