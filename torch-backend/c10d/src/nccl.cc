// kiln-c10d with its `cuda` feature: libtorch's ProcessGroupNCCL for CUDA
// tensors (see include/c10d_nccl.h). Compiled with the CUDA and NCCL headers.

#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#ifndef USE_CUDA
#define USE_CUDA
#endif

// A CUDA source is compiled before (and apart from) the cxx bridge, without
// its `kiln-c10d/...` include prefix: headers by relative path.
#include "../include/c10d_nccl.h"

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace kiln::dist {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, int device,
    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  // Communicators are created lazily, on the device of the first collective's
  // tensors; `device` is where Kiln's tensors live, checked on the Rust side.
  (void)device;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

bool nccl_compiled() { return true; }

}  // namespace kiln::dist
