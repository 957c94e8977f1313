//! The fused ops on libtorch: against finite differences (float64), against the
//! equivalent composition of built-in torch ops (float32, 1e-5), typed errors
//! instead of aborts, and the TorchScript round trip through Python in both
//! directions (the library loads into Python; a model scripted there runs here).

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::{Path, PathBuf};

use kiln_core::{Device, Error};
use kiln_torch::ScriptModule;
use tch::{Kind, Tensor};

fn opts(kind: Kind) -> (Kind, tch::Device) {
    (kind, tch::Device::Cpu)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// Central differences of `f` (a scalar function) w.r.t. every element of `inputs[which]`.
fn numeric_grad(f: &dyn Fn(&[Tensor]) -> f64, inputs: &[Tensor], which: usize) -> Tensor {
    let h = 1e-6;
    let base = inputs[which].copy();
    let flat = base.view([-1]);
    let mut grad = vec![0f64; flat.size()[0] as usize];
    for (i, g) in grad.iter_mut().enumerate() {
        let eval = |delta: f64| {
            let moved: Vec<Tensor> = inputs.iter().map(Tensor::copy).collect();
            let m = moved[which].view([-1]);
            let v = m.double_value(&[i as i64]);
            let _ = m.get(i as i64).fill_(v + delta);
            f(&moved)
        };
        *g = (eval(h) - eval(-h)) / (2.0 * h);
    }
    Tensor::from_slice(&grad).view(base.size().as_slice())
}

/// Analytic gradients of `sum(f(inputs) * probe)` against central differences, float64.
fn check_against_finite_differences(
    name: &str,
    inputs: Vec<Tensor>,
    differentiable: &[usize],
    f: &dyn Fn(&[Tensor]) -> Tensor,
) {
    let probe = f(&inputs).randn_like();
    let leaves: Vec<Tensor> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if differentiable.contains(&i) {
                t.copy().set_requires_grad(true)
            } else {
                t.copy()
            }
        })
        .collect();
    (f(&leaves) * &probe).sum(Kind::Double).backward();
    let scalar = |xs: &[Tensor]| (f(xs) * &probe).sum(Kind::Double).double_value(&[]);
    for &i in differentiable {
        let numeric = numeric_grad(&scalar, &inputs, i);
        let err = max_diff(&leaves[i].grad(), &numeric);
        eprintln!("{name}: input {i} analytic vs finite differences {err:.2e}");
        assert!(err < 1e-6, "{name}: gradient of input {i} differs by {err}");
    }
}

#[test]
fn gradients_match_finite_differences() {
    let d = opts(Kind::Double);
    tch::manual_seed(1);
    check_against_finite_differences(
        "bias_gelu",
        vec![Tensor::randn([3, 5], d), Tensor::randn([5], d)],
        &[0, 1],
        &|t| kiln_fused_ops::bias_gelu(&t[0], &t[1]).unwrap(),
    );
    check_against_finite_differences(
        "softmax_xent",
        vec![
            Tensor::randn([4, 6], d),
            Tensor::from_slice(&[1i64, 0, 5, 2]),
        ],
        &[0],
        &|t| kiln_fused_ops::softmax_cross_entropy(&t[0], &t[1], 0.15).unwrap(),
    );
    check_against_finite_differences(
        "swish",
        vec![Tensor::randn([4, 7], d), Tensor::from_slice(&[0.8f64])],
        &[0, 1],
        &|t| kiln_fused_ops::swish(&t[0], &t[1]).unwrap(),
    );
}

/// Output and gradients of op and reference on the same float32 leaves.
fn compare(name: &str, leaves: &[Tensor], op: Tensor, reference: Tensor, tol: f64) {
    let probe = op.randn_like();
    let grads =
        |y: &Tensor| Tensor::run_backward(&[(y * &probe).sum(Kind::Float)], leaves, true, false);
    let forward = max_diff(&op, &reference);
    let (a, b) = (grads(&op), grads(&reference));
    eprintln!("{name}: forward {forward:.2e}");
    assert!(forward < tol, "{name}: forward differs by {forward}");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let err = max_diff(x, y) / (1.0 + y.abs().max().double_value(&[]));
        eprintln!("{name}: gradient {i} {err:.2e}");
        assert!(err < tol, "{name}: gradient {i} differs by {err}");
    }
}

