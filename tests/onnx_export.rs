//! ONNX export against ONNX Runtime: every layer case of
//! `tests/fixtures/layer_cases.json`, the models of `examples/configs/digits-cnn.toml`
//! and `digits-mlp-fused.toml` (Kiln's fused custom ops), a causal transformer
//! block and a few extra configurations are built on libtorch with a fixed seed
//! (weights perturbed off their tidy initial values, batch-norm statistics
//! included), put in eval mode and run; each is exported to ONNX and
//! `tests/reference/onnx_check.py` checks every model with `onnx.checker`
//! (full check) and runs it with onnxruntime's CPU provider, once for all cases,
//! and Kiln's own `OnnxModel` runs every file too. Every output agrees with
//! Kiln's within 1e-5; a few cases exported with batch
//! 2 also run with batch 3. Then the refusals: unmapped ops, TorchScript layers,
//! existing files, missing weights, missing directories.

#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln_testkit::noise;
use std::path::{Path, PathBuf};

use kiln::core::backend::{Backend, TrainBackend};
use kiln::core::export::{ExportError, ExportOptions};
use kiln::core::model::{CustomConfig, Init, Layer, LinearConfig, TorchScriptConfig};
use kiln::core::module::Module;
use kiln::onnx::{export_onnx, OnnxExport, OnnxModel};
use kiln::torch::{TorchBackend, TorchModel};
use kiln::{DType, Device, HostTensor, Mode, StateDict};

/// The global libtorch generator: tests in this binary build models one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("onnx-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

struct Case {
    name: String,
    spec: Layer,
    input: Vec<usize>,
    /// Integer inputs in [0, int_high) (embeddings).
    int_high: Option<usize>,
    /// Also run the export (made with batch 2) with batch 3.
    batch_check: bool,
    /// Export the weights as float64 (the graph then computes in float64).
    float64: bool,
}

fn case(name: &str, spec: Layer, input: &[usize]) -> Case {
    Case {
        name: name.to_owned(),
        spec,
        input: input.to_vec(),
        int_high: None,
        batch_check: false,
        float64: false,
    }
}

fn json_cases() -> Vec<Case> {
    // Mixtures of experts included: every expert on every token, weighted by
    // a dense table of the router's choices.
    kiln_testkit::layer_cases()
        .into_iter()
        .map(|c| Case {
            name: c.name,
            spec: serde_json::from_value(c.layer).unwrap(),
            input: c.input,
            int_high: c.int_high,
            batch_check: false,
            float64: false,
        })
        .collect()
}

/// The `[model]` of a shipped config.
fn config_model(file: &str) -> Layer {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/configs")
        .join(file);
    let table: toml::Table = toml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    table["model"].clone().try_into().unwrap()
}

