//! The example's Rust ops on both engines, each against an independent
//! reference: the composition of the engine's own built-in ops (float32,
//! outputs and gradients), central finite differences (float64), and each other
//! (float32, bitwise: the kernel is the same Rust code in both).

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln_custom_op::{AttrValue, Attrs, CustomOp};
use kiln_example_rust_op::ops::{RmsNorm, SquaredRelu, Swish, RMS_NORM_EPS};
use tch::{Kind, Tensor};
use tensorflow::{
    DataType, Graph, Operation, Output, Session, SessionOptions, SessionRunArgs,
    Tensor as TfTensor, TensorType,
};

/// The ops under test, with their input shapes.
const CASES: [(&str, &[&[i64]]); 3] = [
    ("squared_relu", &[&[6, 33]]),
    ("rms_norm", &[&[6, 33], &[33]]),
    ("swish", &[&[6, 33], &[1]]),
];

/// A non-default `eps`, so the tests see it reach the kernel: 2^-10, exact in
/// float32, because TensorFlow keeps float attributes as float32 and the bitwise
/// comparison needs both engines to pass the kernel the same value.
const EPS: f64 = 0.000_976_562_5;

fn attrs(op: &str) -> Attrs {
    match op {
        "rms_norm" => {
            let mut a = Attrs::defaults(&RmsNorm::schema());
            a.set("eps", AttrValue::Float(EPS)).unwrap();
            a
        }
        _ => Attrs::default(),
    }
}

/// Deterministic inputs in (-3, 3) (exact zeros included); weights around 1.
fn inputs(op: &str, shapes: &[&[i64]]) -> Vec<(Vec<f64>, Vec<i64>)> {
    shapes
        .iter()
        .enumerate()
        .map(|(k, shape)| {
            let n: i64 = shape.iter().product();
            let data = (0..n)
                .map(|i| {
                    let v = 3.0 * (i as f64 * 0.77 + k as f64).sin();
                    match (op, k) {
                        (_, 0) if i % 9 == 0 => 0.0,
                        (_, 0) => v,
                        ("rms_norm", _) => 1.0 + v / 6.0,
                        _ => 0.8,
                    }
                })
                .collect();
            (data, shape.to_vec())
        })
        .collect()
}

/// A fixed upstream gradient for `y` (the loss is `sum(y * probe)`).
fn probe(shape: &[i64]) -> Vec<f64> {
    let n: i64 = shape.iter().product();
    (0..n).map(|i| (i as f64 * 0.31).cos()).collect()
}

fn register() {
    kiln_example_rust_op::register().unwrap();
}

// ----- libtorch -----

fn tch_tensor(data: &[f64], shape: &[i64], kind: Kind) -> Tensor {
    Tensor::from_slice(data)
        .reshape(shape)
        .to_kind(kind)
        .set_requires_grad(true)
}

/// The op through the dispatcher (autograd applies), or its built-in composition.
fn torch_forward(op: &str, x: &[Tensor], rust: bool) -> Tensor {
    if rust {
        let name = format!("example_rs::{op}");
        return kiln_torch_op::call(&name, &x.iter().collect::<Vec<_>>(), &attrs(op))
            .unwrap()
            .remove(0);
    }
    match op {
        "squared_relu" => x[0].relu().square(),
        "rms_norm" => {
            let ms = x[0].square().mean_dim(-1, true, x[0].kind());
            &x[0] * (ms + EPS).rsqrt() * &x[1]
        }
        _ => &x[0] * (&x[1] * &x[0]).sigmoid(),
    }
}

/// `y` and the gradients of `sum(y * probe)` for every input, as f64 vectors.
fn torch_run(op: &str, data: &[(Vec<f64>, Vec<i64>)], kind: Kind, rust: bool) -> Vec<Vec<f64>> {
    let x: Vec<Tensor> = data.iter().map(|(d, s)| tch_tensor(d, s, kind)).collect();
    let y = torch_forward(op, &x, rust);
    let p = Tensor::from_slice(&probe(&data[0].1))
        .reshape(data[0].1.as_slice())
        .to_kind(kind);
    (&y * p).sum(kind).backward();
    let flat = |t: &Tensor| {
        Vec::<f64>::try_from(&t.detach().flatten(0, -1).to_kind(Kind::Double)).unwrap()
    };
    std::iter::once(flat(&y))
        .chain(x.iter().map(|t| flat(&t.grad())))
        .collect()
}