#[test]
fn ops_equal_the_composition_of_builtin_ops() {
    let f = opts(Kind::Float);
    tch::manual_seed(2);
    // Large enough that at::parallel_for splits the work across threads.
    let x = Tensor::randn([64, 1024], f).set_requires_grad(true);
    let b = Tensor::randn([1024], f).set_requires_grad(true);
    compare(
        "bias_gelu",
        &[x.shallow_clone(), b.shallow_clone()],
        kiln_fused_ops::bias_gelu(&x, &b).unwrap(),
        (&x + &b).gelu("none"),
        1e-5,
    );
    let logits = Tensor::randn([512, 37], f).set_requires_grad(true);
    let target = Tensor::randint(37, [512], (Kind::Int64, tch::Device::Cpu));
    compare(
        "softmax_xent",
        std::slice::from_ref(&logits),
        kiln_fused_ops::softmax_cross_entropy(&logits, &target, 0.1).unwrap(),
        logits.cross_entropy_loss::<Tensor>(&target, None, tch::Reduction::None, -100, 0.1),
        1e-5,
    );
    let beta = Tensor::from_slice(&[1.7f32]).set_requires_grad(true);
    compare(
        "swish",
        &[x.shallow_clone(), beta.shallow_clone()],
        kiln_fused_ops::swish(&x, &beta).unwrap(),
        &x * (&beta * &x).sigmoid(),
        1e-5,
    );
}

#[test]
fn bad_input_is_an_error_not_an_abort() {
    let f = opts(Kind::Float);
    let x = Tensor::randn([4, 8], f);
    let cases = [
        (
            kiln_fused_ops::bias_gelu(&x, &Tensor::zeros([7], f)).unwrap_err(),
            "kiln::bias_gelu: bias must have shape [8] (x's last dimension), got [7] for x of shape [4, 8]",
        ),
        (
            kiln_fused_ops::bias_gelu(&x, &Tensor::zeros([8], opts(Kind::Double))).unwrap_err(),
            "kiln::bias_gelu: x is Float but bias is Double",
        ),
        (
            kiln_fused_ops::softmax_cross_entropy(&x, &Tensor::zeros([4], opts(Kind::Int)), 0.0)
                .unwrap_err(),
            "kiln::softmax_xent: target must be int64 class indices, got Int",
        ),
        (
            kiln_fused_ops::softmax_cross_entropy(&x, &Tensor::from_slice(&[0i64, 1, 8, 2]), 0.0)
                .unwrap_err(),
            "kiln::softmax_xent: target 8 at row 2 is outside [0, 8)",
        ),
        (
            kiln_fused_ops::swish(&x, &Tensor::ones([2], f)).unwrap_err(),
            "kiln::swish: beta must have one element, got shape [2]",
        ),
        (
            kiln_fused_ops::swish(&Tensor::zeros([3], opts(Kind::Int64)), &Tensor::ones([1], f))
                .unwrap_err(),
            "kiln::swish: x must be float32 or float64, got Long",
        ),
    ];
    for (err, expected) in cases {
        assert!(matches!(err, Error::Backend { .. }), "{err:?}");
        // The C++ exception is the error's source: read the chain, as a user sees it.
        let text = err.display_chain().to_string();
        assert!(
            text.contains(expected),
            "`{text}` does not contain `{expected}`"
        );
        assert!(!text.contains("Exception raised from"), "{text}");
    }
}

fn python() -> Option<PathBuf> {
    kiln_testkit::python("kiln-fused-ops torch_ops reference")
}

fn tensor(value: &serde_json::Value, kind: Kind) -> Tensor {
    let shape: Vec<i64> = serde_json::from_value(value["shape"].clone()).unwrap();
    let data: Vec<f64> = serde_json::from_value(value["data"].clone()).unwrap();
    Tensor::from_slice(&data)
        .to_kind(kind)
        .view(shape.as_slice())
}

#[test]
fn torchscript_round_trip_through_python() {
    let Some(python) = python() else { return };
    assert!(kiln_fused_ops::register());
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ops-ts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/reference/torchscript_ops.py"
    );
    let out = std::process::Command::new(&python)
        .args([script, kiln_fused_ops::TORCH_LIBRARY, dir.to_str().unwrap()])
        .output()
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(
        out.status.success(),
        "python: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let io: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("io.json")).unwrap()).unwrap();
    let model = ScriptModule::load(dir.join("model.pt"), Device::Cpu).unwrap();
    let x = tensor(&io["x"], Kind::Float);
    let target = tensor(&io["target"], Kind::Int64);
    let outputs = model.forward_tensors(&[x, target]).unwrap();
    let logits_err = max_diff(&outputs[0], &tensor(&io["logits"], Kind::Float));
    let loss_err = max_diff(&outputs[1], &tensor(&io["loss"], Kind::Float));
    eprintln!("scripted model in Kiln vs Python: logits {logits_err:.2e}, loss {loss_err:.2e}");
    assert!(logits_err < 1e-5 && loss_err < 1e-5);
    // The kiln ops differentiate inside the scripted model too.
    outputs[1].backward();
    std::fs::remove_dir_all(&dir).unwrap();
}
