// Kiln's fused ops in libtorch: CPU kernels (every core, through libtorch's parallel_for),
// autograd functions, and their registration with TORCH_LIBRARY under `kiln`, so
// they are `torch.ops.kiln.<op>` in Python and TorchScript and in this process.
// This file has no Rust dependency: the same object links into the shared library
// Python loads with `torch.ops.load_library`.

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/library.h>

#include <atomic>
#include <exception>

#include "../include/checks.h"
#include "../include/kernels.h"

namespace kiln::ops {
namespace {

using checks::check_bias_gelu;
using checks::check_softmax_xent;
using checks::check_swish;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// at::parallel_for is a header template whose parallel path exists only where
// _OPENMP is defined; compiled here, without -fopenmp, it runs every range on the
// calling thread. torch_parallel_for (libtorch's stable C shim, 2.10 and later) is
// the same at::parallel_for compiled inside libtorch, on its intra-op OpenMP threads
// (serial inside a parallel region, like at::parallel_for). The shim turns an
// exception into an error code, so the callback keeps the first one and rethrows it
// here.
struct AtParallel {
  template <typename F>
  void operator()(std::int64_t begin, std::int64_t end, std::int64_t grain, const F& f) const {
    struct Call {
      const F& f;
      std::exception_ptr error;
      std::atomic_flag failed = ATOMIC_FLAG_INIT;
    } call{f, nullptr};
    const auto run = [](std::int64_t b, std::int64_t e, void* ctx) {
      auto& c = *static_cast<Call*>(ctx);
      try {
        c.f(b, e);
      } catch (...) {
        if (!c.failed.test_and_set()) c.error = std::current_exception();
      }
    };
    const AOTITorchError status = torch_parallel_for(begin, end, grain, run, &call);
    if (call.error) std::rethrow_exception(call.error);
    TORCH_CHECK(status == AOTI_TORCH_SUCCESS, "kiln: torch_parallel_for failed");
  }
};

// ----- bias + GELU -----

at::Tensor bias_gelu_cpu(const at::Tensor& x, const at::Tensor& bias) {
  check_bias_gelu(x, bias);
  const auto xc = x.contiguous();
  const auto bc = bias.contiguous();
  auto y = at::empty_like(xc);
  const std::int64_t cols = bias.size(0);
  const std::int64_t rows = cols == 0 ? 0 : xc.numel() / cols;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "kiln::bias_gelu", [&] {
    kernels::bias_gelu_forward<scalar_t>(xc.data_ptr<scalar_t>(), bc.data_ptr<scalar_t>(),
                                         y.data_ptr<scalar_t>(), rows, cols, AtParallel{});
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward_cpu(const at::Tensor& grad,
                                                          const at::Tensor& x,
                                                          const at::Tensor& bias) {
  check_bias_gelu(x, bias);
  TORCH_CHECK(grad.sizes() == x.sizes(), "kiln::bias_gelu_backward: grad has shape ",
              grad.sizes(), ", expected x's ", x.sizes());
  const auto gc = grad.contiguous().to(x.scalar_type());
  const auto xc = x.contiguous();
  const auto bc = bias.contiguous();
  auto dx = at::empty_like(xc);
  auto db = at::empty_like(bc);
  const std::int64_t cols = bias.size(0);
  const std::int64_t rows = cols == 0 ? 0 : xc.numel() / cols;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "kiln::bias_gelu_backward", [&] {
    kernels::bias_gelu_backward<scalar_t>(gc.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(),
                                          bc.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(),
                                          db.data_ptr<scalar_t>(), rows, cols, AtParallel{});
  });
  return {dx, db};
}

// ----- softmax cross-entropy with label smoothing -----

at::Tensor softmax_xent_cpu(const at::Tensor& logits, const at::Tensor& target, double eps) {
  check_softmax_xent(logits, target, eps);
  const auto lc = logits.contiguous();
  const auto tc = target.contiguous();
  auto loss = at::empty({logits.size(0)}, logits.options());
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "kiln::softmax_xent", [&] {
    kernels::softmax_xent_forward<scalar_t>(lc.data_ptr<scalar_t>(), tc.data_ptr<std::int64_t>(),
                                            static_cast<scalar_t>(eps),
                                            loss.data_ptr<scalar_t>(), lc.size(0), lc.size(1),
                                            AtParallel{});
  });
  return loss;
}

at::Tensor softmax_xent_backward_cpu(const at::Tensor& grad, const at::Tensor& logits,
                                     const at::Tensor& target, double eps) {
  check_softmax_xent(logits, target, eps);
  TORCH_CHECK(grad.dim() == 1 && grad.size(0) == logits.size(0),
              "kiln::softmax_xent_backward: grad must have shape [", logits.size(0), "], got ",
              grad.sizes());
  const auto gc = grad.contiguous().to(logits.scalar_type());
  const auto lc = logits.contiguous();
  const auto tc = target.contiguous();
  auto dlogits = at::empty_like(lc);
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "kiln::softmax_xent_backward", [&] {
    kernels::softmax_xent_backward<scalar_t>(
        gc.data_ptr<scalar_t>(), lc.data_ptr<scalar_t>(), tc.data_ptr<std::int64_t>(),
        static_cast<scalar_t>(eps), dlogits.data_ptr<scalar_t>(), lc.size(0), lc.size(1),
        AtParallel{});
  });
  return dlogits;
}

// ----- Swish-beta -----

at::Tensor swish_cpu(const at::Tensor& x, const at::Tensor& beta) {
  check_swish(x, beta);
  const auto xc = x.contiguous();
  const auto bc = beta.contiguous();
  auto y = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "kiln::swish", [&] {
    kernels::swish_forward<scalar_t>(xc.data_ptr<scalar_t>(), bc.data_ptr<scalar_t>(),
                                     y.data_ptr<scalar_t>(), xc.numel(), AtParallel{});
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> swish_backward_cpu(const at::Tensor& grad,
                                                      const at::Tensor& x,
                                                      const at::Tensor& beta) {
  check_swish(x, beta);
  TORCH_CHECK(grad.sizes() == x.sizes(), "kiln::swish_backward: grad has shape ",
              grad.sizes(), ", expected x's ", x.sizes());
  const auto gc = grad.contiguous().to(x.scalar_type());
  const auto xc = x.contiguous();
  const auto bc = beta.contiguous();
  auto dx = at::empty_like(xc);
  auto db = at::empty_like(bc);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "kiln::swish_backward", [&] {
    kernels::swish_backward<scalar_t>(gc.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(),
                                      bc.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(),
                                      db.data_ptr<scalar_t>(), xc.numel(), AtParallel{});
  });
  return {dx, db};
}

// ----- autograd: forward below the autograd key, backward through the backward ops -----

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

class BiasGelu : public torch::autograd::Function<BiasGelu> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& bias) {
    ctx->save_for_backward({x, bias});
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op("kiln::bias_gelu").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    return fwd.call(x, bias);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    static auto bwd = op("kiln::bias_gelu_backward")
                          .typed<std::tuple<at::Tensor, at::Tensor>(
                              const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    auto [dx, db] = bwd.call(grads[0], saved[0], saved[1]);
    return {dx, db};
  }
};

class SoftmaxXent : public torch::autograd::Function<SoftmaxXent> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, double eps) {
    ctx->save_for_backward({logits, target});
    ctx->saved_data["eps"] = eps;
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op("kiln::softmax_xent")
                          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
    return fwd.call(logits, target, eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const double eps = ctx->saved_data["eps"].toDouble();
    static auto bwd = op("kiln::softmax_xent_backward")
                          .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, double)>();
    return {bwd.call(grads[0], saved[0], saved[1], eps), at::Tensor(), at::Tensor()};
  }
};

