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

/// The commands whose output is what they print refuse a standard output
/// that is closed (`>&-`), where the text would vanish; `kiln generate`
/// refuses a checkpoint that is not a language model; and an average that
/// could never update is refused before the first step.
#[test]
fn a_closed_stdout_a_float_model_to_generate_and_a_late_average_are_refused() {
    if !digits_available() {
        return;
    }
    let _serial = serial();
    let dir = scratch("hostile-closed");
    let (cfg, checkpoint) = trained(&dir, 5);
    let limit = Duration::from_secs(30);
    for (args, command) in [
        (vec!["inspect", s(&checkpoint)], "kiln inspect"),
        (
            vec!["eval", "--config", s(&cfg), "--checkpoint", s(&checkpoint)],
            "kiln eval",
        ),
        (
            vec!["generate", "--model", s(&checkpoint), "--prompt-ids", "1"],
            "kiln generate",
        ),
    ] {
        let out = Command::new("sh")
            .args(["-c", "exec \"$0\" \"$@\" >&-", KILN])
            .args(&args)
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "stdout is closed; {command} prints its output there"
            )),
            "{args:?}: {stderr}"
        );
    }
    let err = fails_within(
        limit,
        &dir,
        &["generate", "--model", s(&checkpoint), "--prompt-ids", "1,2"],
    );
    assert!(
        err.contains("the checkpoint's model reads float32 features, not token ids (its first layer is Linear)"),
        "{err}"
    );
    for (ema, key, first) in [
        ("{ start_step = 1000 }", "training.ema.start_step", 1000),
        ("{ every_n_steps = 500 }", "training.ema.every_n_steps", 500),
    ] {
        let late = edited(
            &cfg,
            &[("[training]\n", &format!("[training]\nema = {ema}\n"))],
            "late.toml",
        );
        let run = dir.join(format!("late-{first}"));
        let err = fails_within(
            limit,
            &dir,
            &["train", "--config", s(&late), "--output", s(&run)],
        );
        assert!(
            err.contains(key)
                && err.contains(&format!(
                    "the average would first update after step {first}"
                ))
                && err.contains("epochs of")
                && err.contains("so it would never update"),
            "{err}"
        );
        assert!(!run.join("checkpoints").exists(), "{err}");
    }
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

// Round three: bounded memory from small files, no write through a planted
// link, checks at start-up (tests/reference/hostile_models.py makes the tiny
// models, the long documents and the PNG bomb once per binary).

/// The directory `hostile_models.py make` fills, once per test binary.
fn models(test: &str) -> Option<PathBuf> {
    static MADE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    common::made_once(test, &MADE, "hostile_models.py", "hostile-models")
}

/// A copy of the model directory `from` with `edit` applied to its config.json.
fn model_copy(from: &Path, to: &Path, edit: &dyn Fn(&mut serde_json::Value)) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(to.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(to.join("config.json"), config.to_string()).unwrap();
    to.to_path_buf()
}

