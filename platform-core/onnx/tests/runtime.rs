//! `OnnxModel` and `ModelInfo` against Python: `tests/reference/onnx_models.py`
//! builds ONNX models with `onnx.helper` (an MLP with a dynamic batch, an
//! int64 embedding lookup, a model of two inputs and two outputs in float64
//! and int32, a float16 model, a bool model), runs them with Python
//! onnxruntime and prints what the files declare; Kiln's outputs must equal
//! Python's (within 1e-6, bitwise expected) at batch sizes 3 and 17, bad
//! inputs must give typed errors before ONNX Runtime runs, and `ModelInfo`
//! must agree with the `onnx` package.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kiln_core::{state_dict::StateDict, DType, HostTensor};
use kiln_onnx::{Dim, Error, ModelInfo, OnnxModel, OptimizationLevel};
use serde_json::Value;

/// The reference directory and the script's JSON report, made once per test binary.
struct Fixtures {
    dir: PathBuf,
    report: Value,
    data: StateDict,
}

fn fixtures(test: &str) -> Option<&'static Fixtures> {
    static FIXTURES: OnceLock<Option<Fixtures>> = OnceLock::new();
    FIXTURES
        .get_or_init(|| {
            let python = kiln_testkit::python(test)?;
            let dir = kiln_testkit::scratch_dir(
                Path::new(env!("CARGO_TARGET_TMPDIR")),
                "onnx-runtime-models",
            );
            let out = kiln_testkit::run_reference_script!(&python, "onnx_models.py", &[&dir]);
            let report: Value = serde_json::from_str(&out).unwrap();
            let (data, _) = StateDict::load_safetensors(dir.join("data.safetensors")).unwrap();
            Some(Fixtures { dir, report, data })
        })
        .as_ref()
}

impl Fixtures {
    fn model(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.onnx"))
    }

    fn tensor(&self, key: &str) -> HostTensor {
        self.data
            .get(key)
            .unwrap_or_else(|| panic!("no {key} in data.safetensors"))
            .clone()
    }
}

/// Largest absolute difference and whether every element is bitwise equal
/// (compared as f64, which every dtype here converts to exactly).
fn compare(what: &str, actual: &HostTensor, expected: &HostTensor) -> (f64, bool) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape");
    let a = actual.to_f64_vec();
    let e = expected.to_f64_vec();
    let mut max = 0.0f64;
    let mut bitwise = true;
    for (x, y) in a.iter().zip(&e) {
        assert!(!x.is_nan() && !y.is_nan(), "{what}: NaN");
        max = max.max((x - y).abs());
        bitwise &= x.to_bits() == y.to_bits();
    }
    (max, bitwise)
}

/// Named values with their Kiln dtypes.
type Values = &'static [(&'static str, DType)];

/// (model, inputs, outputs).
const CASES: &[(&str, Values, Values)] = &[
    ("mlp", &[("x", DType::F32)], &[("y", DType::F32)]),
    ("embed", &[("ids", DType::I64)], &[("emb", DType::F32)]),
    (
        "two_io",
        &[("a", DType::F64), ("k", DType::I32)],
        &[("s", DType::F64), ("m", DType::I32)],
    ),
    (
        "half",
        &[("h", DType::F16)],
        &[("sq", DType::F16), ("f", DType::F32)],
    ),
];

