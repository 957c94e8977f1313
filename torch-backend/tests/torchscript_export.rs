//! `export_torchscript`: every case of `tests/fixtures/layer_cases.json`, the
//! model of `examples/configs/digits-cnn.toml`, a causal transformer block with
//! dropout, and models around a TorchScript backbone (once, and twice in one
//! model), exported and checked by Python PyTorch alone in one run
//! (`tests/reference/torchscript_export_check.py`): state-dict keys in PyTorch's
//! order and bitwise values, eval outputs within 1e-6, train-mode batch norm
//! updating the running statistics as Kiln's forward does, and one SGD step
//! that reaches every trainable parameter. In Rust, `ScriptModule::load` of
//! each file gives Kiln's outputs bitwise and its state dict, and trains with
//! Kiln's SGD (dropout, batch norm) exactly as the model does; a batch norm
//! pinned to eval stays pinned; a model on CUDA (when there is one) exports
//! from the CPU copy. Bad requests (an op Python cannot run, an existing file,
//! a missing directory) are typed errors that leave the disk as it was.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

mod common;

use kiln_testkit::noise;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use kiln_core::{
    backend::{Backend, Mode},
    export::{ExportError, ExportOptions},
    model::{CustomConfig, Init, Layer, LinearConfig, TorchScriptConfig},
    module::Module,
    state_dict::StateDict,
    Device, HostTensor,
};
use kiln_torch::{export_torchscript, from_tch, to_tch, ScriptModule, TorchBackend, TorchModel};

/// libtorch's generator is global: the tests of this binary run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

struct Case {
    name: String,
    spec: Layer,
    input: Vec<usize>,
    /// Indices below this bound for int64 inputs; `None` for float inputs.
    int_high: Option<usize>,
    /// The mode the model is in at export (the file's `training` flag).
    train: bool,
}

/// Every case of the layer suite shared by the parity tests.
fn layer_cases() -> Vec<Case> {
    kiln_testkit::layer_cases()
        .into_iter()
        .map(|c| Case {
            name: c.name,
            spec: serde_json::from_value(c.layer).unwrap(),
            input: c.input,
            int_high: c.int_high,
            train: c.train,
        })
        .collect()
}

/// The `[model]` table of the shipped digits CNN config, read as the CLI reads it.
fn digits_cnn() -> Case {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/configs/digits-cnn.toml");
    let table: toml::Table = toml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let spec: Layer = table["model"].clone().try_into().unwrap();
    Case {
        name: "digits_cnn".to_owned(),
        spec,
        input: vec![6, 1, 8, 8],
        int_high: None,
        train: true,
    }
}

fn transformer_block() -> Case {
    Case {
        name: "transformer_encoder_block".to_owned(),
        spec: Layer::transformer_encoder_block(32, 4, 64, true, 0.1),
        input: vec![3, 6, 32],
        int_high: None,
        train: false,
    }
}

/// A frozen TorchScript backbone (Linear, BatchNorm1d, Linear, scripted by
/// `torchscript_models.py`) under a trainable head.
fn backbone_case(backbone: &Path) -> Case {
    Case {
        name: "torchscript_backbone".to_owned(),
        spec: Layer::sequential([
            TorchScriptConfig::new(backbone).frozen().into(),
            Layer::Relu,
            LinearConfig::new(3, 2).into(),
        ]),
        input: vec![6, 4],
        int_high: None,
        train: true,
    }
}

/// The same TorchScript file twice, trainable then frozen, around a Linear:
/// two modules of distinct types under one class name.
fn two_backbones_case(backbone: &Path) -> Case {
    Case {
        name: "two_torchscript_backbones".to_owned(),
        spec: Layer::sequential([
            TorchScriptConfig::new(backbone).into(),
            LinearConfig::new(3, 4).into(),
            TorchScriptConfig::new(backbone).frozen().into(),
        ]),
        input: vec![5, 4],
        int_high: None,
        train: false,
    }
}

fn input(case: &Case, seed: u64) -> HostTensor {
    let n: usize = case.input.iter().product();
    match case.int_high {
        Some(high) => HostTensor::new(
            kiln_testkit::noise_indices(n, high, seed),
            case.input.clone(),
        )
        .unwrap(),
        None => HostTensor::new(noise(n, seed), case.input.clone()).unwrap(),
    }
}

