// The C++ side of src/bridge.rs (see include/c10d.h).

// libtorch's Gloo process group is declared only with this macro; Gloo's own
// headers are Kiln's declarations in include/gloo-api (see its README).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif

#include "kiln-c10d/include/c10d.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>

#include <ATen/ops/from_blob.h>
#include <ATen/ops/stack.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include "kiln-c10d/include/c10d_nccl.h"
#include "kiln/rethrowing.h"

#include "kiln-c10d/src/bridge.rs.h"

namespace kiln::dist {

namespace {

std::string to_string(rust::Str s) { return std::string(s.data(), s.size()); }

c10d::ReduceOp reduce_op(ReduceKind kind) {
  switch (kind) {
    case ReduceKind::Sum: return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceKind::Max: return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceKind::Min: return c10d::ReduceOp(c10d::ReduceOp::MIN);
    case ReduceKind::Product: return c10d::ReduceOp(c10d::ReduceOp::PRODUCT);
  }
  throw std::invalid_argument("unknown reduce operation");
}

// Waits for a collective, turning its failure into one message that names it.
void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) {
  rethrowing(what, [&] { work->wait(); });
}

c10::intrusive_ptr<c10d::Store> make_store(const GroupConfig& config) {
  const auto timeout = std::chrono::milliseconds(config.timeout_ms);
  c10::intrusive_ptr<c10d::Store> store;
  if (config.store == StoreKind::File) {
    store = rethrowing("rendezvous (file store)", [&] {
      auto file = c10::make_intrusive<c10d::FileStore>(to_string(config.file_path), config.world_size);
      file->setTimeout(timeout);
      return c10::static_intrusive_pointer_cast<c10d::Store>(file);
    });
  } else {
    c10d::TCPStoreOptions options;
    options.port = config.port;
    options.isServer = config.is_server;
    options.numWorkers = static_cast<std::size_t>(config.world_size);
    // Kiln counts the ranks that joined itself (below), for every kind of store.
    options.waitWorkers = false;
    options.timeout = timeout;
    const auto host = to_string(config.host);
    try {
      store = c10::make_intrusive<c10d::TCPStore>(host, options);
    } catch (const c10::Error& e) {
      std::ostringstream message;
      message << "rendezvous: rank " << config.rank
              << (config.is_server ? " could not host" : " could not reach")
              << " the TCP store at " << host << ":" << config.port << " within "
              << config.timeout_ms / 1000.0 << " s: " << e.what_without_backtrace();
      throw std::runtime_error(message.str());
    }
  }
  return c10::make_intrusive<c10d::PrefixStore>(to_string(config.prefix), store);
}

// Every rank adds one to a counter and waits until all `size` are there, so a
// rank that never arrives gives an error that says how many did.
void join(const c10::intrusive_ptr<c10d::Store>& store, const GroupConfig& config) {
  const std::string key = "kiln/joined";
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(config.timeout_ms);
  auto joined = rethrowing("rendezvous", [&] { return store->add(key, 1); });
  while (joined < config.world_size) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::ostringstream message;
      message << "rendezvous timed out after " << config.timeout_ms / 1000.0 << " s: "
              << joined << " of " << config.world_size << " ranks joined";
      throw std::runtime_error(message.str());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    joined = rethrowing("rendezvous", [&] { return store->add(key, 0); });
  }
}

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(
    const c10::intrusive_ptr<c10d::Store>& store, const GroupConfig& config) {
  const auto timeout = std::chrono::milliseconds(config.timeout_ms);
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  if (config.gloo_interfaces.empty()) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  } else {
    for (const auto& interface : config.gloo_interfaces) {
      options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForInterface(std::string(interface)));
    }
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(
      store, config.rank, config.world_size, options);
}

}  // namespace

void TensorList::push(const at::Tensor& tensor) { tensors.push_back(tensor); }
std::unique_ptr<TensorList> new_tensor_list() { return std::make_unique<TensorList>(); }

struct DistGroup::State {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
};

DistGroup::DistGroup(std::unique_ptr<State> state) : state_(std::move(state)) {}
DistGroup::~DistGroup() = default;

