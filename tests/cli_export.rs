//! `kiln export` through the CLI: the digits CNN trained for a few steps, then
//! exported from its checkpoint as ONNX, TorchScript and a SavedModel, which
//! onnxruntime, `torch.jit.load` and `tf.saved_model.load` run to the same
//! outputs (`tests/reference/export_check.py`); `kiln predict` on the ONNX file
//! gives the checkpoint's predictions, also for a checkpoint the TensorFlow
//! backend trained; `kiln inspect` reads the ONNX file; and
//! what must be refused is refused with nothing written.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{digits_available, kiln, kiln_stdout, scratch, serial, train, KILN};

mod common;

const CONFIG: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/examples/configs/digits-cnn.toml"
);

/// Runs `kiln args`, which must fail; its standard error.
fn kiln_fails(args: &[&str]) -> String {
    let out = Command::new(KILN)
        .args(args)
        .env("RUST_LOG", "warn")
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "kiln {args:?} succeeded, expected a failure:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The `score_*` columns of a predictions CSV, row by row.
fn scores(path: &Path) -> Vec<Vec<f64>> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').skip(3).map(|v| v.parse().unwrap()).collect())
        .collect()
}

/// A short run of the shipped digits CNN: its last checkpoint.
fn trained(dir: &Path) -> PathBuf {
    let run = dir.join("run");
    train(
        CONFIG,
        &run,
        &["--epochs", "1", "--no-progress", "--workers", "0"],
    );
    run.join("checkpoints/last.safetensors")
}

