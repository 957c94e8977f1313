//! Loss values and input gradients against `torch.nn.functional`
//! (tests/reference/losses.py), and the validation errors.

use std::fmt::Write as _;
use std::path::Path;

use kiln_core::{
    loss::{BceWithLogitsConfig, CrossEntropyConfig, Loss, NllConfig, Reduction, SmoothL1Config},
    state_dict::StateDict,
    DType, Error,
};
use tensorflow::{DataType, Session, SessionOptions, SessionRunArgs, Tensor};

use super::build_loss;
use crate::graph::Builder;

/// Absolute and relative tolerance on values and gradients.
const TOL: f64 = 1e-5;

/// A class-index or float target.
#[derive(Clone)]
enum Target {
    Index(Vec<i64>),
    Float(Vec<f32>),
}

struct Case {
    name: String,
    loss: Loss,
    input_dims: Vec<i64>,
    input: Vec<f32>,
    target_dims: Vec<i64>,
    target: Target,
    /// Leave the batch dim unknown (`-1`) in the placeholders.
    dynamic_batch: bool,
}

/// A small deterministic generator (64-bit LCG).
struct Lcg(u64);

impl Lcg {
    fn uniform(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }
    fn floats(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| (self.uniform() * 2.0 - 1.0) * scale)
            .collect()
    }
    fn classes(&mut self, n: usize, classes: i64) -> Vec<i64> {
        (0..n)
            .map(|_| ((self.uniform() * classes as f32) as i64).min(classes - 1))
            .collect()
    }
    /// Rows of non-negative values summing to 1 along `axis` 1 of `dims`.
    fn probabilities(&mut self, dims: &[i64]) -> Vec<f32> {
        let (n, c) = (dims[0] as usize, dims[1] as usize);
        let inner: usize = dims[2..].iter().product::<i64>() as usize;
        let mut p: Vec<f32> = (0..n * c * inner).map(|_| self.uniform() + 0.05).collect();
        for i in 0..n {
            for k in 0..inner {
                let at = |j: usize| (i * c + j) * inner + k;
                let total: f32 = (0..c).map(|j| p[at(j)]).sum();
                for j in 0..c {
                    p[at(j)] /= total;
                }
            }
        }
        p
    }
}

fn numel(dims: &[i64]) -> usize {
    dims.iter().product::<i64>() as usize
}

fn reduction_name(r: Reduction) -> &'static str {
    match r {
        Reduction::Mean => "mean",
        Reduction::Sum => "sum",
        Reduction::None => "none",
    }
}

/// An `f32` as JSON, exactly (through `f64`); infinities as Python's json reads them.
fn json_f32(v: f32) -> String {
    if v == f32::NEG_INFINITY {
        "-Infinity".to_owned()
    } else if v == f32::INFINITY {
        "Infinity".to_owned()
    } else {
        format!("{:?}", f64::from(v))
    }
}

fn json_list<T>(values: &[T], f: impl Fn(&T) -> String) -> String {
    let parts: Vec<String> = values.iter().map(f).collect();
    format!("[{}]", parts.join(","))
}

fn json_weights(w: &Option<Vec<f64>>) -> String {
    match w {
        Some(w) => json_list(w, |v| format!("{v:?}")),
        None => "null".to_owned(),
    }
}

