//! Rust ops registered in libtorch, called through its dispatcher from Rust:
//! forward against compositions of libtorch's own ops (f32 and f64, 1e-6),
//! gradients through libtorch's autograd against central finite differences
//! of the forward in f64 (1e-6 relative), attributes of every kind, two
//! outputs (one gradient missing), a shape-changing op on meta tensors,
//! errors (the kernel's own, a panic on the calling thread and on a libtorch
//! worker, wrong dtypes and devices, a missing gradient op, registering twice,
//! a name libtorch already has) as typed errors after which the process goes
//! on, and an op as a `Layer::Custom` layer that the Trainer trains.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln_core::backend::Trainable;
use std::sync::OnceLock;

use kiln_core::{
    backend::{Backend, EagerBackend, TrainBackend},
    loss::Loss,
    model::{CustomConfig, Init, Layer, LinearConfig},
    module::Module,
    optim::{OptimizerConfig, SgdConfig},
    Device, Error, HostTensor,
};
use kiln_custom_op::{
    AttrValue, Attrs, Context, CustomOp, Float, OpError, OpSchema, Saved, Shape, TensorMut,
    TensorRef,
};
use kiln_data::{InMemoryDataset, SequentialLoader};
use kiln_testkit::noise;
use kiln_torch::{TorchBackend, TorchModel};
use kiln_train::{Trainer, TrainerConfig, TrainingState};
use tch::{Kind, Tensor};

const NS: &str = "kiln_test";

fn same_shape(a: &[i64], b: &[i64], what: &str) -> Result<(), OpError> {
    if a == b {
        Ok(())
    } else {
        Err(OpError::new(format!(
            "{what} has shape {a:?}, expected {b:?}"
        )))
    }
}

/// `y = sign * alpha * x^power` (`sign` -1 when `negate`): one attribute of
/// each kind. Small grains, so that libtorch's threads share the work.
struct Scale;

fn scale_factors(attrs: &Attrs) -> Result<(f64, u32), OpError> {
    let alpha = attrs.float("alpha")? * if attrs.bool("negate")? { -1.0 } else { 1.0 };
    let power = attrs.int("power")?;
    let power = u32::try_from(power)
        .map_err(|_| OpError::new(format!("power is {power}, expected 0 or more")))?;
    Ok((alpha, power))
}

fn powi<T: Float>(x: T, n: u32) -> T {
    (0..n).fold(T::ONE, |acc, _| acc * x)
}