/// The state-dict keys in PyTorch's order: each layer's own, in
/// `parameter_specs` order; a TorchScript layer's as `[path, file]`, which the
/// script expands from the file itself.
fn expected_keys(layer: &Layer, path: &str, out: &mut Vec<serde_json::Value>) {
    let join = |name: &str| {
        if path.is_empty() {
            name.to_owned()
        } else {
            format!("{path}.{name}")
        }
    };
    match layer {
        Layer::Sequential { layers } => {
            for (i, child) in layers.iter().enumerate() {
                expected_keys(child, &join(&i.to_string()), out);
            }
        }
        Layer::Residual { block } => expected_keys(block, &join("block"), out),
        Layer::TorchScript(config) => out.push(serde_json::json!([path, config.path])),
        // The shared weight, held again by the projection's module.
        Layer::TiedLinear(_) => out.push(serde_json::Value::String(join("weight"))),
        leaf => out.extend(
            leaf.parameter_specs(path)
                .unwrap()
                .into_iter()
                .map(|s| serde_json::Value::String(s.name)),
        ),
    }
}

/// Whether a train-mode forward is deterministic (no dropout that draws).
fn deterministic_in_training(spec: &Layer) -> bool {
    spec.layers().iter().all(|(_, layer)| match layer {
        Layer::Dropout { p } => *p == 0.0,
        Layer::MultiHeadSelfAttention(c) => c.dropout == 0.0,
        _ => true,
    })
}

fn forward(model: &impl Module<TorchBackend>, x: &HostTensor) -> HostTensor {
    let x = to_tch(x, Device::Cpu).unwrap();
    from_tch(&tch::no_grad(|| model.forward(&x)).unwrap()).unwrap()
}

/// `state` with a tied projection's weight also under the projection's name,
/// as its exported module holds the shared tensor.
fn with_tied(spec: &Layer, state: &StateDict) -> StateDict {
    let mut out = state.clone();
    for (path, layer) in spec.layers() {
        if let Layer::TiedLinear(c) = layer {
            let shared = state.get(&c.weight).unwrap().clone();
            out.insert(format!("{path}.weight"), shared);
        }
    }
    out
}

/// Exports one case and checks it in Rust; returns its manifest entry for the
/// Python check.
fn export_case(case: &Case, dir: &Path) -> serde_json::Value {
    let name = &case.name;
    // Seeded by the name, so that a case added to the suite changes no
    // other case's weights or batch.
    let index = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    }) % 10_000;
    TorchBackend::manual_seed(100 + index);
    let mut model = TorchModel::new(&case.spec, Device::Cpu).unwrap();
    model.set_mode(if case.train { Mode::Train } else { Mode::Eval });
    let file = dir.join(format!("{name}.pt"));
    export_torchscript(&model, &file, &ExportOptions::default()).unwrap();

    let exported_state = model.state_dict().unwrap();
    let x = input(case, 7 + index);
    model.set_mode(Mode::Eval);
    let y_eval = forward(&model, &x);

    // Kiln reads its export back: the same numbers, bit for bit.
    let mut script = ScriptModule::load(&file, Device::Cpu).unwrap();
    let expected_state = with_tied(&case.spec, &exported_state);
    assert_eq!(
        script.state_dict().unwrap(),
        expected_state,
        "{name}: state dict of the reloaded export"
    );
    script.set_mode(Mode::Eval);
    assert_eq!(
        forward(&script, &x),
        y_eval,
        "{name}: ScriptModule output of the export"
    );

    model.set_mode(Mode::Train);
    let y_train = forward(&model, &x);
    let after = model.state_dict().unwrap();

    let mut io = StateDict::new();
    io.insert("x", x);
    io.insert("y_eval", y_eval);
    if deterministic_in_training(&case.spec) {
        io.insert("y_train", y_train);
    }
    for (key, value) in expected_state.iter() {
        io.insert(format!("state.{key}"), value.clone());
    }
    for (key, value) in with_tied(&case.spec, &after).iter() {
        io.insert(format!("after.{key}"), value.clone());
    }
    let io_path = dir.join(format!("{name}.io.safetensors"));
    io.save_safetensors(&io_path, &Default::default()).unwrap();

    let mut keys = Vec::new();
    expected_keys(&case.spec, "", &mut keys);
    let mut trainable: Vec<String> = model
        .named_parameters()
        .unwrap()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .map(|(n, _)| n)
        .collect();
    // TorchScript lists a shared parameter under each module that holds it.
    for (path, layer) in case.spec.layers() {
        if matches!(layer, Layer::TiedLinear(_)) {
            trainable.push(format!("{path}.weight"));
        }
    }
    serde_json::json!({
        "name": name,
        "file": file,
        "io": io_path,
        "training": case.train,
        "keys": keys,
        "trainable": trainable,
    })
}