/// Paths the layer-case suite does not take: adaptive pooling's other two
/// mappings, batch norm without affine or running stats on other ranks, group
/// norm on 3-d input, layer norm without bias, a transposed convolution with
/// groups and dilation, attention without biases, flatten from the batch.
fn extra_cases() -> Vec<Case> {
    let json = |v: serde_json::Value| -> Layer { serde_json::from_value(v).unwrap() };
    vec![
        case(
            "adaptive_avg_pool2d_divides",
            json(serde_json::json!({"type": "adaptive_avg_pool2d", "output_size": [2, 3]})),
            &[2, 3, 8, 9],
        ),
        case(
            "adaptive_avg_pool2d_global",
            json(serde_json::json!({"type": "adaptive_avg_pool2d", "output_size": 1})),
            &[2, 3, 5, 7],
        ),
        case(
            "adaptive_avg_pool2d_one_axis",
            json(serde_json::json!({"type": "adaptive_avg_pool2d", "output_size": [5, 3]})),
            &[2, 2, 5, 7],
        ),
        case(
            "batch_norm1d_2d_no_affine",
            json(serde_json::json!({"type": "batch_norm1d", "num_features": 5, "affine": false})),
            &[6, 5],
        ),
        case(
            "batch_norm1d_no_running_stats_affine",
            json(
                serde_json::json!({"type": "batch_norm1d", "num_features": 4,
                "track_running_stats": false}),
            ),
            &[3, 4, 7],
        ),
        case(
            "group_norm_3d_no_affine",
            json(
                serde_json::json!({"type": "group_norm", "num_groups": 3, "num_channels": 6,
                "affine": false, "eps": 1e-3}),
            ),
            &[2, 6, 5],
        ),
        case(
            "layer_norm_no_bias",
            json(serde_json::json!({"type": "layer_norm", "normalized_shape": [8], "bias": false})),
            &[3, 8],
        ),
        case(
            "conv_transpose2d_groups_dilation",
            json(
                serde_json::json!({"type": "conv_transpose2d", "in_channels": 4,
                "out_channels": 6, "kernel_size": [3, 2], "stride": [2, 3], "padding": [1, 0],
                "output_padding": [1, 2], "dilation": [2, 1], "groups": 2, "bias": false}),
            ),
            &[2, 4, 5, 4],
        ),
        case(
            "attention_no_bias",
            json(
                serde_json::json!({"type": "multi_head_self_attention", "embed_dim": 12,
                "num_heads": 3, "bias": false}),
            ),
            &[2, 5, 12],
        ),
        case(
            "flatten_from_batch",
            json(serde_json::json!({"type": "sequential", "layers": [
                {"type": "flatten", "start_dim": 0, "end_dim": 1},
                {"type": "linear", "in_features": 5, "out_features": 3}]})),
            &[2, 4, 5],
        ),
        case(
            "softmax_dim0_leaky_relu",
            json(serde_json::json!({"type": "sequential", "layers": [
                {"type": "leaky_relu", "negative_slope": 0.3},
                {"type": "softmax", "dim": 0}]})),
            &[3, 4],
        ),
    ]
}

fn cases() -> Vec<Case> {
    let mut all = json_cases();
    all.extend(extra_cases());
    all.push(case(
        "digits_cnn",
        config_model("digits-cnn.toml"),
        &[2, 1, 8, 8],
    ));
    if cfg!(feature = "ops") {
        all.push(case(
            "digits_mlp_fused",
            config_model("digits-mlp-fused.toml"),
            &[2, 64],
        ));
    }
    all.push(case(
        "transformer_encoder_block_causal",
        Layer::transformer_encoder_block(32, 4, 64, true, 0.0),
        &[2, 6, 32],
    ));
    // float64 state dicts export as float64 graphs (on operators onnxruntime
    // runs in float64), compared with Kiln's float32 outputs.
    let float64: Vec<Case> = all
        .iter()
        .filter(|c| {
            ["residual_mlp", "attention_causal", "batch_norm1d_3d_eval"].contains(&c.name.as_str())
        })
        .map(|c| Case {
            name: format!("{}_float64", c.name),
            spec: c.spec.clone(),
            float64: true,
            ..case("", Layer::Relu, &c.input)
        })
        .collect();
    all.extend(float64);
    // Exported with batch 2, also run with batch 3.
    for c in &mut all {
        if [
            "cnn",
            "transformer_block",
            "attention_causal",
            "flatten_middle",
            "flatten_from_batch",
            "embedding",
            "group_norm",
            "batch_norm2d_no_running_stats_eval",
            "digits_cnn",
            "digits_mlp_fused",
            "transformer_encoder_block_causal",
        ]
        .contains(&c.name.as_str())
        {
            c.batch_check = true;
            c.input[0] = 2;
        }
    }
    all
}

fn input_for(case: &Case, batch: usize, seed: u64) -> HostTensor {
    let mut shape = case.input.clone();
    shape[0] = batch;
    let n: usize = shape.iter().product();
    match case.int_high {
        Some(high) => HostTensor::new(kiln_testkit::noise_indices(n, high, seed), shape).unwrap(),
        None => HostTensor::new(noise(n, seed), shape).unwrap(),
    }
}

