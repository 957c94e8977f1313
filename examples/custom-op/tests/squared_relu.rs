//! The example op: its gradient against finite differences, its values against
//! `relu(x)^2`, a clear error for a bad dtype, and the same library in Python.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln_example_custom_op::{squared_relu, LIBRARY};
use tch::{Kind, Tensor};

#[test]
fn gradient_matches_finite_differences_and_values_match_relu_squared() {
    let x = Tensor::from_slice(&[-1.5f64, -0.2, 0.3, 0.9, 2.0, -3.0]).set_requires_grad(true);
    let y = squared_relu(&x).unwrap();
    let expected = x.relu().square();
    assert!((&y - &expected).abs().max().double_value(&[]) < 1e-15);
    y.sum(Kind::Double).backward();
    let h = 1e-6;
    for i in 0..6 {
        let at = |d: f64| {
            let moved = x.detach().copy();
            let _ = moved.get(i).fill_(x.double_value(&[i]) + d);
            squared_relu(&moved)
                .unwrap()
                .sum(Kind::Double)
                .double_value(&[])
        };
        let numeric = (at(h) - at(-h)) / (2.0 * h);
        let analytic = x.grad().double_value(&[i]);
        assert!(
            (numeric - analytic).abs() < 1e-6,
            "{i}: {numeric} vs {analytic}"
        );
    }
}

#[test]
fn a_bad_dtype_is_an_error() {
    let err = squared_relu(&Tensor::from_slice(&[1i64, 2])).unwrap_err();
    assert!(
        err.to_string()
            .contains("example::squared_relu: x must be float32 or float64, got Long"),
        "{err}"
    );
}

#[test]
fn python_loads_the_same_library() {
    let python = std::path::Path::new(env!("KILN_VENV_PYTHON"));
    if !python.exists() {
        eprintln!("SKIPPED: no project virtualenv at {}", python.display());
        return;
    }
    let code = "import sys, torch\n\
                torch.ops.load_library(sys.argv[1])\n\
                x = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)\n\
                y = torch.ops.example.squared_relu(x)\n\
                y.sum().backward()\n\
                assert y.tolist() == [0.0, 0.25, 4.0], y\n\
                assert x.grad.tolist() == [0.0, 1.0, 4.0], x.grad\n\
                print('ok')";
    let out = std::process::Command::new(python)
        .args(["-c", code, LIBRARY])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
