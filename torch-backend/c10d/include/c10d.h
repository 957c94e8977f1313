// libtorch's c10d (include/c10d.h): stores, process groups with Gloo (CPU) and
// NCCL (CUDA) backends, their collectives, and DDP's gradient reducer, for
// kiln-c10d (src/bridge.rs). tch 0.24 has no
// distributed API.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "rust/cxx.h"

namespace kiln::dist {

// Defined by the cxx bridge (src/bridge.rs).
struct GroupConfig;
struct ReducerConfig;
enum class ReduceKind : std::uint8_t;

// A list of tensor handles (reference counts, not data), filled from Rust one at
// a time, since cxx passes no list of opaque C++ values.
class TensorList {
 public:
  void push(const at::Tensor& tensor);
  std::vector<at::Tensor> tensors;
};
std::unique_ptr<TensorList> new_tensor_list();

// A collective started and not yet waited for.
class PendingWork {
 public:
  struct State;
  explicit PendingWork(std::unique_ptr<State> state);
  ~PendingWork();
  // Returns once the collective is done; throws if it failed.
  void wait() const;
  std::unique_ptr<State> state_;
};

// A joined process group: the (prefixed) store every rank reached, and a
// c10d::ProcessGroup with Gloo for CPU tensors and, when asked, NCCL for CUDA ones.
class DistGroup {
 public:
  struct State;
  explicit DistGroup(std::unique_ptr<State> state);
  ~DistGroup();

  // In-place collectives on one tensor; they return once the result is there.
  void all_reduce(const at::Tensor& tensor, ReduceKind op) const;
  void broadcast(const at::Tensor& tensor, std::int32_t root) const;
  // An in-place all-reduce that runs while the caller goes on.
  std::unique_ptr<PendingWork> all_reduce_start(const at::Tensor& tensor, ReduceKind op) const;
  // The tensor of every rank, stacked along a new leading axis.
  std::unique_ptr<at::Tensor> all_gather(const at::Tensor& tensor) const;
  void barrier() const;
  // `input` (world size x output's elements, rank-major) reduced over the ranks,
  // rank r keeping segment r in `output` (c10d's reduce_scatter_tensor).
  void reduce_scatter_flat(const at::Tensor& output, const at::Tensor& input, ReduceKind op) const;
  // Every rank's `input` into `output` (world size x input's elements, rank-major;
  // c10d's all_gather_into_tensor).
  void all_gather_flat(const at::Tensor& output, const at::Tensor& input) const;
  // all_gather_flat, running while the caller goes on (both tensors must live
  // until it is waited for).
  std::unique_ptr<PendingWork> all_gather_flat_start(const at::Tensor& output,
                                                     const at::Tensor& input) const;
  // An in-place all-reduce of host float32 memory owned by the caller (wrapped
  // with at::from_blob, no copy): how TensorFlow's gradients are reduced.
  void all_reduce_host_f32(rust::Slice<float> data, ReduceKind op) const;
  // Every tensor broadcast from `root`, packed in buffers of up to `buffer_bytes`.
  void broadcast_coalesced(const TensorList& tensors, std::size_t buffer_bytes, std::int32_t root) const;
  // Fails, naming the parameter, unless every rank's tensors have rank 0's count,
  // shapes and dtypes.
  void verify_same_tensors(const TensorList& tensors) const;

  // The store's key-value interface, under the group's prefix.
  void store_set(rust::Str key, rust::Slice<const std::uint8_t> value) const;
  rust::Vec<std::uint8_t> store_get(rust::Str key) const;
  // Whether `key` is set, without waiting.
  bool store_check(rust::Str key) const;

  std::unique_ptr<State> state_;
};

// Joins the group described by `config` (rendezvous, then the backends' own
// connections). Fails with a message that says how many ranks joined when not all
// of them arrive within the timeout.
std::unique_ptr<DistGroup> new_dist_group(const GroupConfig& config);

// DDP's gradient reducer (c10d::Reducer) over a model's parameters.
class DdpReducer {
 public:
  struct State;
  explicit DdpReducer(std::unique_ptr<State> state);
  ~DdpReducer();

  // Before a forward pass whose gradients are synchronised: rebuilds the buckets
  // in gradient-arrival order after the first step (as DDP does).
  void prepare_for_forward() const;
  // After it: the reducer expects every parameter's gradient hook in the next
  // backward pass. `outputs` (the loss) are searched for unused parameters when
  // the reducer was built with find_unused_parameters.
  void prepare_for_backward(const TensorList& outputs) const;

  std::unique_ptr<State> state_;
};

std::unique_ptr<DdpReducer> new_ddp_reducer(
    const DistGroup& group, const TensorList& params, const ReducerConfig& config);

// Whether this build has NCCL (kiln-c10d's `cuda` feature).
bool nccl_compiled();

}  // namespace kiln::dist
