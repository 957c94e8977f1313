//! TensorFlow's C++ logging follows Kiln's `log` level in any program that uses
//! Kiln's TensorFlow backend, as it does in the `kiln` CLI: quiet by default.
//!
//! Before the first session (and so before a SavedModel loads or a graph runs),
//! [`follow_log_level`] sets the level of TensorFlow's logger (Abseil's):
//!
//! - `TF_CPP_MIN_LOG_LEVEL` set: nothing changes (the user's choice wins);
//! - [`TENSORFLOW_LOG_TARGET`] enabled at `debug` in the program's logger
//!   (`RUST_LOG=debug` or `RUST_LOG=kiln=debug` with `env_logger`): everything;
//! - otherwise TensorFlow's warnings and errors only, without its INFO lines
//!   (`cpu_feature_guard`, the SavedModel loader's `reader.cc`, MLIR's notes).
//!
//! Setting `TF_CPP_MIN_LOG_LEVEL` from the program would come too late:
//! TensorFlow reads it while its libraries load, before `main`. What it logs then
//! (absl's `WARNING: All log messages before absl::InitializeLog()`, oneDNN's
//! notice) prints whatever the level, as it does in Python; the CLI hides those
//! too, by running TensorFlow in a second executable whose start it captures.

/// The log target whose `debug` level shows TensorFlow's own lines.
pub const TENSORFLOW_LOG_TARGET: &str = "kiln::tensorflow";

/// Abseil's `LogSeverityAtLeast` values (`enum class : int`).
const INFO: std::ffi::c_int = 0;
const WARNING: std::ffi::c_int = 1;

#[allow(unsafe_code)]
mod absl {
    extern "C" {
        /// `absl::SetMinLogLevel(absl::LogSeverityAtLeast)` of the Abseil that
        /// TensorFlow 2.21 is built with (`lts_20250814`), exported by
        /// `libtensorflow_framework.so.2` (kiln-build pins that TensorFlow).
        #[link_name = "_ZN4absl12lts_2025081414SetMinLogLevelENS0_18LogSeverityAtLeastE"]
        pub(super) fn set_min_log_level(level: std::ffi::c_int);
    }

    /// Sets the least severity TensorFlow's logger prints.
    pub(super) fn min_log_level(level: std::ffi::c_int) {
        // SAFETY: a C++ free function taking an `int`-sized enum by value, which
        // the x86-64 and AArch64 C++ ABIs pass as a C `int`; it stores the value
        // in an atomic and throws nothing. `level` is one of the enum's values.
        unsafe { set_min_log_level(level) }
    }
}

/// Makes TensorFlow's logging follow Kiln's `log` level (see the module
/// docs), once; the backend calls it before its first session.
pub fn follow_log_level() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_some() {
            return;
        }
        let debug = log::log_enabled!(target: TENSORFLOW_LOG_TARGET, log::Level::Debug);
        absl::min_log_level(if debug { INFO } else { WARNING });
    });
}
