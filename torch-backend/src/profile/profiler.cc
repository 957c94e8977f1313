// The C++ side of src/profile/bridge.rs (see include/profiler.h).

#include "kiln-torch/include/profiler.h"

#include <set>
#include <stdexcept>
#include <string>
#include <utility>

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "kiln/rethrowing.h"

#include "kiln-torch/src/profile/bridge.rs.h"

namespace kiln::torch {
namespace {

namespace prof = ::torch::profiler::impl;

prof::ProfilerConfig kineto_config() {
  return prof::ProfilerConfig(prof::ProfilerState::KINETO, /*report_input_shapes=*/false,
                              /*profile_memory=*/false, /*with_stack=*/false,
                              /*with_flops=*/false, /*with_modules=*/false);
}

std::set<prof::ActivityType> activities(bool cuda) {
  std::set<prof::ActivityType> set{prof::ActivityType::CPU};
  if (cuda) {
    set.insert(prof::ActivityType::CUDA);
  }
  return set;
}

}  // namespace

void profiler_prepare(bool cuda) {
  rethrowing("preparing libtorch's profiler", [&] {
    ::torch::autograd::profiler::prepareProfiler(kineto_config(), activities(cuda));
  });
}

void profiler_start(bool cuda) {
  rethrowing("starting libtorch's profiler", [&] {
    if (::torch::profiler::impl::profilerEnabled()) {
      throw std::runtime_error("a profiler is already recording in this process");
    }
    ::torch::autograd::profiler::enableProfiler(kineto_config(), activities(cuda));
  });
}

void profiler_discard() {
  rethrowing("stopping libtorch's profiler", [&] {
    if (::torch::profiler::impl::profilerEnabled()) {
      ::torch::autograd::profiler::disableProfiler();
    }
  });
}

bool profiler_recording() {
  return ::torch::profiler::impl::profilerEnabled();
}

rust::Vec<ProfilerEvent> profiler_stop(rust::Str trace_path) {
  return rethrowing("stopping libtorch's profiler", [&] {
    auto result = ::torch::autograd::profiler::disableProfiler();
    if (!result) {
      throw std::runtime_error("libtorch's profiler returned no result");
    }
    result->save(std::string(trace_path));
    rust::Vec<ProfilerEvent> out;
    for (const auto& event : result->events()) {
      ProfilerEvent e;
      e.name = rust::String::lossy(event.name());
      e.thread = event.startThreadId();
      e.start_ns = event.startNs();
      e.duration_ns = event.durationNs();
      e.device_type = static_cast<std::int8_t>(event.deviceType());
      e.activity = event.activityType();
      e.is_async = event.isAsync();
      out.push_back(std::move(e));
    }
    return out;
  });
}

struct UserRange::State {
  std::string name;
  at::RecordFunction record{at::RecordScope::USER_SCOPE};
};

UserRange::UserRange(std::string name) : state_(std::make_unique<State>()) {
  state_->name = std::move(name);
  state_->record.before(std::string_view(state_->name));
}

UserRange::~UserRange() = default;

std::unique_ptr<UserRange> user_range_begin(rust::Str name) {
  return rethrowing("beginning a profiler range", [&]() -> std::unique_ptr<UserRange> {
    if (!::torch::profiler::impl::profilerEnabled()) {
      return nullptr;
    }
    return std::make_unique<UserRange>(std::string(name));
  });
}

}  // namespace kiln::torch
