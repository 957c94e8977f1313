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
    // The model summary is the same table on either engine.
    let summaries: Vec<String> = [&tf_config, &torch_config]
        .iter()
        .map(|c| kiln(&["inspect", c.to_str().unwrap()]))
        .collect();
    assert!(
        summaries[0].starts_with("tensorflow on cpu"),
        "{}",
        summaries[0]
    );
    let table = |s: &str| s.lines().skip(1).collect::<Vec<_>>().join("\n");
    assert!(
        table(&summaries[0]).contains("mult-adds for one sample"),
        "{}",
        summaries[0]
    );
    assert_eq!(table(&summaries[0]), table(&summaries[1]));
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

/// A run started on torch resumes on TensorFlow from where torch left it: the
/// weights and buffers, the data position, the optimizer's moments and step count,
/// and the schedule. The main job without dropout (whose masks are each engine's
/// own draws), every step logged: 23 steps (one epoch) on torch, then to step 69
/// on TensorFlow, and from a copy of the same checkpoint to step 69 on torch. The
/// two continuations set the same learning rate at every step; their first
/// losses agree to float32 differences between the engines' kernels (the same
/// batch through the same weights, then the first updates from the restored
/// moments), which a fresh start, a replayed epoch or lost moments would not; and
/// later losses stay close while those differences grow.
#[test]
fn a_run_started_on_torch_resumes_on_tensorflow() {
    if !common::digits_available() {
        return;
    }
    let dir = scratch("tf-resume");
    let text = std::fs::read_to_string(CONFIG).unwrap();
    let edited = text
        .replace(
            "{ type = \"dropout\", p = 0.25 }",
            "{ type = \"dropout\", p = 0.0 }",
        )
        .replace("log_every = 10", "log_every = 1");
    assert!(
        edited.contains("p = 0.0 }") && edited.contains("log_every = 1\n"),
        "the main job's config changed: update this test\n{text}"
    );
    let config = dir.join("no-dropout.toml");
    std::fs::write(&config, edited).unwrap();
    let train = |backend: &str, steps: &str, out: &Path, resume: bool| {
        let mut args = vec![
            "train",
            "--config",
            config.to_str().unwrap(),
            "--backend",
            backend,
            "--max-steps",
            steps,
            "--no-progress",
            "--output",
            out.to_str().unwrap(),
        ];
        if resume {
            args.extend(["--resume", "auto"]);
        }
        kiln(&args);
    };
    let (on_tf, on_torch) = (dir.join("tf"), dir.join("torch"));
    train("torch", "23", &on_tf, false);
    copy_dir(&on_tf, &on_torch);
    train("tensorflow", "69", &on_tf, true);
    train("torch", "69", &on_torch, true);

    let inspected = kiln(&[
        "inspect",
        on_tf.join("checkpoints/last.safetensors").to_str().unwrap(),
    ]);
    assert!(inspected.contains("backend     tensorflow"), "{inspected}");
    assert!(inspected.contains("position    step 69"), "{inspected}");

    let (tf, torch) = (steps_csv(&on_tf), steps_csv(&on_torch));
    let expected_steps: Vec<u64> = (1..=69).collect();
    let steps = |rows: &[Row]| rows.iter().map(|r| r.step).collect::<Vec<_>>();
    assert_eq!(
        steps(&tf),
        expected_steps,
        "steps.csv of the TensorFlow continuation"
    );
    assert_eq!(
        steps(&torch),
        expected_steps,
        "steps.csv of the torch continuation"
    );
    let mut worst = 0f64;
    for (a, e) in tf.iter().zip(&torch) {
        let step = a.step;
        // The schedule's state: the same rate, to the last bit (computed on the host).
        assert_eq!(a.lr, e.lr, "step {step}: learning rate");
        let err = (a.loss - e.loss).abs() / e.loss.abs();
        worst = worst.max(err);
        let tolerance = match step {
            // The torch run both continue from: one file.
            ..=23 => 0.0,
            24..=26 => FIRST_RESUMED_STEPS,
            _ => LATER_STEPS,
        };
        assert!(
            err <= tolerance,
            "step {step}: TensorFlow's loss {}, torch's {} (relative {err:.2e} > {tolerance:.0e})",
            a.loss,
            e.loss
        );
    }
    eprintln!(
        "TensorFlow vs torch from the same checkpoint: worst relative loss difference {worst:.2e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The first three resumed steps: float32 kernel differences only (seen: 2.2e-7).
const FIRST_RESUMED_STEPS: f64 = 1e-5;
/// Later steps, as those differences grow through AdamW (seen: 4.4e-3 by step 69).
const LATER_STEPS: f64 = 2e-2;

/// One row of a run's `steps.csv`.
struct Row {
    step: u64,
    loss: f64,
    lr: String,
}

/// The rows of `run/steps.csv` (`step,loss,lr`).
fn steps_csv(run: &Path) -> Vec<Row> {
    let text = std::fs::read_to_string(run.join("steps.csv")).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("step,loss,lr"), "{text}");
    lines
        .map(|line| {
            let cells: Vec<&str> = line.split(',').collect();
            assert_eq!(cells.len(), 3, "{line}");
            Row {
                step: cells[0].parse().unwrap(),
                loss: cells[1].parse().unwrap(),
                lr: cells[2].to_owned(),
            }
        })
        .collect()
}

/// Copies a directory tree.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dst = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &dst);
        } else {
            std::fs::copy(entry.path(), &dst).unwrap();
        }
    }
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