/// The inputs as float32 values, so that float32 and float64 runs see the same numbers.
fn rounded_to_f32(data: Vec<(Vec<f64>, Vec<i64>)>) -> Vec<(Vec<f64>, Vec<i64>)> {
    data.into_iter()
        .map(|(d, s)| (d.into_iter().map(|v| f64::from(v as f32)).collect(), s))
        .collect()
}

/// Checks the float32 op (output, then the gradient of each input) against the
/// engine's composition of built-in ops run in float64 on the same inputs
/// (1e-6 of the scale), and prints how far the float32 composition is: the
/// float32 composition rounds sums of hundreds of terms in float32 (libtorch's
/// Swish `beta` gradient is 1.1e-6 off), where the kernels sum in f64.
fn check_float32(
    engine: &str,
    op: &str,
    rust: &[Vec<f64>],
    composed: &[Vec<f64>],
    exact: &[Vec<f64>],
) {
    for (k, ((r, c), e)) in rust.iter().zip(composed).zip(exact).enumerate() {
        let d = max_rel_diff(r, e);
        eprintln!(
            "{engine} {op} output {k}: max relative difference {d:.2e} (the float32 composition: {:.2e})",
            max_rel_diff(c, e)
        );
        assert!(d <= 1e-6, "{engine} {op}: output {k} differs by {d:e}");
    }
}

/// The largest difference relative to the reference's scale.
fn max_rel_diff(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs() / scale)
        .fold(0.0, f64::max)
}

#[test]
fn torch_matches_the_builtin_composition_in_float32() {
    register();
    for (op, shapes) in CASES {
        let data = rounded_to_f32(inputs(op, shapes));
        let rust = torch_run(op, &data, Kind::Float, true);
        let composed = torch_run(op, &data, Kind::Float, false);
        let exact = torch_run(op, &data, Kind::Double, false);
        check_float32("torch", op, &rust, &composed, &exact);
    }
}

/// Central differences of `sum(forward(x) * probe)` in each input element.
fn finite_differences(
    data: &[(Vec<f64>, Vec<i64>)],
    forward: impl Fn(&[(Vec<f64>, Vec<i64>)]) -> Vec<f64>,
) -> Vec<Vec<f64>> {
    let p = probe(&data[0].1);
    let loss =
        |d: &[(Vec<f64>, Vec<i64>)]| -> f64 { forward(d).iter().zip(&p).map(|(y, p)| y * p).sum() };
    let h = 1e-6;
    (0..data.len())
        .map(|k| {
            (0..data[k].0.len())
                .map(|i| {
                    let mut up = data.to_vec();
                    up[k].0[i] += h;
                    let mut down = data.to_vec();
                    down[k].0[i] -= h;
                    (loss(&up) - loss(&down)) / (2.0 * h)
                })
                .collect()
        })
        .collect()
}

#[test]
fn torch_gradients_match_finite_differences_in_float64() {
    register();
    for (op, _) in CASES {
        // Smaller inputs: every element is moved twice.
        let shapes: &[&[i64]] = match op {
            "squared_relu" => &[&[3, 5]],
            "rms_norm" => &[&[3, 5], &[5]],
            _ => &[&[3, 5], &[1]],
        };
        let data = inputs(op, shapes);
        let analytic = torch_run(op, &data, Kind::Double, true);
        let numeric = finite_differences(&data, |d| tch::no_grad(|| torch_run_forward(op, d)));
        for (k, (a, n)) in analytic[1..].iter().zip(&numeric).enumerate() {
            let d = max_rel_diff(a, n);
            eprintln!(
                "torch {op} gradient {k}: max relative difference from finite differences {d:.2e}"
            );
            assert!(
                d < 1e-7,
                "torch {op}: gradient of input {k} is off by {d:e}"
            );
        }
    }
}

