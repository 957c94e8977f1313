//! The CLI against input a hostile or careless user gives it: each case ends
//! within seconds with an error that names the real cause, or (for a closed
//! pipe) quietly, and nothing is left that refuses the next run.
//!
//! - too many workers for `kiln launch`; two ranks with different configs;
//! - a named pipe or a device given as a checkpoint; a closed standard output;
//! - a model with nothing to train; NaN weights in a checkpoint;
//! - a new run that fails before its first checkpoint; a resume into a new
//!   directory; a resume on other data or outside its data;
//! - the small ones: an ONNX or TorchScript file given to `eval`, `export
//!   --batch-size 0`, a missing output directory, a dangling output link.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::{config, digits_available, kiln, kiln_fails, scratch, serial, train, KILN};
use kiln::core::state_dict::StateDict;

mod common;

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// What a command that had to end within its limit left.
struct Ended {
    status: ExitStatus,
    stderr: String,
    took: Duration,
}

/// Runs `kiln args` (or `program`), killing it and failing the test if it has
/// not ended within `limit`: a hang is a failure, never a stuck suite.
fn within(limit: Duration, dir: &Path, program: &str, args: &[&str]) -> Ended {
    let err = dir.join("stderr.txt");
    let started = Instant::now();
    let mut child = Command::new(program)
        .args(args)
        .env("RUST_LOG", "warn")
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{program} {args:?} still running after {limit:?}: it hangs\n{}",
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Ended {
        status,
        stderr: std::fs::read_to_string(&err).unwrap(),
        took: started.elapsed(),
    }
}

/// `kiln args`, which must fail within `limit`: its standard error.
fn fails_within(limit: Duration, dir: &Path, args: &[&str]) -> String {
    let ended = within(limit, dir, KILN, args);
    assert!(!ended.status.success(), "kiln {args:?} succeeded");
    assert!(
        !ended.stderr.contains("panicked"),
        "kiln {args:?} panicked:\n{}",
        ended.stderr
    );
    ended.stderr
}

/// The small digits run of `common::config` (an MLP, checkpoints every 5
/// steps), trained in `dir/run` for `steps` steps: its last checkpoint.
fn trained(dir: &Path, steps: u64) -> (PathBuf, PathBuf) {
    let cfg = config(dir, 0);
    let run = dir.join("run");
    train(s(&cfg), &run, &["--max-steps", &steps.to_string()]);
    (cfg, run.join("checkpoints/last.safetensors"))
}

