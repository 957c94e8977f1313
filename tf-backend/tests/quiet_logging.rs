//! A program that uses Kiln's TensorFlow backend as a library is quiet by
//! default, as the CLI is: TensorFlow's INFO lines (`cpu_feature_guard` when its
//! first session starts) show only when the program logs `kiln::tensorflow` at
//! debug, and a `TF_CPP_MIN_LOG_LEVEL` the user set wins.
//!
//! The test runs this binary again as the program, in a child process with a
//! fresh TensorFlow, and reads what the child printed.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::process::Command;

use kiln_core::model::{Layer, LinearConfig};
use kiln_core::{module::Module, Device, HostTensor};
use kiln_tf::{TfBackend, TfModel, TfTensor, TENSORFLOW_LOG_TARGET};

/// Set in the child: what its logger lets through (`debug` or `info`).
const CHILD: &str = "KILN_QUIET_LOGGING_CHILD";

/// The child's logger: everything up to the level its parent chose.
struct Logger(log::LevelFilter);

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= self.0
    }
    fn log(&self, _: &log::Record<'_>) {}
    fn flush(&self) {}
}

/// The program: a logger, then a model built and run on TensorFlow.
fn child(level: &str) {
    let filter = if level == "debug" {
        log::LevelFilter::Debug
    } else {
        log::LevelFilter::Info
    };
    log::set_logger(Box::leak(Box::new(Logger(filter)))).unwrap();
    log::set_max_level(filter);
    assert_eq!(
        log::log_enabled!(target: TENSORFLOW_LOG_TARGET, log::Level::Debug),
        level == "debug"
    );
    let model = TfModel::new(
        &Layer::sequential([LinearConfig::new(3, 2).into()]),
        Device::Cpu,
    )
    .unwrap();
    let x = TfTensor::from_host(&HostTensor::new(vec![1.0f32, 2.0, 3.0], [1, 3]).unwrap()).unwrap();
    let y = Module::<TfBackend>::forward(&model, &x)
        .unwrap()
        .to_host()
        .unwrap();
    assert_eq!(y.dims(), [1, 2]);
}

/// What the child printed on stderr, run with its logger at `level` and `env`.
fn run(level: &str, env: &[(&str, &str)]) -> String {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--exact",
            "a_library_program_is_quiet_unless_it_logs_debug",
            "--nocapture",
        ])
        .env(CHILD, level)
        .env_remove("TF_CPP_MIN_LOG_LEVEL");
    for (key, value) in env {
        command.env(key, value);
    }
    let out = command.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    stderr
}

#[test]
fn a_library_program_is_quiet_unless_it_logs_debug() {
    if let Ok(level) = std::env::var(CHILD) {
        child(&level);
        return;
    }
    let info_line = "cpu_feature_guard";
    let quiet = run("info", &[]);
    assert!(!quiet.contains(info_line), "quiet by default:\n{quiet}");
    let verbose = run("debug", &[]);
    assert!(
        verbose.contains(info_line),
        "debug shows TensorFlow's INFO lines:\n{verbose}"
    );
    let chosen = run("info", &[("TF_CPP_MIN_LOG_LEVEL", "0")]);
    assert!(
        chosen.contains(info_line),
        "the user's TF_CPP_MIN_LOG_LEVEL wins:\n{chosen}"
    );
}
