//! Loading ONNX Runtime: a missing library, a file that is not a library and a
//! library that is not ONNX Runtime, named by `ORT_DYLIB_PATH`, each give
//! `Error::Runtime` naming the path and the variable (never a panic), and the
//! build's default library loads afterwards. One test in its own binary: the
//! library is loaded once per process and the variable is process-wide.

#![allow(clippy::unwrap_used)]

use std::path::Path;

use kiln_core::HostTensor;
use kiln_onnx::{Error, OnnxModel};

#[test]
fn a_missing_or_wrong_library_is_a_runtime_error() {
    let Some(python) = kiln_testkit::python("a_missing_or_wrong_library_is_a_runtime_error") else {
        return;
    };
    let dir = kiln_testkit::scratch_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "onnx-library");
    kiln_testkit::run_reference_script!(&python, "onnx_models.py", &[&dir]);
    let model = dir.join("mlp.onnx");

    let not_a_library = dir.join("libonnxruntime.so");
    std::fs::write(&not_a_library, "not an ELF file").unwrap();
    let mut wrong: Vec<std::path::PathBuf> =
        vec![dir.join("nowhere/libonnxruntime.so"), not_a_library];
    // A real shared library without ONNX Runtime's entry point, where the system has one.
    for candidate in [
        "/usr/lib/x86_64-linux-gnu/libz.so.1",
        "/lib/x86_64-linux-gnu/libz.so.1",
    ] {
        if Path::new(candidate).is_file() {
            wrong.push(candidate.into());
            break;
        }
    }
    for path in &wrong {
        std::env::set_var(kiln_onnx::runtime::LIBRARY_VARIABLE, path);
        match OnnxModel::load(&model) {
            Err(Error::Runtime(msg)) => {
                eprintln!("{msg}");
                assert!(msg.contains(&path.display().to_string()), "{msg}");
                assert!(msg.contains("ORT_DYLIB_PATH"), "{msg}");
            }
            other => panic!("{}: expected Error::Runtime, got {other:?}", path.display()),
        }
    }

    std::env::remove_var(kiln_onnx::runtime::LIBRARY_VARIABLE);
    let model = OnnxModel::load(&model).unwrap();
    let y = model
        .predict(&HostTensor::new(vec![0.0f32; 8], [2, 4]).unwrap())
        .unwrap();
    assert_eq!(y.dims(), &[2, 3]);
}