fn check_against_python(fx: &Fixtures, model: &OnnxModel, name: &str, label: &str) -> f64 {
    let (_, ins, outs) = CASES.iter().find(|c| c.0 == name).unwrap();
    let mut worst = 0.0f64;
    for case in ["b3", "b17"] {
        let inputs: Vec<(&str, HostTensor)> = ins
            .iter()
            .map(|(n, d)| (*n, fx.tensor(&format!("{name}.{n}.{case}")).to_dtype(*d)))
            .collect();
        // Named inputs in reverse order: run must place them by name.
        let named: Vec<(&str, &HostTensor)> = inputs.iter().rev().map(|(n, t)| (*n, t)).collect();
        let got = model.run(&named).unwrap();
        assert_eq!(
            got.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
            outs.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
            "{name}: outputs in model order"
        );
        for ((out_name, t), (_, dtype)) in got.iter().zip(outs.iter()) {
            assert_eq!(t.dtype(), *dtype, "{name}.{out_name}: dtype");
            let expected = fx.tensor(&format!("{name}.{out_name}.{case}"));
            let (max, bitwise) = compare(&format!("{name}.{out_name}.{case}"), t, &expected);
            eprintln!(
                "{label} {name}.{out_name} {case}: max |diff| vs Python onnxruntime {max:e}, bitwise equal: {bitwise}"
            );
            assert!(max <= 1e-6, "{name}.{out_name} {case}: max diff {max:e}");
            worst = worst.max(max);
        }
        if inputs.len() == 1 {
            let y = model.predict(&inputs[0].1).unwrap();
            assert_eq!(&y, &got[0].1, "{name}: predict is run's first output");
        }
    }
    worst
}

#[test]
fn outputs_match_python_onnxruntime() {
    let Some(fx) = fixtures("outputs_match_python_onnxruntime") else {
        return;
    };
    eprintln!(
        "Python onnxruntime {}",
        fx.report["onnxruntime_version"].as_str().unwrap()
    );
    for (name, _, _) in CASES {
        let model = OnnxModel::load(fx.model(name)).unwrap();
        check_against_python(fx, &model, name, "default");
    }
}

#[test]
fn builder_options_give_the_same_numbers() {
    let Some(fx) = fixtures("builder_options_give_the_same_numbers") else {
        return;
    };
    for level in [OptimizationLevel::Disable, OptimizationLevel::Basic] {
        let model = OnnxModel::builder()
            .intra_threads(1)
            .inter_threads(2)
            .optimization_level(level)
            .load(fx.model("mlp"))
            .unwrap();
        check_against_python(fx, &model, "mlp", &format!("{level:?}"));
    }
}

#[test]
fn one_model_serves_threads() {
    let Some(fx) = fixtures("one_model_serves_threads") else {
        return;
    };
    let model = OnnxModel::load(fx.model("mlp")).unwrap();
    let x = fx.tensor("mlp.x.b17");
    let expected = fx.tensor("mlp.y.b17");
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..20 {
                    let y = model.predict(&x).unwrap();
                    assert!(compare("mlp.y", &y, &expected).0 <= 1e-6);
                }
            });
        }
    });
}

fn input_error(r: kiln_onnx::Result<impl std::fmt::Debug>) -> (String, String) {
    match r {
        Err(Error::Input { name, reason }) => (name, reason),
        other => panic!("expected Error::Input, got {other:?}"),
    }
}

#[test]
fn bad_inputs_give_typed_errors() {
    let Some(fx) = fixtures("bad_inputs_give_typed_errors") else {
        return;
    };
    let mlp = OnnxModel::load(fx.model("mlp")).unwrap();
    let x = fx.tensor("mlp.x.b3");

    let (name, reason) = input_error(mlp.run(&[("input", &x)]));
    assert_eq!(name, "input");
    assert!(reason.contains("'x' (float32 [batch, 4])"), "{reason}");

    let (name, reason) = input_error(mlp.run(&[]));
    assert_eq!(name, "x");
    assert!(reason.starts_with("missing"), "{reason}");

    let (_, reason) = input_error(mlp.predict(&x.to_dtype(DType::F64)));
    assert_eq!(reason, "dtype is float64, the model expects float32");

    let (_, reason) = input_error(mlp.predict(&x.clone().reshape([3, 4, 1]).unwrap()));
    assert!(reason.starts_with("rank is 3"), "{reason}");

    let x7 = HostTensor::zeros(DType::F32, [3, 7]).unwrap();
    let (_, reason) = input_error(mlp.predict(&x7));
    assert!(
        reason.starts_with("dimension 1 is 7, the model expects 4"),
        "{reason}"
    );

    let two = OnnxModel::load(fx.model("two_io")).unwrap();
    let a = fx.tensor("two_io.a.b3");
    let k = fx.tensor("two_io.k.b17");
    let (name, reason) = input_error(two.run(&[("a", &a)]));
    assert_eq!(name, "k");
    assert!(reason.starts_with("missing"), "{reason}");
    let (name, reason) = input_error(two.run(&[("a", &a), ("k", &k)]));
    assert_eq!(name, "k");
    assert!(
        reason.contains("dimension 0 ('n') is 17, but input 'a' set 'n' to 3"),
        "{reason}"
    );
    let (_, reason) = input_error(two.predict(&a));
    assert!(reason.contains("exactly one input"), "{reason}");

    // bool: a dtype Kiln's tensors lack.
    let boolean = OnnxModel::load(fx.model("bool")).unwrap();
    assert_eq!(boolean.inputs()[0].dtype, None);
    let mask = HostTensor::zeros(DType::U8, [4]).unwrap();
    let (_, reason) = input_error(boolean.predict(&mask));
    assert!(reason.contains("bool"), "{reason}");
}

