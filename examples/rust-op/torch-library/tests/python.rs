//! The shared library in Python's torch, in one Python run
//! (`tests/reference/torch_library.py`): `torch.ops.load_library` registers the
//! ops; forward and backward match compositions of torch's ops (1e-6 in
//! float32, 1e-12 in float64, relative to max(1, |reference|)); gradcheck and
//! every default test of `torch.library.opcheck` pass; bad inputs raise the
//! kernel's message; loading a second copy of the library reports each op as
//! registered already, on stderr, and the process goes on. Python scripts a module calling the ops and saves it;
//! this process registers the same ops in its own libtorch and runs that
//! TorchScript with tch's `CModule`, matching Python's output.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::PathBuf;

use serde_json::Value;
use tch::{CModule, Kind, Tensor};

#[path = "../../src/ops.rs"]
#[allow(dead_code)] // the TorchScript part registers two of the three ops here
mod ops;

/// The cdylib cargo built for this test: beside the test executable in
/// `target/<profile>/deps/` (where `cargo test` leaves it), else in
/// `target/<profile>/` (where `cargo build` puts it).
fn library() -> PathBuf {
    const NAME: &str = "libkiln_example_rust_op_torch.so";
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let candidates = [deps.join(NAME), deps.parent().unwrap().join(NAME)];
    candidates
        .iter()
        .find(|path| path.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "{NAME} is in neither {candidates:?}: cargo builds it for this package's tests \
                 (crate-type cdylib + rlib)"
            )
        })
}

fn numbers(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[test]
fn python_torch_loads_the_library_and_agrees() {
    let Some(python) = kiln_testkit::python("python_torch_loads_the_library_and_agrees") else {
        return;
    };
    let out = kiln_testkit::TempDir::new("rust-op-torch");
    let lib = library();
    let stdout = kiln_testkit::run_reference_script!(
        &python,
        "torch_library.py",
        &[lib.as_os_str(), out.path().as_os_str()]
    );
    let report: Value = serde_json::from_str(&stdout).unwrap();

    let diffs = report["diffs"].as_object().unwrap();
    assert!(diffs.len() >= 17, "{diffs:?}");
    for (case, d) in diffs {
        let d = d.as_f64().unwrap();
        let tol = if case.ends_with("f32") { 1e-6 } else { 1e-12 };
        eprintln!("{case}: {d:.3e}");
        assert!(
            d <= tol,
            "{case}: differs from torch's composition by {d:e} > {tol:e}"
        );
    }
    for (case, result) in report["opcheck"].as_object().unwrap() {
        eprintln!("opcheck {case}: {result}");
    }
    assert_eq!(report["opcheck"].as_object().unwrap().len(), 5);
    let errors = &report["errors"];
    assert_eq!(
        errors["bad weight"],
        "example_rs::rms_norm: weight has shape [7], expected [8] (x's last dimension; x has shape [2, 8])"
    );
    assert_eq!(
        errors["float16"],
        "example_rs::squared_relu: input `x` is float16, expected float32 or float64"
    );
    // Loading a second copy: each op refused (on stderr, the only channel at
    // load time), the process goes on (squared_relu after a second load, above).
    let second = errors["second load"].as_str().unwrap();
    assert_eq!(second.lines().count(), 6, "{second}");
    assert!(
        second.contains(
            "cannot register kiln_example_rust_op_torch::ops::RmsNorm in libtorch: torch failed in \
             registering `example_rs::rms_norm`: libtorch already has an op `example_rs::rms_norm`"
        ),
        "{second}"
    );

    // The same ops registered in this process's libtorch run Python's TorchScript.
    kiln_torch_op::register::<ops::SquaredRelu>().unwrap();
    kiln_torch_op::register::<ops::SquaredReluBackward>().unwrap();
    kiln_torch_op::register::<ops::RmsNorm>().unwrap();
    kiln_torch_op::register::<ops::RmsNormBackward>().unwrap();
    let script = &report["script"];
    let module = CModule::load(script["path"].as_str().unwrap()).unwrap();
    let shape: Vec<i64> = numbers(&script["shape"])
        .iter()
        .map(|&d| d as i64)
        .collect();
    let x = Tensor::from_slice(&numbers(&script["x"])).reshape(&shape);
    let w = Tensor::from_slice(&numbers(&script["w"]));
    let y = module.forward_ts(&[x, w]).unwrap();
    assert_eq!(y.kind(), Kind::Double);
    let y = Vec::<f64>::try_from(&y.reshape([-1])).unwrap();
    let expected = numbers(&script["y"]);
    let d = kiln_testkit::max_abs_diff(&y, &expected);
    eprintln!("TorchScript in Rust vs Python: max abs difference {d:.3e}");
    assert!(
        d <= 1e-12,
        "TorchScript output differs from Python's by {d:e}"
    );
}
