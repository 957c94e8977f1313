#![allow(clippy::unwrap_used)] // a test that fails should fail loudly
//! The fused ops in TensorFlow graphs (`KilnBiasGelu`, `KilnSoftmaxXent`,
//! `KilnSwish`), built with the `tensorflow` crate directly: outputs and
//! `Graph::add_gradients` gradients against the libtorch ops with autograd (float32,
//! 1e-5) and against central finite differences of the TensorFlow op itself
//! (float64); the float64 forward on both engines against PyTorch's composition of
//! built-in ops (`tests/reference/fused_ops_float64.py`, 1e-12); shape inference; and bad inputs failing the session run (or the graph
//! construction, when shapes are known) with the op's message instead of aborting.

use kiln_fused_ops::tf as ops;
use tch::Kind;
use tensorflow::{
    Code, DataType, Graph, Operation, Output, Session, SessionOptions, SessionRunArgs, Shape,
    Status, Tensor, TensorType,
};

// ----- a graph holding one op, its gradients, and a session -----

/// One Kiln op fed by placeholders, with `d sum(y * probe) / d inputs[wrt]`.
struct OpGraph {
    /// Kept for as long as the session that runs it.
    _graph: Graph,
    session: Session,
    /// The float inputs' placeholders, in the op's input order.
    floats: Vec<Operation>,
    /// The int64 `target` placeholder (softmax cross-entropy).
    target: Option<Operation>,
    /// The upstream gradient, shaped like the op's output.
    probe: Operation,
    y: Operation,
    grads: Vec<Output>,
}

/// A float placeholder of `dtype`; `dims` of `None` leaves the shape unknown.
fn placeholder(graph: &mut Graph, name: &str, dtype: DataType, dims: Option<&[i64]>) -> Operation {
    let mut nd = graph.new_operation("Placeholder", name).unwrap();
    nd.set_attr_type("dtype", dtype).unwrap();
    if let Some(dims) = dims {
        let shape = Shape::from(Some(
            dims.iter()
                .map(|&d| (d >= 0).then_some(d))
                .collect::<Vec<_>>(),
        ));
        nd.set_attr_shape("shape", &shape).unwrap();
    }
    nd.finish().unwrap()
}

impl OpGraph {
    /// `op_type` with `n_floats` float inputs of `dtype` (then an int64 target when
    /// `target`), shapes unknown to the graph, so that every check runs in the kernel.
    fn new(
        op_type: &str,
        dtype: DataType,
        n_floats: usize,
        target: bool,
        label_smoothing: Option<f32>,
        wrt: &[usize],
    ) -> Self {
        // Graphs name the ops by type: registered by the first `register` call.
        ops::register().unwrap();
        let mut graph = Graph::new();
        let floats: Vec<Operation> = (0..n_floats)
            .map(|i| placeholder(&mut graph, &format!("in{i}"), dtype, None))
            .collect();
        let target = target.then(|| placeholder(&mut graph, "target", DataType::Int64, None));
        let probe = placeholder(&mut graph, "probe", dtype, None);
        let mut nd = graph.new_operation(op_type, "op").unwrap();
        for op in &floats {
            nd.add_input(op.clone());
        }
        if let Some(t) = &target {
            nd.add_input(t.clone());
        }
        if let Some(eps) = label_smoothing {
            nd.set_attr_float(ops::LABEL_SMOOTHING, eps).unwrap();
        }
        let y = nd.finish().unwrap();
        // y * probe, differentiated with the default upstream gradient (ones), gives
        // the gradients of sum(y * probe). (Passing `probe` as `add_gradients`'s `dx`
        // crashes: tensorflow 0.21 hands TensorFlow a pointer into a dropped Vec.)
        let weighted = {
            let mut nd = graph.new_operation("Mul", "weighted").unwrap();
            nd.add_input(y.clone());
            nd.add_input(probe.clone());
            nd.finish().unwrap()
        };
        let xs: Vec<Output> = wrt.iter().map(|&i| floats[i].clone().into()).collect();
        let grads = graph
            .add_gradients(None, &[weighted.into()], &xs, None)
            .unwrap()
            .into_iter()
            .map(|g| g.expect("a gradient for every requested input"))
            .collect();
        let session = Session::new(&SessionOptions::new(), &graph).unwrap();
        OpGraph {
            _graph: graph,
            session,
            floats,
            target,
            probe,
            y,
            grads,
        }
    }