class Swish : public torch::autograd::Function<Swish> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& beta) {
    ctx->save_for_backward({x, beta});
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op("kiln::swish").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    return fwd.call(x, beta);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    static auto bwd = op("kiln::swish_backward")
                          .typed<std::tuple<at::Tensor, at::Tensor>(
                              const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    auto [dx, db] = bwd.call(grads[0], saved[0], saved[1]);
    return {dx, db};
  }
};

at::Tensor bias_gelu_autograd(const at::Tensor& x, const at::Tensor& bias) {
  return BiasGelu::apply(x, bias);
}
at::Tensor softmax_xent_autograd(const at::Tensor& logits, const at::Tensor& target, double eps) {
  return SoftmaxXent::apply(logits, target, eps);
}
at::Tensor swish_autograd(const at::Tensor& x, const at::Tensor& beta) {
  return Swish::apply(x, beta);
}

// ----- autocast: the kernels are float32/float64, so under autocast (Kiln's
// bf16-mixed, torch.autocast) the ops run in float32, as PyTorch's autocast runs
// the ops on its float32 list; the casts are differentiable, so gradients flow
// back to the bf16 activations and float32 parameters. -----

// Leaves the autocast key for the redispatch, as libtorch's own autocast wrappers do.
template <c10::DeviceType device>
c10::impl::ExcludeDispatchKeyGuard below_autocast() {
  return c10::impl::ExcludeDispatchKeyGuard(
      at::autocast::get_autocast_dispatch_key_from_device_type(device));
}

