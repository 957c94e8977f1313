//! The `kiln` CLI on the TensorFlow backend: the main job's config trains with one
//! changed value, checkpoints evaluate on either backend, a run started on torch
//! resumes on TensorFlow, and `kiln inspect` lists a Keras SavedModel's signatures.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

use common::{kiln_stdout as kiln, metric, scratch};
const CONFIG: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/examples/configs/digits-cnn.toml"
);

/// A copy of the main job's config with `backend` changed.
fn config_for(dir: &Path, backend: &str) -> PathBuf {
    let text = std::fs::read_to_string(CONFIG).unwrap();
    let changed: String = text
        .lines()
        .map(|l| {
            if l.starts_with("backend = ") {
                format!("backend = \"{backend}\"\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    let path = dir.join(format!("{backend}.toml"));
    std::fs::write(&path, changed).unwrap();
    path
}

#[test]
fn the_main_job_trains_on_tensorflow_and_checkpoints_evaluate_on_both_backends() {
    let dir = scratch("tf-train");
    let out = dir.join("run");
    let stdout = kiln(&[
        "train",
        "--config",
        CONFIG,
        "--backend",
        "tensorflow",
        "--epochs",
        "4",
        "--no-progress",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(stdout.contains("accuracy"), "{stdout}");
    let checkpoint = out.join("checkpoints/last.safetensors");
    let inspected = kiln(&["inspect", checkpoint.to_str().unwrap()]);
    assert!(inspected.contains("backend     tensorflow"), "{inspected}");

    let tf_config = config_for(&dir, "tensorflow");
    let torch_config = config_for(&dir, "torch");
    let on_tf = kiln(&[
        "eval",
        "--config",
        tf_config.to_str().unwrap(),
        "--checkpoint",
        checkpoint.to_str().unwrap(),
    ]);
    let on_torch = kiln(&[
        "eval",
        "--config",
        torch_config.to_str().unwrap(),
        "--checkpoint",
        checkpoint.to_str().unwrap(),
    ]);
    let accuracy = metric(&on_tf, "accuracy");
    assert!(accuracy > 0.95, "4 epochs on TensorFlow reach {accuracy}");
    assert_eq!(accuracy, metric(&on_torch, "accuracy"));
    assert!((metric(&on_tf, "loss") - metric(&on_torch, "loss")).abs() < 1e-5);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_run_started_on_torch_resumes_on_tensorflow() {
    let dir = scratch("tf-resume");
    let out = dir.join("run");
    let common = |backend: &'static str, steps: &'static str| {
        vec![
            "train".to_owned(),
            "--config".to_owned(),
            CONFIG.to_owned(),
            "--backend".to_owned(),
            backend.to_owned(),
            "--max-steps".to_owned(),
            steps.to_owned(),
            "--no-progress".to_owned(),
            "--output".to_owned(),
            out.to_str().unwrap().to_owned(),
        ]
    };
    let first = common("torch", "23");
    kiln(&first.iter().map(String::as_str).collect::<Vec<_>>());
    let mut second = common("tensorflow", "69");
    second.extend(["--resume".to_owned(), "auto".to_owned()]);
    kiln(&second.iter().map(String::as_str).collect::<Vec<_>>());
    let inspected = kiln(&[
        "inspect",
        out.join("checkpoints/last.safetensors").to_str().unwrap(),
    ]);
    assert!(inspected.contains("backend     tensorflow"), "{inspected}");
    assert!(inspected.contains("position    step 69"), "{inspected}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn inspect_lists_a_keras_savedmodels_signatures() {
    let Some(python) = kiln_testkit::python("inspect_lists_a_keras_savedmodels_signatures") else {
        return;
    };
    let dir = scratch("tf-inspect");
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tf-backend/tests/reference/saved_models.py"
    );
    let status = Command::new(&python)
        .args([script, "export", dir.to_str().unwrap()])
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .status()
        .unwrap();
    assert!(status.success());
    let listing = kiln(&["inspect", dir.join("mlp").to_str().unwrap()]);
    for line in [
        "serve: inputs x: f32[?, 8] -> outputs output_0: f32[?, 3]",
        "train: inputs x: f32[?, 8], y: i32[?] -> outputs loss: f32[]",
    ] {
        assert!(listing.contains(line), "missing `{line}` in\n{listing}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
