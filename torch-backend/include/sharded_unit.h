// Sharded units (src/sharded_unit.rs, src/sharded_unit.cc): a part of a model
// whose parameters live sharded across ranks. Its forward pass gathers them,
// runs the part and (optionally) frees them again; its backward pass gathers
// them again if they were freed, computes the part's gradients and hands the
// parameters' gradients to the strategy to reduce, then frees them. FSDP's
// unit, with the collectives left to the caller (kiln-c10d).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "rust/cxx.h"

namespace kiln::torch {

// The part and its collectives (Rust, src/sharded_unit.rs).
struct UnitPart;

// Tensors passed between the two languages, some possibly undefined (a
// gradient the backward pass did not reach).
class UnitTensors {
 public:
  void push(const at::Tensor& tensor);
  std::size_t len() const;
  bool defined(std::size_t i) const;
  const at::Tensor& get(std::size_t i) const;
  std::vector<at::Tensor> tensors;
};

// Where Rust puts the part's output.
class UnitOutput {
 public:
  void set(const at::Tensor& tensor);
  at::Tensor tensor;
};

// The part's output on `x`. When autograd records, a graph node: the gathered
// parameters are freed after the forward pass when `reshard_after_forward`
// (and gathered again for the backward pass), and always after the backward
// pass, whose parameter gradients go to the part's `reduce`. Without autograd,
// gather, run, free.
std::unique_ptr<at::Tensor> sharded_unit(const at::Tensor& x, bool reshard_after_forward,
                                         rust::Box<UnitPart> part);

// Bytes of gathered parameters the sharded units of this process hold now.
std::int64_t sharded_unit_bytes_held();

// Adds `grad` into `param`'s `.grad` (a copy of it when `.grad` is undefined),
// as autograd's accumulation does: what a strategy does with a reduced
// gradient shard. Throws on a shape, dtype or device that is not `param`'s.
void accumulate_grad(const at::Tensor& param, const at::Tensor& grad);

}  // namespace kiln::torch