#[test]
fn a_checkpoint_exports_to_three_formats_that_agree() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let Some(python) = kiln_testkit::python("a_checkpoint_exports_to_three_formats_that_agree")
    else {
        return;
    };
    let dir = scratch("export");
    let checkpoint = trained(&dir);
    let out = dir.join("exported");
    std::fs::create_dir_all(&out).unwrap();
    let (onnx, pt, saved) = (
        out.join("model.onnx"),
        out.join("model.pt"),
        out.join("savedmodel"),
    );
    let names = ["--input-name", "pixels", "--output-name", "logits"];

    // ONNX and the SavedModel take the input shape from the config's data;
    // TorchScript from --input-shape (the checkpoint gives the definition).
    let printed = kiln_stdout(
        &[
            &["export", "--checkpoint", s(&checkpoint), "--config", CONFIG][..],
            &["--format", "onnx", "--output", s(&onnx)],
            &names,
        ]
        .concat(),
    );
    assert!(
        printed.contains("input pixels [batch, 1, 8, 8], output logits [batch, 10]"),
        "{printed}"
    );
    kiln(&[
        "export",
        "--checkpoint",
        s(&checkpoint),
        "--input-shape",
        "1,8,8",
        "--format",
        "torchscript",
        "--output",
        s(&pt),
    ]);
    kiln(
        &[
            &["export", "--checkpoint", s(&checkpoint), "--config", CONFIG][..],
            &["--format", "savedmodel", "--output", s(&saved)],
            &names,
        ]
        .concat(),
    );
    assert!(saved.join("saved_model.pb").is_file());

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/export_check.py");
    let report = kiln_testkit::run_reference(&python, &script, &[s(&out), "pixels", "logits"]);
    let report: serde_json::Value = serde_json::from_str(report.trim()).unwrap();
    println!("{report}");
    assert_eq!(report["onnx_inputs"], serde_json::json!(["pixels"]));
    assert_eq!(report["onnx_outputs"], serde_json::json!(["logits"]));
    assert_eq!(report["onnx_batch_dim"], "batch");
    assert_eq!(report["ir_version"], 10);
    assert_eq!(report["opset"], 21);
    assert_eq!(report["savedmodel_inputs"], serde_json::json!(["pixels"]));
    assert_eq!(report["savedmodel_outputs"], serde_json::json!(["logits"]));
    assert_eq!(report["shape"], serde_json::json!([5, 10]));
    let keys: Vec<String> = serde_json::from_value(report["torchscript_keys"].clone()).unwrap();
    let definition: kiln::core::model::Layer =
        toml::from_str::<toml::Table>(&std::fs::read_to_string(CONFIG).unwrap()).unwrap()["model"]
            .clone()
            .try_into()
            .unwrap();
    let expected: Vec<String> = definition
        .parameter_specs("")
        .unwrap()
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert_eq!(keys, expected, "the TorchScript file's state dict keys");
    for key in ["onnx_vs_torchscript", "onnx_vs_savedmodel"] {
        let diff = report[key].as_f64().unwrap();
        assert!(diff <= 1e-5, "{key}: {diff:e}");
    }

    // `kiln predict` on the ONNX file: the checkpoint's own predictions.
    let (from_checkpoint, from_onnx) = (dir.join("ckpt.csv"), dir.join("onnx.csv"));
    kiln(&[
        "predict",
        "--config",
        CONFIG,
        "--checkpoint",
        s(&checkpoint),
        "--output",
        s(&from_checkpoint),
    ]);
    kiln(&[
        "predict",
        "--config",
        CONFIG,
        "--checkpoint",
        s(&onnx),
        "--output",
        s(&from_onnx),
    ]);
    let (a, b) = (scores(&from_checkpoint), scores(&from_onnx));
    assert_eq!(a.len(), 360);
    assert_eq!(a.len(), b.len());
    let worst = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    println!("predict: checkpoint vs ONNX Runtime, worst score difference {worst:e}");
    assert!(worst <= 1e-5, "{worst:e}");

    // `kiln inspect` reads the ONNX file.
    let shown = kiln_stdout(&["inspect", s(&onnx)]);
    for needle in ["pixels", "logits", "batch", "Conv"] {
        assert!(shown.contains(needle), "{needle} not in\n{shown}");
    }

    // A fixed batch size instead of a dynamic one.
    let fixed = out.join("fixed.onnx");
    kiln(&[
        "export",
        "--checkpoint",
        s(&checkpoint),
        "--input-shape",
        "1,8,8",
        "--batch-size",
        "4",
        "--format",
        "onnx",
        "--output",
        s(&fixed),
    ]);
    let shown = kiln_stdout(&["inspect", s(&fixed)]);
    assert!(!shown.contains("batch"), "{shown}");

    // Never over an existing file without --overwrite; with it, replaced.
    let before = std::fs::read(&onnx).unwrap();
    let again = [
        "export",
        "--checkpoint",
        s(&checkpoint),
        "--input-shape",
        "1,8,8",
        "--format",
        "onnx",
        "--output",
        s(&onnx),
    ];
    let err = kiln_fails(&again);
    assert!(
        err.contains("exists") && err.contains("--overwrite"),
        "{err}"
    );
    assert_eq!(std::fs::read(&onnx).unwrap(), before);
    for existing in [&pt, &saved] {
        let format = if existing == &pt {
            "torchscript"
        } else {
            "savedmodel"
        };
        let err = kiln_fails(&[
            "export",
            "--checkpoint",
            s(&checkpoint),
            "--config",
            CONFIG,
            "--format",
            format,
            "--output",
            s(existing),
        ]);
        assert!(err.contains("--overwrite"), "{err}");
    }
    kiln(&[&again[..], &["--overwrite"]].concat());
    // The default names this time: a different file.
    assert_ne!(std::fs::read(&onnx).unwrap(), before);
}

