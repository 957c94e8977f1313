// Step 2: the op. Squared ReLU, y = max(x, 0)^2 (as in the Primer transformer),
// with its gradient dy/dx = 2 max(x, 0): a CPU kernel on every core, an autograd
// function, and the registration as torch.ops.example.squared_relu.
// Nothing here calls Rust, so the same object also goes into the shared library.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace example {
namespace {

at::Tensor forward_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "example::squared_relu: x must be float32 or float64, got ", x.scalar_type());
  const auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "squared_relu", [&] {
    const scalar_t* in = xc.data_ptr<scalar_t>();
    scalar_t* out = y.data_ptr<scalar_t>();
    at::parallel_for(0, xc.numel(), 4096, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) {
        const scalar_t r = in[i] > 0 ? in[i] : scalar_t(0);
        out[i] = r * r;
      }
    });
  });
  return y;
}

at::Tensor backward_cpu(const at::Tensor& grad, const at::Tensor& x) {
  TORCH_CHECK(grad.sizes() == x.sizes(), "example::squared_relu_backward: grad has shape ",
              grad.sizes(), ", expected ", x.sizes());
  const auto xc = x.contiguous();
  const auto gc = grad.contiguous().to(x.scalar_type());
  auto dx = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "squared_relu_backward", [&] {
    const scalar_t* in = xc.data_ptr<scalar_t>();
    const scalar_t* g = gc.data_ptr<scalar_t>();
    scalar_t* out = dx.data_ptr<scalar_t>();
    at::parallel_for(0, xc.numel(), 4096, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) out[i] = in[i] > 0 ? scalar_t(2) * in[i] * g[i] : 0;
    });
  });
  return dx;
}

class SquaredRelu : public torch::autograd::Function<SquaredRelu> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    ctx->save_for_backward({x});
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("example::squared_relu", "")
                         .typed<at::Tensor(const at::Tensor&)>();
    return op.call(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("example::squared_relu_backward", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    return {op.call(grads[0], ctx->get_saved_variables()[0])};
  }
};

at::Tensor forward_autograd(const at::Tensor& x) { return SquaredRelu::apply(x); }

}  // namespace
}  // namespace example

TORCH_LIBRARY(example, m) {
  m.def("squared_relu(Tensor x) -> Tensor");
  m.def("squared_relu_backward(Tensor grad, Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(example, CPU, m) {
  m.impl("squared_relu", &example::forward_cpu);
  m.impl("squared_relu_backward", &example::backward_cpu);
}
TORCH_LIBRARY_IMPL(example, Autograd, m) { m.impl("squared_relu", &example::forward_autograd); }
