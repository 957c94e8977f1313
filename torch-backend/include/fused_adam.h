// Fused Adam (include/fused_adam.h): libtorch's multi-tensor Adam and AdamW
// kernels (`at::_fused_adam_`, `at::_fused_adamw_`) for kiln-torch's optimizer in
// capturable mode. tch 0.24 does not expose them.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace kiln::torch {

// Defined by the cxx bridge (src/optim/fused.rs).
enum class FusedAdamList : std::uint8_t;
struct FusedAdamHypers;

// The tensor lists of one fused step. Rust fills them one tensor at a time with
// `const at::Tensor&` (kiln-torch's cxx_tensor), since cxx passes no list of
// opaque C++ values; each entry is a copy of the handle (a reference count).
class FusedAdamTensors {
 public:
  void push(FusedAdamList list, const at::Tensor& tensor);
  // A 0-dim float32 learning rate, read on the device, instead of hypers.lr.
  void set_lr_tensor(const at::Tensor& lr);
  // A 1-element float32 flag on the parameters' device: when it is non-zero the
  // kernel skips the update and the step counts stay as they were (GradScaler's
  // skipped step, decided on the device).
  void set_found_inf(const at::Tensor& found_inf);

  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
  std::optional<at::Tensor> lr_tensor;
  std::optional<at::Tensor> found_inf;
};

std::unique_ptr<FusedAdamTensors> new_fused_adam_tensors();

// Adds one to every step count, then runs one fused Adam (or AdamW) update over
// the lists, without gradient recording. On error, the step counts are put back
// and the error is rethrown as std::runtime_error.
void fused_adam_step(const FusedAdamTensors& tensors, const FusedAdamHypers& hypers);

// torch.amp.GradScaler's unscale: multiplies every tensor of the `grads` list by
// `inv_scale` in place and sets `found_inf` to 1 if any element is inf or NaN
// (`at::_amp_foreach_non_finite_check_and_unscale_`), without synchronising.
void non_finite_check_and_unscale(const FusedAdamTensors& tensors, const at::Tensor& found_inf,
                                  const at::Tensor& inv_scale);

}  // namespace kiln::torch
