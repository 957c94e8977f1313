// TorchScript buffers and parameters by name (include/script.h).
#include "kiln-torch/include/script.h"

#include <stdexcept>
#include <string>

namespace kiln::script {

rust::Vec<rust::String> buffer_names(const ::torch::jit::Module& module) {
  rust::Vec<rust::String> names;
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    names.push_back(rust::String(item.name));
  }
  return names;
}

std::unique_ptr<at::Tensor> buffer(const ::torch::jit::Module& module, rust::Str name) {
  const std::string wanted(name);
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (item.name == wanted) {
      return std::make_unique<at::Tensor>(item.value);
    }
  }
  throw std::out_of_range("no buffer named " + wanted);
}

rust::Vec<rust::String> parameter_names(const ::torch::jit::Module& module) {
  rust::Vec<rust::String> names;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    names.push_back(rust::String(item.name));
  }
  return names;
}

std::unique_ptr<at::Tensor> parameter(const ::torch::jit::Module& module, rust::Str name) {
  const std::string wanted(name);
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (item.name == wanted) {
      return std::make_unique<at::Tensor>(item.value);
    }
  }
  throw std::out_of_range("no parameter named " + wanted);
}

rust::Vec<rust::String> submodule_names(const ::torch::jit::Module& module,
                                        rust::Vec<rust::String>& types) {
  rust::Vec<rust::String> names;
  for (const auto& item : module.named_modules()) {
    if (item.name.empty()) {
      continue;  // the module itself
    }
    names.push_back(rust::String(item.name));
    const auto type = item.value.type();
    types.push_back(rust::String(type && type->name() ? type->name()->qualifiedName() : ""));
  }
  return names;
}

void set_submodule_training(const ::torch::jit::Module& module, rust::Str name, bool training) {
  const std::string wanted(name);
  for (const auto& item : module.named_modules()) {
    if (item.name == wanted) {
      // A Module is a handle to its object: this copy sets the shared flag.
      ::torch::jit::Module submodule = item.value;
      submodule.train(training);
      return;
    }
  }
  throw std::out_of_range("no submodule named " + wanted);
}

}  // namespace kiln::script