fn torch_run_forward(op: &str, data: &[(Vec<f64>, Vec<i64>)]) -> Vec<f64> {
    let x: Vec<Tensor> = data
        .iter()
        .map(|(d, s)| Tensor::from_slice(d).reshape(s.as_slice()))
        .collect();
    let y = torch_forward(op, &x, true);
    Vec::<f64>::try_from(&y.flatten(0, -1)).unwrap()
}

// ----- TensorFlow -----

fn node(graph: &mut Graph, op: &str, name: &str, inputs: &[Output]) -> Output {
    let mut nd = graph.new_operation(op, name).unwrap();
    for input in inputs {
        nd.add_input(input.clone());
    }
    nd.finish().unwrap().into()
}

fn placeholder(graph: &mut Graph, name: &str, dtype: DataType) -> Operation {
    let mut nd = graph.new_operation("Placeholder", name).unwrap();
    nd.set_attr_type("dtype", dtype).unwrap();
    nd.finish().unwrap()
}

fn constant<T: TensorType>(graph: &mut Graph, name: &str, value: TfTensor<T>) -> Output {
    let mut nd = graph.new_operation("Const", name).unwrap();
    nd.set_attr_type("dtype", T::data_type()).unwrap();
    nd.set_attr_tensor("value", value).unwrap();
    nd.finish().unwrap().into()
}

/// The built-in composition of `op` in a TensorFlow graph.
fn tf_composed<T: TensorType>(graph: &mut Graph, op: &str, x: &[Output], eps: T) -> Output {
    match op {
        "squared_relu" => {
            let r = node(graph, "Relu", "relu", &x[..1]);
            node(graph, "Square", "square", &[r])
        }
        "rms_norm" => {
            let sq = node(graph, "Square", "sq", &x[..1]);
            let axis = constant(graph, "axis", TfTensor::<i32>::from(-1));
            let mut nd = graph.new_operation("Mean", "ms").unwrap();
            nd.add_input(sq);
            nd.add_input(axis);
            nd.set_attr_bool("keep_dims", true).unwrap();
            let ms: Output = nd.finish().unwrap().into();
            let eps = constant(graph, "eps", TfTensor::<T>::from(eps));
            let shifted = node(graph, "AddV2", "shifted", &[ms, eps]);
            let r = node(graph, "Rsqrt", "rsqrt", &[shifted]);
            let xr = node(graph, "Mul", "xr", &[x[0].clone(), r]);
            node(graph, "Mul", "scaled", &[xr, x[1].clone()])
        }
        _ => {
            let bx = node(graph, "Mul", "bx", &[x[1].clone(), x[0].clone()]);
            let s = node(graph, "Sigmoid", "sig", &[bx]);
            node(graph, "Mul", "swish", &[x[0].clone(), s])
        }
    }
}

/// The op (or its composition) forward, and the gradients of `sum(y * probe)`
/// from `Graph::add_gradients`, as f64 vectors.
fn tf_run<T: TensorType + Copy + Into<f64>>(
    op: &str,
    data: &[(Vec<f64>, Vec<i64>)],
    rust: bool,
    with_gradients: bool,
    cast: impl Fn(f64) -> T,
) -> Vec<Vec<f64>> {
    let mut graph = Graph::new();
    let holders: Vec<Operation> = (0..data.len())
        .map(|k| placeholder(&mut graph, &format!("in{k}"), T::data_type()))
        .collect();
    let x: Vec<Output> = holders.iter().map(|h| h.clone().into()).collect();
    let y = if rust {
        let added = match op {
            "squared_relu" => kiln_tf_op::add_op::<SquaredRelu>(&mut graph, "op", &x, &attrs(op)),
            "rms_norm" => kiln_tf_op::add_op::<RmsNorm>(&mut graph, "op", &x, &attrs(op)),
            _ => kiln_tf_op::add_op::<Swish>(&mut graph, "op", &x, &attrs(op)),
        };
        added.unwrap().remove(0)
    } else {
        tf_composed::<T>(&mut graph, op, &x, cast(EPS))
    };
    let p = placeholder(&mut graph, "probe", T::data_type());
    let weighted = node(
        &mut graph,
        "Mul",
        "weighted",
        &[y.clone(), p.clone().into()],
    );
    let grads: Vec<Output> = if with_gradients {
        graph
            .add_gradients(None, &[weighted], &x, None)
            .unwrap()
            .into_iter()
            .map(|g| g.unwrap())
            .collect()
    } else {
        Vec::new()
    };
    let session = Session::new(&SessionOptions::new(), &graph).unwrap();
    let tensor = |d: &[f64], s: &[i64]| {
        let dims: Vec<u64> = s.iter().map(|&v| v as u64).collect();
        TfTensor::new(&dims)
            .with_values(&d.iter().map(|&v| cast(v)).collect::<Vec<T>>())
            .unwrap()
    };
    let feeds: Vec<TfTensor<T>> = data.iter().map(|(d, s)| tensor(d, s)).collect();
    let probe_value = tensor(&probe(&data[0].1), &data[0].1);
    let mut args = SessionRunArgs::new();
    for (h, f) in holders.iter().zip(&feeds) {
        args.add_feed(h, 0, f);
    }
    args.add_feed(&p, 0, &probe_value);
    let tokens: Vec<_> = std::iter::once(&y)
        .chain(&grads)
        .map(|o| args.request_fetch(&o.operation, o.index))
        .collect();
    session.run(&mut args).unwrap();
    tokens
        .into_iter()
        .map(|t| {
            args.fetch::<T>(t)
                .unwrap()
                .iter()
                .map(|&v| v.into())
                .collect()
        })
        .collect()
}