/// A text run over the pretrained `model`: `data` is the `[data]` body after
/// `dataset = "text"`, `extra` top-level tables (`[lora]`).
fn text_config(dir: &Path, name: &str, model: &Path, data: &str, extra: &str) -> PathBuf {
    let text = format!(
        r#"
seed = 3
output_dir = "{out}"

[model]
pretrained = "{model}"

[data]
dataset = "text"
batch_size = 2
val_fraction = 0
{data}

[loss]
type = "cross_entropy"

[optimizer]
type = "adamw"
lr = 0.01

[training]
epochs = 1
log_every = 1

[checkpoint]
every_n_steps = 2

[logging]
tensorboard = false
plots = false
progress = false

{extra}
"#,
        out = dir.join(format!("{name}-default-out")).display(),
        model = model.display()
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_config_json_cannot_ask_for_more_than_its_weights_hold() {
    let test = "a_config_json_cannot_ask_for_more_than_its_weights_hold";
    let Some(refs) = models(test) else { return };
    let dir = scratch("hostile-config-bounds");
    let limit = Duration::from_secs(20);
    let generate = |model: &Path| {
        fails_within(
            limit,
            &dir,
            &["generate", "--model", s(model), "--prompt-ids", "1,5"],
        )
    };
    // A million layers over a file of two: refused from the headers.
    let deep = model_copy(&refs.join("llama"), &dir.join("deep"), &|c| {
        c["num_hidden_layers"] = 1_000_000.into()
    });
    let err = generate(&deep);
    assert!(
        err.contains(
            "`num_hidden_layers`: is 1000000, but the weights (model.safetensors) hold 2 layers"
        ),
        "{err}"
    );
    // Twenty million tokens over an embedding of a few hundred.
    let wide = model_copy(&refs.join("llama"), &dir.join("wide"), &|c| {
        c["vocab_size"] = 20_000_000.into()
    });
    let err = generate(&wide);
    assert!(
        err.contains("`vocab_size`: is 20000000, but `model.embed_tokens.weight`")
            && err.contains("rows (tokens)"),
        "{err}"
    );
    // GPT-2's keys and its learned positions.
    let long = model_copy(&refs.join("gpt2"), &dir.join("long"), &|c| {
        c["n_positions"] = 100_000_000.into()
    });
    let err = generate(&long);
    assert!(
        err.contains("`n_positions`: is 100000000, but `transformer.wpe.weight`"),
        "{err}"
    );
    // Heads that do not divide the hidden size: named by config.json's keys.
    let heads = model_copy(&refs.join("llama"), &dir.join("heads"), &|c| {
        c["num_attention_heads"] = 5.into();
        c["num_key_value_heads"] = 5.into();
        c.as_object_mut().unwrap().remove("head_dim");
    });
    let err = generate(&heads);
    assert!(
        err.contains("`hidden_size`: is 32, which num_attention_heads = 5 does not divide"),
        "{err}"
    );
    let groups = model_copy(&refs.join("llama"), &dir.join("groups"), &|c| {
        c["num_key_value_heads"] = 3.into()
    });
    let err = generate(&groups);
    assert!(
        err.contains("`num_key_value_heads`: is 3, which does not divide num_attention_heads = 4"),
        "{err}"
    );
    // A file where the model directory goes is said to be one.
    let file = dir.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let cfg = text_config(&dir, "file", &file, "path = \"rows.jsonl\"", "");
    let err = fails_within(limit, &dir, &["train", "--config", s(&cfg)]);
    assert!(
        err.contains("a-file: not a Hugging Face model directory: a regular file, not a directory"),
        "{err}"
    );
    // A shard index whose weight_map is an array.
    let sharded = model_copy(&refs.join("llama"), &dir.join("sharded"), &|_| {});
    std::fs::rename(
        sharded.join("model.safetensors"),
        sharded.join("model-00001-of-00001.safetensors"),
    )
    .unwrap();
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        r#"{"weight_map": ["model-00001-of-00001.safetensors"]}"#,
    )
    .unwrap();
    let err = generate(&sharded);
    assert!(
        err.contains("`weight_map`: an array; expected an object"),
        "{err}"
    );
}

#[test]
fn generation_refuses_what_cannot_work_and_a_tiny_temperature_is_greedy() {
    let test = "generation_refuses_what_cannot_work_and_a_tiny_temperature_is_greedy";
    let Some(refs) = models(test) else { return };
    let dir = scratch("hostile-generate");
    let llama = refs.join("llama");
    let run = |extra: &[&str]| -> String {
        let mut args = vec![
            "generate",
            "--model",
            s(&llama),
            "--prompt-ids",
            "1,5,9",
            "--max-new-tokens",
            "12",
            // Never a token of this vocabulary: every sequence runs to 12.
            "--stop=100000",
        ];
        args.extend_from_slice(extra);
        let out = kiln(&args);
        String::from_utf8(out.stdout).unwrap()
    };
    let greedy = run(&[]);
    // 3 / 1e-310 overflows: the largest logit comes off first, so this is
    // greedy decoding, not token 0 every time.
    let tiny = run(&["--temperature", "1e-310", "--seed", "4"]);
    assert_eq!(tiny, greedy);
    assert!(
        !greedy.trim().split(',').skip(3).all(|t| t == "0"),
        "{greedy}"
    );

    let limit = Duration::from_secs(20);
    let fails = |args: &[&str]| {
        let mut all = vec!["generate", "--model", s(&llama)];
        all.extend_from_slice(args);
        fails_within(limit, &dir, &all)
    };
    let err = fails(&["--prompt-ids", "1,999999"]);
    assert!(
        err.contains("token id 999999 is outside the model's vocabulary"),
        "{err}"
    );
    let err = fails(&["--prompt-ids", "1,5", "--max-new-tokens", "1000000000"]);
    assert!(
        err.contains("more than the model's 128") && err.contains("--max-new-tokens 1000000000"),
        "{err}"
    );
    let err = fails(&["--prompt-ids", "1,5", "--temperature", "-1"]);
    assert!(err.contains("temperature") && err.contains("-1"), "{err}");
    let err = fails(&["--prompt-ids", "1,5", "--temperature", "0"]);
    assert!(err.contains("leave out --temperature"), "{err}");
}

#[test]
fn text_rows_are_bounded_while_read_and_rows_without_targets_refused_at_start() {
    let test = "text_rows_are_bounded_while_read_and_rows_without_targets_refused_at_start";
    let Some(refs) = models(test) else { return };
    let _serial = serial();
    let dir = scratch("hostile-text");
    let llama = refs.join("llama");
    let limit = Duration::from_secs(30);
    // A 20 MB row with max_length = 96: refused while it is read.
    let big = dir.join("big.jsonl");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&big).unwrap();
        writeln!(f, r#"{{"text": "the fox sleeps"}}"#).unwrap();
        write!(f, r#"{{"text": ""#).unwrap();
        f.write_all(&b"fox ".repeat(5 << 20)).unwrap();
        writeln!(f, r#""}}"#).unwrap();
    }
    let data = format!(
        "path = \"{}\"\ntext_column = \"text\"\nmax_length = 96",
        big.display()
    );
    let cfg = text_config(&dir, "big", &llama, &data, "");
    let ended = within(
        limit,
        &dir,
        KILN,
        &[
            "train",
            "--config",
            s(&cfg),
            "--output",
            s(&dir.join("big-run")),
        ],
    );
    assert!(!ended.status.success());
    assert!(
        ended
            .stderr
            .contains("big.jsonl, line 2: the row is longer than 1048576 bytes"),
        "took {:?}: {}",
        ended.took,
        ended.stderr
    );
    assert!(!dir.join("big-run/checkpoints").exists());

    // A prompt that fills max_length leaves no target once truncated.
    let rows = dir.join("pairs.jsonl");
    std::fs::write(
        &rows,
        format!(
            "{}\n{}\n",
            r#"{"q": "fox", "a": "the river"}"#,
            r#"{"q": "the fox sleeps by the river on the hill by a quiet barn", "a": "owl"}"#
        ),
    )
    .unwrap();
    let data = format!(
        "path = \"{}\"\nprompt_template = \"{{q}}\"\nresponse_template = \"{{a}}\"\nmax_length = 4\ntruncation = true",
        rows.display()
    );
    let cfg = text_config(&dir, "pairs", &llama, &data, "");
    let err = fails_within(
        limit,
        &dir,
        &[
            "train",
            "--config",
            s(&cfg),
            "--output",
            s(&dir.join("pairs-run")),
        ],
    );
    assert!(
        err.contains("pairs.jsonl, line 2: the row has no target")
            && err.contains("no response token is left"),
        "{err}"
    );

    // A Parquet list column is named as what it is, not as missing.
    let data = format!(
        "path = \"{}\"\ntext_column = \"question\"\nmax_length = 32",
        refs.join("lists.parquet").display()
    );
    let cfg = text_config(&dir, "lists", &llama, &data, "");
    let err = fails_within(
        limit,
        &dir,
        &[
            "train",
            "--config",
            s(&cfg),
            "--output",
            s(&dir.join("lists-run")),
        ],
    );
    assert!(
        err.contains("column `question` holds a list in each row, not text"),
        "{err}"
    );
}

#[test]
fn packing_joins_documents_and_cuts_the_stream_as_group_texts_does() {
    let test = "packing_joins_documents_and_cuts_the_stream_as_group_texts_does";
    let Some(refs) = models(test) else { return };
    let _serial = serial();
    let dir = scratch("hostile-packing");
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(refs.join("cases.json")).unwrap()).unwrap();
    let block = cases["block"].as_u64().unwrap();
    let data = format!(
        "path = \"{}\"\ntext_column = \"text\"\nmax_length = {block}\npacking = true",
        refs.join("long.jsonl").display()
    );
    let cfg = text_config(&dir, "packed", &refs.join("llama"), &data, "");
    let out = Command::new(KILN)
        .args([
            "train",
            "--config",
            s(&cfg),
            "--output",
            s(&dir.join("run")),
        ])
        .args(["--max-steps", "2"])
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let lengths: Vec<u64> = cases["lengths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let total: u64 = lengths.iter().sum();
    // The 402-token document is whole in the stream: it spans blocks.
    let line = format!(
        "{total} tokens packed into {} blocks of {block}",
        cases["blocks"]
    );
    assert!(stderr.contains(&line), "expected `{line}`:\n{stderr}");
}

#[test]
fn data_files_that_are_not_regular_files_are_refused_and_a_png_bomb_too() {
    let test = "data_files_that_are_not_regular_files_are_refused_and_a_png_bomb_too";
    let Some(refs) = models(test) else { return };
    let _serial = serial();
    let dir = scratch("hostile-data-files");
    let limit = Duration::from_secs(20);
    let fifo = dir.join("rows.jsonl");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let zero = dir.join("zero.jsonl");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    for (path, what) in [
        (&fifo, "a named pipe (FIFO)"),
        (&zero, "a character device"),
    ] {
        let data = format!("path = \"{}\"\ntext_column = \"text\"", path.display());
        let cfg = text_config(&dir, "special", &refs.join("llama"), &data, "");
        let err = fails_within(
            limit,
            &dir,
            &[
                "train",
                "--config",
                s(&cfg),
                "--output",
                s(&dir.join("run")),
            ],
        );
        assert!(
            err.contains(what) && err.contains("not a regular file"),
            "{err}"
        );
    }

    // Class folders: a FIFO under an image's name, and a 30000x30000 PNG.
    let images = |name: &str, fill: &dyn Fn(&Path)| -> String {
        let root = dir.join(name);
        for class in ["a", "b"] {
            std::fs::create_dir_all(root.join(class)).unwrap();
            fill(&root.join(class));
        }
        let cfg = dir.join(format!("{name}.toml"));
        std::fs::write(
            &cfg,
            format!(
                r#"
seed = 1
output_dir = "{out}"

[data]
dataset = "image_folder"
path = "{root}"
image_size = 8
batch_size = 2
val_fraction = 0

[model]
type = "sequential"
layers = [{{ type = "flatten" }}, {{ type = "linear", in_features = 192, out_features = 2 }}]

[loss]
type = "cross_entropy"

[optimizer]
type = "sgd"
lr = 0.01

[logging]
tensorboard = false
plots = false
progress = false
"#,
                out = dir.join(format!("{name}-out")).display(),
                root = root.display()
            ),
        )
        .unwrap();
        fails_within(
            limit,
            &dir,
            &[
                "train",
                "--config",
                s(&cfg),
                "--output",
                s(&dir.join(format!("{name}-run"))),
            ],
        )
    };
    let err = images("fifo-images", &|class| {
        assert!(Command::new("mkfifo")
            .arg(class.join("x.png"))
            .status()
            .unwrap()
            .success());
    });
    assert!(
        err.contains("x.png") && err.contains("a named pipe (FIFO), not a regular file"),
        "{err}"
    );
    let err = images("bomb-images", &|class| {
        std::fs::copy(refs.join("bomb.png"), class.join("bomb.png")).unwrap();
    });
    assert!(
        err.contains("the PNG image is 30000x30000, more than 178956970 pixels"),
        "{err}"
    );
    // A link inside a class folder back to the root would list class b's
    // images (and a's again) as class a.
    let err = images("looped-images", &|class| {
        std::fs::copy(refs.join("bomb.png"), class.join("x.txt")).unwrap();
        if class.ends_with("a") {
            std::os::unix::fs::symlink("..", class.join("all")).unwrap();
        }
    });
    assert!(
        err.contains("a/all: leads (through a symbolic link) to")
            && err.contains("they would be listed again under this class"),
        "{err}"
    );
}

#[test]
fn lora_mistakes_are_refused_at_start_up_and_on_resume() {
    let test = "lora_mistakes_are_refused_at_start_up_and_on_resume";
    let Some(refs) = models(test) else { return };
    let _serial = serial();
    let dir = scratch("hostile-lora");
    let limit = Duration::from_secs(60);
    let data = format!(
        "path = \"{}\"\ntext_column = \"text\"\nmax_length = 32\npacking = true",
        refs.join("long.jsonl").display()
    );
    let lora = |alpha: &str, rslora: bool, targets: &str| {
        format!("[lora]\nr = 4\nalpha = {alpha}\ntarget_modules = {targets}\nuse_rslora = {rslora}")
    };
    // GPT-2's q and v live in one fused c_attn: the adapter saved at the end
    // is one c_attn adapter holding both, a block each, with the rank and
    // alpha that keep their scale (tests/lora.rs checks it against PEFT).
    let cfg = text_config(
        &dir,
        "gpt2",
        &refs.join("gpt2"),
        &data,
        &lora("8", false, r#"["q_proj", "v_proj"]"#),
    );
    let out = dir.join("gpt2-run");
    let ended = within(
        limit,
        &dir,
        KILN,
        &[
            "train",
            "--config",
            s(&cfg),
            "--output",
            s(&out),
            "--max-steps",
            "1",
        ],
    );
    assert!(ended.status.success(), "{}", ended.stderr);
    let adapter: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        adapter["target_modules"],
        serde_json::json!(["c_attn"]),
        "{adapter}"
    );
    assert_eq!(
        adapter["rank_pattern"]["transformer.h.0.attn.c_attn"], 12,
        "{adapter}"
    );
    assert_eq!(
        adapter["alpha_pattern"]["transformer.h.0.attn.c_attn"], 24.0,
        "{adapter}"
    );

    // A LoRA run interrupted, resumed with another alpha or rsLoRA: refused.
    let targets = r#"["q_proj", "v_proj"]"#;
    let first = text_config(
        &dir,
        "lora",
        &refs.join("llama"),
        &data,
        &lora("8", false, targets),
    );
    let run = dir.join("lora-run");
    train(s(&first), &run, &["--max-steps", "2"]);
    for (changed, key) in [
        (
            lora("16", false, targets),
            "at `lora.alpha` the config has 16.0 and the checkpoint 8.0",
        ),
        (
            lora("8", true, targets),
            "at `lora.use_rslora` the config has true and the checkpoint false",
        ),
        (lora("8", false, r#"["q_proj"]"#), "at `lora.target_modules"),
        (String::new(), "this config has no [lora] table"),
    ] {
        let cfg = text_config(&dir, "lora-again", &refs.join("llama"), &data, &changed);
        let err = fails_within(
            limit,
            &dir,
            &[
                "train",
                "--config",
                s(&cfg),
                "--output",
                s(&run),
                "--resume",
                "auto",
            ],
        );
        assert!(err.contains(key), "expected `{key}`:\n{err}");
    }
}

#[test]
fn the_learning_rate_finder_refuses_what_cannot_work_before_sweeping() {
    if !digits_available() {
        return;
    }
    let _serial = serial();
    let dir = scratch("hostile-lr-find");
    let cfg = config(&dir, 0);
    let limit = Duration::from_secs(60);
    let tune = |extra: &[&str]| -> Ended {
        let mut args = vec!["tune", "lr", "--config", s(&cfg)];
        args.extend_from_slice(extra);
        within(limit, &dir, KILN, &args)
    };
    // Ten billion steps: no allocation for them up front; a linear sweep to
    // 1e12 diverges within a few steps and stops early.
    let ended = tune(&[
        "--num-training",
        "10000000000",
        "--mode",
        "linear",
        "--max-lr",
        "1e12",
        "--output",
        s(&dir.join("huge")),
    ]);
    assert!(ended.status.success(), "{}", ended.stderr);
    assert!(dir.join("huge/lr_find.csv").is_file());
    for (args, expected) in [
        (vec!["--num-training", "12"], "must be at least 13"),
        (
            vec!["--early-stop-threshold", "-1"],
            "--early-stop-threshold must be 0",
        ),
        (
            vec!["--early-stop-threshold", "NaN"],
            "--early-stop-threshold must be 0",
        ),
    ] {
        let ended = tune(&args);
        assert!(!ended.status.success());
        assert!(
            ended.stderr.contains(expected),
            "{args:?}: {}",
            ended.stderr
        );
    }
    // --save-config into a missing directory or onto a dangling link: refused
    // before the sweep, so nothing of it is written.
    let dangling = dir.join("dangling.toml");
    std::os::unix::fs::symlink(dir.join("nowhere.toml"), &dangling).unwrap();
    for (target, expected) in [
        (dir.join("missing/lr.toml"), "does not exist"),
        (dangling.clone(), "(a symbolic link)"),
    ] {
        let out = dir.join("saved");
        let ended = tune(&["--save-config", s(&target), "--output", s(&out)]);
        assert!(!ended.status.success());
        assert!(ended.stderr.contains(expected), "{}", ended.stderr);
        assert!(!out.exists());
    }
}

#[test]
fn a_link_planted_at_a_temporary_name_never_redirects_a_write() {
    if !digits_available() {
        return;
    }
    let _serial = serial();
    let dir = scratch("hostile-planted");
    let (_, last) = trained(&dir, 6);
    let victim = dir.join("victim.txt");
    std::fs::write(&victim, "the user's file").unwrap();
    let output = dir.join("one.safetensors");
    // The shell plants links at the names a predictable writer would use
    // (its own pid, which `exec` hands to kiln), then becomes kiln.
    let script =
        r#"ln -s "$1" "$2.tmp-$$"; ln -s "$1" "$2.tmp"; exec "$0" consolidate "$3" --output "$2""#;
    let ended = within(
        Duration::from_secs(30),
        &dir,
        "/bin/sh",
        &["-c", script, KILN, s(&victim), s(&output), s(&last)],
    );
    assert!(ended.status.success(), "{}", ended.stderr);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "the user's file");
    assert!(kiln::train::Checkpoint::load(&output).is_ok());
}

#[test]
fn pretrained_weights_and_adapters_are_checked_when_loaded() {
    let test = "pretrained_weights_and_adapters_are_checked_when_loaded";
    let Some(refs) = models(test) else { return };
    let dir = scratch("hostile-weights");
    let limit = Duration::from_secs(20);
    let generate = |model: &Path, extra: &[&str]| {
        let mut args = vec!["generate", "--model", s(model), "--prompt-ids", "1,5"];
        args.extend_from_slice(extra);
        fails_within(limit, &dir, &args)
    };
    let metadata = std::collections::BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
    // One tensor of the weights replaced by `tensor`.
    let with = |name: &str, tensor: kiln::core::HostTensor| {
        let to = model_copy(&refs.join("llama"), &dir.join(name), &|_| {});
        let file = to.join("model.safetensors");
        let (mut weights, _) = StateDict::load_safetensors(&file).unwrap();
        weights.insert("model.norm.weight".to_owned(), tensor);
        weights.save_safetensors(&file, &metadata).unwrap();
        to
    };
    let mut values = vec![1.0f32; 32];
    values[3] = f32::NAN;
    let err = generate(
        &with("nan", kiln::core::HostTensor::new(values, [32]).unwrap()),
        &[],
    );
    assert!(
        err.contains("`model.norm.weight`: holds 1 NaN of 32 values"),
        "{err}"
    );
    let ints = kiln::core::HostTensor::new(vec![1i64; 32], [32]).unwrap();
    let err = generate(&with("int", ints), &[]);
    assert!(
        err.contains("`model.norm.weight`: holds I64 values") && err.contains("never casts"),
        "{err}"
    );

    // A PEFT adapter on q_proj of the first layer, as PEFT names it.
    let adapter = |name: &str, edit: &dyn Fn(&mut serde_json::Value), b: f32| {
        let to = dir.join(name);
        std::fs::create_dir_all(&to).unwrap();
        let mut config = serde_json::json!({
            "peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
            "target_modules": ["q_proj"], "layers_to_transform": [0], "bias": "none",
            "use_rslora": false,
        });
        edit(&mut config);
        std::fs::write(to.join("adapter_config.json"), config.to_string()).unwrap();
        let prefix = "base_model.model.model.layers.0.self_attn.q_proj";
        let mut tensors = StateDict::new();
        tensors.insert(
            format!("{prefix}.lora_A.weight"),
            kiln::core::HostTensor::new(vec![0.1f32; 4 * 32], [4, 32]).unwrap(),
        );
        tensors.insert(
            format!("{prefix}.lora_B.weight"),
            kiln::core::HostTensor::new(vec![b; 32 * 4], [32, 4]).unwrap(),
        );
        tensors
            .save_safetensors(to.join("adapter_model.safetensors"), &metadata)
            .unwrap();
        to
    };
    let llama = refs.join("llama");
    let good = adapter("good", &|_| {}, 0.5);
    kiln(&[
        "generate",
        "--model",
        s(&llama),
        "--prompt-ids",
        "1,5",
        "--max-new-tokens",
        "2",
        "--adapter",
        s(&good),
    ]);
    for (name, edit, expected) in [
        (
            "zero",
            &(|c: &mut serde_json::Value| c["lora_alpha"] = 0.into())
                as &dyn Fn(&mut serde_json::Value),
            "`lora_alpha` = 0",
        ),
        (
            "huge",
            &|c: &mut serde_json::Value| c["lora_alpha"] = 1e38.into(),
            "`lora_alpha` = 100000000000000000000000000000000000000",
        ),
        (
            "alora",
            &|c: &mut serde_json::Value| c["alora_invocation_tokens"] = serde_json::json!([5, 6]),
            "`alora_invocation_tokens` is set",
        ),
        (
            "prefix",
            &|c: &mut serde_json::Value| c["peft_type"] = "PREFIX_TUNING".into(),
            "`peft_type` is \"PREFIX_TUNING\"",
        ),
        // The config and the tensors compared, both ways, as PEFT matches names.
        (
            "claims-more",
            &|c: &mut serde_json::Value| {
                c["target_modules"] = serde_json::json!(["q_proj", "v_proj"])
            },
            "`base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight` is missing: \
             adapter_config.json's target_modules ([\"q_proj\",\"v_proj\"]) names \
             `model.layers.0.self_attn.v_proj`",
        ),
        (
            "all-layers",
            &|c: &mut serde_json::Value| c["layers_to_transform"] = serde_json::Value::Null,
            "`base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight` is missing",
        ),
        (
            "claims-other",
            &|c: &mut serde_json::Value| c["target_modules"] = serde_json::json!("k_proj|v_proj"),
            "`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` adapts \
             `model.layers.0.self_attn.q_proj`, which adapter_config.json's target_modules \
             (\"k_proj|v_proj\") does not name",
        ),
    ] {
        let err = generate(&llama, &["--adapter", s(&adapter(name, edit, 0.5))]);
        assert!(
            err.contains(expected),
            "{name}: expected `{expected}`:\n{err}"
        );
    }
    let err = generate(
        &llama,
        &["--adapter", s(&adapter("nan-adapter", &|_| {}, f32::NAN))],
    );
    assert!(
        err.contains("lora_B.weight` holds 128 NaN of 128 values"),
        "{err}"
    );
    // A missing half is named as PEFT names it.
    let half = adapter("half", &|_| {}, 0.5);
    let file = half.join("adapter_model.safetensors");
    let (mut tensors, _) = StateDict::load_safetensors(&file).unwrap();
    tensors.remove("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight");
    tensors.save_safetensors(&file, &metadata).unwrap();
    let err = generate(&llama, &["--adapter", s(&half)]);
    assert!(
        err.contains(
            "`base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight` is missing: each \
             adapted module needs both lora_A and lora_B"
        ),
        "{err}"
    );
}

#[test]
fn resume_auto_starts_afresh_where_a_killed_run_left_only_its_own_files() {
    if !digits_available() {
        return;
    }
    let _serial = serial();
    let dir = scratch("hostile-killed");
    let cfg = config(&dir, 0);
    // What a run SIGKILLed before its first checkpoint leaves: its lock file
    // (a PID no longer running), its config copy, a CSV and a partial checkpoint.
    let left = |run: &Path| {
        std::fs::create_dir_all(run.join("checkpoints")).unwrap();
        std::fs::write(run.join(".kiln.lock"), "4194303\n").unwrap();
        std::fs::write(run.join("config.toml"), "seed = 3\n").unwrap();
        std::fs::write(run.join("steps.csv"), "step,loss\n1,2.3\n").unwrap();
        std::fs::write(
            run.join("checkpoints/step-00000005.safetensors.tmp-4194303"),
            "partial",
        )
        .unwrap();
    };
    let run = dir.join("run");
    left(&run);
    let printed = train(s(&cfg), &run, &["--resume", "auto", "--max-steps", "6"]);
    assert!(printed.contains("6 steps"), "{printed}");
    assert!(run.join("checkpoints/step-00000005.safetensors").is_file());
    assert!(!run
        .join("checkpoints/step-00000005.safetensors.tmp-4194303")
        .exists());
    // A file of the user's beside them: nothing is removed, the run refused.
    let mine = dir.join("mine");
    left(&mine);
    std::fs::write(mine.join("notes.txt"), "mine").unwrap();
    let err = fails_within(
        Duration::from_secs(30),
        &dir,
        &[
            "train",
            "--config",
            s(&cfg),
            "--output",
            s(&mine),
            "--resume",
            "auto",
        ],
    );
    assert!(err.contains("is not empty"), "{err}");
    assert!(mine.join("notes.txt").is_file() && mine.join("steps.csv").is_file());
}