fn json_loss(loss: &Loss) -> String {
    let r = |r: Reduction| reduction_name(r);
    match loss {
        Loss::CrossEntropy(c) => format!(
            r#"{{"type":"cross_entropy","weight":{},"ignore_index":{},"label_smoothing":{:?},"reduction":"{}"}}"#,
            json_weights(&c.weight),
            c.ignore_index.unwrap_or(-100),
            c.label_smoothing,
            r(c.reduction)
        ),
        Loss::Nll(c) => format!(
            r#"{{"type":"nll","weight":{},"ignore_index":{},"reduction":"{}"}}"#,
            json_weights(&c.weight),
            c.ignore_index.unwrap_or(-100),
            r(c.reduction)
        ),
        Loss::Mse { reduction } => {
            format!(r#"{{"type":"mse","reduction":"{}"}}"#, r(*reduction))
        }
        Loss::L1 { reduction } => format!(r#"{{"type":"l1","reduction":"{}"}}"#, r(*reduction)),
        Loss::SmoothL1(c) => format!(
            r#"{{"type":"smooth_l1","beta":{:?},"reduction":"{}"}}"#,
            c.beta,
            r(c.reduction)
        ),
        Loss::BceWithLogits(c) => format!(
            r#"{{"type":"bce_with_logits","pos_weight":{},"reduction":"{}"}}"#,
            json_weights(&c.pos_weight),
            r(c.reduction)
        ),
        other => panic!("no reference for {other:?}"),
    }
}

fn json_cases(cases: &[Case]) -> String {
    let mut out = String::from(r#"{"cases":["#);
    for (i, case) in cases.iter().enumerate() {
        let (dtype, data) = match &case.target {
            Target::Index(t) => ("int64", json_list(t, |v| v.to_string())),
            Target::Float(t) => ("float32", json_list(t, |v| json_f32(*v))),
        };
        write!(
            out,
            r#"{}{{"name":"{}","loss":{},"input":{{"shape":{:?},"dtype":"float32","data":{}}},"target":{{"shape":{:?},"dtype":"{}","data":{}}}}}"#,
            if i == 0 { "" } else { "," },
            case.name,
            json_loss(&case.loss),
            case.input_dims,
            json_list(&case.input, |v| json_f32(*v)),
            case.target_dims,
            dtype,
            data
        )
        .unwrap();
    }
    out.push_str("]}");
    out
}

/// The reference values and gradients, or `None` (with a message) without the venv.
fn torch_reference(test: &str, cases: &[Case]) -> Option<StateDict> {
    let python = kiln_testkit::python(test)?;
    let dir = std::env::temp_dir().join(format!("kiln-tf-losses-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let request = dir.join("cases.json");
    let answer = dir.join("reference.safetensors");
    std::fs::write(&request, json_cases(cases)).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/losses.py");
    kiln_testkit::run_reference(&python, &script, &[&request, &answer]);
    let (dict, _) = StateDict::load_safetensors(&answer).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    Some(dict)
}

fn to_u64(dims: &[i64]) -> Vec<u64> {
    dims.iter().map(|&d| d as u64).collect()
}

/// The loss and its gradient with respect to the input, as computed by TensorFlow.
fn run_tf(case: &Case) -> (Vec<u64>, Vec<f32>, Vec<u64>, Vec<f32>) {
    let mut b = Builder::new();
    let unknown_batch = |dims: &[i64]| -> Vec<i64> {
        let mut d = dims.to_vec();
        if case.dynamic_batch && !d.is_empty() {
            d[0] = -1;
        }
        d
    };
    let input_dims = unknown_batch(&case.input_dims);
    let target_dims = unknown_batch(&case.target_dims);
    let input = b.placeholder(DataType::Float, Some(&input_dims)).unwrap();
    let (target_type, target_dtype) = match case.target {
        Target::Index(_) => (DataType::Int64, DType::I64),
        Target::Float(_) => (DataType::Float, DType::F32),
    };
    let target = b.placeholder(target_type, Some(&target_dims)).unwrap();
    let loss = build_loss(
        &mut b,
        &case.loss,
        &input,
        &input_dims,
        &target,
        target_dtype,
        &target_dims,
    )
    .unwrap();
    let grads = b.gradients(&loss, std::slice::from_ref(&input)).unwrap();
    let grad = grads[0].clone().expect("the loss depends on the input");
    let session = Session::new(&SessionOptions::new(), &b.graph).unwrap();
    let x = Tensor::new(&to_u64(&case.input_dims))
        .with_values(&case.input)
        .unwrap();
    let t_index;
    let t_float;
    let mut args = SessionRunArgs::new();
    args.add_feed(&input.operation, input.index, &x);
    match &case.target {
        Target::Index(t) => {
            t_index = Tensor::new(&to_u64(&case.target_dims))
                .with_values(t)
                .unwrap();
            args.add_feed(&target.operation, target.index, &t_index);
        }
        Target::Float(t) => {
            t_float = Tensor::new(&to_u64(&case.target_dims))
                .with_values(t)
                .unwrap();
            args.add_feed(&target.operation, target.index, &t_float);
        }
    }
    let loss_token = args.request_fetch(&loss.operation, loss.index);
    let grad_token = args.request_fetch(&grad.operation, grad.index);
    session.run(&mut args).unwrap();
    let value: Tensor<f32> = args.fetch(loss_token).unwrap();
    let grad: Tensor<f32> = args.fetch(grad_token).unwrap();
    (
        value.dims().to_vec(),
        value.to_vec(),
        grad.dims().to_vec(),
        grad.to_vec(),
    )
}

/// The largest `|a - e| / (1 + |e|)`, asserting it is within [`TOL`].
fn check_close(what: &str, actual: &[f32], expected: &[f64]) -> f64 {
    assert_eq!(actual.len(), expected.len(), "{what}: element count");
    let mut worst = 0.0f64;
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let a = f64::from(a);
        let err = (a - e).abs() / (1.0 + e.abs());
        assert!(
            err <= TOL,
            "{what}: element {i} is {a} but PyTorch gives {e} (error {err:.3e} > {TOL:.0e})"
        );
        worst = worst.max(err);
    }
    worst
}

fn class_case(name: &str, loss: Loss, dims: &[i64], ignore: &[(usize, i64)], g: &mut Lcg) -> Case {
    let mut target_dims = dims.to_vec();
    target_dims.remove(1);
    let mut target = g.classes(numel(&target_dims), dims[1]);
    for &(at, value) in ignore {
        target[at] = value;
    }
    Case {
        name: name.to_owned(),
        loss,
        input_dims: dims.to_vec(),
        input: g.floats(numel(dims), 3.0),
        target_dims,
        target: Target::Index(target),
        dynamic_batch: true,
    }
}

fn probability_case(name: &str, loss: Loss, dims: &[i64], g: &mut Lcg) -> Case {
    Case {
        name: name.to_owned(),
        loss,
        input_dims: dims.to_vec(),
        input: g.floats(numel(dims), 3.0),
        target_dims: dims.to_vec(),
        target: Target::Float(g.probabilities(dims)),
        dynamic_batch: true,
    }
}

fn regression_case(name: &str, loss: Loss, input: Vec<f32>, target: Vec<f32>) -> Case {
    let dims = vec![4, input.len() as i64 / 4];
    Case {
        name: name.to_owned(),
        loss,
        input_dims: dims.clone(),
        input,
        target_dims: dims,
        target: Target::Float(target),
        dynamic_batch: true,
    }
}

fn ce(weight: Option<Vec<f64>>, ignore: Option<i64>, smoothing: f64, r: Reduction) -> Loss {
    Loss::CrossEntropy(CrossEntropyConfig {
        weight,
        ignore_index: ignore,
        label_smoothing: smoothing,
        reduction: r,
    })
}

fn nll(weight: Option<Vec<f64>>, ignore: Option<i64>, r: Reduction) -> Loss {
    Loss::Nll(NllConfig {
        weight,
        ignore_index: ignore,
        reduction: r,
    })
}

fn cases() -> Vec<Case> {
    use Reduction::{Mean, None as Unreduced, Sum};
    let mut g = Lcg(0x5eed);
    let w5 = Some(vec![1.0, 2.0, 0.5, 1.5, 0.25]);
    let w4 = Some(vec![0.5, 2.0, 1.0, 3.0]);
    let mut cases = vec![
        // Cross-entropy on class indices.
        class_case("ce_mean", ce(None, None, 0.0, Mean), &[6, 5], &[], &mut g),
        class_case("ce_sum", ce(None, None, 0.0, Sum), &[6, 5], &[], &mut g),
        class_case(
            "ce_none",
            ce(None, None, 0.0, Unreduced),
            &[6, 5],
            &[],
            &mut g,
        ),
        class_case(
            "ce_weight_mean",
            ce(w5.clone(), None, 0.0, Mean),
            &[7, 5],
            &[],
            &mut g,
        ),
        class_case(
            "ce_weight_ignore_sum",
            ce(w5.clone(), Some(2), 0.0, Sum),
            &[7, 5],
            &[(1, 2), (4, 2)],
            &mut g,
        ),
        class_case(
            "ce_default_ignore_mean",
            ce(None, None, 0.0, Mean),
            &[6, 5],
            &[(0, -100), (3, -100)],
            &mut g,
        ),
        class_case(
            "ce_weight_ignore_none",
            ce(w5.clone(), Some(1), 0.0, Unreduced),
            &[6, 5],
            &[(2, 1), (5, 1)],
            &mut g,
        ),
        // Label smoothing.
        class_case(
            "ce_smooth_mean",
            ce(None, None, 0.1, Mean),
            &[6, 5],
            &[],
            &mut g,
        ),
        class_case(
            "ce_smooth_ignore_sum",
            ce(None, None, 0.15, Sum),
            &[6, 5],
            &[(1, -100)],
            &mut g,
        ),
        class_case(
            "ce_smooth_weight_ignore_mean",
            ce(w5.clone(), Some(3), 0.2, Mean),
            &[8, 5],
            &[(0, 3), (6, 3)],
            &mut g,
        ),
        class_case(
            "ce_smooth_weight_ignore_none",
            ce(w5.clone(), Some(0), 0.3, Unreduced),
            &[6, 5],
            &[(2, 0)],
            &mut g,
        ),
        class_case(
            "ce_smooth_weight_sum",
            ce(w5.clone(), None, 0.1, Sum),
            &[6, 5],
            &[],
            &mut g,
        ),
        // Spatial class dims: [N, C, L] and [N, C, H, W].
        class_case(
            "ce_ncl_mean",
            ce(None, None, 0.0, Mean),
            &[3, 4, 5],
            &[],
            &mut g,
        ),
        class_case(
            "ce_ncl_weight_ignore_sum",
            ce(w4.clone(), None, 0.0, Sum),
            &[3, 4, 5],
            &[(4, -100), (7, -100)],
            &mut g,
        ),
        class_case(
            "ce_nchw_smooth_weight_ignore_none",
            ce(w4.clone(), Some(2), 0.1, Unreduced),
            &[2, 4, 2, 3],
            &[(1, 2), (9, 2)],
            &mut g,
        ),
        class_case(
            "ce_nchw_smooth_weight_ignore_mean",
            ce(w4.clone(), Some(2), 0.1, Mean),
            &[2, 4, 2, 3],
            &[(1, 2), (9, 2)],
            &mut g,
        ),
        // Probability targets.
        probability_case("ce_probs_mean", ce(None, None, 0.0, Mean), &[6, 5], &mut g),
        probability_case(
            "ce_probs_smooth_sum",
            ce(None, None, 0.2, Sum),
            &[6, 5],
            &mut g,
        ),
        probability_case(
            "ce_probs_weight_mean",
            ce(w5.clone(), None, 0.0, Mean),
            &[6, 5],
            &mut g,
        ),
        probability_case(
            "ce_probs_smooth_weight_mean",
            ce(w4.clone(), None, 0.1, Mean),
            &[3, 4, 5],
            &mut g,
        ),
        probability_case(
            "ce_probs_ncl_smooth_none",
            ce(None, None, 0.1, Unreduced),
            &[2, 4, 3],
            &mut g,
        ),
        // Negative log-likelihood (any floats stand in for log-probabilities).
        class_case("nll_mean", nll(None, None, Mean), &[6, 5], &[], &mut g),
        class_case(
            "nll_weight_ignore_mean",
            nll(w5.clone(), Some(4), Mean),
            &[7, 5],
            &[(0, 4), (5, 4)],
            &mut g,
        ),
        class_case(
            "nll_weight_sum",
            nll(w5.clone(), None, Sum),
            &[6, 5],
            &[],
            &mut g,
        ),
        class_case(
            "nll_ncl_ignore_none",
            nll(None, None, Unreduced),
            &[3, 4, 5],
            &[(2, -100)],
            &mut g,
        ),
    ];
    // NLL ignores other classes' log-probabilities entirely, even infinite ones,
    // and an ignored row contributes an exact 0.
    let mut infinite = class_case(
        "nll_infinite_others_mean",
        nll(None, Some(1), Mean),
        &[4, 3],
        &[(3, 1)],
        &mut g,
    );
    let Target::Index(t) = infinite.target.clone() else {
        unreachable!()
    };
    for (row, &class) in t.iter().enumerate() {
        for j in 0..3 {
            if j as i64 != class {
                infinite.input[row * 3 + j] = f32::NEG_INFINITY;
            }
        }
    }
    cases.push(infinite);

    // Regression losses, with ties (x == y) and |x - y| == beta exactly.
    let mut x = g.floats(12, 2.0);
    let mut y = g.floats(12, 2.0);
    (x[0], y[0]) = (0.75, 0.75);
    (x[1], y[1]) = (1.5, 0.5);
    (x[2], y[2]) = (-0.25, 0.25);
    cases.extend([
        regression_case("mse_mean", Loss::mse(), x.clone(), y.clone()),
        regression_case(
            "mse_sum",
            Loss::mse().with_reduction(Sum),
            x.clone(),
            y.clone(),
        ),
        regression_case(
            "mse_none",
            Loss::mse().with_reduction(Unreduced),
            x.clone(),
            y.clone(),
        ),
        regression_case("l1_mean", Loss::l1(), x.clone(), y.clone()),
        regression_case(
            "l1_sum",
            Loss::l1().with_reduction(Sum),
            x.clone(),
            y.clone(),
        ),
        regression_case(
            "l1_none",
            Loss::l1().with_reduction(Unreduced),
            x.clone(),
            y.clone(),
        ),
        regression_case("smooth_l1_mean", Loss::smooth_l1(), x.clone(), y.clone()),
        regression_case(
            "smooth_l1_none",
            Loss::smooth_l1().with_reduction(Unreduced),
            x.clone(),
            y.clone(),
        ),
        regression_case(
            "smooth_l1_beta_0_5_sum",
            SmoothL1Config::new()
                .with_beta(0.5)
                .with_reduction(Sum)
                .into(),
            x.clone(),
            y.clone(),
        ),
        regression_case(
            "smooth_l1_beta_0_5_none",
            SmoothL1Config::new()
                .with_beta(0.5)
                .with_reduction(Unreduced)
                .into(),
            x.clone(),
            y.clone(),
        ),
    ]);

    // BCE with logits: zero, large and small logits; hard and soft targets.
    let mut logits = g.floats(12, 4.0);
    (logits[0], logits[1], logits[2], logits[3]) = (0.0, 30.0, -30.0, -0.0);
    let targets: Vec<f32> = (0..12)
        .map(|i| match i % 3 {
            0 => 1.0,
            1 => 0.0,
            _ => g.uniform(),
        })
        .collect();
    cases.extend([
        regression_case(
            "bce_mean",
            Loss::bce_with_logits(),
            logits.clone(),
            targets.clone(),
        ),
        regression_case(
            "bce_sum",
            Loss::bce_with_logits().with_reduction(Sum),
            logits.clone(),
            targets.clone(),
        ),
        regression_case(
            "bce_pos_weight_mean",
            BceWithLogitsConfig::new()
                .with_pos_weight(vec![2.0, 0.5, 3.0])
                .into(),
            logits.clone(),
            targets.clone(),
        ),
        regression_case(
            "bce_pos_weight_none",
            BceWithLogitsConfig::new()
                .with_pos_weight(vec![2.0, 0.5, 3.0])
                .with_reduction(Unreduced)
                .into(),
            logits.clone(),
            targets.clone(),
        ),
        regression_case(
            "bce_pos_weight_one_sum",
            BceWithLogitsConfig::new()
                .with_pos_weight(vec![4.0])
                .with_reduction(Sum)
                .into(),
            logits.clone(),
            targets.clone(),
        ),
    ]);
    // Static batch dims work the same.
    for name in ["ce_smooth_weight_ignore_mean", "mse_sum", "ce_probs_mean"] {
        let case = cases.iter().find(|c| c.name == name).unwrap();
        cases.push(Case {
            name: format!("{name}_static"),
            loss: case.loss.clone(),
            input_dims: case.input_dims.clone(),
            input: case.input.clone(),
            target_dims: case.target_dims.clone(),
            target: case.target.clone(),
            dynamic_batch: false,
        });
    }
    cases
}

#[test]
fn losses_match_pytorch() {
    let cases = cases();
    let Some(reference) = torch_reference("losses_match_pytorch", &cases) else {
        return;
    };
    let (mut worst_value, mut worst_grad) = ((0.0f64, ""), (0.0f64, ""));
    for case in &cases {
        let (value_dims, value, grad_dims, grad) = run_tf(case);
        let expected_value = reference.get(&format!("{}/value", case.name)).unwrap();
        let expected_grad = reference.get(&format!("{}/grad", case.name)).unwrap();
        let to_u64 = |d: &[usize]| d.iter().map(|&x| x as u64).collect::<Vec<_>>();
        assert_eq!(
            value_dims,
            to_u64(expected_value.dims()),
            "{}: loss shape",
            case.name
        );
        assert_eq!(
            grad_dims,
            to_u64(expected_grad.dims()),
            "{}: gradient shape",
            case.name
        );
        let v = check_close(
            &format!("{} loss", case.name),
            &value,
            &expected_value.to_f64_vec(),
        );
        let g = check_close(
            &format!("{} gradient", case.name),
            &grad,
            &expected_grad.to_f64_vec(),
        );
        if v >= worst_value.0 {
            worst_value = (v, &case.name);
        }
        if g >= worst_grad.0 {
            worst_grad = (g, &case.name);
        }
    }
    eprintln!(
        "{} cases; worst loss error {:.2e} ({}), worst gradient error {:.2e} ({})",
        cases.len(),
        worst_value.0,
        worst_value.1,
        worst_grad.0,
        worst_grad.1
    );
}

/// Builds `loss` on placeholders of the given static shapes.
fn build(loss: &Loss, input_dims: &[i64], target_dtype: DType, target_dims: &[i64]) -> Error {
    let mut b = Builder::new();
    let input = b.placeholder(DataType::Float, Some(input_dims)).unwrap();
    let tf_type = match target_dtype {
        DType::I64 => DataType::Int64,
        DType::I32 => DataType::Int32,
        DType::F64 => DataType::Double,
        _ => DataType::Float,
    };
    let target = b.placeholder(tf_type, Some(target_dims)).unwrap();
    build_loss(
        &mut b,
        loss,
        &input,
        input_dims,
        &target,
        target_dtype,
        target_dims,
    )
    .expect_err("the loss should be rejected")
}

#[test]
fn invalid_targets_are_rejected() {
    let ce = Loss::cross_entropy();
    /// The loss, input dims, target dtype and dims, and the expected message.
    type Rejected = (Loss, &'static [i64], DType, &'static [i64], &'static str);
    let cases: Vec<Rejected> = vec![
        (
            ce.clone(),
            &[-1, 5],
            DType::I32,
            &[-1],
            "cross_entropy class-index targets: expected dtype int64, got int32",
        ),
        (
            Loss::nll(),
            &[-1, 5],
            DType::F32,
            &[-1],
            "nll class-index targets: expected dtype int64, got float32",
        ),
        (
            ce.clone(),
            &[-1, 5, 3],
            DType::I64,
            &[-1, 4],
            "cross_entropy class-index targets: expected shape [?, 3] (the input's shape \
             [?, 5, 3] without the class dim 1), got [?, 4]",
        ),
        (
            ce.clone(),
            &[6, 5],
            DType::I64,
            &[4],
            "cross_entropy class-index targets: expected shape [6] (the input's shape \
             [6, 5] without the class dim 1), got [4]",
        ),
        (
            ce.clone(),
            &[-1, 5],
            DType::F32,
            &[-1, 4],
            "cross_entropy probability targets: expected shape [?, 5] (the input's \
             shape), got [?, 4]",
        ),
        (
            ce.clone(),
            &[-1, 5],
            DType::F64,
            &[-1, 5],
            "cross_entropy probability targets: expected dtype float32, got float64",
        ),
        (
            ce.clone(),
            &[-1],
            DType::I64,
            &[-1],
            "cross_entropy input: expected shape [N, C] or [N, C, d1, ...] with the class \
             count C known when the graph is built, got [?]",
        ),
        (
            CrossEntropyConfig::new().with_weight(vec![1.0; 4]).into(),
            &[-1, 5],
            DType::I64,
            &[-1],
            "cross_entropy weight: expected shape [5] (one weight per class), got [4]",
        ),
        (
            CrossEntropyConfig::new().with_ignore_index(0).into(),
            &[-1, 5],
            DType::F32,
            &[-1, 5],
            "invalid argument `ignore_index`: is not supported with probability targets, \
             got 0",
        ),
        (
            CrossEntropyConfig::new().with_label_smoothing(1.5).into(),
            &[-1, 5],
            DType::I64,
            &[-1],
            "invalid argument `label_smoothing`: must be in [0, 1], got 1.5",
        ),
        (
            Loss::mse(),
            &[-1, 3],
            DType::F32,
            &[-1, 3, 1],
            "mse target: expected shape [?, 3] (the input's shape), got [?, 3, 1]",
        ),
        (
            Loss::l1(),
            &[-1, 3],
            DType::I64,
            &[-1, 3],
            "l1 target: expected dtype float32, got int64",
        ),
        (
            BceWithLogitsConfig::new()
                .with_pos_weight(vec![1.0, 2.0])
                .into(),
            &[-1, 3],
            DType::F32,
            &[-1, 3],
            "bce_with_logits pos_weight: expected shape [1] or one value per entry of the \
             last dim of the input [?, 3], got [2]",
        ),
    ];
    for (loss, input_dims, dtype, target_dims, message) in cases {
        let err = build(&loss, input_dims, dtype, target_dims);
        assert_eq!(err.to_string(), message);
        match (&err, message.contains("dtype")) {
            (Error::DTypeMismatch { .. }, true) | (Error::ShapeMismatch { .. }, false) => {}
            (Error::InvalidArgument { .. }, false) => {}
            _ => panic!("unexpected error kind: {err:?}"),
        }
    }
    // An unknown batch dim on either side is compatible with a known one.
    let mut b = Builder::new();
    let input = b.placeholder(DataType::Float, Some(&[6, 5])).unwrap();
    let target = b.placeholder(DataType::Int64, Some(&[-1])).unwrap();
    build_loss(&mut b, &ce, &input, &[6, 5], &target, DType::I64, &[-1]).unwrap();
    build_loss(&mut b, &ce, &input, &[-1, 5], &target, DType::I64, &[6]).unwrap();
}

#[test]
fn out_of_range_targets_fail_the_run() {
    for (loss, target) in [
        (Loss::cross_entropy(), [0i64, 5]),
        (Loss::nll(), [-1, 2]),
        (
            CrossEntropyConfig::new()
                .with_ignore_index(7)
                .with_label_smoothing(0.1)
                .into(),
            [7, 9],
        ),
    ] {
        let mut b = Builder::new();
        let input = b.placeholder(DataType::Float, Some(&[-1, 5])).unwrap();
        let t = b.placeholder(DataType::Int64, Some(&[-1])).unwrap();
        let out = build_loss(&mut b, &loss, &input, &[-1, 5], &t, DType::I64, &[-1]).unwrap();
        let grad = b.gradients(&out, std::slice::from_ref(&input)).unwrap()[0]
            .clone()
            .unwrap();
        let session = Session::new(&SessionOptions::new(), &b.graph).unwrap();
        let x = Tensor::new(&[2, 5]).with_values(&[0.5f32; 10]).unwrap();
        let targets = Tensor::new(&[2]).with_values(&target).unwrap();
        // Fetching only the gradient runs the check too.
        for fetch in [&out, &grad] {
            let mut args = SessionRunArgs::new();
            args.add_feed(&input.operation, 0, &x);
            args.add_feed(&t.operation, 0, &targets);
            args.request_fetch(&fetch.operation, fetch.index);
            let err = session.run(&mut args).expect_err("out-of-range target");
            assert!(err.to_string().contains("out of bounds"), "{err}");
        }
    }
}