    /// Runs the op (and its gradients when `with_grads`) on `floats` (values, dims).
    #[allow(clippy::type_complexity)]
    fn run<T: TensorType + Copy>(
        &self,
        floats: &[(&[T], &[u64])],
        target: Option<(&[i64], &[u64])>,
        probe: (&[T], &[u64]),
        with_grads: bool,
    ) -> Result<(Vec<T>, Vec<Vec<T>>), Status> {
        let tensors: Vec<Tensor<T>> = floats
            .iter()
            .map(|(v, d)| Tensor::new(d).with_values(v).unwrap())
            .collect();
        let target = target.map(|(v, d)| Tensor::new(d).with_values(v).unwrap());
        let probe = Tensor::new(probe.1).with_values(probe.0).unwrap();
        let mut args = SessionRunArgs::new();
        for (op, t) in self.floats.iter().zip(&tensors) {
            args.add_feed(op, 0, t);
        }
        if let (Some(op), Some(t)) = (&self.target, &target) {
            args.add_feed(op, 0, t);
        }
        args.add_feed(&self.probe, 0, &probe);
        let y = args.request_fetch(&self.y, 0);
        let grads: Vec<_> = if with_grads {
            self.grads
                .iter()
                .map(|g| args.request_fetch(&g.operation, g.index))
                .collect()
        } else {
            Vec::new()
        };
        self.session.run(&mut args)?;
        let y = args.fetch::<T>(y)?.to_vec();
        let grads = grads
            .into_iter()
            .map(|g| Ok(args.fetch::<T>(g)?.to_vec()))
            .collect::<Result<_, Status>>()?;
        Ok((y, grads))
    }

    /// `sum(y * probe)`, the scalar whose gradients `run` returns.
    fn objective(
        &self,
        floats: &[(&[f64], &[u64])],
        target: Option<(&[i64], &[u64])>,
        probe: (&[f64], &[u64]),
    ) -> f64 {
        let (y, _) = self.run(floats, target, probe, false).unwrap();
        y.iter().zip(probe.0).map(|(a, b)| a * b).sum()
    }
}

// ----- data -----

/// Standard normal values of `dims` on the CPU.
fn randn(dims: &[i64], kind: Kind) -> tch::Tensor {
    tch::Tensor::randn(dims, (kind, tch::Device::Cpu))
}

fn values<T: tch::kind::Element>(t: &tch::Tensor) -> Vec<T> {
    let n = t.numel();
    let mut v = vec![T::ZERO; n];
    t.detach().contiguous().copy_data(&mut v, n);
    v
}

fn udims(t: &tch::Tensor) -> Vec<u64> {
    t.size().iter().map(|&d| d as u64).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max)
}

// ----- float32: TensorFlow against libtorch (forward and autograd) -----

/// Runs `op_type` in TensorFlow and `torch_op` with autograd on the same float32
/// data; compares outputs and the gradients of `sum(y * probe)` w.r.t. `wrt`.
fn compare_with_torch(
    name: &str,
    op_type: &str,
    floats: Vec<tch::Tensor>,
    target: Option<tch::Tensor>,
    label_smoothing: Option<f32>,
    wrt: &[usize],
    torch_op: &dyn Fn(&[tch::Tensor], Option<&tch::Tensor>) -> tch::Tensor,
) {
    let leaves: Vec<tch::Tensor> = floats
        .iter()
        .enumerate()
        .map(|(i, t)| t.copy().set_requires_grad(wrt.contains(&i)))
        .collect();
    let y_torch = torch_op(&leaves, target.as_ref());
    let probe = y_torch.randn_like().detach();
    (&y_torch * &probe).sum(Kind::Float).backward();

    let graph = OpGraph::new(
        op_type,
        DataType::Float,
        floats.len(),
        target.is_some(),
        label_smoothing,
        wrt,
    );
    let data: Vec<(Vec<f32>, Vec<u64>)> = floats.iter().map(|t| (values(t), udims(t))).collect();
    let feeds: Vec<(&[f32], &[u64])> = data.iter().map(|(v, d)| (&v[..], &d[..])).collect();
    let target_data = target.as_ref().map(|t| (values::<i64>(t), udims(t)));
    let probe_data = (values::<f32>(&probe), udims(&probe));
    let (y, grads) = graph
        .run(
            &feeds,
            target_data.as_ref().map(|(v, d)| (&v[..], &d[..])),
            (&probe_data.0, &probe_data.1),
            true,
        )
        .unwrap();

    let err = max_abs_diff(&y, &values::<f32>(&y_torch.detach()));
    eprintln!("{name}: TensorFlow vs libtorch, output max |diff| {err:.2e}");
    assert!(err <= 1e-5, "{name}: outputs differ by {err}");
    for (k, &i) in wrt.iter().enumerate() {
        let err = max_abs_diff(&grads[k], &values::<f32>(&leaves[i].grad()));
        eprintln!("{name}: TensorFlow vs libtorch, gradient of input {i} max |diff| {err:.2e}");
        assert!(
            err <= 1e-5,
            "{name}: gradients of input {i} differ by {err}"
        );
    }
}

