//! The cxx bridge to libtorch's profiler (include/profiler.h, src/profile/profiler.cc).

#![allow(unsafe_code)]

#[cxx::bridge(namespace = "kiln::torch")]
pub(crate) mod ffi {
    /// One event of a recorded window (`torch::autograd::profiler::KinetoEvent`).
    struct ProfilerEvent {
        name: String,
        thread: u64,
        start_ns: u64,
        duration_ns: u64,
        /// `c10::DeviceType`'s code: 0 for the host.
        device_type: i8,
        /// `libkineto::ActivityType`'s code.
        activity: u8,
        is_async: bool,
    }

    // SAFETY: the declarations match include/profiler.h (cxx checks the signatures
    // at compile time); every function that can throw returns `Result`, so a C++
    // exception comes back as an error instead of unwinding into Rust. `UserRange`
    // is opaque and owned through `UniquePtr`; it is neither `Send` nor `Sync`, as a
    // `record_function` range must end on the thread that began it.
    unsafe extern "C++" {
        include!("kiln-torch/include/profiler.h");

        type UserRange;

        fn profiler_prepare(cuda: bool) -> Result<()>;
        fn profiler_start(cuda: bool) -> Result<()>;
        fn profiler_stop(trace_path: &str) -> Result<Vec<ProfilerEvent>>;
        fn profiler_discard() -> Result<()>;
        fn profiler_recording() -> bool;
        fn user_range_begin(name: &str) -> Result<UniquePtr<UserRange>>;
    }
}