/// The config at `from` with `edits` (`(old, new)` text) applied, as `name`.
fn edited(from: &Path, edits: &[(&str, &str)], name: &str) -> PathBuf {
    let mut text = std::fs::read_to_string(from).unwrap();
    for (old, new) in edits {
        assert!(text.contains(old), "`{old}` not in the config");
        text = text.replace(old, new);
    }
    let path = from.with_file_name(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn launch_refuses_more_workers_than_the_node_can_run() {
    let dir = scratch("hostile-launch");
    let err = fails_within(
        Duration::from_secs(20),
        &dir,
        &[
            "launch",
            "--nproc-per-node",
            "100000",
            "--exec",
            "/bin/true",
            "--",
        ],
    );
    let cpus = std::thread::available_parallelism().unwrap().get();
    assert!(
        err.contains("--nproc-per-node 100000 is more workers than this node can run")
            && err.contains(&format!("at most {}", (4 * cpus).min(1024)))
            && err.contains(&format!("{cpus} here")),
        "{err}"
    );
}

#[test]
fn ranks_with_different_configs_fail_at_once_naming_the_difference() {
    if !digits_available() {
        return;
    }
    let _serial = serial();
    let dir = scratch("hostile-ranks");
    let cfg = config(&dir, 0);
    // The job's collectives would wait 60 s at most; the check takes far less.
    let base = std::fs::read_to_string(&cfg).unwrap()
        + "\n[distributed]\nbackend = \"gloo\"\ntimeout = 60\n";
    std::fs::write(dir.join("cfg-0.toml"), &base).unwrap();
    // Two ranks, rank 1 with `other` as its config.
    let launch = |other: String| {
        assert_ne!(other, base);
        std::fs::write(dir.join("cfg-1.toml"), other).unwrap();
        let script = r#"exec "$0" train --config "$1/cfg-$RANK.toml" --output "$1/run""#;
        let args = ["--exec", "/bin/sh", "--", "-c", script, KILN, s(&dir)];
        let mut launch = vec!["launch", "--nproc-per-node", "2"];
        launch.extend(args);
        let ended = within(Duration::from_secs(50), &dir, KILN, &launch);
        assert!(!ended.status.success(), "{}", ended.stderr);
        ended
    };
    let ended = launch(base.replace("batch_size = 32", "batch_size = 16"));
    // Both ranks say it, naming the first difference with both values.
    let message = "rank 1 differs from rank 0 at `config.data.batch_size`, where rank 0 has 32 \
                   and rank 1 16";
    assert_eq!(
        ended.stderr.matches(message).count(),
        2,
        "took {:?}:\n{}",
        ended.took,
        ended.stderr
    );
    assert!(!dir.join("run/checkpoints").exists());

    // A different learning rate on one rank is a difference too.
    let ended = launch(base.replace("lr = 0.003", "lr = 0.001"));
    assert!(
        ended
            .stderr
            .contains("at `config.optimizer.lr`, where rank 0 has 0.003 and rank 1 0.001"),
        "{}",
        ended.stderr
    );
}

#[test]
fn pipes_and_devices_are_refused_before_they_are_opened() {
    let dir = scratch("hostile-fifo");
    let fifo = dir.join("ckpt.fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let cfg = config(&dir, 0);
    let limit = Duration::from_secs(20);
    let predictions = dir.join("p.csv");
    let export = dir.join("m.onnx");
    for args in [
        vec!["inspect", s(&fifo)],
        vec!["eval", "--config", s(&cfg), "--checkpoint", s(&fifo)],
        vec![
            "predict",
            "--config",
            s(&cfg),
            "--checkpoint",
            s(&fifo),
            "--output",
            s(&predictions),
        ],
        vec![
            "export",
            "--checkpoint",
            s(&fifo),
            "--format",
            "onnx",
            "--output",
            s(&export),
        ],
    ] {
        let err = fails_within(limit, &dir, &args);
        assert!(
            err.contains(s(&fifo)) && err.contains("a named pipe (FIFO), not a regular file"),
            "{args:?}: {err}"
        );
    }
    for (device, kind) in [
        ("/dev/zero", "a character device"),
        ("/dev/null", "a character device"),
    ] {
        let err = fails_within(limit, &dir, &["inspect", device]);
        assert!(
            err.contains(&format!("{kind}, not a regular file")),
            "{err}"
        );
    }
    assert!(!predictions.exists() && !export.exists());
}

/// `kiln args` with a standard output whose reader is gone before it starts.
fn with_closed_stdout(args: &[&str]) -> (ExitStatus, String) {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(KILN)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_closed_standard_output_ends_the_output_quietly() {
    if !digits_available() {
        return;
    }
    let _serial = serial();
    let dir = scratch("hostile-pipe");
    let (cfg, checkpoint) = trained(&dir, 5);
    for args in [
        vec!["inspect", s(&checkpoint)],
        vec!["eval", "--config", s(&cfg), "--checkpoint", s(&checkpoint)],
        vec!["--help"],
    ] {
        let (status, stderr) = with_closed_stdout(&args);
        assert!(
            status.success() && !stderr.contains("panicked"),
            "{args:?}: {status}\n{stderr}"
        );
    }
    // A run goes on: its results are in its directory.
    let out = dir.join("quiet-run");
    let (status, stderr) = with_closed_stdout(&[
        "train",
        "--config",
        s(&cfg),
        "--output",
        s(&out),
        "--max-steps",
        "3",
    ]);
    assert!(status.success(), "{stderr}");
    assert!(out.join("model.safetensors").is_file());
}

#[test]
fn a_model_without_parameters_is_a_config_error() {
    let dir = scratch("hostile-empty-model");
    let cfg = config(&dir, 0);
    let text = std::fs::read_to_string(&cfg).unwrap();
    let start = text.find("layers = [").unwrap();
    let end = start + text[start..].find("\n]").unwrap() + 2;
    for (layers, found) in [
        ("layers = []", "no layers"),
        (
            "layers = [{ type = \"relu\" }]",
            "only layers without weights",
        ),
    ] {
        let path = dir.join("empty.toml");
        std::fs::write(&path, format!("{}{layers}{}", &text[..start], &text[end..])).unwrap();
        let out = dir.join("never");
        let err = kiln_fails(&["train", "--config", s(&path), "--output", s(&out)]);
        assert!(
            err.contains("model.layers")
                && err.contains(found)
                && err.contains("no parameter to train"),
            "{err}"
        );
        assert!(!out.exists(), "nothing is written");
    }
}

/// Rewrites the checkpoint at `path` with `count` NaN values at the start of
/// the tensor `name`, keeping every other tensor and the metadata.
fn poison(path: &Path, name: &str, count: usize) {
    let (mut state, meta) = StateDict::load_safetensors(path).unwrap();
    let mut tensor = state.remove(name).unwrap();
    for value in &mut tensor.as_mut_slice::<f32>().unwrap()[..count] {
        *value = f32::NAN;
    }
    state.insert(name, tensor);
    state.save_safetensors(path, &meta).unwrap();
}

#[test]
fn non_finite_weights_are_named_wherever_a_checkpoint_is_used() {
    if !digits_available() {
        return;
    }
    let _serial = serial();
    let dir = scratch("hostile-nan");
    let (cfg, checkpoint) = trained(&dir, 5);
    let nan = dir.join("nan.safetensors");
    std::fs::copy(&checkpoint, &nan).unwrap();
    poison(&nan, "model.0.weight", 3);
    let named = "`model.0.weight` holds 3 NaN of 4096 values";
    let out = dir.join("out");
    for args in [
        vec!["eval", "--config", s(&cfg), "--checkpoint", s(&nan)],
        vec![
            "predict",
            "--config",
            s(&cfg),
            "--checkpoint",
            s(&nan),
            "--output",
            s(&out),
        ],
        vec![
            "export",
            "--checkpoint",
            s(&nan),
            "--format",
            "onnx",
            "--output",
            s(&out),
        ],
        vec![
            "train",
            "--config",
            s(&cfg),
            "--resume",
            s(&nan),
            "--output",
            s(&out),
        ],
    ] {
        let err = kiln_fails(&args);
        assert!(
            err.contains(named) && err.contains(s(&nan)),
            "{args:?}: {err}"
        );
        assert!(!out.exists(), "{args:?} wrote {}", out.display());
    }
    let shown = String::from_utf8(kiln(&["inspect", s(&nan)]).stdout).unwrap();
    assert!(
        shown.contains("non-finite values in 1 tensors") && shown.contains(named),
        "{shown}"
    );
}

#[test]
fn a_run_that_fails_before_its_first_checkpoint_leaves_nothing_in_the_way() {
    if !digits_available() {
        return;
    }
    let _serial = serial();
    let dir = scratch("hostile-failed-start");
    let cfg = config(&dir, 0);
    // Adam at this rate overflows the logits at the second step: a NaN loss
    // before the first checkpoint (step 5).
    let diverging = edited(&cfg, &[("lr = 0.003", "lr = 1e30")], "diverging.toml");
    let out = dir.join("run");
    let err = kiln_fails(&["train", "--config", s(&diverging), "--output", s(&out)]);
    assert!(err.contains("loss"), "{err}");
    assert!(!out.exists(), "the failed run removed what it wrote");
    // An empty directory the user made stays, empty.
    std::fs::create_dir_all(&out).unwrap();
    kiln_fails(&["train", "--config", s(&diverging), "--output", s(&out)]);
    assert!(out.is_dir(), "a directory the run did not create stays");
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
    // The same command with a sane rate now runs there.
    train(s(&cfg), &out, &["--max-steps", "6"]);
    assert!(out.join("checkpoints/last.safetensors").is_file());
}

#[test]
fn resumes_are_checked_against_the_data_and_recorded() {
    if !digits_available() {
        return;
    }
    let _serial = serial();
    let dir = scratch("hostile-resume-data");
    // Batch 20 of epoch 0 (45 batches of 32 per epoch).
    let (cfg, checkpoint) = trained(&dir, 20);

    // A resume into a new directory records the run's config there.
    let moved = dir.join("moved");
    train(
        s(&cfg),
        &moved,
        &["--resume", s(&checkpoint), "--max-steps", "22"],
    );
    let recorded = std::fs::read_to_string(moved.join("config.toml")).unwrap();
    assert!(
        recorded.contains("seed = 3") && recorded.contains("batch_size = 32"),
        "{recorded}"
    );

    // Another batch size: 3 batches an epoch, and the checkpoint stands at batch 20.
    let out = dir.join("out");
    let err = kiln_fails(&[
        "train",
        "--config",
        s(&cfg),
        "--resume",
        s(&checkpoint),
        "--output",
        s(&out),
        "--batch-size",
        "512",
    ]);
    assert!(
        err.contains("stands at batch 20 of epoch 0, but an epoch of this data has 3 batches"),
        "{err}"
    );
    assert!(!out.exists());

    // Other data: 200 digits instead of the 1797, as a CSV file.
    let csv = dir.join("few.csv");
    let python = kiln_testkit::python("writing a CSV of digits").unwrap();
    let status = Command::new(python)
        .args([
            "-c",
            "import sys, numpy as np; from sklearn.datasets import load_digits; \
             d = load_digits(); \
             np.savetxt(sys.argv[1], np.c_[d.data[:200], d.target[:200]], fmt='%g', delimiter=',')",
            s(&csv),
        ])
        .status()
        .unwrap();
    assert!(status.success());
    let other = edited(
        &cfg,
        &[(
            "dataset = \"digits\"",
            &format!(
                "dataset = \"csv\"\npath = \"{}\"\nhas_header = false",
                csv.display()
            ),
        )],
        "other.toml",
    );
    let err = kiln_fails(&[
        "train",
        "--config",
        s(&other),
        "--resume",
        s(&checkpoint),
        "--output",
        s(&out),
    ]);
    assert!(
        err.contains(
            "was trained on other data: its `dataset` was \"digits\", this data's is \"csv\""
        ) && err.contains("--resume-on-other-data"),
        "{err}"
    );
    assert!(!out.exists());
    // Said on purpose, it continues there from the epoch's first batch.
    train(
        s(&other),
        &out,
        &[
            "--resume",
            s(&checkpoint),
            "--resume-on-other-data",
            "--max-steps",
            "22",
        ],
    );
    let epochs = std::fs::read_to_string(out.join("epochs.csv")).unwrap_or_default();
    let steps = std::fs::read_to_string(out.join("steps.csv")).unwrap();
    assert!(
        steps.lines().any(|l| l.starts_with("21,")),
        "{steps}\n{epochs}"
    );
}

#[test]
fn eval_and_export_name_files_that_are_not_checkpoints() {
    let dir = scratch("hostile-formats");
    let cfg = config(&dir, 0);
    let onnx = dir.join("model.onnx");
    std::fs::write(&onnx, b"\x08\x07").unwrap();
    let err = kiln_fails(&["eval", "--config", s(&cfg), "--checkpoint", s(&onnx)]);
    assert!(
        err.contains("is an ONNX model, not a Kiln checkpoint") && err.contains("kiln predict"),
        "{err}"
    );
    let pt = dir.join("model.pt");
    std::fs::write(&pt, b"PK\x03\x04rest of a zip").unwrap();
    for args in [
        vec!["eval", "--config", s(&cfg), "--checkpoint", s(&pt)],
        vec![
            "export",
            "--checkpoint",
            s(&pt),
            "--format",
            "onnx",
            "--output",
            s(&dir.join("x.onnx")),
        ],
    ] {
        let err = kiln_fails(&args);
        assert!(
            err.contains("is a TorchScript file (a zip archive), not a Kiln checkpoint"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn outputs_are_checked_before_anything_is_read() {
    let dir = scratch("hostile-outputs");
    let cfg = config(&dir, 0);
    let ckpt = dir.join("absent.safetensors");
    let missing = dir.join("no-such-dir/out");
    for format in ["onnx", "torchscript", "savedmodel"] {
        let err = kiln_fails(&[
            "export",
            "--checkpoint",
            s(&ckpt),
            "--format",
            format,
            "--output",
            s(&missing),
        ]);
        assert!(
            err.contains(&format!(
                "the directory {} does not exist",
                dir.join("no-such-dir").display()
            )),
            "{format}: {err}"
        );
    }
    let err = kiln_fails(&[
        "predict",
        "--config",
        s(&cfg),
        "--checkpoint",
        s(&ckpt),
        "--output",
        s(&missing),
    ]);
    assert!(
        err.contains("does not exist") && !err.contains(".tmp-"),
        "{err}"
    );
    assert!(!dir.join("no-such-dir").exists());

    let link = dir.join("link.onnx");
    std::os::unix::fs::symlink(dir.join("nowhere.onnx"), &link).unwrap();
    let err = kiln_fails(&[
        "export",
        "--checkpoint",
        s(&ckpt),
        "--format",
        "onnx",
        "--output",
        s(&link),
    ]);
    assert!(
        err.contains("is a symbolic link to") && err.contains("which does not exist"),
        "{err}"
    );

    let err = kiln_fails(&[
        "export",
        "--checkpoint",
        s(&ckpt),
        "--format",
        "onnx",
        "--output",
        s(&dir.join("b.onnx")),
        "--batch-size",
        "0",
    ]);
    assert!(
        err.contains("--batch-size 0") && err.contains("at least 1"),
        "{err}"
    );

    let help = String::from_utf8(kiln(&["train", "--help"]).stdout).unwrap();
    assert!(
        help.contains("16-mixed") && help.contains("16-true"),
        "{help}"
    );
}

#[test]
fn a_skipped_validation_image_is_counted_once_over_the_run() {
    let Some(python) = kiln_testkit::python("writing a small image folder") else {
        return;
    };
    let _serial = serial();
    let dir = scratch("hostile-skip-once");
    // Two classes of 8x8 PNGs to train on; a validation folder with one good
    // image and one JPEG cut short.
    let script = r#"
import sys, os, numpy as np
from PIL import Image
root = sys.argv[1]
rng = np.random.default_rng(0)
for split, per_class in (("train", 4), ("val", 1)):
    for label in ("a", "b"):
        os.makedirs(os.path.join(root, split, label), exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(root, split, label, f"{i}.png"))
Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(os.path.join(root, "bad.jpg"))
data = open(os.path.join(root, "bad.jpg"), "rb").read()
open(os.path.join(root, "val", "b", "cut.jpg"), "wb").write(data[: len(data) // 3])
"#;
    let status = Command::new(python)
        .args(["-c", script, s(&dir)])
        .status()
        .unwrap();
    assert!(status.success());
    let cfg = dir.join("images.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
seed = 1
output_dir = "{out}"

[data]
dataset = "image_folder"
path = "{train}"
val_path = "{val}"
image_size = 8
on_error = "skip"
batch_size = 4

[model]
type = "sequential"
layers = [
  {{ type = "conv2d", in_channels = 3, out_channels = 4, kernel_size = 3, padding = 1 }},
  {{ type = "flatten" }},
  {{ type = "linear", in_features = 256, out_features = 2 }},
]

[loss]
type = "cross_entropy"

[optimizer]
type = "adam"
lr = 0.01

[training]
epochs = 3

[logging]
tensorboard = false
plots = false
progress = false
"#,
            out = dir.join("run").display(),
            train = dir.join("train").display(),
            val = dir.join("val").display(),
        ),
    )
    .unwrap();
    // Validated after each of 3 epochs and once more at the end: 4 passes.
    let printed = train(s(&cfg), &dir.join("run"), &[]);
    assert!(
        printed.contains("kiln: 1 images skipped because they could not be read or decoded"),
        "{printed}"
    );
}