fn dims_from_json(v: &Value) -> Vec<Dim> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|d| match d {
            Value::Number(n) => Dim::Fixed(n.as_u64().unwrap() as usize),
            Value::String(s) => Dim::Symbolic(s.clone()),
            _ => Dim::Unknown,
        })
        .collect()
}

#[test]
fn model_info_agrees_with_the_onnx_package() {
    let Some(fx) = fixtures("model_info_agrees_with_the_onnx_package") else {
        return;
    };
    for name in ["mlp", "embed", "two_io", "half", "bool"] {
        let expected = &fx.report[name];
        let info = ModelInfo::read(fx.model(name)).unwrap();
        assert_eq!(info.ir_version, expected["ir_version"].as_i64().unwrap());
        let opsets: Vec<(String, i64)> = info
            .opsets
            .iter()
            .map(|o| (o.domain.clone(), o.version))
            .collect();
        let expected_opsets: Vec<(String, i64)> = expected["opsets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| (o[0].as_str().unwrap().to_string(), o[1].as_i64().unwrap()))
            .collect();
        assert_eq!(opsets, expected_opsets, "{name}: opsets");
        assert_eq!(info.producer_name, expected["producer_name"]);
        assert_eq!(info.producer_version, expected["producer_version"]);
        assert_eq!(info.graph_name, expected["graph_name"]);
        for (what, actual, listed) in [
            ("inputs", &info.inputs, &expected["inputs"]),
            ("outputs", &info.outputs, &expected["outputs"]),
        ] {
            let listed = listed.as_array().unwrap();
            assert_eq!(actual.len(), listed.len(), "{name}: {what}");
            for (t, e) in actual.iter().zip(listed) {
                assert_eq!(t.name, e["name"].as_str().unwrap(), "{name}: {what}");
                assert_eq!(
                    t.dtype.map(|d| d.name()),
                    e["dtype"].as_str(),
                    "{name}.{}: dtype",
                    t.name
                );
                assert_eq!(t.type_name, e["type_name"].as_str().unwrap());
                assert!(t.ranked);
                assert_eq!(t.shape, dims_from_json(&e["shape"]), "{name}.{}", t.name);
            }
        }
        assert_eq!(
            info.node_count as u64,
            expected["node_count"].as_u64().unwrap()
        );
        let ops: serde_json::Map<String, Value> = info
            .op_types
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(*v)))
            .collect();
        assert_eq!(
            &Value::Object(ops),
            &expected["op_types"],
            "{name}: op types"
        );
        assert_eq!(
            info.initializer_count as u64,
            expected["initializer_count"].as_u64().unwrap()
        );
        assert_eq!(
            info.parameter_count,
            expected["parameter_count"].as_u64().unwrap()
        );
        let model = OnnxModel::load(fx.model(name)).unwrap();
        assert_eq!(model.inputs(), info.inputs.as_slice());
        assert_eq!(model.outputs(), info.outputs.as_slice());
    }
    let text = ModelInfo::read(fx.model("mlp")).unwrap().to_string();
    eprintln!("{text}");
    for line in [
        "IR version 10, opsets: ai.onnx 21",
        "producer: kiln-onnx-tests 1.0",
        "x: float32 [batch, 4]",
        "y: float32 [batch, 3]",
        "nodes: 3 (Gemm x2, Relu x1)",
        "initializers: 4 (67 parameters)",
    ] {
        assert!(text.contains(line), "missing '{line}' in:\n{text}");
    }
}

