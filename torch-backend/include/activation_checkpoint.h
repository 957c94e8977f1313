// Activation checkpointing (src/checkpoint.rs, src/checkpoint.cc): a part of a
// model runs without keeping its activations, and runs again in the backward
// pass to compute its gradients, as torch.utils.checkpoint does.
#pragma once

#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "rust/cxx.h"

namespace kiln::torch {

// Runs the part again (Rust, src/checkpoint.rs).
struct Recompute;

// Where Rust puts the part's output.
class TensorSink {
 public:
  void set(const at::Tensor& tensor);
  at::Tensor tensor;
};

// The part's parameters, filled from Rust one at a time.
class ParamList {
 public:
  void push(const at::Tensor& tensor);
  std::vector<at::Tensor> tensors;
};
std::unique_ptr<ParamList> new_param_list();

// The part's output on `x`, computed without keeping its activations when
// autograd records (else as a plain call): a graph node whose backward runs the
// part again on `x`, with the random generators as they were, and returns the
// gradients of `x` and of `params`.
std::unique_ptr<at::Tensor> checkpointed(const at::Tensor& x, const ParamList& params,
                                         rust::Box<Recompute> part);

}  // namespace kiln::torch
