//! Helpers for the tests that compare kiln-torch with Python PyTorch.

#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_core::{HostTensor, StateDict};

/// The project virtualenv's interpreter, or `None` after a skip (a failure
/// under `KILN_REQUIRE_REFERENCES`, as in CI).
pub fn python(test: &str) -> Option<PathBuf> {
    kiln_testkit::python(test)
}

/// A fresh directory under the target's temporary directory.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes `value` as JSON to `dir/name` (a request for a reference script).
pub fn write_json(dir: &Path, name: &str, value: &impl serde::Serialize) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_vec(value).unwrap()).unwrap();
    path
}

/// Runs `tests/reference/<script>` with `args`; panics with its stderr on failure.
pub fn run_reference(python: &Path, script: &str, args: &[&Path]) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/reference")
        .join(script);
    let output = Command::new(python)
        .arg(&path)
        .args(args)
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    assert!(
        output.status.success(),
        "{} failed:\n{}",
        path.display(),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Loads a reference safetensors file.
pub fn load(path: &Path) -> StateDict {
    StateDict::load_safetensors(path).unwrap().0
}

/// Entries of `dict` whose key starts with `prefix`, with the prefix removed.
pub fn strip(dict: &StateDict, prefix: &str) -> StateDict {
    dict.iter()
        .filter_map(|(k, v)| k.strip_prefix(prefix).map(|k| (k.to_owned(), v.clone())))
        .collect()
}

/// Asserts `actual` is within `tol` of `expected` elementwise, relative to
/// max(1, |expected|), naming `what` and the worst element on failure.
pub fn assert_close(what: &str, actual: &HostTensor, expected: &HostTensor, tol: f64) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape");
    let (a, e) = (actual.to_f64_vec(), expected.to_f64_vec());
    let mut worst = (0.0f64, 0usize);
    for (i, (x, y)) in a.iter().zip(&e).enumerate() {
        let err = (x - y).abs() / y.abs().max(1.0);
        if err.is_nan() || err > worst.0 {
            worst = (err, i);
        }
    }
    assert!(
        !worst.0.is_nan() && worst.0 <= tol,
        "{what}: element {} is {} but PyTorch gives {} (relative error {:.3e} > {tol:.0e})",
        worst.1,
        a[worst.1],
        e[worst.1],
        worst.0
    );
}

/// The devices the parity suites run on, with their tolerance: the CPU always
/// (1e-5), and `cuda:0` when libtorch sees a GPU. On CUDA, cuDNN convolutions use
/// TF32 by default (as in PyTorch), which rounds inputs to 10 mantissa bits, so
/// the GPU tolerance is 2e-3.
pub fn devices() -> Vec<(kiln_core::Device, f64)> {
    let mut devices = vec![(kiln_core::Device::Cpu, 1e-5)];
    if kiln_torch::cuda_device_count() > 0 {
        devices.push((kiln_core::Device::Cuda(0), 2e-3));
    } else {
        eprintln!("parity suite: no CUDA device, CPU only");
    }
    devices
}
