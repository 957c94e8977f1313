//! `SavedModelExport`: a `TfModel` written as a SavedModel serves, in Python's
//! TensorFlow (`tf.saved_model.load(dir).signatures["serving_default"]`, one run
//! of `tests/reference/saved_model_export_check.py` for every case) and in Kiln's
//! own `SavedModel`, what the model's eval-mode forward computes (<= 1e-5), at a
//! batch size other than the export's: every case of
//! `tests/fixtures/layer_cases.json`, the digits CNN of
//! `examples/configs/digits-cnn.toml`, a transformer encoder block and a custom
//! layer built from standard TensorFlow ops. A model
//! loaded with another model's state dict exports that state dict (the
//! checkpoint Python reads holds exactly it). Existing paths are refused unless
//! overwriting is asked for, and are left untouched when refused.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use kiln_testkit::noise;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_core::export::{ExportError, ExportOptions};
use kiln_core::{
    backend::{Backend, Mode},
    model::{BatchNormConfig, Layer, LinearConfig},
    module::Module,
    state_dict::StateDict,
    Device, HostTensor,
};
use kiln_tf::{export_saved_model, SavedModel, SavedModelExport, TfBackend, TfModel};

/// The backend's generator is global: tests in this binary run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn input(shape: &[usize], int_high: Option<usize>, seed: u64) -> HostTensor {
    let n: usize = shape.iter().product();
    match int_high {
        Some(high) => {
            HostTensor::new(kiln_testkit::noise_indices(n, high, seed), shape.to_vec()).unwrap()
        }
        None => HostTensor::new(noise(n, seed), shape.to_vec()).unwrap(),
    }
}

fn max_diff(a: &HostTensor, b: &HostTensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    a.to_f64_vec()
        .iter()
        .zip(b.to_f64_vec())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn forward_eval(model: &mut TfModel, x: &HostTensor) -> HostTensor {
    let mode = model.mode();
    model.set_mode(Mode::Eval);
    let y = model
        .forward(&TfBackend::from_host(x, Device::Cpu).unwrap())
        .unwrap()
        .to_host()
        .unwrap();
    model.set_mode(mode);
    y
}

struct Case {
    name: String,
    spec: Layer,
    /// The batch shape the model is exported for.
    shape: Vec<usize>,
    int_high: Option<usize>,
}

fn layer_cases() -> Vec<Case> {
    kiln_testkit::layer_cases()
        .into_iter()
        .map(|c| Case {
            name: c.name,
            spec: serde_json::from_value(c.layer).unwrap(),
            shape: c.input,
            int_high: c.int_high,
        })
        .collect()
}

fn digits_cnn() -> Layer {
    let text = std::fs::read_to_string(
        kiln_testkit::workspace_root().join("examples/configs/digits-cnn.toml"),
    )
    .unwrap();
    let config: toml::Table = toml::from_str(&text).unwrap();
    config["model"].clone().try_into().unwrap()
}

/// One exported case: what Python and Kiln's loader must reproduce.
struct Exported {
    name: String,
    dir: PathBuf,
    data: PathBuf,
    x: HostTensor,
    expected: HostTensor,
    state: Option<PathBuf>,
    /// The model's state-dict entries and, of them, parameters.
    variables: (usize, usize),
}

impl Exported {
    fn manifest_entry(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.name,
            "dir": self.dir,
            "data": self.data,
            "input_name": "input",
            "output_name": "output",
            "state": self.state,
        })
    }
}