#[test]
fn every_layer_case_exports_and_python_runs_and_trains_it() {
    let test = "every_layer_case_exports_and_python_runs_and_trains_it";
    let _guard = serial();
    let Some(python) = common::python(test) else {
        return;
    };
    let dir = common::scratch_dir("torchscript-export");
    common::make_fixtures(&python, "torchscript_models.py", &dir);

    let cases = layer_cases();
    assert_eq!(cases.len(), 68, "the layer suite");
    // The two mixture-of-experts cases export too (each expert a submodule).
    assert_eq!(
        cases
            .iter()
            .filter(|c| matches!(c.spec, Layer::SparseMoe(_)))
            .count(),
        2,
        "the mixture-of-experts cases"
    );
    let mut cases = cases;
    cases.push(digits_cnn());
    cases.push(transformer_block());
    cases.push(backbone_case(&dir.join("mlp_bn.pt")));
    cases.push(two_backbones_case(&dir.join("mlp_bn.pt")));
    let manifest: Vec<serde_json::Value> =
        cases.iter().map(|case| export_case(case, &dir)).collect();
    let manifest_path = common::write_json(&dir, "manifest.json", &manifest);
    let results_path = dir.join("results.json");
    common::run_reference(
        &python,
        "torchscript_export_check.py",
        &[manifest_path.as_path(), results_path.as_path()],
    );

    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&results_path).unwrap()).unwrap();
    let mut worst = std::collections::BTreeMap::<&str, (f64, String)>::new();
    for case in &cases {
        let result = &results[case.name.as_str()];
        assert!(result.is_object(), "{}: no result", case.name);
        for (measure, limit) in [
            ("state", 0.0),
            ("eval_output", 1e-6),
            ("train_output", 1e-6),
            ("train_buffers", 1e-6),
        ] {
            let Some(diff) = result[measure].as_f64() else {
                assert_ne!(measure, "eval_output", "{}: no eval output", case.name);
                continue;
            };
            assert!(
                diff <= limit,
                "{}: {measure} differs from Kiln's by {diff:e} (limit {limit:e})",
                case.name
            );
            let entry = worst.entry(measure).or_insert((0.0, String::new()));
            if diff > entry.0 || entry.1.is_empty() {
                *entry = (diff, case.name.clone());
            }
        }
    }
    // The running statistics moved in training (in Python as in Kiln): the
    // comparison above is not between two unchanged copies.
    let with_batch_norm: Vec<&str> = cases
        .iter()
        .map(|c| c.name.as_str())
        .filter(|name| results[*name]["buffers"].as_u64() > Some(0))
        .collect();
    assert_eq!(with_batch_norm.len(), 8, "{with_batch_norm:?}");
    for name in &with_batch_norm {
        let moved = results[*name]["train_buffers_moved"].as_f64().unwrap();
        assert!(moved > 1e-3, "{name}: running statistics moved by {moved}");
    }
    eprintln!(
        "torchscript export, {} cases; largest differences from Kiln: {worst:?}",
        cases.len()
    );

    // A TorchScript layer with two inputs and a tuple out cannot be a layer
    // of the exported module: a typed error naming it and its forward.
    let spec = Layer::sequential([TorchScriptConfig::new(dir.join("multi_io.pt")).into()]);
    let model = TorchModel::new(&spec, Device::Cpu).unwrap();
    let err = export_torchscript(
        &model,
        dir.join("multi_io_export.pt"),
        &ExportOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(err, ExportError::Unsupported { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("0 (TorchScript)"), "{text}");
    assert!(text.contains("Tensor a, Tensor b"), "{text}");
    assert!(!dir.join("multi_io_export.pt").exists());
}

#[test]
fn an_op_python_cannot_run_is_a_typed_error_and_nothing_is_written() {
    let _guard = serial();
    kiln_torch::register_custom_layer("user::scale", |x, params, _| {
        x.f_mul(params[0])
            .map_err(|e| kiln_torch::torch_error("user::scale", e))
    });
    let spec = Layer::sequential([
        LinearConfig::new(3, 3).into(),
        Layer::residual(Layer::sequential([
            Layer::Tanh,
            CustomConfig::new("user::scale")
                .with_param("s", [3], Init::Ones)
                .into(),
        ])),
    ]);
    let model = TorchModel::new(&spec, Device::Cpu).unwrap();
    let dir = common::scratch_dir("torchscript-export-custom");
    let file = dir.join("model.pt");
    let err = export_torchscript(&model, &file, &ExportOptions::default()).unwrap_err();
    assert!(matches!(err, ExportError::Unsupported { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("1.block.1 (Custom(user::scale))"), "{text}");
    assert!(text.contains("user::scale"), "{text}");
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "files left in {dir:?}"
    );
}

fn small_model() -> TorchModel {
    TorchModel::new(
        &Layer::sequential([LinearConfig::new(4, 2).into(), Layer::Sigmoid]),
        Device::Cpu,
    )
    .unwrap()
}

fn dir_entries(dir: &Path) -> Vec<PathBuf> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    entries
}

#[test]
fn an_existing_file_is_kept_unless_overwrite_is_asked_for() {
    let _guard = serial();
    let dir = common::scratch_dir("torchscript-export-overwrite");
    let file = dir.join("model.pt");
    std::fs::write(&file, b"the user's bytes").unwrap();
    let model = small_model();

    let err = export_torchscript(&model, &file, &ExportOptions::default()).unwrap_err();
    match &err {
        ExportError::Exists { path } => assert_eq!(path, &file),
        other => panic!("expected Exists, got {other}"),
    }
    assert!(err.to_string().contains("overwrite"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"the user's bytes");
    assert_eq!(dir_entries(&dir), vec![file.clone()], "no temporary left");

    export_torchscript(
        &model,
        &file,
        &ExportOptions::default().with_overwrite(true),
    )
    .unwrap();
    let reloaded = ScriptModule::load(&file, Device::Cpu).unwrap();
    assert_eq!(reloaded.state_dict().unwrap(), model.state_dict().unwrap());
    assert_eq!(dir_entries(&dir), vec![file.clone()], "no temporary left");

    // The same model gives the same bytes.
    let first = std::fs::read(&file).unwrap();
    export_torchscript(
        &model,
        &file,
        &ExportOptions::default().with_overwrite(true),
    )
    .unwrap();
    assert!(
        std::fs::read(&file).unwrap() == first,
        "a second export differs"
    );

    // A missing directory, and a directory in the file's place.
    let err = export_torchscript(
        &model,
        dir.join("missing/model.pt"),
        &ExportOptions::default().with_overwrite(true),
    )
    .unwrap_err();
    assert!(matches!(&err, ExportError::MissingParent { .. }), "{err}");
    let err = export_torchscript(&model, &dir, &ExportOptions::default().with_overwrite(true))
        .unwrap_err();
    assert!(matches!(err, ExportError::NotReplaceable { .. }), "{err}");
    assert_eq!(dir_entries(&dir), vec![file], "nothing else written");
}

#[test]
fn an_export_reads_back_as_a_torchscript_layer() {
    let _guard = serial();
    let dir = common::scratch_dir("torchscript-export-flag");
    TorchBackend::manual_seed(3);
    let mut model = small_model();
    model.set_mode(Mode::Eval);
    let file = dir.join("eval.pt");
    export_torchscript(&model, &file, &ExportOptions::default()).unwrap();

    // The export is itself a TorchScript layer of a new Kiln model, whose
    // names are the exported ones under the layer's path.
    let wrapped = TorchModel::new(
        &Layer::sequential([TorchScriptConfig::new(&file).into(), Layer::Relu]),
        Device::Cpu,
    )
    .unwrap();
    let names: Vec<String> = wrapped.state_dict().unwrap().keys().cloned().collect();
    assert_eq!(names, ["0.0.bias", "0.0.weight"]);
    let x = HostTensor::new(noise(8, 1), [2, 4]).unwrap();
    let mut wrapped = wrapped;
    wrapped.set_mode(Mode::Eval);
    let ours = forward(&model, &x).to_f64_vec();
    let theirs = forward(&wrapped, &x).to_f64_vec();
    assert_eq!(ours, theirs);
}

#[test]
fn a_frozen_batch_norm_pinned_to_eval_stays_so_in_the_export() {
    use kiln_core::model::BatchNormConfig;
    use kiln_torch::Freeze;

    let _guard = serial();
    TorchBackend::manual_seed(11);
    let spec = Layer::sequential([
        LinearConfig::new(4, 3).into(),
        Layer::BatchNorm1d(BatchNormConfig::new(3)),
        Layer::Tanh,
    ]);
    let mut model = TorchModel::new(&spec, Device::Cpu).unwrap();
    let x = HostTensor::new(noise(8 * 4, 5), [8, 4]).unwrap();
    // Running statistics away from 0 and 1: eval and train behaviour differ.
    forward(&model, &x);
    model.freeze(&["1.*"]).unwrap();
    assert_eq!(model.keep_frozen_batch_norm_in_eval().unwrap(), ["1"]);
    let dir = common::scratch_dir("torchscript-export-pinned");
    let file = dir.join("pinned.pt");
    export_torchscript(&model, &file, &ExportOptions::default()).unwrap();

    let before = model.state_dict().unwrap();
    let script = ScriptModule::load(&file, Device::Cpu).unwrap();
    assert_eq!(script.mode(), Mode::Train);
    let frozen: Vec<String> = script
        .named_parameters()
        .unwrap()
        .into_iter()
        .filter(|(_, t)| !t.requires_grad())
        .map(|(n, _)| n)
        .collect();
    assert_eq!(frozen, ["1.weight", "1.bias"]);
    assert_eq!(
        forward(&script, &x),
        forward(&model, &x),
        "train-mode output"
    );
    assert_eq!(
        script.state_dict().unwrap(),
        before,
        "running statistics kept"
    );
    assert_eq!(model.state_dict().unwrap(), before);
}

#[test]
fn a_model_on_cuda_exports_its_weights_on_the_cpu() {
    let _guard = serial();
    if kiln_torch::cuda_device_count() == 0 {
        kiln_testkit::skip_without_gpu(
            "a_model_on_cuda_exports_its_weights_on_the_cpu",
            "no CUDA device",
        );
        return;
    }
    TorchBackend::manual_seed(9);
    let spec = Layer::sequential([
        LinearConfig::new(4, 3).into(),
        Layer::BatchNorm1d(kiln_core::model::BatchNormConfig::new(3)),
    ]);
    let mut model = TorchModel::new(&spec, Device::Cpu).unwrap();
    model.set_mode(Mode::Eval);
    let x = HostTensor::new(noise(6 * 4, 2), [6, 4]).unwrap();
    let on_cpu = forward(&model, &x);
    let state = model.state_dict().unwrap();
    model.to(Device::Cuda(0)).unwrap();
    let dir = common::scratch_dir("torchscript-export-cuda");
    let file = dir.join("from_cuda.pt");
    export_torchscript(&model, &file, &ExportOptions::default()).unwrap();
    let mut script = ScriptModule::load(&file, Device::Cpu).unwrap();
    assert_eq!(script.state_dict().unwrap(), state);
    script.set_mode(Mode::Eval);
    assert_eq!(forward(&script, &x), on_cpu);
}

/// Three SGD steps (momentum 0.5) in train mode (dropout drawing the same
/// masks from the same seed), on `model`; returns the losses.
fn train_steps(model: &impl Module<TorchBackend>, x: &HostTensor, seed: u64) -> Vec<f64> {
    use kiln_core::{
        loss::Loss,
        optim::{Optimizer, OptimizerConfig, SgdConfig},
    };
    use kiln_torch::{compute_loss, TorchOptimizer};

    let mut optimizer = TorchOptimizer::new(
        OptimizerConfig::Sgd(SgdConfig::new(0.01).with_momentum(0.5)),
        model.named_parameters().unwrap(),
        &[],
    )
    .unwrap();
    let x = to_tch(x, Device::Cpu).unwrap();
    (0..3)
        .map(|step| {
            TorchBackend::manual_seed(seed + step);
            optimizer.zero_grad().unwrap();
            let out = model.forward(&x).unwrap();
            let target = out.zeros_like();
            let loss = compute_loss(&Loss::mse(), &out, &target).unwrap();
            loss.backward();
            optimizer.step().unwrap();
            loss.double_value(&[])
        })
        .collect()
}

#[test]
fn the_export_trains_in_kiln_exactly_like_the_model() {
    let _guard = serial();
    let dir = common::scratch_dir("torchscript-export-train");
    for case in [digits_cnn(), transformer_block()] {
        TorchBackend::manual_seed(21);
        let mut model = TorchModel::new(&case.spec, Device::Cpu).unwrap();
        model.set_mode(Mode::Train);
        let file = dir.join(format!("{}.pt", case.name));
        export_torchscript(&model, &file, &ExportOptions::default()).unwrap();
        let script = ScriptModule::load(&file, Device::Cpu).unwrap();
        let x = input(&case, 4);

        let exported = model.state_dict().unwrap();

        let ours = train_steps(&model, &x, 500);
        let theirs = train_steps(&script, &x, 500);
        assert_eq!(ours, theirs, "{}: losses", case.name);
        assert_ne!(
            model.state_dict().unwrap(),
            exported,
            "{}: trained",
            case.name
        );
        assert_eq!(
            script.state_dict().unwrap(),
            model.state_dict().unwrap(),
            "{}: weights and running statistics after training",
            case.name
        );
    }
}