// `t` in float32 when it is a floating-point tensor of another dtype.
template <c10::DeviceType device>
at::Tensor f32(const at::Tensor& t) {
  return at::autocast::cached_cast(at::kFloat, t, device);
}

template <c10::DeviceType device>
at::Tensor bias_gelu_autocast(const at::Tensor& x, const at::Tensor& bias) {
  const auto guard = below_autocast<device>();
  static auto fwd = op("kiln::bias_gelu").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return fwd.call(f32<device>(x), f32<device>(bias));
}

template <c10::DeviceType device>
at::Tensor softmax_xent_autocast(const at::Tensor& logits, const at::Tensor& target,
                                 double eps) {
  const auto guard = below_autocast<device>();
  static auto fwd = op("kiln::softmax_xent")
                        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return fwd.call(f32<device>(logits), f32<device>(target), eps);
}

template <c10::DeviceType device>
at::Tensor swish_autocast(const at::Tensor& x, const at::Tensor& beta) {
  const auto guard = below_autocast<device>();
  static auto fwd = op("kiln::swish").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return fwd.call(f32<device>(x), f32<device>(beta));
}

}  // namespace

// Referenced from the cxx bridge so that the linker keeps this object file (and
// with it the static registrations below) in every Rust binary using kiln-fused-ops.
int torch_ops_registered() { return 1; }

}  // namespace kiln::ops

TORCH_LIBRARY(kiln, m) {
  m.def("bias_gelu(Tensor x, Tensor bias) -> Tensor");
  m.def("bias_gelu_backward(Tensor grad, Tensor x, Tensor bias) -> (Tensor, Tensor)");
  m.def("softmax_xent(Tensor logits, Tensor target, float label_smoothing=0.0) -> Tensor");
  m.def(
      "softmax_xent_backward(Tensor grad, Tensor logits, Tensor target, float label_smoothing) "
      "-> Tensor");
  m.def("swish(Tensor x, Tensor beta) -> Tensor");
  m.def("swish_backward(Tensor grad, Tensor x, Tensor beta) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("bias_gelu", &kiln::ops::bias_gelu_cpu);
  m.impl("bias_gelu_backward", &kiln::ops::bias_gelu_backward_cpu);
  m.impl("softmax_xent", &kiln::ops::softmax_xent_cpu);
  m.impl("softmax_xent_backward", &kiln::ops::softmax_xent_backward_cpu);
  m.impl("swish", &kiln::ops::swish_cpu);
  m.impl("swish_backward", &kiln::ops::swish_backward_cpu);
}

TORCH_LIBRARY_IMPL(kiln, Autograd, m) {
  m.impl("bias_gelu", &kiln::ops::bias_gelu_autograd);
  m.impl("softmax_xent", &kiln::ops::softmax_xent_autograd);
  m.impl("swish", &kiln::ops::swish_autograd);
}

TORCH_LIBRARY_IMPL(kiln, AutocastCPU, m) {
  m.impl("bias_gelu", &kiln::ops::bias_gelu_autocast<c10::DeviceType::CPU>);
  m.impl("softmax_xent", &kiln::ops::softmax_xent_autocast<c10::DeviceType::CPU>);
  m.impl("swish", &kiln::ops::swish_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(kiln, AutocastCUDA, m) {
  m.impl("bias_gelu", &kiln::ops::bias_gelu_autocast<c10::DeviceType::CUDA>);
  m.impl("softmax_xent", &kiln::ops::softmax_xent_autocast<c10::DeviceType::CUDA>);
  m.impl("swish", &kiln::ops::swish_autocast<c10::DeviceType::CUDA>);
}
