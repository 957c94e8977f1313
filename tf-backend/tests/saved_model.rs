#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

//! `kiln_tf::SavedModel` against a Keras 3 export made by
//! `tests/reference/saved_models.py`: the signature listing, serving outputs, every
//! validation error, five fine-tuning steps against Python's losses, and variables
//! saved from Rust that Python's `tf.saved_model.load` reads back.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::{assert_close, copy_dir, read_json, run_reference, tensor, tensor_json};
use kiln_core::{DType, Error, HostTensor};
use kiln_tf::{SavedModel, SignatureInfo, TensorDType, TensorSpec};
use serde_json::Value;

const SCRIPT: &str = "saved_models.py";
const TOL: f64 = 1e-5;

/// The exported models and Python's reference numbers, made once per test binary.
struct Fixture {
    python: PathBuf,
    dir: PathBuf,
    reference: Value,
}

impl Fixture {
    fn mlp(&self) -> PathBuf {
        self.dir.join("mlp")
    }

    /// A private copy of the Keras export, for a test that changes its variables.
    fn mlp_copy(&self, name: &str) -> PathBuf {
        let dir = common::scratch_dir(&format!("saved-model-{name}"));
        let copy = dir.join("mlp");
        copy_dir(&self.mlp(), &copy);
        copy
    }

    fn serve_input(&self) -> HostTensor {
        tensor(&self.reference["serve_input"])
    }

    fn tensor(&self, key: &str) -> HostTensor {
        tensor(&self.reference[key])
    }

    fn batch(&self, step: usize) -> (HostTensor, HostTensor) {
        (
            tensor(&self.reference["train_x"][step]),
            tensor(&self.reference["train_y"][step]),
        )
    }

    fn losses(&self) -> Vec<f64> {
        self.reference["losses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    }

    /// What Python's `tf.saved_model.load(dir)` computes on the serving input.
    fn python_serve(&self, dir: &Path) -> (HostTensor, HostTensor, Option<i64>) {
        self.python_serve_on(dir, &self.serve_input())
    }

    /// What Python's `tf.saved_model.load(dir)` computes on `x`: the `serve` method's
    /// output, the `serving_default` signature's, and the optimizer's step count.
    fn python_serve_on(&self, dir: &Path, x: &HostTensor) -> (HostTensor, HostTensor, Option<i64>) {
        let work = common::scratch_dir(&format!(
            "saved-model-serve-{}-{}",
            dir.parent().unwrap().file_name().unwrap().to_string_lossy(),
            dir.file_name().unwrap().to_string_lossy()
        ));
        let input = work.join("input.json");
        std::fs::write(&input, tensor_json(x).to_string()).unwrap();
        let out = work.join("out.json");
        run_reference(
            &self.python,
            SCRIPT,
            &[Path::new("serve"), dir, &input, &out],
        );
        let result = read_json(&out);
        (
            tensor(&result["serve"]),
            tensor(&result["serving_default"]),
            result["iterations"].as_i64(),
        )
    }
}

/// The fixture, or `None` (after a SKIPPED message) without the project virtualenv.
fn fixture(test: &str) -> Option<&'static Fixture> {
    static FIXTURE: OnceLock<Option<Fixture>> = OnceLock::new();
    let fixture = FIXTURE.get_or_init(|| {
        let python = common::python("saved_model tests")?;
        let dir = common::scratch_dir("saved-model-fixtures");
        run_reference(&python, SCRIPT, &[Path::new("export"), &dir]);
        let reference = read_json(&dir.join("reference.json"));
        Some(Fixture {
            python,
            dir,
            reference,
        })
    });
    if fixture.is_none() {
        kiln_testkit::skip(
            test,
            "no project virtualenv to export the SavedModel fixtures",
        );
    }
    fixture.as_ref()
}

fn serve(model: &SavedModel, signature: &str, x: &HostTensor) -> HostTensor {
    let mut outputs = model.run(signature, &[("x", x)]).unwrap();
    assert_eq!(outputs.keys().collect::<Vec<_>>(), ["output_0"]);
    outputs.remove("output_0").unwrap()
}

fn train(model: &SavedModel, fixture: &Fixture) -> Vec<f64> {
    (0..fixture.reference["steps"].as_u64().unwrap() as usize)
        .map(|step| {
            let (x, y) = fixture.batch(step);
            model.train_step("train", &[("x", &x), ("y", &y)]).unwrap()
        })
        .collect()
}

fn spec<'a>(info: &'a SignatureInfo, name: &str) -> &'a TensorSpec {
    info.input(name)
        .or_else(|| info.output(name))
        .unwrap_or_else(|| panic!("signature {} has no tensor {name}", info.name))
}

