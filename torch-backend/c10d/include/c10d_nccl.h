// The NCCL half of kiln-c10d's bridge (include/c10d_nccl.h): defined by
// src/nccl.cc with the `cuda` feature, by src/no_nccl.cc
// without it.
#pragma once

#include <chrono>

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace kiln::dist {

// A ProcessGroupNCCL for `rank` of `size` bound to CUDA device `device`; throws
// without the `cuda` feature.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, int device,
    std::chrono::milliseconds timeout);

// Whether this build has NCCL (also declared in c10d.h for the bridge).
bool nccl_compiled();

}  // namespace kiln::dist
