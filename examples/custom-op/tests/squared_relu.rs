//! The example op: its gradient against finite differences, its values against
//! `relu(x)^2`, a clear error for a bad dtype, and the same library in Python; the
//! TensorFlow op against the libtorch op (float32 and float64) and finite
//! differences, and its errors as statuses.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln_example_custom_op::{squared_relu, tf, LIBRARY};
use tch::{Kind, Tensor};
use tensorflow::{
    Code, DataType, Graph, Operation, Session, SessionOptions, SessionRunArgs, Tensor as TfTensor,
    TensorType,
};

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
    // The C++ exception is the error's source: read the chain, as a user sees it.
    let text = err.display_chain().to_string();
    assert!(
        text.contains("example::squared_relu: x must be float32 or float64, got Long"),
        "{text}"
    );
}

#[test]
fn python_loads_the_same_library() {
    let Some(python) = kiln_testkit::python("python_loads_the_same_library") else {
        return;
    };
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

// ----- the TensorFlow op (`kiln_example_custom_op::tf`) -----

fn placeholder(graph: &mut Graph, name: &str, dtype: DataType) -> Operation {
    let mut nd = graph.new_operation("Placeholder", name).unwrap();
    nd.set_attr_type("dtype", dtype).unwrap();
    nd.finish().unwrap()
}

/// `y = squared_relu(x)` in a TensorFlow graph and `d sum(y * probe) / dx` from
/// `Graph::add_gradients` (the op's registered C++ gradient).
fn tf_forward_and_gradient<T: TensorType + Copy>(x: &[T], probe: &[T]) -> (Vec<T>, Vec<T>) {
    let mut graph = Graph::new();
    let xp = placeholder(&mut graph, "x", T::data_type());
    let pp = placeholder(&mut graph, "probe", T::data_type());
    let y = tf::squared_relu(&mut graph, xp.clone().into()).unwrap();
    let mut nd = graph.new_operation("Mul", "weighted").unwrap();
    nd.add_input(y.clone());
    nd.add_input(pp.clone());
    let weighted = nd.finish().unwrap();
    // `dx: None` (the default upstream gradient, ones): tensorflow 0.21 frees a `Some`.
    let dx = graph
        .add_gradients(None, &[weighted.into()], &[xp.clone().into()], None)
        .unwrap()[0]
        .clone()
        .unwrap();
    let session = Session::new(&SessionOptions::new(), &graph).unwrap();
    let dims = [x.len() as u64];
    let (xv, pv) = (
        TfTensor::new(&dims).with_values(x).unwrap(),
        TfTensor::new(&dims).with_values(probe).unwrap(),
    );
    let mut args = SessionRunArgs::new();
    args.add_feed(&xp, 0, &xv);
    args.add_feed(&pp, 0, &pv);
    let y_token = args.request_fetch(&y.operation, y.index);
    let dx_token = args.request_fetch(&dx.operation, dx.index);
    session.run(&mut args).unwrap();
    (
        args.fetch::<T>(y_token).unwrap().to_vec(),
        args.fetch::<T>(dx_token).unwrap().to_vec(),
    )
}

/// The same through the libtorch op with autograd, as float64.
fn torch_forward_and_gradient(x: &Tensor, probe: &Tensor) -> (Vec<f64>, Vec<f64>) {
    let leaf = x.detach().copy().set_requires_grad(true);
    let y = squared_relu(&leaf).unwrap();
    (&y * probe).sum(Kind::Double).backward();
    let to_vec = |t: &Tensor| Vec::<f64>::try_from(&t.detach().to_kind(Kind::Double)).unwrap();
    (to_vec(&y), to_vec(&leaf.grad()))
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
}

/// Deterministic values in (-3, 3), exact zero included.
fn sample(n: usize, phase: f64) -> Vec<f64> {
    (0..n)
        .map(|i| 3.0 * (i as f64 * 0.77 + phase).sin())
        .collect()
}

#[test]
fn tensorflow_matches_libtorch_in_float32_and_float64() {
    let x = sample(64, 0.0);
    let probe = sample(64, 1.0);
    let (xt, pt) = (Tensor::from_slice(&x), Tensor::from_slice(&probe));

    let (y64, dx64) = tf_forward_and_gradient::<f64>(&x, &probe);
    let (ty64, tdx64) = torch_forward_and_gradient(&xt, &pt);
    let (e_y64, e_dx64) = (max_abs_diff(&y64, &ty64), max_abs_diff(&dx64, &tdx64));

    let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    let p32: Vec<f32> = probe.iter().map(|&v| v as f32).collect();
    let (y32, dx32) = tf_forward_and_gradient::<f32>(&x32, &p32);
    let (ty32, tdx32) =
        torch_forward_and_gradient(&Tensor::from_slice(&x32), &Tensor::from_slice(&p32));
    let widen = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
    let (e_y32, e_dx32) = (
        max_abs_diff(&widen(y32), &ty32),
        max_abs_diff(&widen(dx32), &tdx32),
    );
    eprintln!(
        "TensorFlow vs libtorch max |diff|: float64 y {e_y64:.1e} dx {e_dx64:.1e}, \
         float32 y {e_y32:.1e} dx {e_dx32:.1e}"
    );
    for e in [e_y64, e_dx64, e_y32, e_dx32] {
        assert!(e <= 1e-6, "{e}");
    }
}

#[test]
fn tensorflow_gradient_matches_finite_differences() {
    let x = sample(16, 0.3);
    let probe = sample(16, 2.0);
    let (_, analytic) = tf_forward_and_gradient::<f64>(&x, &probe);
    let objective = |x: &[f64]| {
        let (y, _) = tf_forward_and_gradient::<f64>(x, &probe);
        y.iter().zip(&probe).map(|(y, p)| y * p).sum::<f64>()
    };
    let h = 1e-6;
    let mut worst = 0f64;
    for i in 0..x.len() {
        let (mut up, mut down) = (x.clone(), x.clone());
        up[i] += h;
        down[i] -= h;
        let numeric = (objective(&up) - objective(&down)) / (2.0 * h);
        worst = worst.max((numeric - analytic[i]).abs());
    }
    eprintln!("TensorFlow gradient vs finite differences: max |diff| {worst:.1e}");
    assert!(worst < 1e-6, "{worst}");
}

#[test]
fn tensorflow_errors_are_statuses_not_aborts() {
    // Each call finds everything registered by the first and leaves it alone
    // (TensorFlow aborts on a duplicate op, kernel or gradient).
    for _ in 0..3 {
        tf::register().unwrap();
    }

    // A bad dtype: the op's `T: {float, double}` refuses it when the node is added.
    let mut graph = Graph::new();
    let ints = placeholder(&mut graph, "ints", DataType::Int64);
    let err = tf::squared_relu(&mut graph, ints.into()).unwrap_err();
    let text = err.display_chain().to_string();
    eprintln!("got the expected error: {text}");
    assert!(
        text.contains(tf::OP) && text.contains("int64") && text.contains("float, double"),
        "{text}"
    );

    // A mismatch only the kernel can see fails the session run with the op's
    // message, and the session keeps working (with one kernel per type: a
    // duplicate would fail with "Multiple OpKernel registrations match NodeDef").
    let grad = placeholder(&mut graph, "grad", DataType::Float);
    let x = placeholder(&mut graph, "x", DataType::Float);
    let mut nd = graph.new_operation(tf::GRAD_OP, "dx").unwrap();
    nd.add_input(grad.clone());
    nd.add_input(x.clone());
    let dx = nd.finish().unwrap();
    let session = Session::new(&SessionOptions::new(), &graph).unwrap();
    let run = |g: &[f32], xs: &[f32]| {
        let gv = TfTensor::new(&[g.len() as u64]).with_values(g).unwrap();
        let xv = TfTensor::new(&[xs.len() as u64]).with_values(xs).unwrap();
        let mut args = SessionRunArgs::new();
        args.add_feed(&grad, 0, &gv);
        args.add_feed(&x, 0, &xv);
        let token = args.request_fetch(&dx, 0);
        session.run(&mut args)?;
        Ok::<_, tensorflow::Status>(args.fetch::<f32>(token)?.to_vec())
    };
    let status = run(&[1.0, 1.0, 1.0], &[1.0, 2.0]).unwrap_err();
    eprintln!("got the expected error: {status}");
    assert_eq!(status.code(), Code::InvalidArgument, "{status}");
    assert!(
        status
            .to_string()
            .contains("example::squared_relu_backward: grad has shape [3], expected [2]"),
        "{status}"
    );
    assert_eq!(run(&[1.0, 0.5], &[-1.0, 2.0]).unwrap(), vec![0.0, 2.0]);
}
