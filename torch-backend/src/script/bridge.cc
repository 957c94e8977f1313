// TorchScript buffers and parameters by name (include/script.h).
#include "kiln-torch/include/script.h"

#include <stdexcept>
#include <string>

namespace kiln::script {

rust::Vec<rust::String> buffer_names(const torch::jit::Module& module) {
  rust::Vec<rust::String> names;
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    names.push_back(rust::String(item.name));
  }
  return names;
}

std::unique_ptr<at::Tensor> buffer(const torch::jit::Module& module, rust::Str name) {
  const std::string wanted(name);
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (item.name == wanted) {
      return std::make_unique<at::Tensor>(item.value);
    }
  }
  throw std::out_of_range("no buffer named " + wanted);
}

rust::Vec<rust::String> parameter_names(const torch::jit::Module& module) {
  rust::Vec<rust::String> names;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    names.push_back(rust::String(item.name));
  }
  return names;
}

std::unique_ptr<at::Tensor> parameter(const torch::jit::Module& module, rust::Str name) {
  const std::string wanted(name);
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (item.name == wanted) {
      return std::make_unique<at::Tensor>(item.value);
    }
  }
  throw std::out_of_range("no parameter named " + wanted);
}

}  // namespace kiln::script