#[test]
fn export_refuses_what_cannot_work_and_writes_nothing() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("export-refusals");
    let checkpoint = trained(&dir);
    let target = dir.join("out.onnx");

    // A conv net's input size is not fixed by its layers: the shape is needed.
    let err = kiln_fails(&[
        "export",
        "--checkpoint",
        s(&checkpoint),
        "--format",
        "onnx",
        "--output",
        s(&target),
    ]);
    assert!(err.contains("--input-shape"), "{err}");
    // A shape the model cannot take.
    let err = kiln_fails(&[
        "export",
        "--checkpoint",
        s(&checkpoint),
        "--input-shape",
        "3,8,8",
        "--format",
        "onnx",
        "--output",
        s(&target),
    ]);
    assert!(err.contains("input shape"), "{err}");
    // Weights without a definition.
    let weights = dir.join("run/model.safetensors");
    let err = kiln_fails(&[
        "export",
        "--checkpoint",
        s(&weights),
        "--input-shape",
        "1,8,8",
        "--format",
        "onnx",
        "--output",
        s(&target),
    ]);
    assert!(err.contains("--config"), "{err}");
    // TorchScript has no input names.
    let err = kiln_fails(&[
        "export",
        "--checkpoint",
        s(&checkpoint),
        "--input-shape",
        "1,8,8",
        "--format",
        "torchscript",
        "--output",
        s(&dir.join("x.pt")),
        "--input-name",
        "pixels",
    ]);
    assert!(err.contains("--input-name"), "{err}");
    // A fixed batch size is an ONNX option.
    let err = kiln_fails(&[
        "export",
        "--checkpoint",
        s(&checkpoint),
        "--input-shape",
        "1,8,8",
        "--batch-size",
        "4",
        "--format",
        "savedmodel",
        "--output",
        s(&dir.join("sm")),
    ]);
    assert!(err.contains("--batch-size"), "{err}");
    // A missing directory.
    let err = kiln_fails(&[
        "export",
        "--checkpoint",
        s(&checkpoint),
        "--input-shape",
        "1,8,8",
        "--format",
        "onnx",
        "--output",
        s(&dir.join("no/such/dir/out.onnx")),
    ]);
    assert!(err.contains("no/such/dir"), "{err}");
    assert!(!target.exists() && !dir.join("x.pt").exists() && !dir.join("sm").exists());

    // The weights file works with the config.
    kiln(&[
        "export",
        "--checkpoint",
        s(&weights),
        "--config",
        CONFIG,
        "--format",
        "onnx",
        "--output",
        s(&target),
    ]);

    // A truncated ONNX file: inspect and predict say so, predict writes nothing.
    let bytes = std::fs::read(&target).unwrap();
    let broken = dir.join("broken.onnx");
    std::fs::write(&broken, &bytes[..bytes.len() / 3]).unwrap();
    let err = kiln_fails(&["inspect", s(&broken)]);
    assert!(err.contains("not a valid ONNX model"), "{err}");
    let csv = dir.join("p.csv");
    let err = kiln_fails(&[
        "predict",
        "--config",
        CONFIG,
        "--checkpoint",
        s(&broken),
        "--output",
        s(&csv),
    ]);
    assert!(err.contains("broken.onnx"), "{err}");
    assert!(!csv.exists());
}

#[test]
fn a_tensorflow_checkpoint_exports_too() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("export-tensorflow");
    let run = dir.join("run");
    train(
        CONFIG,
        &run,
        &[
            "--backend",
            "tensorflow",
            "--epochs",
            "1",
            "--no-progress",
            "--workers",
            "0",
        ],
    );
    let checkpoint = run.join("checkpoints/last.safetensors");
    let (onnx, pt) = (dir.join("tf.onnx"), dir.join("tf.pt"));
    for (format, path) in [("onnx", &onnx), ("torchscript", &pt)] {
        kiln(&[
            "export",
            "--checkpoint",
            s(&checkpoint),
            "--config",
            CONFIG,
            "--format",
            format,
            "--output",
            s(path),
        ]);
    }
    // The checkpoint's predictions (its weights in the config's torch model), and
    // ONNX Runtime's on the export.
    let (from_checkpoint, from_onnx) = (dir.join("ckpt.csv"), dir.join("onnx.csv"));
    for (model, csv) in [(&checkpoint, &from_checkpoint), (&onnx, &from_onnx)] {
        kiln(&[
            "predict",
            "--config",
            CONFIG,
            "--checkpoint",
            s(model),
            "--output",
            s(csv),
        ]);
    }
    let (a, b) = (scores(&from_checkpoint), scores(&from_onnx));
    assert_eq!(a.len(), b.len());
    let worst = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    println!("predict: TensorFlow checkpoint vs its ONNX export, worst score difference {worst:e}");
    assert!(worst <= 1e-5, "{worst:e}");
    // The TorchScript file holds the TensorFlow-trained weights under Kiln's names.
    let shown = kiln_stdout(&["inspect", s(&pt)]);
    assert!(shown.contains("4.running_var"), "{shown}");
}