impl CustomOp for Scale {
    fn schema() -> OpSchema {
        OpSchema::new(NS, "scale")
            .input("x")
            .output("y")
            .attr("alpha", AttrValue::Float(1.0))
            .attr("power", AttrValue::Int(1))
            .attr("negate", AttrValue::Bool(false))
            .gradient("scale_backward", Saved::Inputs)
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        Ok(vec![inputs[0].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        attrs: &Attrs,
        ctx: &Context<'_>,
    ) -> Result<(), OpError> {
        let (alpha, power) = scale_factors(attrs)?;
        let alpha = T::from_f64(alpha);
        let x = inputs[0].data();
        ctx.map_chunks(outputs[0].data_mut(), 1, 64, |start, y| {
            for (y, &x) in y.iter_mut().zip(&x[start..]) {
                *y = alpha * powi(x, power);
            }
        });
        Ok(())
    }
}

/// `(grad, x) -> grad * sign * alpha * power * x^(power - 1)`.
struct ScaleBackward;

impl CustomOp for ScaleBackward {
    fn schema() -> OpSchema {
        OpSchema::new(NS, "scale_backward")
            .input("grad")
            .input("x")
            .output("grad_x")
            .attr("alpha", AttrValue::Float(1.0))
            .attr("power", AttrValue::Int(1))
            .attr("negate", AttrValue::Bool(false))
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        same_shape(inputs[0], inputs[1], "grad")?;
        Ok(vec![inputs[1].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        attrs: &Attrs,
        ctx: &Context<'_>,
    ) -> Result<(), OpError> {
        let (alpha, power) = scale_factors(attrs)?;
        let c = T::from_f64(alpha * f64::from(power));
        let (g, x) = (inputs[0].data(), inputs[1].data());
        ctx.map_chunks(outputs[0].data_mut(), 1, 64, |start, dx| {
            for (i, dx) in dx.iter_mut().enumerate() {
                let (g, x) = (g[start + i], x[start + i]);
                *dx = if power == 0 {
                    T::ZERO
                } else {
                    g * c * powi(x, power - 1)
                };
            }
        });
        Ok(())
    }
}

/// `(a, b) -> (p = exp(a) * b, q = a - b^2)`: two outputs, a gradient op that
/// gets the outputs too.
struct TwoOut;

impl CustomOp for TwoOut {
    fn schema() -> OpSchema {
        OpSchema::new(NS, "two_out")
            .input("a")
            .input("b")
            .output("p")
            .output("q")
            .gradient("two_out_backward", Saved::InputsAndOutputs)
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        same_shape(inputs[1], inputs[0], "b")?;
        Ok(vec![inputs[0].to_vec(), inputs[0].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        let (a, b) = (inputs[0].data(), inputs[1].data());
        let (p, q) = outputs.split_at_mut(1);
        for (i, (p, q)) in p[0].data_mut().iter_mut().zip(q[0].data_mut()).enumerate() {
            *p = a[i].exp() * b[i];
            *q = a[i] - b[i] * b[i];
        }
        Ok(())
    }
}

/// `(gp, gq, a, b, p, q) -> (gp * p + gq, gp * exp(a) - 2 b gq)`.
struct TwoOutBackward;

impl CustomOp for TwoOutBackward {
    fn schema() -> OpSchema {
        let mut s = OpSchema::new(NS, "two_out_backward");
        for name in ["grad_p", "grad_q", "a", "b", "p", "q"] {
            s = s.input(name);
        }
        s.output("grad_a").output("grad_b")
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        Ok(vec![inputs[2].to_vec(), inputs[3].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        let [gp, gq, a, b, p, _q] = [0, 1, 2, 3, 4, 5].map(|i| inputs[i].data());
        let two = T::ONE + T::ONE;
        let (ga, gb) = outputs.split_at_mut(1);
        for (i, (ga, gb)) in ga[0]
            .data_mut()
            .iter_mut()
            .zip(gb[0].data_mut())
            .enumerate()
        {
            *ga = gp[i] * p[i] + gq[i];
            *gb = gp[i] * a[i].exp() - two * b[i] * gq[i];
        }
        Ok(())
    }
}

/// `x [.., D] -> y [..]`, the sum of each row: the output shape differs.
struct RowSum;

impl CustomOp for RowSum {
    fn schema() -> OpSchema {
        OpSchema::new(NS, "row_sum")
            .input("x")
            .output("y")
            .gradient("row_sum_backward", Saved::Inputs)
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        match inputs[0].split_last() {
            Some((_, rows)) => Ok(vec![rows.to_vec()]),
            None => Err(OpError::new(
                "x is a scalar, expected at least one dimension",
            )),
        }
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        let d = inputs[0].last_dim();
        for (y, row) in outputs[0]
            .data_mut()
            .iter_mut()
            .zip(inputs[0].data().chunks(d))
        {
            *y = row.iter().fold(T::ZERO, |s, &v| s + v);
        }
        Ok(())
    }
}

/// `(g [..], x [.., D]) -> g broadcast over D`.
struct RowSumBackward;

impl CustomOp for RowSumBackward {
    fn schema() -> OpSchema {
        OpSchema::new(NS, "row_sum_backward")
            .input("grad")
            .input("x")
            .output("grad_x")
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        Ok(vec![inputs[1].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        let d = inputs[1].last_dim();
        let g = inputs[0].data();
        for (row, &g) in outputs[0].data_mut().chunks_mut(d).zip(g) {
            row.fill(g);
        }
        Ok(())
    }
}

/// `(x [N, D], w [D], b [D]) -> x * w + b`: a layer with two params.
struct Affine;

impl CustomOp for Affine {
    fn schema() -> OpSchema {
        OpSchema::new(NS, "affine")
            .input("x")
            .input("w")
            .input("b")
            .output("y")
            .gradient("affine_backward", Saved::Inputs)
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        let d = inputs[0].last().copied().unwrap_or(1);
        same_shape(inputs[1], &[d], "w")?;
        same_shape(inputs[2], &[d], "b")?;
        Ok(vec![inputs[0].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        let (x, w, b) = (inputs[0].data(), inputs[1].data(), inputs[2].data());
        let d = w.len();
        for (y, x) in outputs[0].data_mut().chunks_mut(d).zip(x.chunks(d)) {
            for i in 0..d {
                y[i] = x[i] * w[i] + b[i];
            }
        }
        Ok(())
    }
}

/// `(g, x, w, b) -> (g * w, sum_rows(g * x), sum_rows(g))`.
struct AffineBackward;

impl CustomOp for AffineBackward {
    fn schema() -> OpSchema {
        OpSchema::new(NS, "affine_backward")
            .input("grad")
            .input("x")
            .input("w")
            .input("b")
            .output("grad_x")
            .output("grad_w")
            .output("grad_b")
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        Ok(vec![
            inputs[1].to_vec(),
            inputs[2].to_vec(),
            inputs[3].to_vec(),
        ])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        let (g, x, w) = (inputs[0].data(), inputs[1].data(), inputs[2].data());
        let d = w.len();
        let (gx, rest) = outputs.split_at_mut(1);
        let (gw, gb) = rest.split_at_mut(1);
        let (gw, gb) = (gw[0].data_mut(), gb[0].data_mut());
        gw.fill(T::ZERO);
        gb.fill(T::ZERO);
        for ((gx, g), x) in gx[0]
            .data_mut()
            .chunks_mut(d)
            .zip(g.chunks(d))
            .zip(x.chunks(d))
        {
            for i in 0..d {
                gx[i] = g[i] * w[i];
                gw[i] += g[i] * x[i];
                gb[i] += g[i];
            }
        }
        Ok(())
    }
}

/// `mode` 0: `y = x`; 1: the kernel's error; 2: a panic in the kernel; 3: a
/// panic on one of libtorch's worker threads. No gradient.
struct Faulty;

impl CustomOp for Faulty {
    fn schema() -> OpSchema {
        OpSchema::new(NS, "faulty")
            .input("x")
            .output("y")
            .attr("mode", AttrValue::Int(0))
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        Ok(vec![inputs[0].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        attrs: &Attrs,
        ctx: &Context<'_>,
    ) -> Result<(), OpError> {
        let x = inputs[0].data();
        match attrs.int("mode")? {
            1 => {
                return Err(OpError::new(
                    "x is not what this kernel wants, expected nothing",
                ))
            }
            2 => panic!("the faulty kernel gives up"),
            3 => ctx.parallel_for(x.len(), 1, |range| {
                if range.contains(&(x.len() - 1)) {
                    panic!("a worker gives up");
                }
            }),
            _ => {}
        }
        outputs[0].data_mut().copy_from_slice(x);
        Ok(())
    }
}

/// `y = 2 x`, whose gradient op is never registered.
struct Orphan;

impl CustomOp for Orphan {
    fn schema() -> OpSchema {
        OpSchema::new(NS, "orphan")
            .input("x")
            .output("y")
            .gradient("orphan_backward", Saved::Inputs)
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        Ok(vec![inputs[0].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        for (y, &x) in outputs[0].data_mut().iter_mut().zip(inputs[0].data()) {
            *y = x + x;
        }
        Ok(())
    }
}

/// An op registered twice by the test of that.
struct Twice;

impl CustomOp for Twice {
    fn schema() -> OpSchema {
        OpSchema::new(NS, "twice").input("x").output("y")
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        Ok(vec![inputs[0].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        outputs[0].data_mut().copy_from_slice(inputs[0].data());
        Ok(())
    }
}

/// An op whose name libtorch has already: `aten::relu`.
struct ClashesWithAten;

impl CustomOp for ClashesWithAten {
    fn schema() -> OpSchema {
        OpSchema::new("aten", "relu").input("self").output("y")
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        Ok(vec![inputs[0].to_vec()])
    }
    fn compute<T: Float>(
        _: &[TensorRef<'_, T>],
        _: &mut [TensorMut<'_, T>],
        _: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        Ok(())
    }
}

/// Registers the test ops once per process (the gradient ops first for some,
/// after for others: the order does not matter).
fn setup() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        kiln_torch_op::register::<ScaleBackward>().unwrap();
        kiln_torch_op::register::<Scale>().unwrap();
        kiln_torch_op::register::<TwoOut>().unwrap();
        kiln_torch_op::register::<TwoOutBackward>().unwrap();
        kiln_torch_op::register::<RowSum>().unwrap();
        kiln_torch_op::register::<RowSumBackward>().unwrap();
        kiln_torch_op::register::<AffineBackward>().unwrap();
        kiln_torch_op::register_layer::<Affine>().unwrap();
        kiln_torch_op::register_layer::<Scale>().unwrap(); // registered above: layer only
        kiln_torch_op::register::<Faulty>().unwrap();
        kiln_torch_op::register::<Orphan>().unwrap();
    });
}

fn tensor(shape: &[i64], seed: u64, kind: Kind) -> Tensor {
    let n = shape.iter().product::<i64>() as usize;
    Tensor::from_slice(&noise(n, seed))
        .reshape(shape)
        .to_kind(kind)
}

fn values(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(&t.detach().to_kind(Kind::Double).reshape([-1]).contiguous()).unwrap()
}

fn attrs_of<O: CustomOp>(set: &[(&str, AttrValue)]) -> Attrs {
    let mut attrs = Attrs::defaults(&O::schema());
    for (name, value) in set {
        attrs.set(name, *value).unwrap();
    }
    attrs
}

fn call(op: &str, inputs: &[&Tensor], attrs: &Attrs) -> Vec<Tensor> {
    kiln_torch_op::call(&format!("{NS}::{op}"), inputs, attrs)
        .unwrap_or_else(|e| panic!("{op}: {}", e.display_chain()))
}

fn call_err(op: &str, inputs: &[&Tensor], attrs: &Attrs) -> (Error, String) {
    let err = kiln_torch_op::call(&format!("{NS}::{op}"), inputs, attrs)
        .err()
        .unwrap_or_else(|| panic!("{op} succeeded"));
    let text = err.display_chain().to_string();
    (err, text)
}

/// The largest difference relative to `max(1, |expected|)`.
fn worst(actual: &Tensor, expected: &Tensor) -> f64 {
    assert_eq!(actual.size(), expected.size());
    values(actual)
        .iter()
        .zip(values(expected))
        .map(|(a, e)| (a - e).abs() / e.abs().max(1.0))
        .fold(0.0, f64::max)
}

#[test]
fn forward_matches_compositions_of_libtorch_ops() {
    setup();
    let mut report = Vec::new();
    for kind in [Kind::Float, Kind::Double] {
        let tol = if kind == Kind::Float { 1e-6 } else { 1e-12 };
        // Large enough for libtorch's threads (grain 64).
        let x = tensor(&[37, 53], 1, kind);
        let none = Attrs::defaults(&Scale::schema());
        let d = worst(&call("scale", &[&x], &none)[0], &x);
        report.push(("scale default", kind, d));
        // Non-default attributes of each kind reach the kernel.
        let set = attrs_of::<Scale>(&[
            ("alpha", AttrValue::Float(-0.5)),
            ("power", AttrValue::Int(3)),
            ("negate", AttrValue::Bool(true)),
        ]);
        let y = &call("scale", &[&x], &set)[0];
        report.push((
            "scale alpha=-0.5 power=3 negate",
            kind,
            worst(y, &(x.pow_tensor_scalar(3) * 0.5)),
        ));
        // A non-contiguous input (a transpose) is read in its logical order.
        let xt = x.transpose(0, 1);
        assert!(!xt.is_contiguous());
        let y = &call("scale", &[&xt], &set)[0];
        report.push((
            "scale of a transpose",
            kind,
            worst(y, &(xt.pow_tensor_scalar(3) * 0.5)),
        ));

        let (a, b) = (tensor(&[4, 6], 2, kind), tensor(&[4, 6], 3, kind));
        let out = call("two_out", &[&a, &b], &Attrs::default());
        assert_eq!(out.len(), 2);
        report.push(("two_out p", kind, worst(&out[0], &(a.exp() * &b))));
        report.push(("two_out q", kind, worst(&out[1], &(&a - &b * &b))));

        let x3 = tensor(&[2, 3, 5], 4, kind);
        let y = &call("row_sum", &[&x3], &Attrs::default())[0];
        assert_eq!(y.size(), [2, 3]);
        report.push((
            "row_sum",
            kind,
            worst(y, &x3.sum_dim_intlist(-1, false, kind)),
        ));

        let (w, b) = (tensor(&[6], 5, kind), tensor(&[6], 6, kind));
        let y = &call("affine", &[&a, &w, &b], &Attrs::default())[0];
        report.push(("affine", kind, worst(y, &(&a * &w + &b))));

        for (what, k, d) in report.iter().filter(|r| r.1 == kind) {
            eprintln!("{what} ({k:?}): max relative difference {d:.3e}");
            assert!(
                *d <= tol,
                "{what} ({k:?}) differs from libtorch by {d:e} > {tol:e}"
            );
        }
    }
}

/// Gradients of `L = sum_i sum(out_i * weight_i)` with respect to `inputs`,
/// through libtorch's autograd (the op's Autograd kernel and gradient op),
/// against central differences of L computed with the forward op alone.
fn check_gradients(op: &str, inputs: &[Tensor], attrs: &Attrs, used_outputs: &[usize]) -> f64 {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_kind(Kind::Double).detach().set_requires_grad(true))
        .collect();
    let refs: Vec<&Tensor> = leaves.iter().collect();
    let outs = call(op, &refs, attrs);
    let weights: Vec<Tensor> = outs
        .iter()
        .enumerate()
        .map(|(i, o)| tensor(&o.size(), 100 + i as u64, Kind::Double))
        .collect();
    let loss = |outs: &[Tensor]| -> Tensor {
        used_outputs
            .iter()
            .map(|&i| (&outs[i] * &weights[i]).sum(Kind::Double))
            .fold(
                Tensor::zeros([], (Kind::Double, tch::Device::Cpu)),
                |a, b| a + b,
            )
    };
    let grads = Tensor::run_backward(&[loss(&outs)], &leaves, false, false);
    let h = 1e-6;
    let mut worst_err = 0.0f64;
    for (k, leaf) in leaves.iter().enumerate() {
        let analytic = values(&grads[k]);
        let base = leaf.detach();
        let flat = values(&base);
        for (i, &ag) in analytic.iter().enumerate() {
            let at = |delta: f64| -> f64 {
                let mut v = flat.clone();
                v[i] += delta;
                let moved = Tensor::from_slice(&v).reshape(base.size());
                let mut args: Vec<Tensor> = leaves.iter().map(|l| l.detach()).collect();
                args[k] = moved;
                let refs: Vec<&Tensor> = args.iter().collect();
                values(&loss(&call(op, &refs, attrs)))[0]
            };
            let fd = (at(h) - at(-h)) / (2.0 * h);
            let err = (fd - ag).abs() / ag.abs().max(1.0);
            assert!(
                err < 1e-6,
                "{op}: d loss / d input {k} element {i}: autograd {ag}, finite differences {fd}"
            );
            worst_err = worst_err.max(err);
        }
    }
    worst_err
}

#[test]
fn gradients_match_finite_differences_in_f64() {
    setup();
    let set = attrs_of::<Scale>(&[
        ("alpha", AttrValue::Float(1.5)),
        ("power", AttrValue::Int(3)),
        ("negate", AttrValue::Bool(true)),
    ]);
    let cases: Vec<(&str, Vec<Tensor>, Attrs, Vec<usize>)> = vec![
        (
            "scale",
            vec![tensor(&[3, 4], 11, Kind::Double)],
            set,
            vec![0],
        ),
        (
            "two_out",
            vec![
                tensor(&[2, 3], 12, Kind::Double),
                tensor(&[2, 3], 13, Kind::Double),
            ],
            Attrs::default(),
            vec![0, 1],
        ),
        // Only p is used: q's gradient is missing and reaches the gradient op as zeros.
        (
            "two_out",
            vec![
                tensor(&[2, 3], 14, Kind::Double),
                tensor(&[2, 3], 15, Kind::Double),
            ],
            Attrs::default(),
            vec![0],
        ),
        (
            "row_sum",
            vec![tensor(&[2, 2, 3], 16, Kind::Double)],
            Attrs::default(),
            vec![0],
        ),
        (
            "affine",
            vec![
                tensor(&[3, 4], 17, Kind::Double),
                tensor(&[4], 18, Kind::Double),
                tensor(&[4], 19, Kind::Double),
            ],
            Attrs::default(),
            vec![0],
        ),
    ];
    for (op, inputs, attrs, used) in cases {
        let e = check_gradients(op, &inputs, &attrs, &used);
        eprintln!("{op} (outputs {used:?}): max relative gradient error {e:.3e}");
    }
}

#[test]
fn kernel_errors_and_panics_are_errors_and_the_process_goes_on() {
    setup();
    let x = tensor(&[8, 16], 21, Kind::Float);
    let mode = |m: i64| attrs_of::<Faulty>(&[("mode", AttrValue::Int(m))]);

    let (err, text) = call_err("faulty", &[&x], &mode(1));
    assert!(matches!(err, Error::Backend { .. }), "{text}");
    assert!(
        text.contains("kiln_test::faulty: x is not what this kernel wants, expected nothing"),
        "{text}"
    );
    let (_, text) = call_err("faulty", &[&x], &mode(2));
    assert!(
        text.contains("kiln_test::faulty: the kernel panicked: the faulty kernel gives up"),
        "{text}"
    );
    let (_, text) = call_err("faulty", &[&x], &mode(3));
    assert!(text.contains("panicked: a worker gives up"), "{text}");
    // The next call in the same process works.
    let y = &call("faulty", &[&x], &mode(0))[0];
    assert_eq!(worst(y, &x), 0.0);

    let bad_power = attrs_of::<Scale>(&[("power", AttrValue::Int(-2))]);
    let (_, text) = call_err("scale", &[&x], &bad_power);
    assert!(
        text.contains("kiln_test::scale: power is -2, expected 0 or more"),
        "{text}"
    );
    let (_, text) = call_err("row_sum", &[&Tensor::from(1.0f32)], &Attrs::default());
    assert!(text.contains("kiln_test::row_sum: x is a scalar"), "{text}");
    let (_, text) = call_err("two_out", &[&x, &x.reshape([16, 8])], &Attrs::default());
    assert!(
        text.contains("b has shape [16, 8], expected [8, 16]"),
        "{text}"
    );
    // Wrong arity is the dispatcher's error, not a crash.
    let err = kiln_torch_op::call("kiln_test::two_out", &[&x], &Attrs::default()).unwrap_err();
    eprintln!("two_out with one tensor: {}", err.display_chain());
    let err = kiln_torch_op::call("kiln_test::nothing", &[&x], &Attrs::default()).unwrap_err();
    assert!(err
        .display_chain()
        .to_string()
        .contains("no op `kiln_test::nothing`"));
}

#[test]
fn wrong_dtypes_and_devices_are_typed_errors() {
    setup();
    let none = Attrs::defaults(&Scale::schema());
    for (kind, name) in [
        (Kind::Half, "float16"),
        (Kind::Int64, "int64"),
        (Kind::BFloat16, "bfloat16"),
    ] {
        let x = tensor(&[3], 31, kind);
        let (err, text) = call_err("scale", &[&x], &none);
        assert!(matches!(err, Error::Backend { .. }), "{text}");
        assert!(
            text.contains(&format!(
                "kiln_test::scale: input `x` is {name}, expected float32 or float64"
            )),
            "{text}"
        );
    }
    let a = tensor(&[2, 3], 32, Kind::Float);
    let b = tensor(&[2, 3], 33, Kind::Double);
    let (_, text) = call_err("two_out", &[&a, &b], &Attrs::default());
    assert!(
        text.contains("input `b` is float64, expected float32 like `a`"),
        "{text}"
    );
    // A meta tensor beside a CPU one: dispatched to the Meta kernel, refused by name.
    let meta = meta_tensor(&[2, 3]);
    let (_, text) = call_err("two_out", &[&meta, &a], &Attrs::default());
    assert!(
        text.contains("input `b` is on cpu, expected meta"),
        "{text}"
    );
    if tch::Cuda::is_available() {
        let gpu = a.to_device(tch::Device::Cuda(0));
        let (_, text) = call_err("scale", &[&gpu], &none);
        assert!(
            text.contains(
                "kiln ops written in Rust run on CPU; write a CUDA kernel in C++ (see kiln-fused-ops)"
            ),
            "{text}"
        );
        eprintln!("CUDA input: {text}");
    } else {
        eprintln!("no CUDA device: the CUDA input case did not run");
    }
    // The process goes on.
    assert_eq!(worst(&call("scale", &[&a], &none)[0], &a), 0.0);
}

#[test]
fn registering_twice_or_a_taken_name_is_an_error() {
    setup();
    kiln_torch_op::register::<Twice>().unwrap();
    let err = kiln_torch_op::register::<Twice>().unwrap_err();
    let text = err.display_chain().to_string();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{text}");
    assert!(
        text.contains("kiln_test::twice") && text.contains("registered twice"),
        "{text}"
    );
    let x = tensor(&[3], 41, Kind::Float);
    assert_eq!(worst(&call("twice", &[&x], &Attrs::default())[0], &x), 0.0);

    let err = kiln_torch_op::register::<ClashesWithAten>().unwrap_err();
    let text = err.display_chain().to_string();
    assert!(matches!(err, Error::Backend { .. }), "{text}");
    assert!(
        text.contains("libtorch already has an op `aten::relu`"),
        "{text}"
    );
    // aten::relu is untouched.
    assert_eq!(worst(&x.relu(), &x.clamp_min(0.0)), 0.0);
}

#[test]
fn meta_tensors_get_the_shape_functions_shapes() {
    setup();
    let y = &call("row_sum", &[&meta_tensor(&[3, 5, 7])], &Attrs::default())[0];
    assert_eq!(y.size(), [3, 5]);
    let out = call(
        "two_out",
        &[&meta_tensor(&[4, 2]), &meta_tensor(&[4, 2])],
        &Attrs::default(),
    );
    assert_eq!(
        out.iter().map(Tensor::size).collect::<Vec<_>>(),
        [vec![4, 2], vec![4, 2]]
    );
    let (_, text) = call_err(
        "two_out",
        &[&meta_tensor(&[4, 2]), &meta_tensor(&[2, 4])],
        &Attrs::default(),
    );
    assert!(
        text.contains("b has shape [2, 4], expected [4, 2]"),
        "{text}"
    );
}

#[test]
fn backward_without_a_gradient_op_names_what_is_missing() {
    setup();
    let x = tensor(&[3], 51, Kind::Double).set_requires_grad(true);
    let y = &call("orphan", &[&x], &Attrs::default())[0];
    let err = y.sum(Kind::Double).f_backward().unwrap_err().to_string();
    assert!(
        err.contains("the backward of `kiln_test::orphan` calls its gradient op: register `kiln_test::orphan_backward`"),
        "{err}"
    );
    let y = &call("faulty", &[&x], &Attrs::defaults(&Faulty::schema()))[0];
    let err = y.sum(Kind::Double).f_backward().unwrap_err().to_string();
    assert!(
        err.contains("`kiln_test::faulty` is not differentiable"),
        "{err}"
    );
}

/// A float32 meta tensor, made with the stable C ABI (tch has no meta device).
fn meta_tensor(shape: &[i64]) -> Tensor {
    #[repr(C)]
    struct AtenTensorOpaque {
        _unused: [u8; 0],
    }
    extern "C" {
        fn aoti_torch_empty_strided(
            ndim: i64,
            sizes: *const i64,
            strides: *const i64,
            dtype: i32,
            device_type: i32,
            device_index: i32,
            ret: *mut *mut AtenTensorOpaque,
        ) -> i32;
        fn aoti_torch_dtype_float32() -> i32;
        fn aoti_torch_device_type_meta() -> i32;
    }
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    let mut handle = std::ptr::null_mut();
    // SAFETY: shape and strides have `shape.len()` elements; the result is a
    // new `at::Tensor*` that tch's Tensor takes ownership of.
    unsafe {
        let rc = aoti_torch_empty_strided(
            shape.len() as i64,
            shape.as_ptr(),
            strides.as_ptr(),
            aoti_torch_dtype_float32(),
            aoti_torch_device_type_meta(),
            0,
            &mut handle,
        );
        assert_eq!(rc, 0);
        Tensor::from_ptr(handle.cast())
    }
}

/// `Linear(6, 8) -> affine (Rust op, params w and b) -> scale (Rust op, attrs)
/// -> Linear(8, 4)`.
fn spec() -> Layer {
    Layer::sequential([
        LinearConfig::new(6, 8).into(),
        CustomConfig::new("kiln_test::affine")
            .with_param("w", [8], Init::Ones)
            .with_param("b", [8], Init::Zeros)
            .into(),
        CustomConfig::new("kiln_test::scale")
            .with_attr("alpha", 0.5)
            .with_attr("power", 1.0)
            .into(),
        LinearConfig::new(8, 4).into(),
    ])
}

fn batch(rows: usize, seed: u64) -> (HostTensor, HostTensor) {
    let values = noise(rows * 6, seed);
    // Learnable labels: which of the first four features is largest.
    let labels = kiln_testkit::argmax_labels(&values, 6, 4);
    (
        HostTensor::new(values, [rows, 6]).unwrap(),
        HostTensor::new(labels, [rows]).unwrap(),
    )
}

#[test]
fn a_rust_op_as_a_custom_layer_trains() {
    setup();
    TorchBackend::manual_seed(3);
    let model: TorchModel = TorchBackend::build_model(&spec(), Device::Cpu).unwrap();
    // Gradients reach the op's params (through affine_backward).
    let (x, y) = batch(16, 5);
    let out = model
        .forward(&TorchBackend::from_host(&x, Device::Cpu).unwrap())
        .unwrap();
    let target = TorchBackend::from_host(&y, Device::Cpu).unwrap();
    let loss = TorchBackend::loss(&Loss::cross_entropy(), &out, &target).unwrap();
    TorchBackend::backward(&loss).unwrap();
    for (name, p) in Module::<TorchBackend>::named_parameters(&model).unwrap() {
        let g = values(&p.grad());
        assert!(
            g.iter().all(|v| v.is_finite()) && g.iter().any(|&v| v != 0.0),
            "no gradient reached {name}"
        );
    }
    let names: Vec<String> = Module::<TorchBackend>::named_parameters(&model)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(
        names.contains(&"1.w".to_owned()) && names.contains(&"1.b".to_owned()),
        "{names:?}"
    );

    let config = OptimizerConfig::Sgd(SgdConfig::new(0.2).with_momentum(0.9));
    let optimizer = model.build_optimizer(&config, &[]).unwrap();
    let mut state = TrainingState::new(model, optimizer, None);
    let (x, y) = batch(128, 7);
    let loader = SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), 32).unwrap();
    let trainer_config = TrainerConfig {
        epochs: 12,
        ..TrainerConfig::default()
    };
    let history = Trainer::<TorchBackend>::new(trainer_config, Loss::cross_entropy())
        .unwrap()
        .fit(&mut state, &loader, None)
        .unwrap();
    let losses: Vec<f64> = history.series("loss").into_iter().map(|(_, v)| v).collect();
    eprintln!("losses {losses:.4?}");
    assert!(
        losses[losses.len() - 1] < 0.7 * losses[0],
        "training reduces the loss: {losses:?}"
    );
}

#[test]
fn misconfigured_custom_layers_name_the_problem() {
    setup();
    let build = |layer: Layer| {
        let model = TorchBackend::build_model(&layer, Device::Cpu)?;
        model.forward(&Tensor::ones([2, 8], (Kind::Float, tch::Device::Cpu)))
    };
    let one_param: Layer = CustomConfig::new("kiln_test::affine")
        .with_param("w", [8], Init::Ones)
        .into();
    let text = build(one_param).unwrap_err().display_chain().to_string();
    assert!(text.contains("kiln_test::affine.params"), "{text}");
    assert!(text.contains("needs 2 params, got 1 ([\"w\"])"), "{text}");
    let unknown: Layer = CustomConfig::new("kiln_test::scale")
        .with_attr("beta", 1.0)
        .into();
    let text = build(unknown).unwrap_err().display_chain().to_string();
    assert!(text.contains("has no attribute `beta`"), "{text}");
    let fractional: Layer = CustomConfig::new("kiln_test::scale")
        .with_attr("power", 1.5)
        .into();
    let text = build(fractional).unwrap_err().display_chain().to_string();
    assert!(
        text.contains("kiln_test::scale.attrs.power")
            && text.contains("expected a value of kind int, got 1.5"),
        "{text}"
    );
    // The attributes given reach the op; the others keep their defaults.
    let layer: Layer = CustomConfig::new("kiln_test::scale")
        .with_attr("power", 2.0)
        .with_attr("negate", 1.0)
        .into();
    let model = TorchBackend::build_model(&layer, Device::Cpu).unwrap();
    let x = tensor(&[2, 8], 61, Kind::Float);
    let y = model.forward(&x).unwrap();
    assert!(worst(&y, &-(&x * &x)) < 1e-6);
}
