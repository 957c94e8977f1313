// The C++ side of src/optim/fused.rs (see include/fused_adam.h).

#include "kiln-torch/include/fused_adam.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_sub.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>

#include "kiln/rethrowing.h"

#include "kiln-torch/src/optim/fused.rs.h"

namespace kiln::torch {

void FusedAdamTensors::push(FusedAdamList list, const at::Tensor& tensor) {
  switch (list) {
    case FusedAdamList::Params: params.push_back(tensor); break;
    case FusedAdamList::Grads: grads.push_back(tensor); break;
    case FusedAdamList::ExpAvgs: exp_avgs.push_back(tensor); break;
    case FusedAdamList::ExpAvgSqs: exp_avg_sqs.push_back(tensor); break;
    case FusedAdamList::MaxExpAvgSqs: max_exp_avg_sqs.push_back(tensor); break;
    case FusedAdamList::Steps: steps.push_back(tensor); break;
  }
}

void FusedAdamTensors::set_lr_tensor(const at::Tensor& lr) { lr_tensor = lr; }

void FusedAdamTensors::set_found_inf(const at::Tensor& flag) { found_inf = flag; }

std::unique_ptr<FusedAdamTensors> new_fused_adam_tensors() {
  return std::make_unique<FusedAdamTensors>();
}

void fused_adam_step(const FusedAdamTensors& tensors, const FusedAdamHypers& hypers) {
  rethrowing("fused Adam step", [&] {
    const at::NoGradGuard no_grad;
    const auto& params = tensors.params;
    const auto& grads = tensors.grads;
    const auto& exp_avgs = tensors.exp_avgs;
    const auto& exp_avg_sqs = tensors.exp_avg_sqs;
    const auto& max_exp_avg_sqs = tensors.max_exp_avg_sqs;
    const auto& steps = tensors.steps;
    // As torch.optim's _fused_adam: count the step on the device, then update.
    at::_foreach_add_(steps, 1);
    try {
      // The overloads take the learning rate as a tensor (read on the device) or a
      // double; the kernel is the same.
      const auto update = [&](const auto& lr) {
        if (hypers.decoupled) {
          at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr,
                            hypers.beta1, hypers.beta2, hypers.weight_decay, hypers.eps,
                            hypers.amsgrad, /*maximize=*/false, /*grad_scale=*/{},
                            tensors.found_inf);
        } else {
          at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr,
                           hypers.beta1, hypers.beta2, hypers.weight_decay, hypers.eps,
                           hypers.amsgrad, /*maximize=*/false, /*grad_scale=*/{},
                           tensors.found_inf);
        }
      };
      if (tensors.lr_tensor) {
        update(*tensors.lr_tensor);
      } else {
        update(hypers.lr);
      }
      if (tensors.found_inf) {
        // As torch.optim's _fused_adam: a skipped step does not count.
        const std::vector<at::Tensor> flags(steps.size(), *tensors.found_inf);
        at::_foreach_sub_(steps, flags);
      }
    } catch (...) {
      at::_foreach_sub_(steps, 1);
      throw;
    }
  });
}

void non_finite_check_and_unscale(const FusedAdamTensors& tensors, const at::Tensor& found_inf,
                                  const at::Tensor& inv_scale) {
  rethrowing("unscaling the gradients", [&] {
    const at::NoGradGuard no_grad;
    at::Tensor flag = found_inf;
    at::_amp_foreach_non_finite_check_and_unscale_(tensors.grads, flag, inv_scale);
  });
}

}  // namespace kiln::torch