std::unique_ptr<DistGroup> new_dist_group(const GroupConfig& config) {
  auto store = make_store(config);
  join(store, config);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, config.rank, config.world_size);
  auto gloo = rethrowing("creating the Gloo process group", [&] {
    return make_gloo_backend(store, config);
  });
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  if (config.nccl) {
    auto nccl = rethrowing("creating the NCCL process group", [&] {
      return make_nccl_backend(store, config.rank, config.world_size, config.cuda_device,
                               std::chrono::milliseconds(config.timeout_ms));
    });
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  }
  auto state = std::make_unique<DistGroup::State>();
  state->store = std::move(store);
  state->group = std::move(group);
  return std::make_unique<DistGroup>(std::move(state));
}

void DistGroup::all_reduce(const at::Tensor& tensor, ReduceKind op) const {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = reduce_op(op);
  auto work = rethrowing("all_reduce", [&] { return state_->group->allreduce(tensors, options); });
  wait(work, "all_reduce");
}

struct PendingWork::State {
  c10::intrusive_ptr<c10d::Work> work;
  // The collective's name, for errors.
  const char* what = "all_reduce";
};

PendingWork::PendingWork(std::unique_ptr<State> state) : state_(std::move(state)) {}

PendingWork::~PendingWork() {
  // A collective dropped unwaited still completes (or fails) in c10d's threads;
  // nothing may escape a destructor called from Rust's Drop.
  try {
    state_.reset();
  } catch (...) {
  }
}

void PendingWork::wait() const { kiln::dist::wait(state_->work, state_->what); }

std::unique_ptr<PendingWork> DistGroup::all_reduce_start(const at::Tensor& tensor,
                                                        ReduceKind op) const {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = reduce_op(op);
  auto state = std::make_unique<PendingWork::State>();
  state->work =
      rethrowing("all_reduce", [&] { return state_->group->allreduce(tensors, options); });
  return std::make_unique<PendingWork>(std::move(state));
}

void DistGroup::broadcast(const at::Tensor& tensor, std::int32_t root) const {
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  auto work = rethrowing("broadcast", [&] { return state_->group->broadcast(tensors, options); });
  wait(work, "broadcast");
}

std::unique_ptr<at::Tensor> DistGroup::all_gather(const at::Tensor& tensor) const {
  std::vector<at::Tensor> inputs{tensor};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int i = 0; i < state_->group->getSize(); ++i) {
    outputs[0].push_back(at::empty_like(tensor));
  }
  auto work = rethrowing("all_gather", [&] { return state_->group->allgather(outputs, inputs); });
  wait(work, "all_gather");
  return std::make_unique<at::Tensor>(rethrowing("all_gather", [&] { return at::stack(outputs[0]); }));
}

void DistGroup::reduce_scatter_flat(const at::Tensor& output, const at::Tensor& input,
                                    ReduceKind op) const {
  at::Tensor out = output;
  at::Tensor in = input;
  c10d::ReduceScatterOptions options;
  options.reduceOp = reduce_op(op);
  auto work = rethrowing("reduce_scatter",
                         [&] { return state_->group->_reduce_scatter_base(out, in, options); });
  wait(work, "reduce_scatter");
}

void DistGroup::all_gather_flat(const at::Tensor& output, const at::Tensor& input) const {
  at::Tensor out = output;
  at::Tensor in = input;
  auto work = rethrowing("all_gather", [&] { return state_->group->_allgather_base(out, in); });
  wait(work, "all_gather");
}

std::unique_ptr<PendingWork> DistGroup::all_gather_flat_start(const at::Tensor& output,
                                                             const at::Tensor& input) const {
  at::Tensor out = output;
  at::Tensor in = input;
  auto state = std::make_unique<PendingWork::State>();
  state->what = "all_gather";
  state->work =
      rethrowing("all_gather", [&] { return state_->group->_allgather_base(out, in); });
  return std::make_unique<PendingWork>(std::move(state));
}

void DistGroup::barrier() const {
  auto work = rethrowing("barrier", [&] { return state_->group->barrier(); });
  wait(work, "barrier");
}

void DistGroup::all_reduce_host_f32(rust::Slice<float> data, ReduceKind op) const {
  if (data.empty()) {
    return;
  }
  auto tensor = rethrowing("all_reduce", [&] {
    return at::from_blob(data.data(), {static_cast<std::int64_t>(data.size())},
                         at::TensorOptions().dtype(at::kFloat));
  });
  all_reduce(tensor, op);
}