/// Exports `model` for `shape` into `root/name` and records its eval-mode
/// output on a batch one larger than the export's.
fn export_case(
    root: &Path,
    name: &str,
    model: &mut TfModel,
    shape: &[usize],
    int_high: Option<usize>,
) -> Exported {
    let dir = root.join(name);
    // The model is in training mode: the export is eval-mode all the same.
    model.set_mode(Mode::Train);
    export_saved_model(model, &dir, &ExportOptions::new(shape))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut other = shape.to_vec();
    other[0] += 1;
    let x = input(&other, int_high, 5);
    let expected = forward_eval(model, &x);
    let data = root.join(format!("{name}.safetensors"));
    let mut tensors = StateDict::new();
    tensors.insert("input", x.clone());
    tensors.insert("expected", expected.clone());
    tensors.save_safetensors(&data, &BTreeMap::new()).unwrap();
    let variables = (
        model.state_dict().unwrap().len(),
        model.named_parameters().unwrap().len(),
    );
    Exported {
        name: name.to_owned(),
        dir,
        data,
        x,
        expected,
        state: None,
        variables,
    }
}

/// Kiln's own loader serves the export's signature as the model computes.
fn check_with_kiln(case: &Exported) -> f64 {
    let loaded = SavedModel::load(&case.dir).unwrap_or_else(|e| panic!("{}: {e}", case.name));
    let info = loaded.signature("serving_default").unwrap();
    assert_eq!(info.method_name, "tensorflow/serving/predict");
    let out = loaded
        .run("serving_default", &[("input", &case.x)])
        .unwrap_or_else(|e| panic!("{}: {e}", case.name));
    max_diff(&out["output"], &case.expected)
}

