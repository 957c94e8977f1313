// TorchScript export (include/script_export.h).
#include "kiln-torch/include/script_export.h"

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/grad_mode.h>
#include <torch/csrc/jit/frontend/resolver.h>

namespace kiln::script {

ExportBuilder::ExportBuilder() : cu_(std::make_shared<::torch::jit::CompilationUnit>()) {}

::torch::jit::Module& ExportBuilder::module_at(std::size_t node) {
  if (node >= modules_.size()) {
    throw std::out_of_range("no export module " + std::to_string(node));
  }
  return modules_[node];
}

const ::torch::jit::Module& ExportBuilder::module_at(std::size_t node) const {
  if (node >= modules_.size()) {
    throw std::out_of_range("no export module " + std::to_string(node));
  }
  return modules_[node];
}

std::size_t ExportBuilder::add_module(rust::Str class_name) {
  const c10::QualifiedName name("__torch__.kiln." + std::string(class_name));
  ::torch::jit::Module module(name, cu_, /*shouldMangle=*/true);
  // Every nn.Module has it: `forward` reads it, and `train()` sets it.
  module.register_attribute("training", c10::BoolType::get(), true);
  modules_.push_back(module);
  return modules_.size() - 1;
}

std::size_t ExportBuilder::add_script_module(const ::torch::jit::Module& module) {
  ::torch::jit::Module copy;
  {
    // Copies without autograd history: the copies are leaves, then get their
    // original's `requires_grad` back (a frozen backbone stays frozen).
    at::NoGradGuard no_grad;
    copy = module.deepcopy(at::Device(at::kCPU));
  }
  std::vector<std::pair<std::string, bool>> originals;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    originals.emplace_back(item.name, item.value.requires_grad());
  }
  std::size_t index = 0;
  for (const auto& item : copy.named_parameters(/*recurse=*/true)) {
    if (index >= originals.size() || originals[index].first != item.name) {
      throw std::logic_error("the copy of a TorchScript module lists other parameters than it");
    }
    at::Tensor tensor = item.value;  // a handle to the copy's parameter
    tensor.set_requires_grad(originals[index].second);
    ++index;
  }
  modules_.push_back(copy);
  return modules_.size() - 1;
}

void ExportBuilder::add_tensor(std::size_t node, rust::Str name, const at::Tensor& tensor,
                               bool is_buffer, bool requires_grad) {
  ::torch::jit::Module& module = module_at(node);
  at::Tensor copy = tensor.detach().to(at::TensorOptions().device(at::kCPU),
                                       /*non_blocking=*/false, /*copy=*/true);
  if (!is_buffer) {
    copy.set_requires_grad(requires_grad);
  }
  module.register_parameter(std::string(name), copy, is_buffer);
}

void ExportBuilder::add_child(std::size_t parent, rust::Str name, std::size_t child) {
  const ::torch::jit::Module submodule = module_at(child);
  module_at(parent).register_module(std::string(name), submodule);
}

void ExportBuilder::define(std::size_t node, rust::Str source) {
  module_at(node).define(std::string(source), ::torch::jit::nativeResolver());
}

rust::String ExportBuilder::class_name(std::size_t node) const {
  const auto type = module_at(node).type();
  return rust::String(type && type->name() ? type->name()->qualifiedName() : "");
}

void ExportBuilder::save(std::size_t root, rust::Str path, bool training) {
  ::torch::jit::Module& module = module_at(root);
  module.train(training);
  module.save(std::string(path));
}

rust::String forward_mismatch(const ::torch::jit::Module& module) {
  const auto method = module.find_method("forward");
  if (!method) {
    return rust::String("(no forward method)");
  }
  const c10::FunctionSchema& schema = method->function().getSchema();
  const auto& args = schema.arguments();  // args[0] is self
  std::size_t required = 0;
  for (std::size_t i = 1; i < args.size(); ++i) {
    required += args[i].default_value().has_value() ? 0 : 1;
  }
  const auto tensor = c10::TensorType::get();
  const bool fits = args.size() >= 2 && required <= 1 && args[1].type()->isSubtypeOf(*tensor) &&
                    schema.returns().size() == 1 &&
                    schema.returns()[0].type()->isSubtypeOf(*tensor);
  if (fits) {
    return rust::String();
  }
  std::ostringstream text;
  text << schema;
  return rust::String(text.str());
}

std::unique_ptr<ExportBuilder> new_export_builder() { return std::make_unique<ExportBuilder>(); }

}  // namespace kiln::script