#[test]
fn float32_outputs_and_gradients_match_libtorch() {
    tch::manual_seed(7);
    let f = Kind::Float;
    // Small (serial) and large (split across threads) cases of each op.
    for (rows, cols) in [(3, 5), (64, 300)] {
        compare_with_torch(
            &format!("bias_gelu [{rows}, {cols}]"),
            ops::BIAS_GELU,
            vec![randn(&[rows, cols], f), randn(&[cols], f)],
            None,
            None,
            &[0, 1],
            &|t, _| kiln_fused_ops::bias_gelu(&t[0], &t[1]).unwrap(),
        );
    }
    compare_with_torch(
        "bias_gelu [2, 3, 4]",
        ops::BIAS_GELU,
        vec![randn(&[2, 3, 4], f), randn(&[4], f)],
        None,
        None,
        &[0, 1],
        &|t, _| kiln_fused_ops::bias_gelu(&t[0], &t[1]).unwrap(),
    );
    for (n, c, eps) in [(4, 6, 0.0), (4, 6, 0.1), (100, 37, 0.2)] {
        let target = tch::Tensor::randint(c, [n], (Kind::Int64, tch::Device::Cpu));
        compare_with_torch(
            &format!("softmax_xent [{n}, {c}] eps {eps}"),
            ops::SOFTMAX_XENT,
            vec![randn(&[n, c], f) * 3.0],
            Some(target),
            Some(eps as f32),
            &[0],
            &move |t, target| {
                kiln_fused_ops::softmax_cross_entropy(&t[0], target.unwrap(), eps).unwrap()
            },
        );
    }
    for dims in [vec![7], vec![5, 4, 3], vec![10_000]] {
        compare_with_torch(
            &format!("swish {dims:?}"),
            ops::SWISH,
            vec![randn(&dims, f), randn(&[1], f)],
            None,
            None,
            &[0, 1],
            &|t, _| kiln_fused_ops::swish(&t[0], &t[1]).unwrap(),
        );
    }
}

// ----- float64: TensorFlow's gradients against finite differences -----

/// `add_gradients` gradients of `sum(y * probe)` against central differences of
/// the same TensorFlow graph, float64.
fn check_finite_differences(
    name: &str,
    op_type: &str,
    floats: Vec<tch::Tensor>,
    target: Option<tch::Tensor>,
    label_smoothing: Option<f32>,
    wrt: &[usize],
) {
    let graph = OpGraph::new(
        op_type,
        DataType::Double,
        floats.len(),
        target.is_some(),
        label_smoothing,
        wrt,
    );
    let mut data: Vec<(Vec<f64>, Vec<u64>)> =
        floats.iter().map(|t| (values(t), udims(t))).collect();
    let target_data = target.as_ref().map(|t| (values::<i64>(t), udims(t)));
    let target_feed = target_data.as_ref().map(|(v, d)| (&v[..], &d[..]));
    // The probe has the output's shape: run once to learn it.
    let probe_dims = {
        let feeds: Vec<(&[f64], &[u64])> = data.iter().map(|(v, d)| (&v[..], &d[..])).collect();
        let ones = vec![1.0; 1];
        let y = graph
            .run(&feeds, target_feed, (&ones, &[]), false)
            .unwrap()
            .0;
        let y_dims: Vec<u64> = match op_type {
            o if o == ops::SOFTMAX_XENT => vec![data[0].1[0]],
            _ => data[0].1.clone(),
        };
        assert_eq!(y.len() as u64, y_dims.iter().product::<u64>());
        y_dims
    };
    let probe = values::<f64>(&tch::Tensor::randn(
        probe_dims.iter().map(|&d| d as i64).collect::<Vec<_>>(),
        (Kind::Double, tch::Device::Cpu),
    ));
    let (_, analytic) = {
        let feeds: Vec<(&[f64], &[u64])> = data.iter().map(|(v, d)| (&v[..], &d[..])).collect();
        graph
            .run(&feeds, target_feed, (&probe, &probe_dims), true)
            .unwrap()
    };
    let h = 1e-6;
    for (k, &i) in wrt.iter().enumerate() {
        let mut worst = 0f64;
        for (j, &expected) in analytic[k].iter().enumerate() {
            let original = data[i].0[j];
            let mut at = |value: f64| {
                data[i].0[j] = value;
                let feeds: Vec<(&[f64], &[u64])> =
                    data.iter().map(|(v, d)| (&v[..], &d[..])).collect();
                graph.objective(&feeds, target_feed, (&probe, &probe_dims))
            };
            let numeric = (at(original + h) - at(original - h)) / (2.0 * h);
            data[i].0[j] = original;
            worst = worst.max((numeric - expected).abs());
        }
        eprintln!("{name}: add_gradients vs finite differences, input {i} max |diff| {worst:.2e}");
        assert!(
            worst < 1e-6,
            "{name}: gradient of input {i} differs by {worst}"
        );
    }
}

