// kiln-c10d without its `cuda` feature: no NCCL (see include/c10d_nccl.h).

#include "kiln-c10d/include/c10d_nccl.h"

#include <stdexcept>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "kiln-c10d/include/c10d.h"

namespace kiln::dist {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(
    const c10::intrusive_ptr<c10d::Store>&, int, int, int, std::chrono::milliseconds) {
  throw std::runtime_error(
      "the NCCL backend needs kiln-c10d built with its `cuda` feature "
      "(kiln's `cuda` feature); use the Gloo backend for CPU tensors");
}

bool nccl_compiled() { return false; }

}  // namespace kiln::dist