/// Freezing is a capability the TensorFlow backend does not have
/// (`TrainBackend::CAN_FREEZE`): the config is refused when it is checked, before
/// any data is read or anything written, naming the key and what it needs.
#[test]
fn freezing_on_tensorflow_is_refused_before_anything_is_written() {
    let dir = scratch("tf-freeze");
    let config = config_for(&dir, "tensorflow");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("seed = 0\n", "seed = 0\nfreeze = [\"0.*\"]\n"),
    )
    .unwrap();
    let out = dir.join("run");
    let stderr = common::kiln_fails(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(stderr.contains("`freeze`"), "{stderr}");
    assert!(stderr.contains("torch backend"), "{stderr}");
    assert!(!out.exists(), "nothing is written");
}

/// `[training] ema` on TensorFlow (the average kept through the host): the
/// checkpoint holds it with one update per step, batch norm's running
/// statistics included, and the run's `model.safetensors` is the average.
#[test]
fn ema_averages_on_tensorflow() {
    let dir = scratch("tf-ema");
    let text = std::fs::read_to_string(config_for(&dir, "tensorflow")).unwrap();
    let config = dir.join("ema.toml");
    std::fs::write(
        &config,
        text.replace("[training]\n", "[training]\nema = { decay = 0.9 }\n"),
    )
    .unwrap();
    let out = dir.join("run");
    let stdout = kiln(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--epochs",
        "2",
        "--no-progress",
        "--output",
        out.to_str().unwrap(),
    ]);
    // "validation loss 0.2779, accuracy 96.94%": the averaged model's.
    let accuracy: f64 = stdout
        .split("accuracy ")
        .nth(1)
        .and_then(|rest| rest.split('%').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {stdout}"));
    assert!(accuracy > 80.0, "the average after 2 epochs: {stdout}");
    let checkpoint =
        kiln::train::Checkpoint::load(&out.join("checkpoints/last.safetensors")).unwrap();
    let averaged = checkpoint
        .averaged
        .as_ref()
        .expect("the average is checkpointed");
    assert_eq!(averaged.updates, checkpoint.step);
    assert!(averaged.tensors.get("1.running_mean").is_some());
    let (model, _) =
        kiln::core::state_dict::StateDict::load_safetensors(out.join("model.safetensors")).unwrap();
    for (name, t) in averaged.tensors.iter() {
        assert_eq!(model.get(name), Some(t), "{name}");
        assert_ne!(checkpoint.model.get(name), Some(t), "{name} is averaged");
    }
}