#[test]
fn float64_gradients_match_finite_differences() {
    tch::manual_seed(3);
    let d = Kind::Double;
    check_finite_differences(
        "bias_gelu",
        ops::BIAS_GELU,
        vec![randn(&[3, 5], d), randn(&[5], d)],
        None,
        None,
        &[0, 1],
    );
    for eps in [0.0, 0.125] {
        check_finite_differences(
            &format!("softmax_xent eps {eps}"),
            ops::SOFTMAX_XENT,
            vec![randn(&[4, 6], d) * 2.0],
            Some(tch::Tensor::from_slice(&[0i64, 5, 2, 2])),
            Some(eps),
            &[0],
        );
    }
    check_finite_differences(
        "swish",
        ops::SWISH,
        vec![randn(&[2, 7], d), tch::Tensor::from_slice(&[0.8f64])],
        None,
        None,
        &[0, 1],
    );
}

// ----- float64: both engines against PyTorch's composition, outside Kiln -----

/// A tensor as the reference script reads it.
fn tensor_json(t: &tch::Tensor) -> serde_json::Value {
    let data: Vec<f64> = values(&t.to_kind(Kind::Double));
    serde_json::json!({ "shape": t.size(), "data": data })
}

/// Kiln's float64 forward of every fused op, on libtorch (`kiln_fused_ops::*`) and in a
/// TensorFlow graph (`Kiln*` ops), against PyTorch's composition of built-in ops
/// in float64 (`tests/reference/fused_ops_float64.py`, which does not load Kiln's
/// library): within 1e-12 of `max(1, |expected|)`. Inputs reach GELU's and the
/// sigmoid's tails and rows of logits far apart.
#[test]
fn float64_outputs_match_pytorch_composition() {
    let test = "float64_outputs_match_pytorch_composition";
    let Some(python) = kiln_testkit::python(test) else {
        return;
    };
    tch::manual_seed(5);
    let d = Kind::Double;
    // Label smoothing exactly representable in float32 (TensorFlow's attribute).
    let (n, c, eps) = (9, 7, 0.125);
    let cases: Vec<(&str, Vec<tch::Tensor>, Option<tch::Tensor>, f64)> = vec![
        (
            "bias_gelu",
            vec![randn(&[6, 9], d) * 4.0, randn(&[9], d)],
            None,
            0.0,
        ),
        (
            "bias_gelu",
            vec![randn(&[2, 3, 4], d), randn(&[4], d)],
            None,
            0.0,
        ),
        (
            "softmax_xent",
            vec![randn(&[n, c], d) * 10.0],
            Some(tch::Tensor::randint(
                c,
                [n],
                (Kind::Int64, tch::Device::Cpu),
            )),
            eps,
        ),
        (
            "softmax_xent",
            vec![randn(&[4, 5], d)],
            Some(tch::Tensor::from_slice(&[0i64, 4, 2, 2])),
            0.0,
        ),
        (
            "swish",
            vec![randn(&[5, 8], d) * 6.0, tch::Tensor::from_slice(&[1.7f64])],
            None,
            0.0,
        ),
    ];
    let request: Vec<serde_json::Value> = cases
        .iter()
        .map(|(op, inputs, target, eps)| {
            serde_json::json!({
                "op": op,
                "inputs": inputs.iter().map(tensor_json).collect::<Vec<_>>(),
                "target": target.as_ref().map(tensor_json),
                "label_smoothing": eps,
            })
        })
        .collect();
    let dir = kiln_testkit::TempDir::new("fused-ops-float64");
    let request_path = dir.path().join("cases.json");
    std::fs::write(&request_path, serde_json::to_vec(&request).unwrap()).unwrap();
    let stdout =
        kiln_testkit::run_reference_script!(&python, "fused_ops_float64.py", &[&request_path]);
    let expected: Vec<serde_json::Value> = serde_json::from_str(&stdout).unwrap();
    assert_eq!(expected.len(), cases.len(), "reference outputs");

    for ((op, inputs, target, eps), expected) in cases.iter().zip(&expected) {
        let what = format!("{op} {:?}", inputs[0].size());
        let shape: Vec<i64> = serde_json::from_value(expected["shape"].clone()).unwrap();
        let expected: Vec<f64> = serde_json::from_value(expected["data"].clone()).unwrap();

        let torch = match *op {
            "bias_gelu" => kiln_fused_ops::bias_gelu(&inputs[0], &inputs[1]),
            "softmax_xent" => {
                kiln_fused_ops::softmax_cross_entropy(&inputs[0], target.as_ref().unwrap(), *eps)
            }
            _ => kiln_fused_ops::swish(&inputs[0], &inputs[1]),
        }
        .unwrap();
        assert_eq!(torch.kind(), Kind::Double, "{what}: libtorch output kind");
        assert_eq!(torch.size(), shape, "{what}: libtorch output shape");
        let torch = values::<f64>(&torch);
        kiln_testkit::assert_close(
            &format!("{what} on libtorch"),
            &torch,
            &expected,
            1e-12,
            "PyTorch's float64 composition",
        );

        let op_type = match *op {
            "bias_gelu" => ops::BIAS_GELU,
            "softmax_xent" => ops::SOFTMAX_XENT,
            _ => ops::SWISH,
        };
        let smoothing = target.is_some().then_some(*eps as f32);
        let graph = OpGraph::new(
            op_type,
            DataType::Double,
            inputs.len(),
            target.is_some(),
            smoothing,
            &[],
        );
        let data: Vec<(Vec<f64>, Vec<u64>)> =
            inputs.iter().map(|t| (values(t), udims(t))).collect();
        let feeds: Vec<(&[f64], &[u64])> = data.iter().map(|(v, d)| (&v[..], &d[..])).collect();
        let target_data = target.as_ref().map(|t| (values::<i64>(t), udims(t)));
        let (tf, _) = graph
            .run(
                &feeds,
                target_data.as_ref().map(|(v, d)| (&v[..], &d[..])),
                (&[0.0], &[]),
                false,
            )
            .unwrap();
        kiln_testkit::assert_close(
            &format!("{what} in TensorFlow"),
            &tf,
            &expected,
            1e-12,
            "PyTorch's float64 composition",
        );
        let (worst_torch, worst_tf) = (
            kiln_testkit::max_abs_diff(&torch, &expected),
            kiln_testkit::max_abs_diff(&tf, &expected),
        );
        eprintln!("{what}: float64 max |diff| from PyTorch: libtorch {worst_torch:.2e}, TensorFlow {worst_tf:.2e}");
    }
}

