// Fused Adam (include/fused_adam.h): libtorch's multi-tensor Adam and AdamW
// kernels (`at::_fused_adam_`, `at::_fused_adamw_`) for kiln-torch's optimizer in
// capturable mode. tch 0.24 does not expose them.
#pragma once

namespace kiln::torch {

// Defined by the cxx bridge (src/optim/fused.rs).
struct FusedAdamTensors;
struct FusedAdamHypers;

// Adds one to every step count, then runs one fused Adam (or AdamW) update over
// the lists, without gradient recording. On error, the step counts are put back
// and the error is rethrown as std::runtime_error.
void fused_adam_step(const FusedAdamTensors& tensors, const FusedAdamHypers& hypers);

}  // namespace kiln::torch
