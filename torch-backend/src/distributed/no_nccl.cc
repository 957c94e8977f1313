// kiln-torch without its `cuda` feature: no NCCL (see include/c10d_nccl.h).

#include "kiln-torch/include/c10d_nccl.h"

#include <stdexcept>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "kiln-torch/include/c10d.h"

namespace kiln::torch {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(
    const c10::intrusive_ptr<c10d::Store>&, int, int, int, std::chrono::milliseconds) {
  throw std::runtime_error(
      "the NCCL backend needs kiln-torch built with its `cuda` feature "
      "(kiln's `cuda` feature); use the Gloo backend for CPU tensors");
}

bool nccl_compiled() { return false; }

}  // namespace kiln::torch
