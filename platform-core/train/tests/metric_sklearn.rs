//! Every metric against scikit-learn on random logits and targets, fed in
//! uneven batches.
//!
//! `tests/reference/logger_metrics.py` computes scikit-learn's values for the
//! cases this test writes to a JSON file.

use kiln_core::HostTensor;
use kiln_train::{Accuracy, MeanAbsoluteError, Metric, Precision, Recall, TopKAccuracy, F1};
use serde::Deserialize;
use serde_json::json;
use std::collections::BTreeMap;

/// Agreement required with scikit-learn (absolute; values are in [0, 1] or small).
const TOL: f64 = 1e-12;

/// splitmix64: a small deterministic generator, so the cases are the same every run.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let u = 1.0 - self.uniform();
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

struct ClassCase {
    name: &'static str,
    classes: usize,
    /// Row-major logits as f64 (exactly the values the tensors hold).
    logits: Vec<f64>,
    targets: Vec<i64>,
    f32: bool,
    ks: Vec<usize>,
    batch: usize,
}

impl ClassCase {
    fn rows(&self) -> usize {
        self.targets.len()
    }

    /// The logits of rows `lo..hi` as a tensor of the case's dtype.
    fn logits(&self, lo: usize, hi: usize) -> HostTensor {
        let data = &self.logits[lo * self.classes..hi * self.classes];
        let shape = [hi - lo, self.classes];
        let t = if self.f32 {
            HostTensor::new(data.iter().map(|&v| v as f32).collect::<Vec<_>>(), shape)
        } else {
            HostTensor::new(data.to_vec(), shape)
        };
        t.expect("logits tensor")
    }

    fn targets(&self, lo: usize, hi: usize) -> HostTensor {
        HostTensor::new(self.targets[lo..hi].to_vec(), [hi - lo]).expect("targets tensor")
    }
}

/// How a classification case is made: name, rows, classes, number of
/// classes that occur as targets, bias added to the target's logit, f32 (else
/// f64) logits, the k's of top-k accuracy, and the batch size.
type ClassSpec = (
    &'static str,
    usize,
    usize,
    usize,
    f64,
    bool,
    &'static [usize],
    usize,
);

/// Random logits (rounded to f32 where the case is f32, so that Python sees
/// exactly what the tensors hold), with the bias added at each row's target
/// class.
fn class_case(rng: &mut Rng, spec: ClassSpec) -> ClassCase {
    let (name, rows, classes, target_classes, bias, f32, ks, batch) = spec;
    let targets: Vec<i64> = (0..rows)
        .map(|_| rng.below(target_classes) as i64)
        .collect();
    let mut logits = Vec::with_capacity(rows * classes);
    for &t in &targets {
        for c in 0..classes {
            let mut v = rng.normal() + if c == t as usize { bias } else { 0.0 };
            if f32 {
                v = f64::from(v as f32);
            }
            logits.push(v);
        }
    }
    ClassCase {
        name,
        classes,
        logits,
        targets,
        f32,
        ks: ks.to_vec(),
        batch,
    }
}

struct RegCase {
    name: &'static str,
    shape: Vec<usize>,
    pred: Vec<f64>,
    target: Vec<f64>,
    f32: bool,
    batch: usize,
}

impl RegCase {
    fn tensor(&self, data: &[f64], lo: usize, hi: usize) -> HostTensor {
        let width: usize = self.shape[1..].iter().product();
        let mut shape = self.shape.clone();
        shape[0] = hi - lo;
        let data = &data[lo * width..hi * width];
        let t = if self.f32 {
            HostTensor::new(data.iter().map(|&v| v as f32).collect::<Vec<_>>(), shape)
        } else {
            HostTensor::new(data.to_vec(), shape)
        };
        t.expect("regression tensor")
    }

    /// Rows as nested lists for JSON.
    fn json(&self, data: &[f64]) -> serde_json::Value {
        if self.shape.len() == 1 {
            json!(data)
        } else {
            json!(data.chunks(self.shape[1]).collect::<Vec<_>>())
        }
    }
}

