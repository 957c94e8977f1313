//! Helpers for the tests that compare kiln-tf with Python TensorFlow.

#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use kiln_core::HostTensor;
use serde_json::Value;

/// The project virtualenv's interpreter, or `None` after a skip (a failure
/// under `KILN_REQUIRE_REFERENCES`, as in CI).
pub fn python(test: &str) -> Option<PathBuf> {
    kiln_testkit::python(test)
}

/// A fresh directory under the target's temporary directory.
pub fn scratch_dir(name: &str) -> PathBuf {
    kiln_testkit::scratch_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), name)
}

/// Runs `tests/reference/<script>` with `args`; panics with its stderr on failure.
pub fn run_reference(python: &Path, script: &str, args: &[&Path]) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/reference")
        .join(script);
    kiln_testkit::run_reference(python, &path, args);
}

/// Reads a JSON file.
pub fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// A tensor written by a reference script as `{"shape", "dtype", "data"}`.
pub fn tensor(value: &Value) -> HostTensor {
    let shape: Vec<usize> = value["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    let data = value["data"].as_array().unwrap();
    match value["dtype"].as_str().unwrap() {
        "float32" => {
            let v: Vec<f32> = data.iter().map(|x| x.as_f64().unwrap() as f32).collect();
            HostTensor::new(v, shape).unwrap()
        }
        "float64" => {
            let v: Vec<f64> = data.iter().map(|x| x.as_f64().unwrap()).collect();
            HostTensor::new(v, shape).unwrap()
        }
        "int32" => {
            let v: Vec<i32> = data.iter().map(|x| x.as_i64().unwrap() as i32).collect();
            HostTensor::new(v, shape).unwrap()
        }
        "int64" => {
            let v: Vec<i64> = data.iter().map(|x| x.as_i64().unwrap()).collect();
            HostTensor::new(v, shape).unwrap()
        }
        other => panic!("no host type for reference dtype {other}"),
    }
}

/// A tensor as a reference script reads it.
pub fn tensor_json(t: &HostTensor) -> Value {
    let dtype = match t.dtype() {
        kiln_core::DType::F32 => "float32",
        kiln_core::DType::F64 => "float64",
        kiln_core::DType::I32 => "int32",
        kiln_core::DType::I64 => "int64",
        other => panic!("no reference dtype for {other}"),
    };
    serde_json::json!({
        "shape": t.dims(),
        "dtype": dtype,
        "data": t.to_f64_vec(),
    })
}

/// Asserts `actual` is within `tol` of `expected` elementwise, relative to
/// max(1, |expected|), naming `what` and the worst element on failure.
pub fn assert_close(what: &str, actual: &HostTensor, expected: &HostTensor, tol: f64) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape");
    assert_eq!(actual.dtype(), expected.dtype(), "{what}: dtype");
    let (a, e) = (actual.to_f64_vec(), expected.to_f64_vec());
    kiln_testkit::assert_close(what, &a, &e, tol, "TensorFlow");
}

/// Copies a directory tree.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dst = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &dst);
        } else {
            std::fs::copy(entry.path(), &dst).unwrap();
        }
    }
}