// ----- a loss as in training: mean of the per-row loss, default upstream gradient -----

#[test]
fn mean_loss_gradient_through_add_gradients() {
    tch::manual_seed(11);
    let logits = randn(&[8, 5], Kind::Float);
    let target = tch::Tensor::randint(5, [8], (Kind::Int64, tch::Device::Cpu));
    let eps = 0.1;

    let leaf = logits.copy().set_requires_grad(true);
    let loss = kiln_fused_ops::softmax_cross_entropy(&leaf, &target, eps)
        .unwrap()
        .mean(Kind::Float);
    loss.backward();
    // The fused loss is the cross-entropy torch computes with label smoothing.
    let reference =
        logits.cross_entropy_loss::<tch::Tensor>(&target, None, tch::Reduction::Mean, -100, eps);

    let mut graph = Graph::new();
    let l = placeholder(&mut graph, "logits", DataType::Float, Some(&[-1, 5]));
    let t = placeholder(&mut graph, "target", DataType::Int64, Some(&[-1]));
    let per_row = ops::softmax_cross_entropy(
        &mut graph,
        "xent",
        l.clone().into(),
        t.clone().into(),
        eps as f32,
    )
    .unwrap();
    // Shape inference: [N] from logits [N, 5] (N unknown).
    let shape = graph.tensor_shape(per_row.clone()).unwrap();
    assert_eq!(shape.dims(), Some(1));
    assert_eq!(shape[0], None);
    let axis = {
        let mut nd = graph.new_operation("Const", "axis").unwrap();
        nd.set_attr_type("dtype", DataType::Int32).unwrap();
        nd.set_attr_tensor("value", Tensor::<i32>::new(&[1]).with_values(&[0]).unwrap())
            .unwrap();
        nd.finish().unwrap()
    };
    let mean = {
        let mut nd = graph.new_operation("Mean", "loss").unwrap();
        nd.add_input(per_row);
        nd.add_input(axis);
        nd.finish().unwrap()
    };
    let grad = graph
        .add_gradients(
            Some("grad"),
            &[mean.clone().into()],
            &[l.clone().into()],
            None,
        )
        .unwrap()[0]
        .clone()
        .unwrap();
    let session = Session::new(&SessionOptions::new(), &graph).unwrap();
    let lv = Tensor::new(&[8, 5])
        .with_values(&values::<f32>(&logits))
        .unwrap();
    let tv = Tensor::new(&[8])
        .with_values(&values::<i64>(&target))
        .unwrap();
    let mut args = SessionRunArgs::new();
    args.add_feed(&l, 0, &lv);
    args.add_feed(&t, 0, &tv);
    let loss_token = args.request_fetch(&mean, 0);
    let grad_token = args.request_fetch(&grad.operation, grad.index);
    session.run(&mut args).unwrap();
    let tf_loss = args.fetch::<f32>(loss_token).unwrap()[0];
    let tf_grad = args.fetch::<f32>(grad_token).unwrap().to_vec();

    let err_loss = f64::from((tf_loss - loss.double_value(&[]) as f32).abs());
    let err_ref = f64::from((tf_loss - reference.double_value(&[]) as f32).abs());
    let err_grad = max_abs_diff(&tf_grad, &values::<f32>(&leaf.grad()));
    eprintln!(
        "mean softmax_xent: loss vs kiln torch {err_loss:.2e}, vs F.cross_entropy {err_ref:.2e}, \
         gradient {err_grad:.2e}"
    );
    assert!(err_loss <= 1e-5 && err_ref <= 1e-5 && err_grad <= 1e-5);
}