fn reg_case(
    rng: &mut Rng,
    name: &'static str,
    shape: &[usize],
    f32: bool,
    batch: usize,
) -> RegCase {
    let n: usize = shape.iter().product();
    let round = |v: f64| if f32 { f64::from(v as f32) } else { v };
    let target: Vec<f64> = (0..n).map(|_| round(rng.normal() * 3.0)).collect();
    let pred: Vec<f64> = target.iter().map(|t| round(t + rng.normal())).collect();
    RegCase {
        name,
        shape: shape.to_vec(),
        pred,
        target,
        f32,
        batch,
    }
}

#[derive(Deserialize)]
struct Reference {
    classification: Vec<ClassRef>,
    regression: Vec<RegRef>,
}

#[derive(Deserialize)]
struct ClassRef {
    name: String,
    accuracy: f64,
    top_k: BTreeMap<String, f64>,
    precision: f64,
    recall: f64,
    f1: f64,
}

#[derive(Deserialize)]
struct RegRef {
    name: String,
    mae: f64,
}

/// Feeds `metric` the case in batches of `case.batch` rows and returns its value.
fn run_class(metric: &mut dyn Metric, case: &ClassCase) -> f64 {
    metric.reset();
    let mut lo = 0;
    while lo < case.rows() {
        let hi = (lo + case.batch).min(case.rows());
        metric
            .update(&case.logits(lo, hi), &case.targets(lo, hi))
            .unwrap_or_else(|e| panic!("{}: {}: {e}", case.name, metric.name()));
        lo = hi;
    }
    metric
        .compute()
        .unwrap_or_else(|e| panic!("{}: {}: {e}", case.name, metric.name()))
}

fn check(case: &str, metric: &str, ours: f64, sklearn: f64) {
    assert!(
        (ours - sklearn).abs() <= TOL,
        "{case}: {metric}: Kiln {ours}, scikit-learn {sklearn}"
    );
}