#[test]
fn saved_model_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<SavedModel>();
}

#[test]
fn lists_the_signatures_of_a_keras_export() {
    let Some(fixture) = fixture("lists_the_signatures_of_a_keras_export") else {
        return;
    };
    let model = SavedModel::load(fixture.mlp()).unwrap();
    let signatures = model.signatures();
    let names: Vec<&str> = signatures.iter().map(|s| s.name.as_str()).collect();
    // ExportArchive's endpoints, plus the `serving_default` alias of the first one;
    // TensorFlow's `__saved_model_init_op` entry is not a signature.
    assert_eq!(names, ["serve", "serving_default", "train"]);

    for info in &signatures {
        assert_eq!(info.method_name, "tensorflow/serving/predict");
    }
    let serving = model.signature("serving_default").unwrap();
    let x = spec(serving, "x");
    assert_eq!(x.dtype, TensorDType::Kiln(DType::F32));
    assert_eq!(x.shape, Some(vec![None, Some(8)]));
    assert_eq!(x.tensor, "serving_default_x:0");
    let out = spec(serving, "output_0");
    assert_eq!(out.dtype, TensorDType::Kiln(DType::F32));
    assert_eq!(out.shape, Some(vec![None, Some(3)]));

    let train = model.signature("train").unwrap();
    let input_names: Vec<&str> = train.inputs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(input_names, ["x", "y"]);
    assert_eq!(spec(train, "y").dtype, TensorDType::Kiln(DType::I32));
    assert_eq!(spec(train, "y").shape, Some(vec![None]));
    assert_eq!(spec(train, "loss").shape, Some(vec![]));

    assert_eq!(
        serving.to_string(),
        "serving_default: inputs x: f32[?, 8] -> outputs output_0: f32[?, 3]"
    );
    assert_eq!(
        train.to_string(),
        "train: inputs x: f32[?, 8], y: i32[?] -> outputs loss: f32[]"
    );

    assert!(model.has_saver());
    let described = model.describe();
    eprintln!("{described}");
    let lines: Vec<&str> = described.lines().collect();
    assert_eq!(lines.len(), 5, "{described}");
    assert!(
        lines[0].starts_with("SavedModel ") && lines[0].ends_with("(tags: serve), 3 signatures:")
    );
    assert_eq!(
        lines[1],
        "  serve: inputs x: f32[?, 8] -> outputs output_0: f32[?, 3]"
    );
    assert_eq!(lines[2], format!("  {serving}"));
    assert_eq!(lines[3], format!("  {train}"));
    assert!(lines[4].starts_with("variables: can be saved (SaverDef: saver_filename:0 -> "));
}

#[test]
fn serving_outputs_match_keras() {
    let Some(fixture) = fixture("serving_outputs_match_keras") else {
        return;
    };
    let model = SavedModel::load(fixture.mlp()).unwrap();
    let x = fixture.serve_input();
    let expected = fixture.tensor("serve_output");
    assert_close("serve", &serve(&model, "serve", &x), &expected, TOL);
    assert_close(
        "serving_default",
        &serve(&model, "serving_default", &x),
        &expected,
        TOL,
    );
    // Any batch size fits the `?` dimension, including one row.
    let row = x.row(0).unwrap().reshape([1, 8]).unwrap();
    let one = serve(&model, "serve", &row);
    assert_close(
        "one row",
        &one,
        &expected.row(0).unwrap().reshape([1, 3]).unwrap(),
        TOL,
    );
}

