// TorchScript modules (include/script.h): what tch's `CModule` does not expose of
// a `::torch::jit::Module`, its buffers (batch-norm running statistics), for
// src/script.rs.
#pragma once

#include <cstddef>
#include <memory>

#include <ATen/core/Tensor.h>
#include <torch/csrc/jit/api/module.h>

#include "rust/cxx.h"

namespace kiln::script {

// The dotted names of every buffer of `module` and its submodules, in
// `named_buffers()` order (PyTorch's state-dict names: `layer1.0.bn1.running_mean`).
rust::Vec<rust::String> buffer_names(const ::torch::jit::Module& module);

// The buffer `name` (one of buffer_names), a handle sharing storage with the
// module's. Throws std::out_of_range for an unknown name.
std::unique_ptr<at::Tensor> buffer(const ::torch::jit::Module& module, rust::Str name);

// The dotted names of every parameter, in `named_parameters()` order.
rust::Vec<rust::String> parameter_names(const ::torch::jit::Module& module);

// The parameter `name`, a handle sharing storage with the module's.
std::unique_ptr<at::Tensor> parameter(const ::torch::jit::Module& module, rust::Str name);

// The dotted names of every submodule (not the module itself) and, at the same
// index of `types`, its TorchScript class name
// (`__torch__.torch.nn.modules.batchnorm.BatchNorm2d`).
rust::Vec<rust::String> submodule_names(const ::torch::jit::Module& module,
                                        rust::Vec<rust::String>& types);

// Sets the `training` flag of the submodule `name` and of its own submodules, as
// Python's `module.get_submodule(name).train(training)`. Throws
// std::out_of_range for an unknown name.
void set_submodule_training(const ::torch::jit::Module& module, rust::Str name, bool training);

}  // namespace kiln::script