#[test]
fn metrics_match_scikit_learn() {
    let Some(python) = kiln_testkit::python("metrics_match_scikit_learn") else {
        return;
    };
    let mut rng = Rng(20_240_611);
    let specs: [ClassSpec; 5] = [
        (
            "c10_f32_batches_of_32",
            257,
            10,
            10,
            0.8,
            true,
            &[1, 2, 3, 5],
            32,
        ),
        // Class 6 is never a target: its recall has no support (zero_division).
        (
            "c7_f64_class_without_support",
            120,
            7,
            6,
            0.3,
            false,
            &[1, 3, 6, 7],
            17,
        ),
        // Few rows for many classes: some classes occur in neither targets nor predictions.
        ("c12_f32_sparse", 30, 12, 12, 0.5, true, &[1, 4, 12], 7),
        ("c5_f64_mostly_right", 200, 5, 5, 3.0, false, &[1, 2], 64),
        ("c3_f32_tiny", 5, 3, 3, 0.0, true, &[1, 2, 3], 2),
    ];
    let class_cases: Vec<ClassCase> = specs.into_iter().map(|s| class_case(&mut rng, s)).collect();
    let reg_cases = [
        reg_case(&mut rng, "mae_1d_f32", &[101], true, 16),
        reg_case(&mut rng, "mae_2d_f64", &[50, 3], false, 9),
    ];

    let cases = json!({
        "classification": class_cases.iter().map(|c| json!({
            "name": c.name,
            "classes": c.classes,
            "logits": c.logits.chunks(c.classes).collect::<Vec<_>>(),
            "targets": c.targets,
            "ks": c.ks,
        })).collect::<Vec<_>>(),
        "regression": reg_cases.iter().map(|c| json!({
            "name": c.name,
            "pred": c.json(&c.pred),
            "target": c.json(&c.target),
        })).collect::<Vec<_>>(),
    });
    let dir = kiln_testkit::TempDir::new("metrics");
    let input = dir.path().join("cases.json");
    std::fs::write(&input, cases.to_string()).expect("write cases");
    let stdout =
        kiln_testkit::run_reference_script!(&python, "logger_metrics.py", &[input.as_os_str()]);
    let reference: Reference = serde_json::from_str(&stdout).expect("script prints JSON");
    assert_eq!(reference.classification.len(), class_cases.len());
    assert_eq!(reference.regression.len(), reg_cases.len());

    let mut distinct = std::collections::HashSet::new();
    for (case, r) in class_cases.iter().zip(&reference.classification) {
        assert_eq!(case.name, r.name);
        check(
            case.name,
            "accuracy",
            run_class(&mut Accuracy::new(), case),
            r.accuracy,
        );
        check(
            case.name,
            "precision",
            run_class(&mut Precision::new(), case),
            r.precision,
        );
        check(
            case.name,
            "recall",
            run_class(&mut Recall::new(), case),
            r.recall,
        );
        check(case.name, "f1", run_class(&mut F1::new(), case), r.f1);
        assert_eq!(r.top_k.len(), case.ks.len(), "{}", case.name);
        for &k in &case.ks {
            let mut m = TopKAccuracy::new(k).expect("k >= 1");
            let sk = r.top_k[&k.to_string()];
            check(
                case.name,
                m.name().to_string().as_str(),
                run_class(&mut m, case),
                sk,
            );
        }
        for v in [r.accuracy, r.precision, r.recall, r.f1] {
            distinct.insert(v.to_bits());
        }
    }
    // The cases are not degenerate: the reference values differ from each other.
    assert!(distinct.len() >= 15, "{} distinct values", distinct.len());

    for (case, r) in reg_cases.iter().zip(&reference.regression) {
        assert_eq!(case.name, r.name);
        let mut mae = MeanAbsoluteError::new();
        let rows = case.shape[0];
        let mut lo = 0;
        while lo < rows {
            let hi = (lo + case.batch).min(rows);
            mae.update(
                &case.tensor(&case.pred, lo, hi),
                &case.tensor(&case.target, lo, hi),
            )
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
            lo = hi;
        }
        let ours = mae.compute().expect("mae");
        assert!(r.mae > 0.1, "{}: {}", case.name, r.mae);
        check(case.name, "mae", ours, r.mae);
    }
}

#[test]
fn mismatched_inputs_are_typed_errors_naming_both() {
    let logits = HostTensor::new(vec![0.0f32; 12], [4, 3]).expect("logits");
    let targets = HostTensor::new(vec![0i64, 1, 2], [3]).expect("targets");
    let mut metrics: Vec<Box<dyn Metric>> = vec![
        Box::new(Accuracy::new()),
        Box::new(TopKAccuracy::new(2).expect("k")),
        Box::new(Precision::new()),
        Box::new(Recall::new()),
        Box::new(F1::new()),
    ];
    for m in &mut metrics {
        let err = m
            .update(&logits, &targets)
            .expect_err("3 targets for 4 rows");
        let msg = err.to_string();
        assert!(
            matches!(err, kiln_core::Error::ShapeMismatch { .. }),
            "{}: {msg}",
            m.name()
        );
        assert!(
            msg.contains("[4, 3]") && msg.contains("[3]") && msg.contains("[4]"),
            "{msg}"
        );
        assert!(msg.starts_with(m.name()), "{msg}");
        assert!(
            m.compute().is_err(),
            "{}: a failed update adds nothing",
            m.name()
        );
    }

    // The number of classes is fixed by the first batch.
    let mut p = Precision::new();
    p.update(
        &logits,
        &HostTensor::new(vec![0i64, 1, 2, 0], [4]).expect("t"),
    )
    .expect("first batch");
    let wider = HostTensor::new(vec![0.0f32; 8], [2, 4]).expect("wider");
    let err = p
        .update(&wider, &HostTensor::new(vec![0i64, 3], [2]).expect("t"))
        .expect_err("4 classes after 3");
    assert_eq!(
        err.to_string(),
        "precision: logits (earlier batches had 3 classes): expected shape [N, 3], got [2, 4]"
    );
}