void DistGroup::broadcast_coalesced(const TensorList& tensors, std::size_t buffer_bytes,
                                    std::int32_t root) const {
  if (tensors.tensors.empty()) {
    return;
  }
  rethrowing("broadcast_coalesced", [&] {
    c10d::broadcast_coalesced(state_->group, tensors.tensors, buffer_bytes, root);
  });
}

void DistGroup::verify_same_tensors(const TensorList& tensors) const {
  rethrowing("checking that every rank has the same model", [&] {
    c10d::verify_params_across_processes(state_->group, tensors.tensors, std::nullopt);
  });
}

void DistGroup::store_set(rust::Str key, rust::Slice<const std::uint8_t> value) const {
  std::vector<std::uint8_t> bytes(value.begin(), value.end());
  rethrowing("store set", [&] { state_->store->set(to_string(key), bytes); });
}

rust::Vec<std::uint8_t> DistGroup::store_get(rust::Str key) const {
  auto bytes = rethrowing("store get", [&] { return state_->store->get(to_string(key)); });
  rust::Vec<std::uint8_t> out;
  out.reserve(bytes.size());
  for (auto b : bytes) {
    out.push_back(b);
  }
  return out;
}

bool DistGroup::store_check(rust::Str key) const {
  return rethrowing("store check", [&] { return state_->store->check({to_string(key)}); });
}

struct DdpReducer::State {
  std::shared_ptr<c10d::Reducer> reducer;
  bool find_unused_parameters = false;
};

DdpReducer::DdpReducer(std::unique_ptr<State> state) : state_(std::move(state)) {}

DdpReducer::~DdpReducer() {
  // c10d::Reducer's destructor may throw (it is noexcept(false)); nothing may
  // escape a destructor called from Rust's Drop.
  try {
    state_.reset();
  } catch (...) {
  }
}

std::unique_ptr<DdpReducer> new_ddp_reducer(
    const DistGroup& group, const TensorList& params, const ReducerConfig& config) {
  return rethrowing("creating DDP's reducer", [&] {
    const auto& tensors = params.tensors;
    // As torch.nn.parallel.DistributedDataParallel: one bucket at first unless
    // unused parameters are searched for (the reducer rebuilds the buckets in
    // gradient-arrival order after the first step, with the two caps), buckets
    // in reverse parameter order.
    std::vector<std::size_t> limits;
    if (config.find_unused_parameters) {
      limits = {static_cast<std::size_t>(config.first_bucket_bytes),
                static_cast<std::size_t>(config.bucket_cap_bytes)};
    } else {
      limits = {std::numeric_limits<std::size_t>::max()};
    }
    std::vector<bool> sparse(tensors.size(), false);
    auto [buckets, per_bucket_limits] =
        c10d::compute_bucket_assignment_by_size(tensors, limits, sparse);
    std::reverse(buckets.begin(), buckets.end());
    std::unordered_map<std::size_t, std::string> names;
    for (std::size_t i = 0; i < config.param_names.size(); ++i) {
      names.emplace(i, std::string(config.param_names[i]));
    }
    auto reducer = std::make_shared<c10d::Reducer>(
        tensors, std::move(buckets), group.state_->group, std::move(sparse),
        config.bucket_cap_bytes, config.find_unused_parameters,
        /*gradient_as_bucket_view=*/false, std::move(names), config.first_bucket_bytes,
        /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
        /*bucket_bytes_cap_list=*/std::vector<std::int64_t>{});
    auto state = std::make_unique<DdpReducer::State>();
    state->reducer = std::move(reducer);
    state->find_unused_parameters = config.find_unused_parameters;
    return std::make_unique<DdpReducer>(std::move(state));
  });
}

void DdpReducer::prepare_for_forward() const {
  rethrowing("DDP forward", [&] {
    state_->reducer->prepare_for_forward();
    state_->reducer->rebuild_buckets();
  });
}

void DdpReducer::prepare_for_backward(const TensorList& outputs) const {
  rethrowing("DDP backward", [&] {
    if (state_->find_unused_parameters) {
      state_->reducer->prepare_for_backward(outputs.tensors);
    } else {
      state_->reducer->prepare_for_backward({});
    }
  });
}

}  // namespace kiln::dist