/// Every float entry moved off its initial value (ones, zeros, a tidy
/// distribution) so that every weight, bias and running statistic matters;
/// running variances stay positive.
fn perturb(model: &mut TorchModel, seed: u64) {
    let state = Module::<TorchBackend>::state_dict(model).unwrap();
    let mut moved = StateDict::new();
    for (i, (key, t)) in state.iter().enumerate() {
        if !t.dtype().is_float() {
            moved.insert(key.clone(), t.clone());
            continue;
        }
        let old = t.as_slice::<f32>().unwrap();
        let delta = noise(old.len(), seed + i as u64);
        let new: Vec<f32> = if key.ends_with("running_var") {
            old.iter()
                .zip(&delta)
                .map(|(v, d)| v * (1.0 + 0.5 * d.abs()))
                .collect()
        } else {
            old.iter().zip(&delta).map(|(v, d)| v + 0.2 * d).collect()
        };
        moved.insert(
            key.clone(),
            HostTensor::new(new, t.dims().to_vec()).unwrap(),
        );
    }
    Module::<TorchBackend>::load_state_dict(model, &moved).unwrap();
}

fn forward(model: &TorchModel, x: &HostTensor) -> HostTensor {
    let out = model
        .forward(&TorchBackend::from_host(x, Device::Cpu).unwrap())
        .unwrap();
    TorchBackend::to_host(&out).unwrap()
}

fn save(dir: &Path, file: &str, key: &str, t: &HostTensor) -> String {
    let mut sd = StateDict::new();
    sd.insert(key, t.clone());
    sd.save_safetensors(dir.join(file), &Default::default())
        .unwrap();
    file.to_owned()
}

