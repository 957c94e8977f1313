// The C++ side of src/optim/fused.rs (see include/fused_adam.h).

#include "kiln-torch/include/fused_adam.h"

#include <cstddef>
#include <vector>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_sub.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>

#include "kiln/rethrowing.h"

#include "kiln-torch/src/optim/fused.rs.h"

namespace kiln::torch {
namespace {

const at::Tensor& tensor_at(std::size_t address) {
  return *reinterpret_cast<const at::Tensor*>(address);
}

std::vector<at::Tensor> tensors_at(const rust::Vec<std::size_t>& addresses) {
  std::vector<at::Tensor> out;
  out.reserve(addresses.size());
  for (const auto address : addresses) out.push_back(tensor_at(address));
  return out;
}

}  // namespace

void fused_adam_step(const FusedAdamTensors& tensors, const FusedAdamHypers& hypers) {
  rethrowing("fused Adam step", [&] {
    const at::NoGradGuard no_grad;
    const auto params = tensors_at(tensors.params);
    const auto grads = tensors_at(tensors.grads);
    const auto exp_avgs = tensors_at(tensors.exp_avgs);
    const auto exp_avg_sqs = tensors_at(tensors.exp_avg_sqs);
    const auto max_exp_avg_sqs = tensors_at(tensors.max_exp_avg_sqs);
    const auto steps = tensors_at(tensors.steps);
    // As torch.optim's _fused_adam: count the step on the device, then update.
    at::_foreach_add_(steps, 1);
    try {
      // The overloads take the learning rate as a tensor (read on the device) or a
      // double; the kernel is the same.
      const auto update = [&](const auto& lr) {
        if (hypers.decoupled) {
          at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr,
                            hypers.beta1, hypers.beta2, hypers.weight_decay, hypers.eps,
                            hypers.amsgrad, /*maximize=*/false);
        } else {
          at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr,
                           hypers.beta1, hypers.beta2, hypers.weight_decay, hypers.eps,
                           hypers.amsgrad, /*maximize=*/false);
        }
      };
      if (tensors.lr_tensor != 0) {
        update(tensor_at(tensors.lr_tensor));
      } else {
        update(hypers.lr);
      }
    } catch (...) {
      at::_foreach_sub_(steps, 1);
      throw;
    }
  });
}

}  // namespace kiln::torch