#[test]
fn invalid_calls_are_rejected_with_what_was_expected() {
    let Some(fixture) = fixture("invalid_calls_are_rejected_with_what_was_expected") else {
        return;
    };
    let model = SavedModel::load(fixture.mlp()).unwrap();
    let x = fixture.serve_input();
    let (bx, by) = fixture.batch(0);

    let err = model.run("predict", &[("x", &x)]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("has no signature `predict`"), "{msg}");
    assert!(
        msg.contains("available: serve, serving_default, train"),
        "{msg}"
    );

    let err = model.run("serve", &[("z", &x)]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "invalid argument `inputs`: signature `serve` has no input `z`; expected inputs: \
         x: f32[?, 8]"
    );

    let err = model.train_step("train", &[("x", &bx)]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "invalid argument `inputs`: signature `train` needs input `y`, not given; expected \
         inputs: x: f32[?, 8], y: i32[?]"
    );

    let err = model.run("serve", &[("x", &x), ("x", &x)]).unwrap_err();
    assert!(
        err.to_string()
            .contains("input `x` of signature `serve` is given twice"),
        "{err}"
    );

    let x64 = x.to_dtype(DType::F64);
    match model.run("serve", &[("x", &x64)]).unwrap_err() {
        Error::DTypeMismatch {
            expected, actual, ..
        } => assert_eq!((expected, actual), (DType::F32, DType::F64)),
        other => panic!("expected DTypeMismatch, got {other:?}"),
    }
    let y64 = by.to_dtype(DType::I64);
    let err = model
        .train_step("train", &[("x", &bx), ("y", &y64)])
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "signature `train` input `y`: expected dtype int32, got int64"
    );

    let narrow = HostTensor::zeros(DType::F32, [4, 7]).unwrap();
    let err = model.run("serve", &[("x", &narrow)]).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "signature `serve` input `x`: expected shape [?, 8], got [4, 7]"
    );
    let flat = HostTensor::zeros(DType::F32, [32]).unwrap();
    let err = model.run("serving_default", &[("x", &flat)]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "signature `serving_default` input `x`: expected shape [?, 8], got [32]"
    );

    // The serving signature's output is not a single number: refused before running.
    let err = model.train_step("serve", &[("x", &x)]).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
    assert!(err.to_string().contains("the loss `output_0`"), "{err}");

    // None of the rejected calls ran: the weights are the exported ones.
    assert_close(
        "after rejected calls",
        &serve(&model, "serve", &x),
        &fixture.tensor("serve_output"),
        TOL,
    );
}

#[test]
fn missing_or_wrong_directories_say_what_was_expected() {
    let dir = common::scratch_dir("saved-model-not-a-model");
    let missing = dir.join("nope");
    match SavedModel::load(&missing).unwrap_err() {
        Error::Io { path, source } => {
            assert_eq!(path, missing);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
            assert!(source.to_string().contains("saved_model.pb"), "{source}");
        }
        other => panic!("expected Io, got {other:?}"),
    }

    let err = SavedModel::load(&dir).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&dir.display().to_string()), "{msg}");
    assert!(msg.contains("holds no saved_model.pb"), "{msg}");

    let file = dir.join("model.pb");
    std::fs::write(&file, b"not a model").unwrap();
    let err = SavedModel::load(&file).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert!(err.to_string().contains("is a file"), "{err}");

    let Some(fixture) = fixture("missing_or_wrong_directories_say_what_was_expected") else {
        return;
    };
    let err = SavedModel::load_with_tags(fixture.mlp(), &["train"]).unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    assert!(err.to_string().contains("with tags [train]"), "{err}");
}

#[test]
fn five_fine_tuning_steps_match_python() {
    let Some(fixture) = fixture("five_fine_tuning_steps_match_python") else {
        return;
    };
    let dir = fixture.mlp_copy("finetune");
    let model = SavedModel::load(&dir).unwrap();
    let losses = train(&model, fixture);
    let expected = fixture.losses();
    assert_eq!(losses.len(), 5);
    for (step, (got, want)) in losses.iter().zip(&expected).enumerate() {
        assert!(
            (got - want).abs() <= TOL * want.abs().max(1.0),
            "step {}: loss {got} but Python gives {want}",
            step + 1
        );
    }
    assert!(losses[4] < losses[0], "the loss did not fall: {losses:?}");
    assert_close(
        "serving output after fine-tuning",
        &serve(&model, "serving_default", &fixture.serve_input()),
        &fixture.tensor("trained_output"),
        TOL,
    );
    // Training changes the session only: the directory still holds the export.
    let reloaded = SavedModel::load(&dir).unwrap();
    assert_close(
        "reloaded without saving",
        &serve(&reloaded, "serve", &fixture.serve_input()),
        &fixture.tensor("serve_output"),
        TOL,
    );
}