#[test]
fn every_layer_matches_onnx_runtime() {
    let _serial = serial();
    let Some(python) = kiln_testkit::python("every_layer_matches_onnx_runtime") else {
        return;
    };
    #[cfg(feature = "ops")]
    kiln::fused_ops::register_layers().unwrap();
    let dir = scratch("layers");
    let cases = cases();
    let mut manifest = Vec::new();
    let (mut rust_diffs, mut rust_failures) = (Vec::new(), Vec::new());
    for c in &cases {
        TorchBackend::manual_seed(3);
        let mut model = TorchBackend::build_model(&c.spec, Device::Cpu).unwrap();
        perturb(&mut model, 11);
        model.set_mode(Mode::Eval);
        let file = format!("{}.onnx", c.name);
        let as_float = |t: &HostTensor| match (c.float64, t.dtype().is_float()) {
            (true, true) => t.to_dtype(DType::F64),
            _ => t.clone(),
        };
        if c.float64 {
            let state: StateDict = Module::<TorchBackend>::state_dict(&model)
                .unwrap()
                .iter()
                .map(|(k, t)| (k.clone(), as_float(t)))
                .collect();
            OnnxExport::new(&c.spec, &state, &ExportOptions::new(&c.input))
                .write(dir.join(&file))
                .unwrap_or_else(|e| panic!("{}: {e}", c.name));
        } else {
            export_onnx(&model, dir.join(&file), &ExportOptions::new(&c.input))
                .unwrap_or_else(|e| panic!("{}: {e}", c.name));
        }
        let mut batches = vec![c.input[0]];
        if c.batch_check {
            batches.push(3);
        }
        // The same file through Kiln's own ONNX Runtime binding.
        let onnx = OnnxModel::load(dir.join(&file)).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let runs: Vec<serde_json::Value> = batches
            .iter()
            .map(|&b| {
                let x = input_for(c, b, 5 + b as u64);
                let y = forward(&model, &x);
                let from_ort = onnx
                    .predict(&as_float(&x))
                    .unwrap_or_else(|e| panic!("{} at batch {b}: {e}", c.name));
                assert_eq!(from_ort.dims(), y.dims(), "{}", c.name);
                let diff = kiln_testkit::max_abs_diff(&from_ort.to_f64_vec(), &y.to_f64_vec());
                rust_diffs.push(diff);
                if diff.is_nan() || diff >= 1e-5 {
                    rust_failures.push(format!("{} at batch {b}: OnnxModel max |diff| {diff:e}", c.name));
                }
                serde_json::json!({
                    "input": save(&dir, &format!("{}-b{b}-x.safetensors", c.name), "x", &as_float(&x)),
                    "expected": save(&dir, &format!("{}-b{b}-y.safetensors", c.name), "y", &as_float(&y)),
                })
            })
            .collect();
        manifest.push(serde_json::json!({"name": c.name, "model": file, "runs": runs}));
    }
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_string_pretty(&manifest).unwrap(),
    )
    .unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/onnx_check.py");
    let stdout = kiln_testkit::run_reference(&python, &script, &[&dir]);
    let results: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();

    let mut failures = Vec::new();
    eprintln!("{:<38} {:>10} {:>12}  ops", "case", "max |diff|", "batch 3");
    for c in &cases {
        let r = &results[&c.name];
        if let Some(e) = r.get("error") {
            failures.push(format!("{}: {e}", c.name));
            eprintln!("{:<38} ERROR {e}", c.name);
            continue;
        }
        assert_eq!(r["ir_version"], 10, "{}", c.name);
        assert_eq!(r["opset"], serde_json::json!([["", 21]]), "{}", c.name);
        let diffs: Vec<f64> = serde_json::from_value(r["max_diff"].clone()).unwrap();
        assert_eq!(diffs.len(), if c.batch_check { 2 } else { 1 }, "{}", c.name);
        // Outputs of all zeros would compare equal whatever the graph computed.
        assert!(
            r["max_abs_expected"].as_f64().unwrap() > 1e-3,
            "{}: {r}",
            c.name
        );
        let ops: Vec<String> = serde_json::from_value(r["ops"].clone()).unwrap();
        eprintln!(
            "{:<38} {:>10.1e} {:>12}  {}",
            c.name,
            diffs[0],
            diffs.get(1).map_or("-".to_owned(), |d| format!("{d:.1e}")),
            ops.join(" ")
        );
        for d in diffs {
            if d.is_nan() || d >= 1e-5 {
                failures.push(format!("{}: max |diff| {d:e}", c.name));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    eprintln!(
        "OnnxModel (Kiln's ONNX Runtime binding) on the same files: {} runs, worst max |diff| {:.1e}",
        rust_diffs.len(),
        rust_diffs.iter().copied().fold(0.0, f64::max)
    );
    assert!(rust_failures.is_empty(), "{rust_failures:#?}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn linear_model() -> TorchModel {
    TorchBackend::manual_seed(1);
    let spec = Layer::sequential([LinearConfig::new(4, 3).into(), Layer::Relu]);
    TorchBackend::build_model(&spec, Device::Cpu).unwrap()
}

#[test]
fn a_user_op_without_a_mapping_is_unsupported_naming_it() {
    let spec = Layer::sequential([
        LinearConfig::new(4, 4).into(),
        Layer::residual(
            CustomConfig::new("acme::wiggle")
                .with_param("k", [4], Init::Ones)
                .into(),
        ),
    ]);
    let mut state = StateDict::new();
    state.insert("0.weight", HostTensor::zeros(DType::F32, [4, 4]).unwrap());
    state.insert("0.bias", HostTensor::zeros(DType::F32, [4]).unwrap());
    state.insert("1.block.k", HostTensor::zeros(DType::F32, [4]).unwrap());
    let err = OnnxExport::new(&spec, &state, &ExportOptions::new(&[2, 4]))
        .to_model()
        .unwrap_err();
    assert!(
        matches!(&err, ExportError::Unsupported { path, layer, .. }
            if path == "1.block" && layer == "Custom(acme::wiggle)"),
        "{err}"
    );
    assert!(err.to_string().contains("acme::wiggle"), "{err}");
    assert!(
        err.to_string()
            .contains("kiln_onnx::register_onnx_lowering"),
        "{err}"
    );
}

#[test]
fn a_torchscript_layer_is_unsupported() {
    let spec = Layer::sequential([
        TorchScriptConfig::new("backbone.pt")
            .frozen()
            .with_output_shape([16])
            .into(),
        LinearConfig::new(16, 2).into(),
    ]);
    let state = StateDict::new();
    let err = OnnxExport::new(&spec, &state, &ExportOptions::new(&[1, 3, 8, 8]))
        .to_model()
        .unwrap_err();
    assert!(
        matches!(&err, ExportError::Unsupported { path, layer, .. } if path == "0" && layer == "TorchScript"),
        "{err}"
    );
    assert!(err.to_string().contains("backbone.pt"), "{err}");
}

#[test]
fn an_existing_file_is_left_alone_unless_overwrite_is_asked() {
    let _serial = serial();
    let dir = scratch("exists");
    let model = linear_model();
    let path = dir.join("model.onnx");
    std::fs::write(&path, b"precious").unwrap();
    let err = export_onnx(&model, &path, &ExportOptions::new(&[1, 4])).unwrap_err();
    assert!(
        matches!(&err, ExportError::Exists { path: p } if *p == path),
        "{err}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), b"precious");
    // `?` in a function returning kiln's Result keeps the kind and the message.
    let as_kiln =
        || -> kiln::Result<()> { Ok(export_onnx(&model, &path, &ExportOptions::new(&[1, 4]))?) };
    match as_kiln().unwrap_err() {
        kiln::Error::Export(e) => {
            assert!(
                matches!(&*e, ExportError::Exists { path: p } if *p == path),
                "{e}"
            );
            assert!(e.to_string().contains("--overwrite"), "{e}");
        }
        other => panic!("expected Error::Export, got {other:?}"),
    }
    assert_eq!(std::fs::read(&path).unwrap(), b"precious");

    let state = Module::<TorchBackend>::state_dict(&model).unwrap();
    let export = OnnxExport::new(
        kiln::core::model::Definition::definition(&model),
        &state,
        &ExportOptions::new(&[1, 4]),
    );
    assert!(matches!(
        export.write(&path),
        Err(ExportError::Exists { .. })
    ));
    let replacing = ExportOptions::new(&[1, 4]).with_overwrite(true);
    OnnxExport::new(
        kiln::core::model::Definition::definition(&model),
        &state,
        &replacing,
    )
    .write(&path)
    .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), export.to_bytes().unwrap());
    // Nothing but the model is left in the directory (no temporary files).
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["model.onnx"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_missing_weight_is_a_typed_error_and_nothing_is_written() {
    let _serial = serial();
    let dir = scratch("missing");
    let model = linear_model();
    let mut state = Module::<TorchBackend>::state_dict(&model).unwrap();
    state.remove("0.bias");
    let path = dir.join("model.onnx");
    let spec = kiln::core::model::Definition::definition(&model);
    let err = OnnxExport::new(spec, &state, &ExportOptions::new(&[1, 4]))
        .write(&path)
        .unwrap_err();
    match &err {
        ExportError::Weight {
            path, layer, key, ..
        } => {
            assert_eq!(
                (path.as_str(), layer.as_str(), key.as_str()),
                ("0", "Linear", "0.bias")
            )
        }
        other => panic!("{other}"),
    }
    assert_eq!(
        err.to_string(),
        "0 (Linear): state dict entry `0.bias` is missing (the state dict has 1 entries)"
    );
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "nothing written"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_missing_directory_is_a_typed_error() {
    let _serial = serial();
    let model = linear_model();
    let path = scratch("parent").join("no/such/dir/model.onnx");
    let err = export_onnx(&model, &path, &ExportOptions::new(&[1, 4])).unwrap_err();
    assert!(
        matches!(&err, ExportError::MissingParent { path: p } if *p == path),
        "{err}"
    );
    assert!(!path.exists());
}