// ----- bad inputs: a failed run (or op construction) with the op's message -----

fn expect_error<T>(result: Result<T, Status>, code: Code, needle: &str) {
    let Err(status) = result else {
        panic!("expected an error containing {needle:?}")
    };
    let text = status.to_string();
    eprintln!("got the expected error: {text}");
    assert_eq!(status.code(), code, "{text}");
    assert!(text.contains(needle), "{text}");
}

#[test]
fn bad_inputs_fail_the_session_run_with_the_ops_message() {
    let bias_gelu = OpGraph::new(ops::BIAS_GELU, DataType::Float, 2, false, None, &[0, 1]);
    let x = [0f32; 8];
    expect_error(
        bias_gelu.run(&[(&x, &[2, 4]), (&[0f32; 3], &[3])], None, (&x, &[2, 4]), false),
        Code::InvalidArgument,
        "kiln::bias_gelu: bias must have shape [4] (x's last dimension), got [3] for x of shape [2, 4]",
    );
    // The gradient op checks too (it runs when the gradients are fetched).
    expect_error(
        bias_gelu.run(
            &[(&x, &[2, 4]), (&[0f32; 3], &[3])],
            None,
            (&x, &[2, 4]),
            true,
        ),
        Code::InvalidArgument,
        "kiln::bias_gelu: bias must have shape [4]",
    );

    let xent = OpGraph::new(ops::SOFTMAX_XENT, DataType::Float, 1, true, Some(0.0), &[0]);
    let logits = [0f32; 10];
    expect_error(
        xent.run(
            &[(&logits, &[2, 5])],
            Some((&[0, 7], &[2])),
            (&[1.0; 2], &[2]),
            false,
        ),
        Code::InvalidArgument,
        "kiln::softmax_xent: target 7 at row 1 is outside [0, 5)",
    );
    expect_error(
        xent.run(
            &[(&logits, &[2, 5])],
            Some((&[-1, 0], &[2])),
            (&[1.0; 2], &[2]),
            true,
        ),
        Code::InvalidArgument,
        "kiln::softmax_xent: target -1 at row 0 is outside [0, 5)",
    );
    expect_error(
        xent.run(
            &[(&logits, &[2, 5])],
            Some((&[0, 1, 2], &[3])),
            (&[1.0; 2], &[2]),
            false,
        ),
        Code::InvalidArgument,
        "kiln::softmax_xent: target must have shape [2], got [3]",
    );

    let bad_eps = OpGraph::new(ops::SOFTMAX_XENT, DataType::Float, 1, true, Some(1.5), &[]);
    expect_error(
        bad_eps.run(
            &[(&logits, &[2, 5])],
            Some((&[0, 1], &[2])),
            (&[1.0; 2], &[2]),
            false,
        ),
        Code::InvalidArgument,
        "kiln::softmax_xent: label_smoothing must be in [0, 1], got 1.5",
    );

    let swish = OpGraph::new(ops::SWISH, DataType::Double, 2, false, None, &[0, 1]);
    expect_error(
        swish.run(
            &[(&[1.0f64; 3], &[3]), (&[1.0, 2.0], &[2])],
            None,
            (&[1.0; 3], &[3]),
            false,
        ),
        Code::InvalidArgument,
        "kiln::swish: beta must have one element, got shape [2]",
    );

    // The graphs still run after the failures.
    let (y, _) = bias_gelu
        .run(
            &[(&x, &[2, 4]), (&[0f32; 4], &[4])],
            None,
            (&x, &[2, 4]),
            true,
        )
        .unwrap();
    assert_eq!(y, vec![0f32; 8]);
}

