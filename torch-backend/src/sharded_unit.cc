// The C++ side of src/sharded_unit.rs (see include/sharded_unit.h).

#include "kiln-torch/include/sharded_unit.h"

#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <stdexcept>
#include <utility>

#include "kiln-torch/src/sharded_unit.rs.h"

namespace kiln::torch {

using ::torch::autograd::AutogradContext;
using ::torch::autograd::variable_list;

void UnitTensors::push(const at::Tensor& tensor) { tensors.push_back(tensor); }

std::size_t UnitTensors::len() const { return tensors.size(); }

bool UnitTensors::defined(std::size_t i) const { return tensors.at(i).defined(); }

const at::Tensor& UnitTensors::get(std::size_t i) const { return tensors.at(i); }

void UnitOutput::set(const at::Tensor& tensor) { this->tensor = tensor; }

namespace {

std::atomic<std::int64_t> bytes_held{0};

// Owns the Rust part for as long as the graph node does.
struct UnitHolder : ::torch::CustomClassHolder {
  explicit UnitHolder(rust::Box<UnitPart> part) : part(std::move(part)) {}
  rust::Box<UnitPart> part;
};

std::size_t nbytes_of(const at::Tensor& t) {
  return static_cast<std::size_t>(t.numel()) * t.element_size();
}

// The part's full parameters, each alone in its own memory (so that freeing it
// frees exactly it): a tensor sharing its storage with others is copied.
std::vector<at::Tensor> gather(const UnitPart& part) {
  UnitTensors out;
  unit_gather(part, out);
  std::vector<at::Tensor> full;
  full.reserve(out.tensors.size());
  for (auto& t : out.tensors) {
    if (!t.defined()) {
      throw std::runtime_error("a sharded unit's gather returned an undefined tensor");
    }
    at::NoGradGuard no_grad;
    bool alone = t.is_contiguous() && t.storage_offset() == 0 &&
                 t.storage().nbytes() == nbytes_of(t) && t.storage().allocator() != nullptr;
    full.push_back(alone ? t.detach() : t.detach().clone(at::MemoryFormat::Contiguous));
    bytes_held += static_cast<std::int64_t>(nbytes_of(full.back()));
  }
  return full;
}

// Frees a gathered parameter's memory and keeps the tensor: the graph's saved
// references to it stay valid, and `restore` fills the same storage again.
void release(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == 0) {
    return;
  }
  bytes_held -= static_cast<std::int64_t>(impl->nbytes());
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

// Gives a released parameter its memory back, holding `value`. The copy goes
// through a second tensor on the same memory, outside autograd's version
// counter: the graph saved `t` and would take a write to it for an in-place
// modification.
void restore(const at::Tensor& t, const at::Tensor& value) {
  if (!value.sizes().equals(t.sizes()) || value.scalar_type() != t.scalar_type()) {
    throw std::runtime_error("a sharded unit's second gather returned another shape or dtype");
  }
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  const std::size_t n = nbytes_of(t);
  c10::Allocator* allocator = impl->allocator();
  if (allocator == nullptr) {
    allocator = c10::GetAllocator(t.device().type());
  }
  impl->set_data_ptr_noswap(allocator->allocate(n));
  impl->set_nbytes(n);
  bytes_held += static_cast<std::int64_t>(n);
  at::NoGradGuard no_grad;
  at::Tensor raw = at::from_blob(impl->mutable_data(), t.sizes(), t.strides(),
                                 t.options().requires_grad(false));
  raw.copy_(value);
}

// A unit's gathered parameters, as its graph node keeps them: released when
// the node goes, even if no backward pass ever ran (a step given up).
struct Leaves : ::torch::CustomClassHolder {
  explicit Leaves(std::vector<at::Tensor> tensors) : tensors(std::move(tensors)) {}
  ~Leaves() override {
    try {
      for (auto& t : tensors) {
        release(t);
      }
    } catch (...) {
    }
  }
  std::vector<at::Tensor> tensors;
};

// While a unit's part runs with autograd on this thread: the anchors of the
// units nested in it. Its backward pass asks for their gradients too, since
// `autograd::grad` runs only the nodes on a path to what it is asked for, and a
// nested unit whose input needs no gradient (the model's first layer, with the
// root unit around it) is on no path to the outer unit's parameters.
thread_local std::vector<at::Tensor>* nested_anchors = nullptr;

at::Tensor run(const UnitPart& part, const at::Tensor& x, const std::vector<at::Tensor>& params) {
  UnitTensors list;
  list.tensors = params;
  UnitOutput out;
  unit_run(part, x, list, out);
  return out.tensor;
}

class ShardedUnitFn : public ::torch::autograd::Function<ShardedUnitFn> {
 public:
  // `anchor` requires gradients, so that the backward pass reaches this node
  // (and the parameters get theirs) even when `x` does not.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& anchor,
                               c10::intrusive_ptr<UnitHolder> holder, bool reshard) {
    (void)anchor;
    auto leaves = c10::make_intrusive<Leaves>(gather(*holder->part));
    for (auto& leaf : leaves->tensors) {
      leaf.requires_grad_(true);
    }
    at::Tensor input = x.detach();
    input.requires_grad_(x.requires_grad());
    at::Tensor out;
    std::vector<at::Tensor> anchors;
    {
      at::AutoGradMode grad(true);
      std::vector<at::Tensor>* outer = nested_anchors;
      nested_anchors = &anchors;
      try {
        out = run(*holder->part, input, leaves->tensors);
      } catch (...) {
        nested_anchors = outer;
        throw;
      }
      nested_anchors = outer;
    }
    ctx->saved_data["anchors"] = anchors;
    // The part's own graph, kept until the backward pass (its activations, and
    // references to the parameters, whose memory is released now or after it).
    ctx->saved_data["out"] = out;
    ctx->saved_data["input"] = input;
    ctx->saved_data["reshard"] = reshard;
    ctx->saved_data["part"] = c10::IValue::make_capsule(std::move(holder));
    if (reshard) {
      for (auto& leaf : leaves->tensors) {
        release(leaf);
      }
    }
    ctx->saved_data["leaves"] = c10::IValue::make_capsule(std::move(leaves));
    return {out.detach()};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto holder =
        c10::static_intrusive_pointer_cast<UnitHolder>(ctx->saved_data["part"].toCapsule());
    at::Tensor out = ctx->saved_data["out"].toTensor();
    at::Tensor input = ctx->saved_data["input"].toTensor();
    auto held = c10::static_intrusive_pointer_cast<Leaves>(ctx->saved_data["leaves"].toCapsule());
    const std::vector<at::Tensor>& leaves = held->tensors;
    auto release_all = [&] {
      for (const auto& leaf : leaves) {
        release(leaf);
      }
    };
    variable_list computed;
    const bool x_grad = input.requires_grad();
    try {
      if (ctx->saved_data["reshard"].toBool()) {
        std::vector<at::Tensor> full = gather(*holder->part);
        if (full.size() != leaves.size()) {
          throw std::runtime_error(
              "a sharded unit's second gather returned another number of parameters");
        }
        for (std::size_t i = 0; i < leaves.size(); ++i) {
          restore(leaves[i], full[i]);
          bytes_held -= static_cast<std::int64_t>(nbytes_of(full[i]));
        }
      }
      variable_list wrt;
      if (x_grad) {
        wrt.push_back(input);
      }
      wrt.insert(wrt.end(), leaves.begin(), leaves.end());
      // Their gradients are dropped: asking for them runs the nested units'
      // backward passes, which reduce their parameters' gradients.
      std::vector<at::Tensor> anchors = ctx->saved_data["anchors"].toTensorVector();
      wrt.insert(wrt.end(), anchors.begin(), anchors.end());
      if (out.requires_grad() && grads[0].defined()) {
        computed = ::torch::autograd::grad({out}, wrt, {grads[0]}, /*retain_graph=*/false,
                                           /*create_graph=*/false, /*allow_unused=*/true);
      } else {
        computed = variable_list(wrt.size());
      }
    } catch (...) {
      release_all();
      throw;
    }
    release_all();
    ctx->saved_data.erase("out");
    ctx->saved_data.erase("anchors");
    UnitTensors param_grads;
    const std::size_t first = x_grad ? 1 : 0;
    for (std::size_t i = first; i < first + leaves.size(); ++i) {
      param_grads.push(computed[i]);
    }
    unit_reduce(*holder->part, param_grads);
    // One gradient per input of forward: x, the anchor, the part, the flag.
    return {x_grad ? computed[0] : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::unique_ptr<at::Tensor> sharded_unit(const at::Tensor& x, bool reshard_after_forward,
                                         rust::Box<UnitPart> part) {
  if (!at::GradMode::is_enabled()) {
    // Nothing keeps the parameters after the call: dropped, not released (an
    // output may be a view of one).
    std::vector<at::Tensor> full = gather(*part);
    auto forget = [&] {
      for (auto& t : full) {
        bytes_held -= static_cast<std::int64_t>(nbytes_of(t));
      }
    };
    at::Tensor out;
    try {
      out = run(*part, x, full);
    } catch (...) {
      forget();
      throw;
    }
    forget();
    return std::make_unique<at::Tensor>(out);
  }
  auto holder = c10::make_intrusive<UnitHolder>(std::move(part));
  // Float whatever `x` is (token ids, say): only floats can require gradients.
  at::Tensor anchor =
      at::empty({0}, at::TensorOptions().dtype(at::kFloat).device(x.device())).requires_grad_(true);
  if (nested_anchors != nullptr) {
    nested_anchors->push_back(anchor);
  }
  auto out = ShardedUnitFn::apply(x, anchor, std::move(holder), reshard_after_forward);
  return std::make_unique<at::Tensor>(out[0]);
}

std::int64_t sharded_unit_bytes_held() { return bytes_held.load(); }

void accumulate_grad(const at::Tensor& param, const at::Tensor& grad) {
  TORCH_CHECK(grad.sizes() == param.sizes() && grad.scalar_type() == param.scalar_type() &&
                  grad.device() == param.device(),
              "accumulate_grad: a gradient of shape ", grad.sizes(), ", ", grad.scalar_type(),
              " on ", grad.device(), " for a parameter of shape ", param.sizes(), ", ",
              param.scalar_type(), " on ", param.device());
  at::NoGradGuard no_grad;
  // `mutable_grad` is the leaf's own slot (what `.grad` reads).
  at::Tensor& slot = const_cast<at::Tensor&>(param).mutable_grad();
  if (slot.defined()) {
    slot.add_(grad);
  } else {
    slot = grad.detach().clone(at::MemoryFormat::Contiguous);
  }
}

}  // namespace kiln::torch