#[test]
fn variables_saved_to_a_new_directory_load_in_python() {
    let Some(fixture) = fixture("variables_saved_to_a_new_directory_load_in_python") else {
        return;
    };
    let source = fixture.mlp_copy("save-to");
    let model = SavedModel::load(&source).unwrap();
    train(&model, fixture);
    let dest = source.parent().unwrap().join("tuned");
    model.save_variables_to(&dest).unwrap();

    let x = fixture.serve_input();
    let trained = fixture.tensor("trained_output");
    let (by_endpoint, by_signature, iterations) = fixture.python_serve(&dest);
    assert_close(
        "Python serve() of the saved copy",
        &by_endpoint,
        &trained,
        TOL,
    );
    assert_close(
        "Python serving_default of the saved copy",
        &by_signature,
        &trained,
        TOL,
    );
    assert_eq!(
        iterations,
        Some(5),
        "the optimizer's step count was not saved"
    );

    let original = fixture.tensor("serve_output");
    let (by_endpoint, _, iterations) = fixture.python_serve(&source);
    assert_close(
        "Python serve() of the original",
        &by_endpoint,
        &original,
        TOL,
    );
    assert_eq!(iterations, Some(0));

    let reloaded = SavedModel::load(&dest).unwrap();
    assert_close("Kiln reload", &serve(&reloaded, "serve", &x), &trained, TOL);
    let mut dest_files: Vec<String> = std::fs::read_dir(&dest)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    dest_files.sort();
    assert_eq!(
        dest_files,
        ["assets", "fingerprint.pb", "saved_model.pb", "variables"]
    );

    // The destination must be new (or empty) and outside the model.
    let err = model.save_variables_to(&dest).unwrap_err();
    assert!(
        err.to_string().contains("already exists and is not empty"),
        "{err}"
    );
    let err = model.save_variables_to(&source).unwrap_err();
    assert!(err.to_string().contains("use save_variables"), "{err}");
    let err = model.save_variables_to(source.join("inner")).unwrap_err();
    assert!(err.to_string().contains("is inside"), "{err}");
    let empty = source.parent().unwrap().join("empty");
    std::fs::create_dir(&empty).unwrap();
    model.save_variables_to(&empty).unwrap();
    assert!(empty.join("variables/variables.index").is_file());
    // No staging directory is left behind.
    let leftovers: Vec<_> = std::fs::read_dir(source.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".kiln"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn variables_saved_in_place_load_in_python() {
    let Some(fixture) = fixture("variables_saved_in_place_load_in_python") else {
        return;
    };
    let dir = fixture.mlp_copy("save-in-place");
    let model = SavedModel::load(&dir).unwrap();
    train(&model, fixture);
    model.save_variables().unwrap();

    let mut files: Vec<String> = std::fs::read_dir(dir.join("variables"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["variables.data-00000-of-00001", "variables.index"]);

    let trained = fixture.tensor("trained_output");
    let (by_endpoint, by_signature, iterations) = fixture.python_serve(&dir);
    assert_close(
        "Python serve() after save_variables",
        &by_endpoint,
        &trained,
        TOL,
    );
    assert_close(
        "Python serving_default after save_variables",
        &by_signature,
        &trained,
        TOL,
    );
    assert_eq!(iterations, Some(5));

    // Saving again over the saved checkpoint works, and Kiln reloads it.
    model.save_variables().unwrap();
    let reloaded = SavedModel::load(&dir).unwrap();
    assert_close(
        "Kiln reload",
        &serve(&reloaded, "serve", &fixture.serve_input()),
        &trained,
        TOL,
    );
}

#[test]
fn a_saved_model_without_a_saver_runs_but_cannot_save() {
    let Some(fixture) = fixture("a_saved_model_without_a_saver_runs_but_cannot_save") else {
        return;
    };
    let model = SavedModel::load(fixture.dir.join("nosaver")).unwrap();
    assert!(!model.has_saver());
    assert!(model.describe().contains("variables: no saver"));
    let x = HostTensor::new(vec![1.0f32, -2.5, 4.0], [3]).unwrap();
    let y = model.run("serving_default", &[("x", &x)]).unwrap();
    assert_eq!(y["y"].as_slice::<f32>().unwrap(), &[2.0, -5.0, 8.0]);

    let err = model.save_variables().unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("has no saver"), "{msg}");
    assert!(msg.contains("tf.saved_model.save"), "{msg}");
    let dest = common::scratch_dir("saved-model-nosaver-dest").join("out");
    assert!(matches!(
        model.save_variables_to(&dest).unwrap_err(),
        Error::Unsupported { .. }
    ));
    assert!(!dest.exists());
}

#[test]
fn a_plain_tf_module_trains_and_saves_too() {
    let Some(fixture) = fixture("a_plain_tf_module_trains_and_saves_too") else {
        return;
    };
    let model = SavedModel::load(fixture.dir.join("counter")).unwrap();
    assert_eq!(
        model.signature("bump").unwrap().to_string(),
        "bump: inputs (none) -> outputs w: f32[3]"
    );
    for expected in [[2.0f32, 3.0, 4.0], [3.0, 4.0, 5.0]] {
        let w = model.run("bump", &[]).unwrap();
        assert_eq!(w["w"].as_slice::<f32>().unwrap(), &expected);
    }
    let dest = common::scratch_dir("saved-model-counter").join("bumped");
    model.save_variables_to(&dest).unwrap();

    let x = HostTensor::new(vec![1.0f32, 1.0, 1.0, 2.0, 2.0, 2.0], [2, 3]).unwrap();
    let expected = HostTensor::new(vec![3.0f32, 4.0, 5.0, 6.0, 8.0, 10.0], [2, 3]).unwrap();
    let (by_method, by_signature, iterations) = fixture.python_serve_on(&dest, &x);
    assert_eq!(by_method, expected);
    assert_eq!(by_signature, expected);
    assert_eq!(iterations, None);
    let original = SavedModel::load(fixture.dir.join("counter")).unwrap();
    let y = original.run("serving_default", &[("x", &x)]).unwrap();
    assert_eq!(
        y["y"].as_slice::<f32>().unwrap(),
        &[1.0, 2.0, 3.0, 2.0, 4.0, 6.0]
    );
}

/// A SavedModel whose files were damaged is an error naming the file, before
/// TensorFlow's loader (whose messages name none) runs.
#[test]
fn damaged_saved_models_name_the_file() {
    let Some(fixture) = fixture("damaged_saved_models_name_the_file") else {
        return;
    };
    let expect = |dir: &Path, file: &str, words: &str| {
        let err = SavedModel::load(dir).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::Data { .. }), "{err:?}");
        assert!(text.contains(file) && text.contains(words), "{text}");
    };
    let empty = fixture.mlp_copy("empty-pb");
    std::fs::write(empty.join("saved_model.pb"), b"").unwrap();
    expect(&empty, "saved_model.pb", "empty");

    let cut = fixture.mlp_copy("cut-pb");
    let pb = std::fs::read(cut.join("saved_model.pb")).unwrap();
    std::fs::write(cut.join("saved_model.pb"), &pb[..pb.len() / 2]).unwrap();
    expect(&cut, "saved_model.pb", "cut short");

    let no_variables = fixture.mlp_copy("no-variables");
    std::fs::remove_dir_all(no_variables.join("variables")).unwrap();
    expect(&no_variables, "variables.index", "missing");

    let no_data = fixture.mlp_copy("no-data");
    std::fs::remove_file(no_data.join("variables/variables.data-00000-of-00001")).unwrap();
    expect(&no_data, "variables.data-00000-of-00001", "missing");

    // Data cut short is found by TensorFlow; its error lists the files it read.
    let cut_data = fixture.mlp_copy("cut-data");
    let data = cut_data.join("variables/variables.data-00000-of-00001");
    let bytes = std::fs::read(&data).unwrap();
    std::fs::write(&data, &bytes[..bytes.len() / 2]).unwrap();
    let text = SavedModel::load(&cut_data).unwrap_err().to_string();
    assert!(
        text.contains("variables/variables.data-00000-of-00001"),
        "{text}"
    );
}