#[test]
fn tensorflow_matches_the_builtin_composition_in_float32() {
    register();
    for (op, shapes) in CASES {
        let data = rounded_to_f32(inputs(op, shapes));
        let rust = tf_run::<f32>(op, &data, true, true, |v| v as f32);
        let composed = tf_run::<f32>(op, &data, false, true, |v| v as f32);
        let exact = tf_run::<f64>(op, &data, false, true, |v| v);
        check_float32("TensorFlow", op, &rust, &composed, &exact);
    }
}

#[test]
fn tensorflow_gradients_match_finite_differences_in_float64() {
    register();
    for (op, _) in CASES {
        let shapes: &[&[i64]] = match op {
            "squared_relu" => &[&[3, 5]],
            "rms_norm" => &[&[3, 5], &[5]],
            _ => &[&[3, 5], &[1]],
        };
        let data = inputs(op, shapes);
        let analytic = tf_run::<f64>(op, &data, true, true, |v| v);
        let numeric = finite_differences(&data, |d| {
            tf_run::<f64>(op, d, true, false, |v| v).remove(0)
        });
        for (k, (a, n)) in analytic[1..].iter().zip(&numeric).enumerate() {
            let d = max_rel_diff(a, n);
            eprintln!("TensorFlow {op} gradient {k}: max relative difference from finite differences {d:.2e}");
            assert!(
                d < 1e-7,
                "TensorFlow {op}: gradient of input {k} is off by {d:e}"
            );
        }
    }
}

#[test]
fn torch_and_tensorflow_agree_bitwise_in_float32() {
    register();
    // Also inputs large enough that both engines split the work across threads
    // (libtorch's pool, Kiln's on TensorFlow) and the sums over blocks.
    let large: [(&str, &[&[i64]]); 3] = [
        ("squared_relu", &[&[70, 1000]]),
        ("rms_norm", &[&[70, 1000], &[1000]]),
        ("swish", &[&[70, 1000], &[1]]),
    ];
    for (op, shapes) in CASES.into_iter().chain(large) {
        let data = inputs(op, shapes);
        let torch = torch_run(op, &data, Kind::Float, true);
        let tf = tf_run::<f32>(op, &data, true, true, |v| v as f32);
        for (k, (a, b)) in torch.iter().zip(&tf).enumerate() {
            let a: Vec<u32> = a.iter().map(|&v| (v as f32).to_bits()).collect();
            let b: Vec<u32> = b.iter().map(|&v| (v as f32).to_bits()).collect();
            assert!(
                a == b,
                "{op}: output {k} differs between torch and TensorFlow"
            );
        }
    }
}

#[test]
fn the_default_eps_is_the_schemas() {
    let schema = RmsNorm::schema();
    assert_eq!(Attrs::defaults(&schema).float("eps").unwrap(), RMS_NORM_EPS);
    assert!(schema.torch_schema().contains("float eps=1e-06"));
}