#[test]
fn known_bad_shapes_fail_when_the_op_is_added() {
    let mut graph = Graph::new();
    let x = placeholder(&mut graph, "x", DataType::Float, Some(&[2, 4]));
    let bias = placeholder(&mut graph, "bias", DataType::Float, Some(&[3]));
    let err = ops::bias_gelu(&mut graph, "y", x.clone().into(), bias.into()).unwrap_err();
    // TensorFlow's status is the error's source: read the chain, as a user sees it.
    let text = err.display_chain().to_string();
    eprintln!("got the expected error: {text}");
    assert!(
        text.contains("kiln::bias_gelu: bias must have shape [4] (x's last dimension), got [3]"),
        "{text}"
    );

    let logits = placeholder(&mut graph, "logits", DataType::Float, Some(&[2, 5]));
    let target = placeholder(&mut graph, "target", DataType::Int64, Some(&[3]));
    let err = ops::softmax_cross_entropy(
        &mut graph,
        "xent",
        logits.clone().into(),
        target.into(),
        0.0,
    )
    .unwrap_err()
    .display_chain()
    .to_string();
    assert!(
        err.contains("kiln::softmax_xent: target must have shape [2], got [3]"),
        "{err}"
    );
    let target = placeholder(&mut graph, "target32", DataType::Int32, Some(&[2]));
    let err = ops::softmax_cross_entropy(&mut graph, "xent32", logits.into(), target.into(), 0.0)
        .unwrap_err()
        .display_chain()
        .to_string();
    assert!(err.contains("int64"), "{err}");

    let beta = placeholder(&mut graph, "beta", DataType::Float, Some(&[2, 1]));
    let err = ops::swish(&mut graph, "swish", x.into(), beta.into())
        .unwrap_err()
        .display_chain()
        .to_string();
    assert!(
        err.contains("kiln::swish: beta must have one element, got shape [2, 1]"),
        "{err}"
    );
}

#[test]
fn registration_is_idempotent_and_names_every_op() {
    ops::register().unwrap();
    ops::register().unwrap();
    let graph = Graph::new();
    for op_type in ops::OP_TYPES {
        // TF_GraphGetOpDef: the op is in TensorFlow's registry.
        let def = graph.get_op_def(op_type).unwrap();
        assert!(!def.is_empty(), "{op_type}");
    }
    assert!(graph.get_op_def("KilnNoSuchOp").is_err());
}

// ----- the portable (standard-op) forms a SavedModel export writes -----

/// Runs the fused op and its portable form on the same inputs (float32 or
/// float64, fed as f64 values) and returns both outputs.
fn fused_and_portable<T: TensorType + Copy + Into<f64>>(
    dtype: DataType,
    x: &[T],
    x_dims: &[u64],
    param: &[T],
    param_dims: &[u64],
    fused: &dyn Fn(&mut Graph, Output, Output) -> Operation,
    portable: &dyn Fn(&mut Graph, Output, Output) -> Output,
) -> (Vec<f64>, Vec<f64>) {
    let mut graph = Graph::new();
    let xp = placeholder(&mut graph, "x", dtype, None);
    let pp = placeholder(&mut graph, "param", dtype, None);
    let y_fused = fused(&mut graph, xp.clone().into(), pp.clone().into());
    let y_portable = portable(&mut graph, xp.clone().into(), pp.clone().into());
    let session = Session::new(&SessionOptions::new(), &graph).unwrap();
    let x_t = Tensor::<T>::new(x_dims).with_values(x).unwrap();
    let p_t = Tensor::<T>::new(param_dims).with_values(param).unwrap();
    let mut args = SessionRunArgs::new();
    args.add_feed(&xp, 0, &x_t);
    args.add_feed(&pp, 0, &p_t);
    let a = args.request_fetch(&y_fused, 0);
    let b = args.request_fetch(&y_portable.operation, y_portable.index);
    session.run(&mut args).unwrap();
    let a: Tensor<T> = args.fetch(a).unwrap();
    let b: Tensor<T> = args.fetch(b).unwrap();
    (
        a.iter().map(|&v| v.into()).collect(),
        b.iter().map(|&v| v.into()).collect(),
    )
}

