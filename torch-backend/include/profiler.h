// libtorch's profiler (include/profiler.h): Kineto's recording of a window of
// training steps, as Python's `torch.profiler.profile` drives it, and the
// `record_function` ranges Kiln marks steps and data loading with.
#pragma once

#include <memory>
#include <string>

#include "rust/cxx.h"

namespace kiln::torch {

// Defined by the cxx bridge (src/profile/bridge.rs).
struct ProfilerEvent;

// Warms the profiler up (Kineto's `prepareTrace`): called a step before `profiler_start`
// so that the first recorded step does not pay for Kineto's start-up.
void profiler_prepare(bool cuda);

// Starts recording CPU operators, `record_function` ranges and, when `cuda`, CUDA
// kernels and copies. Throws when a profiler is already recording in this process.
void profiler_start(bool cuda);

// Stops recording, writes the Chrome/Perfetto trace to `trace_path` (Kineto's JSON)
// and returns every event recorded.
rust::Vec<ProfilerEvent> profiler_stop(rust::Str trace_path);

// Stops recording and drops what was recorded (a run that failed in its window).
void profiler_discard();

// Whether a profiler is recording in this process.
bool profiler_recording();

// A `record_function` range on the calling thread, ended when destroyed (on the
// thread that began it).
class UserRange {
 public:
  explicit UserRange(std::string name);
  ~UserRange();
  UserRange(const UserRange&) = delete;
  UserRange& operator=(const UserRange&) = delete;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Begins a range named `name`; nullptr when no profiler is recording.
std::unique_ptr<UserRange> user_range_begin(rust::Str name);

}  // namespace kiln::torch
