//! Helpers for the tests that compare kiln-torch with Python PyTorch.

#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use kiln_core::{state_dict::StateDict, HostTensor};

/// The project virtualenv's interpreter, or `None` after a skip (a failure
/// under `KILN_REQUIRE_REFERENCES`, as in CI).
pub fn python(test: &str) -> Option<PathBuf> {
    kiln_testkit::python(test)
}

/// A fresh directory under the target's temporary directory.
pub fn scratch_dir(name: &str) -> PathBuf {
    kiln_testkit::scratch_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), name)
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
    kiln_testkit::run_reference(python, &path, args);
}

/// The files `tests/reference/<script> make DIR` writes, made once per test
/// run ([`kiln_testkit::made_once_per_run`]) and copied into `dir`, where the
/// test may write beside them.
pub fn make_fixtures(python: &Path, script: &str, dir: &Path) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/reference")
        .join(script);
    let name = script.trim_end_matches(".py");
    let shared = kiln_testkit::made_once_per_run(python, &path, &[Path::new("make")], name);
    kiln_testkit::copy_fixture(&shared, dir);
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
    kiln_testkit::assert_close(what, &a, &e, tol, "PyTorch");
}

/// Asserts `|actual - expected| <= tol.atol + tol.rtol * |expected|`
/// elementwise (`torch.testing.assert_close`'s rule), naming `what` and the
/// worst element on failure.
pub fn assert_allclose(
    what: &str,
    actual: &HostTensor,
    expected: &HostTensor,
    tol: kiln_testkit::tolerance::AllClose,
) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape");
    let (a, e) = (actual.to_f64_vec(), expected.to_f64_vec());
    kiln_testkit::assert_allclose(what, &a, &e, tol, "PyTorch");
}

/// The devices the parity suites run on, with their tolerance: the CPU always
/// ([`kiln_testkit::tolerance::F32`]), and `cuda:0` when libtorch sees a GPU
/// ([`kiln_testkit::tolerance::TF32`]).
pub fn devices() -> Vec<(kiln_core::Device, f64)> {
    use kiln_testkit::tolerance;
    let mut devices = vec![(kiln_core::Device::Cpu, tolerance::F32)];
    if kiln_torch::cuda_device_count() > 0 {
        devices.push((kiln_core::Device::Cuda(0), tolerance::TF32));
    } else {
        eprintln!("parity suite: no CUDA device, CPU only");
    }
    devices
}
