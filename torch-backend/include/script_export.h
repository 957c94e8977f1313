// TorchScript export (include/script_export.h): a `::torch::jit::Module` tree built
// module by module from Kiln's layers (src/script/export_bridge.rs,
// src/script/export.cc), then saved for Python's `torch.jit.load`.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/csrc/jit/api/module.h>

#include "rust/cxx.h"

namespace kiln::script {

// The modules of one export, in one compilation unit, addressed by the index
// each `add_*` call returns. Every method throws on failure (an unknown index,
// a TorchScript compile error, an unwritable file); the bridge turns the
// exception into an error.
class ExportBuilder {
 public:
  ExportBuilder();

  // A new module of class `__torch__.kiln.<class_name>` (mangled by the
  // compilation unit when the name is taken: `__torch__.kiln.___torch_mangle_3.Linear`)
  // with nn.Module's `training` attribute and nothing else.
  std::size_t add_module(rust::Str class_name);

  // A deep copy of `module` on the CPU (a loaded TorchScript file), its
  // parameters keeping their `requires_grad`.
  std::size_t add_script_module(const ::torch::jit::Module& module);

  // Registers a detached CPU copy of `tensor` as parameter (`requires_grad` as
  // given) or buffer `name` of module `node`.
  void add_tensor(std::size_t node, rust::Str name, const at::Tensor& tensor, bool is_buffer,
                  bool requires_grad);

  // Registers module `child` as submodule `name` of module `parent`.
  void add_child(std::size_t parent, rust::Str name, std::size_t child);

  // Compiles `source` (TorchScript, `def forward(self, ...)`) as methods of
  // module `node`'s class, resolving `torch.<op>` to aten's builtins.
  void define(std::size_t node, rust::Str source);

  // The qualified class name of module `node`.
  rust::String class_name(std::size_t node) const;

  // Sets the `training` flag of module `root` and all its submodules, and saves
  // it as a TorchScript archive at `path` (overwriting whatever is there).
  void save(std::size_t root, rust::Str path, bool training);

 private:
  ::torch::jit::Module& module_at(std::size_t node);
  const ::torch::jit::Module& module_at(std::size_t node) const;

  std::shared_ptr<::torch::jit::CompilationUnit> cu_;
  std::vector<::torch::jit::Module> modules_;
};

// Empty when `module`'s forward takes one tensor (other arguments having
// defaults) and returns one, as a layer of a Kiln model does; otherwise the
// forward's schema (`forward(__torch__.M self, Tensor a, Tensor b) -> (Tensor, Tensor)`).
rust::String forward_mismatch(const ::torch::jit::Module& module);

// A builder with an empty compilation unit.
std::unique_ptr<ExportBuilder> new_export_builder();

}  // namespace kiln::script