/// Runs the Python check on every case at once and asserts every difference.
fn check_with_python(python: &Path, root: &Path, cases: &[Exported]) {
    let manifest = root.join("manifest.json");
    let entries: Vec<serde_json::Value> = cases.iter().map(Exported::manifest_entry).collect();
    std::fs::write(&manifest, serde_json::to_string(&entries).unwrap()).unwrap();
    let stdout = kiln_testkit::run_reference_script!(
        python,
        "saved_model_export_check.py",
        &[manifest.as_os_str()],
    );
    let results: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let mut failures = Vec::new();
    for case in cases {
        let r = &results[&case.name];
        let output = r["output"].as_f64().unwrap();
        let state = r["state"].as_f64();
        let variables = (
            r["variables"].as_u64().unwrap() as usize,
            r["trainable"].as_u64().unwrap() as usize,
        );
        eprintln!(
            "{:<36} python {output:.1e}  checkpoint {}  batch dim {}  tf.Variables {}/{}",
            case.name,
            state.map_or("-".to_owned(), |s| format!("{s:.1e}")),
            r["batch_dim"],
            variables.0,
            variables.1,
        );
        if variables != case.variables {
            failures.push(format!(
                "{}: Python made {variables:?} (all, trainable) variables, the model has {:?}",
                case.name, case.variables
            ));
        }
        if output > 1e-5 || state.is_some_and(|s| s > 0.0) {
            failures.push(format!("{}: {r}", case.name));
        }
        if !r["batch_dim"].is_null() {
            failures.push(format!(
                "{}: batch dim {} is not open",
                case.name, r["batch_dim"]
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Every layer case, the digits CNN and a transformer block, exported and run
/// in Python's TensorFlow (one run) and in Kiln's SavedModel loader.
#[test]
fn exports_serve_the_eval_forward_in_python_and_kiln() {
    let _serial = serial();
    let root = common::scratch_dir("saved-model-export");
    let mut cases = Vec::new();
    let mut all = layer_cases();
    all.push(Case {
        name: "digits_cnn".to_owned(),
        spec: digits_cnn(),
        shape: vec![4, 1, 8, 8],
        int_high: None,
    });
    all.push(Case {
        name: "transformer_encoder_block".to_owned(),
        spec: Layer::transformer_encoder_block(32, 4, 64, true, 0.0),
        shape: vec![2, 6, 32],
        int_high: None,
    });
    // A custom layer made of standard ops (`x * scale`, TensorFlow's Mul) exports too.
    kiln_tf::register_custom_layer("test::scale", |graph, name, x, params, _config| {
        let build = |graph: &mut tensorflow::Graph| {
            let mut nd = graph.new_operation("Mul", name)?;
            nd.add_input(x);
            nd.add_input(params[0].clone());
            nd.set_attr_type("T", tensorflow::DataType::Float)?;
            nd.finish()
        };
        let operation = build(graph).map_err(|s| kiln_tf::tf_error(name, s))?;
        Ok(tensorflow::Output {
            operation,
            index: 0,
        })
    });
    all.push(Case {
        name: "custom_standard_ops".to_owned(),
        spec: Layer::sequential([
            LinearConfig::new(5, 4).into(),
            kiln_core::model::CustomConfig::new("test::scale")
                .with_param(
                    "scale",
                    [4],
                    kiln_core::model::Init::Constant { value: 1.5 },
                )
                .into(),
        ]),
        shape: vec![2, 5],
        int_high: None,
    });
    let mut worst_kiln = 0.0f64;
    for case in &all {
        TfBackend::manual_seed(3);
        let mut model = TfModel::new(&case.spec, Device::Cpu).unwrap();
        let exported = export_case(&root, &case.name, &mut model, &case.shape, case.int_high);
        let d = check_with_kiln(&exported);
        assert!(d <= 1e-5, "{}: Kiln's loader differs by {d:.2e}", case.name);
        worst_kiln = worst_kiln.max(d);
        cases.push(exported);
    }
    eprintln!(
        "{} exports; Kiln's loader worst difference {worst_kiln:.1e}",
        cases.len()
    );
    let Some(python) = common::python("exports_serve_the_eval_forward_in_python_and_kiln") else {
        return;
    };
    check_with_python(&python, &root, &cases);
}

/// A model given another model's state dict (as a torch-trained checkpoint
/// would be given) exports that state dict: Python's checkpoint reader finds
/// exactly its tensors, and the signature computes with them.
#[test]
fn a_loaded_state_dict_is_what_is_exported() {
    let _serial = serial();
    let root = common::scratch_dir("saved-model-export-state");
    let spec = Layer::sequential([
        LinearConfig::new(6, 8).into(),
        Layer::BatchNorm1d(BatchNormConfig::new(8)),
        Layer::Relu,
        LinearConfig::new(8, 3).into(),
    ]);
    TfBackend::manual_seed(11);
    let source = TfModel::new(&spec, Device::Cpu).unwrap();
    let mut state = source.state_dict().unwrap();
    // Running statistics as training leaves them, not their initial 0 and 1.
    state.insert(
        "1.running_mean",
        HostTensor::new(noise(8, 21), [8]).unwrap(),
    );
    let var: Vec<f32> = noise(8, 22).iter().map(|v| 1.5 + v).collect();
    state.insert("1.running_var", HostTensor::new(var, [8]).unwrap());

    TfBackend::manual_seed(12);
    let mut model = TfModel::new(&spec, Device::Cpu).unwrap();
    let x = input(&[3, 6], None, 5);
    let before = forward_eval(&mut model, &x);
    model.load_state_dict(&state).unwrap();
    let mut exported = export_case(&root, "state_dict", &mut model, &[2, 6], None);
    assert!(
        max_diff(&before, &exported.expected) > 1e-2,
        "the state dict changed nothing"
    );
    let state_file = root.join("state.safetensors");
    state
        .save_safetensors(&state_file, &BTreeMap::new())
        .unwrap();
    exported.state = Some(state_file);
    let d = check_with_kiln(&exported);
    assert!(d <= 1e-5, "Kiln's loader differs by {d:.2e}");
    let Some(python) = common::python("a_loaded_state_dict_is_what_is_exported") else {
        return;
    };
    check_with_python(&python, &root, &[exported]);
}

/// Lists a directory's files with their contents.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(snapshot(&path));
        } else {
            out.insert(path.clone(), std::fs::read(&path).unwrap());
        }
    }
    out
}

/// What is there stays there: an existing directory or file without
/// `overwrite`, or a directory that is not a SavedModel even with it, is refused
/// before anything is written; a bad setting or a shape the model does not take
/// writes nothing; `overwrite(true)` replaces an earlier export.
#[test]
fn existing_paths_and_bad_settings_are_refused_untouched() {
    let _serial = serial();
    let root = common::scratch_dir("saved-model-export-refused");
    let spec = Layer::sequential([LinearConfig::new(4, 3).into(), Layer::Tanh]);
    TfBackend::manual_seed(1);
    let model = TfModel::new(&spec, Device::Cpu).unwrap();

    let dir = root.join("taken");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), b"mine").unwrap();
    let before = snapshot(&root);
    let err = export_saved_model(&model, &dir, &ExportOptions::new(&[2, 4])).unwrap_err();
    assert!(
        matches!(&err, ExportError::Exists { path } if path == &dir),
        "{err:?}"
    );
    assert!(err.to_string().contains("with_overwrite(true)"), "{err}");
    // `?` in a function returning kiln's Result keeps the error whole.
    let as_kiln = || -> kiln_core::Result<()> {
        Ok(export_saved_model(
            &model,
            &dir,
            &ExportOptions::new(&[2, 4]),
        )?)
    };
    match as_kiln().unwrap_err() {
        kiln_core::Error::Export(e) => {
            assert!(
                matches!(&*e, ExportError::Exists { path } if path == &dir),
                "{e}"
            );
            assert!(e.to_string().contains("with_overwrite(true)"), "{e}");
        }
        other => panic!("expected Error::Export, got {other:?}"),
    }
    let err = SavedModelExport::new(&model, &ExportOptions::new(&[2, 4]).with_overwrite(true))
        .write(&dir)
        .unwrap_err();
    assert!(matches!(err, ExportError::NotReplaceable { .. }), "{err:?}");
    assert!(
        err.to_string().contains("not a SavedModel directory"),
        "{err}"
    );
    let file = root.join("file");
    std::fs::write(&file, b"data").unwrap();
    let err = export_saved_model(&model, &file, &ExportOptions::new(&[2, 4])).unwrap_err();
    assert!(matches!(err, ExportError::Exists { .. }), "{err:?}");
    std::fs::remove_file(&file).unwrap();
    let nested = root.join("no/such/dir/model");
    let err = export_saved_model(&model, &nested, &ExportOptions::new(&[2, 4])).unwrap_err();
    assert!(matches!(err, ExportError::MissingParent { .. }), "{err:?}");
    assert_eq!(snapshot(&root), before, "a refused export changed files");

    let fresh = root.join("fresh");
    let err = export_saved_model(&model, &fresh, &ExportOptions::new(&[2, 5])).unwrap_err();
    assert!(matches!(err, ExportError::Core(_)), "{err:?}");
    let err = export_saved_model(&model, &fresh, &ExportOptions::new(&[])).unwrap_err();
    assert!(
        matches!(
            err,
            ExportError::Invalid { ref what, .. } if what == "input shape"
        ),
        "{err:?}"
    );
    let err = SavedModelExport::new(
        &model,
        &ExportOptions::new(&[2, 4]).with_output_name("input"),
    )
    .write(&fresh)
    .unwrap_err();
    assert!(
        matches!(
            err,
            ExportError::Invalid { ref what, .. } if what == "output name"
        ),
        "{err:?}"
    );
    assert_eq!(snapshot(&root), before, "a refused export wrote files");
    assert!(!fresh.exists());

    // An earlier export is replaced with overwrite, and only with it.
    SavedModelExport::new(
        &model,
        &ExportOptions::new(&[2, 4])
            .with_input_name("x")
            .with_output_name("y"),
    )
    .write(&fresh)
    .unwrap();
    TfBackend::manual_seed(2);
    let mut other = TfModel::new(&spec, Device::Cpu).unwrap();
    let err = export_saved_model(&other, &fresh, &ExportOptions::new(&[2, 4])).unwrap_err();
    assert!(matches!(err, ExportError::Exists { .. }), "{err:?}");
    SavedModelExport::new(
        &other,
        &ExportOptions::new(&[2, 4])
            .with_input_name("x")
            .with_output_name("y")
            .with_overwrite(true),
    )
    .write(&fresh)
    .unwrap();
    let x = input(&[3, 4], None, 8);
    let out = SavedModel::load(&fresh)
        .unwrap()
        .run("serving_default", &[("x", &x)])
        .unwrap();
    let expected = forward_eval(&mut other, &x);
    assert!(max_diff(&out["y"], &expected) <= 1e-6);

    // With overwrite, a user's file inside the SavedModel (or its variables)
    // and a link to a SavedModel are refused, and left as they were.
    let replace = |dir: &Path| {
        SavedModelExport::new(&model, &ExportOptions::new(&[2, 4]).with_overwrite(true))
            .write(dir)
            .unwrap_err()
    };
    for planted in ["notes.txt", "variables/notes.txt"] {
        std::fs::write(fresh.join(planted), b"mine").unwrap();
        let before = snapshot(&root);
        let err = replace(&fresh);
        assert!(matches!(err, ExportError::NotReplaceable { .. }), "{err:?}");
        assert!(
            err.to_string().contains(&format!(
                "holds {}, which is not part of a SavedModel",
                fresh.join(planted).display()
            )),
            "{err}"
        );
        assert_eq!(
            snapshot(&root),
            before,
            "{planted}: a refused export changed files"
        );
        std::fs::remove_file(fresh.join(planted)).unwrap();
    }
    let link = root.join("link");
    std::os::unix::fs::symlink(&fresh, &link).unwrap();
    let before = snapshot(&root);
    let err = replace(&link);
    assert!(
        err.to_string().contains("is a symbolic link (to ")
            && err.to_string().contains("never replaces a link"),
        "{err}"
    );
    assert_eq!(
        snapshot(&root),
        before,
        "a refused export through a link changed files"
    );
    std::fs::remove_file(&link).unwrap();
    let leftovers: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".kiln"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// Kiln's other readers take the export too: `describe` (what `kiln inspect`
/// prints) lists the signature, `save_variables_to` re-saves it through the
/// exported SaverDef, and a `saved_model` layer imports it into a new model as
/// a frozen feature extractor that computes what the exported model did. Such
/// a model cannot itself be exported (typed error, nothing written).
#[test]
fn kilns_loaders_read_the_export() {
    let _serial = serial();
    let root = common::scratch_dir("saved-model-export-loaders");
    let spec = Layer::sequential([
        LinearConfig::new(5, 7).into(),
        Layer::BatchNorm1d(BatchNormConfig::new(7)),
        Layer::Gelu {
            approximate: Default::default(),
        },
    ]);
    TfBackend::manual_seed(4);
    let mut model = TfModel::new(&spec, Device::Cpu).unwrap();
    let dir = root.join("features");
    export_saved_model(&model, &dir, &ExportOptions::new(&[2, 5])).unwrap();

    let loaded = SavedModel::load(&dir).unwrap();
    let text = loaded.describe();
    for part in ["serving_default", "input", "output", "can be saved"] {
        assert!(text.contains(part), "`{part}` missing from:\n{text}");
    }
    let copy = root.join("copy");
    loaded.save_variables_to(&copy).unwrap();
    let x = input(&[4, 5], None, 6);
    let expected = forward_eval(&mut model, &x);
    let out = SavedModel::load(&copy)
        .unwrap()
        .run("serving_default", &[("input", &x)])
        .unwrap();
    assert!(max_diff(&out["output"], &expected) <= 1e-6);

    let imported = Layer::sequential([Layer::SavedModel(
        kiln_core::model::SavedModelLayerConfig::new(&dir),
    )]);
    let mut frozen = TfModel::new(&imported, Device::Cpu).unwrap();
    let y = forward_eval(&mut frozen, &x);
    let d = max_diff(&y, &expected);
    assert!(d <= 1e-6, "the imported export differs by {d:.2e}");
    let again = root.join("again");
    let err = export_saved_model(&frozen, &again, &ExportOptions::new(&[2, 5])).unwrap_err();
    assert!(
        matches!(&err, ExportError::Unsupported { path, layer, .. } if path == "0" && layer == "SavedModel"),
        "{err:?}"
    );
    assert!(!again.exists());
}