/// Differences between the fused op's outputs `a` and the portable form's `b`:
/// the largest relative to `max(1, |a|)` (as the parity suites measure) where
/// `in_tail` is false, and the largest absolute one where it is true.
fn differences(a: &[f64], b: &[f64], in_tail: &dyn Fn(usize) -> bool) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    assert!(a.iter().chain(b).all(|v| v.is_finite()));
    let (mut body, mut tail) = (0.0f64, 0.0f64);
    for (k, (p, q)) in a.iter().zip(b).enumerate() {
        if in_tail(k) {
            tail = tail.max((p - q).abs());
        } else {
            body = body.max((p - q).abs() / p.abs().max(1.0));
        }
    }
    (body, tail)
}

/// `portable_bias_gelu` and `portable_swish` (standard TensorFlow ops only)
/// compute what the fused kernels compute, over inputs spanning [-6, 6] and
/// several betas: in float64 within 1e-12; in float32 within 1e-6 of
/// `max(1, |y|)`, except bias GELU's far negative tail (`x + bias < -5`, where
/// gelu is below 1.5e-6 in magnitude): there `1 + erf` cancels and the two float
/// erfs (the kernel's polynomial, TensorFlow's Eigen one, each within 7 ulp of -1)
/// leave each output about 1e-6 from the exact value, so there the bound is
/// 2e-6 absolute.
#[test]
fn portable_forms_match_the_fused_kernels() {
    ops::register().unwrap();
    let (rows, cols) = (64usize, 50usize);
    let x64: Vec<f64> = (0..rows * cols)
        .map(|i| -6.0 + 12.0 * i as f64 / (rows * cols - 1) as f64)
        .collect();
    let bias64: Vec<f64> = (0..cols).map(|j| (j as f64 * 0.37).sin() * 0.8).collect();
    let x_dims = [rows as u64, cols as u64];
    let x32: Vec<f32> = x64.iter().map(|&v| v as f32).collect();
    let bias32: Vec<f32> = bias64.iter().map(|&v| v as f32).collect();
    let gelu_tail = |k: usize| x64[k] + bias64[k % cols] < -5.0;
    let no_tail = |_: usize| false;
    let bias_gelu = |g: &mut Graph, x, p| ops::bias_gelu(g, "fused", x, p).unwrap();
    let portable_bias_gelu =
        |g: &mut Graph, x, p| ops::portable_bias_gelu(g, "portable", x, p).unwrap();
    let swish = |g: &mut Graph, x, p| ops::swish(g, "fused", x, p).unwrap();
    let portable_swish = |g: &mut Graph, x, p| ops::portable_swish(g, "portable", x, p).unwrap();

    let (a, b) = fused_and_portable(
        DataType::Float,
        &x32,
        &x_dims,
        &bias32,
        &[cols as u64],
        &bias_gelu,
        &portable_bias_gelu,
    );
    let (d32, tail32) = differences(&a, &b, &gelu_tail);
    let (a, b) = fused_and_portable(
        DataType::Double,
        &x64,
        &x_dims,
        &bias64,
        &[cols as u64],
        &bias_gelu,
        &portable_bias_gelu,
    );
    let (d64, tail64) = differences(&a, &b, &no_tail);
    eprintln!(
        "bias_gelu: portable vs fused, float32 {d32:.2e} (relative; tail {tail32:.2e} absolute), \
         float64 {d64:.2e}"
    );
    assert!(d32 <= 1e-6, "bias_gelu float32 differs by {d32:.2e}");
    assert!(
        tail32 <= 2e-6,
        "bias_gelu float32 tail differs by {tail32:.2e}"
    );
    assert!(
        d64 <= 1e-12 && tail64 == 0.0,
        "bias_gelu float64 differs by {d64:.2e}"
    );

    for beta in [1.0f64, 1.7, -0.4] {
        let (a, b) = fused_and_portable(
            DataType::Float,
            &x32,
            &x_dims,
            &[beta as f32],
            &[1],
            &swish,
            &portable_swish,
        );
        let (d32, _) = differences(&a, &b, &no_tail);
        let (a, b) = fused_and_portable(
            DataType::Double,
            &x64,
            &x_dims,
            &[beta],
            &[1],
            &swish,
            &portable_swish,
        );
        let (d64, _) = differences(&a, &b, &no_tail);
        eprintln!("swish beta {beta}: portable vs fused, float32 {d32:.2e}, float64 {d64:.2e}");
        assert!(d32 <= 1e-6, "swish({beta}) float32 differs by {d32:.2e}");
        assert!(d64 <= 1e-12, "swish({beta}) float64 differs by {d64:.2e}");
    }
}