#[test]
fn bad_files_give_invalid_model_or_io() {
    let Some(fx) = fixtures("bad_files_give_invalid_model_or_io") else {
        return;
    };
    let good = std::fs::read(fx.model("mlp")).unwrap();
    let dir = kiln_testkit::TempDir::new("onnx-bad-files");
    let truncated = dir.path().join("truncated.onnx");
    std::fs::write(&truncated, &good[..good.len() / 2]).unwrap();
    let empty = dir.path().join("empty.onnx");
    std::fs::write(&empty, b"").unwrap();
    let text = dir.path().join("notes.onnx");
    std::fs::write(
        &text,
        "ir_version: 10\ngraph { name: \"not binary protobuf\" }\n",
    )
    .unwrap();
    for (path, what) in [
        (&truncated, "truncated"),
        (&empty, "empty"),
        (&text, "text"),
    ] {
        for err in [
            ModelInfo::read(path).unwrap_err(),
            OnnxModel::load(path).unwrap_err(),
        ] {
            match &err {
                Error::InvalidModel { path: p, reason } => {
                    assert_eq!(p, path, "{what}");
                    eprintln!("{what}: {err}");
                    assert!(!reason.is_empty());
                }
                other => panic!("{what}: expected InvalidModel, got {other:?}"),
            }
        }
    }
    let missing = dir.path().join("missing.onnx");
    for err in [
        ModelInfo::read(&missing).unwrap_err(),
        OnnxModel::load(&missing).unwrap_err(),
    ] {
        assert!(
            matches!(&err, Error::Io { path, .. } if path == &missing),
            "expected Io, got {err:?}"
        );
    }
    // Every truncation of a real model: InvalidModel or (cut after the
    // required fields) a readable model, never a panic.
    for n in 0..good.len() {
        match ModelInfo::from_bytes(&good[..n], "cut.onnx") {
            Ok(_) | Err(Error::InvalidModel { .. }) => {}
            Err(e) => panic!("cut at {n}: {e}"),
        }
    }
}

#[test]
fn onnxruntime_refuses_ir_14_with_a_hint() {
    let Some(fx) = fixtures("onnxruntime_refuses_ir_14_with_a_hint") else {
        return;
    };
    let path = fx.model("ir14");
    assert_eq!(ModelInfo::read(&path).unwrap().ir_version, 14);
    match OnnxModel::load(&path) {
        Err(Error::Runtime(msg)) => {
            eprintln!("{msg}");
            assert!(msg.contains("reads 13 at most"), "{msg}");
        }
        other => panic!("expected Error::Runtime, got {other:?}"),
    }
}

#[test]
fn time_predict_reports_latency_and_throughput() {
    let Some(fx) = fixtures("time_predict_reports_latency_and_throughput") else {
        return;
    };
    let model = OnnxModel::load(fx.model("mlp")).unwrap();
    let x = fx.tensor("mlp.x.b17");
    let t = model.time_predict(&x, 3, 9).unwrap();
    assert_eq!((t.batch, t.warmup, t.runs), (17, 3, 9));
    assert!(
        t.min_s > 0.0 && t.min_s <= t.median_s && t.median_s <= t.p90_s,
        "{t:?}"
    );
    assert!((t.samples_per_s - 17.0 / t.median_s).abs() < 1e-6 * t.samples_per_s);
    assert!(matches!(
        model.time_predict(&x, 0, 0),
        Err(Error::Input { .. })
    ));
}
