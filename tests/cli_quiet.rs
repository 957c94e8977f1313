//! A quiet, lean start: `kiln` never loads TensorFlow (its binary does not link
//! it), a command that needs TensorFlow runs in `kiln-tensorflow` beside it, and
//! TensorFlow's own log lines follow Kiln's log level: hidden by default, shown
//! with `RUST_LOG=debug`, and exactly TensorFlow's with a user's `TF_CPP_MIN_LOG_LEVEL`.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

use common::{digits_available, scratch, serial, KILN};

/// The `kiln-tensorflow` executable cargo built beside `kiln`.
const KILN_TENSORFLOW: &str = env!("CARGO_BIN_EXE_kiln-tensorflow");

/// Lines only TensorFlow prints (absl's start-up notice, oneDNN's, glog-style
/// `I0000 ...` INFO lines).
fn tensorflow_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.contains("absl") || l.contains("oneDNN") || is_glog_info(l))
        .collect()
}

/// TensorFlow's notices when its library loads, which differ by CPU: oneDNN's
/// (`port.cc`) and the CPU features' (`cpu_feature_guard.cc`).
fn is_start_up_notice(line: &str) -> bool {
    line.contains("port.cc") || line.contains("cpu_feature_guard.cc")
}

/// `I1126 12:00:00.000000  1234 file.cc:42] ...` or TensorFlow's `I0000 00:00:...`.
fn is_glog_info(line: &str) -> bool {
    let mut chars = line.chars();
    chars.next() == Some('I')
        && chars.by_ref().take(4).all(|c| c.is_ascii_digit())
        && chars.next() == Some(' ')
        && line.contains("] ")
}

/// Runs `program args` with `env` set and `RUST_LOG` / `TF_CPP_MIN_LOG_LEVEL`
/// unset unless `env` sets them, as a user's shell would.
fn run(program: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(program);
    command
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("TF_CPP_MIN_LOG_LEVEL");
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The MLP config of the CLI tests on `backend`, a few steps, one worker process.
fn tiny_config(dir: &Path, backend: &str) -> PathBuf {
    let base = std::fs::read_to_string(common::config(dir, 0)).unwrap();
    let path = dir.join(format!("{backend}.toml"));
    std::fs::write(&path, format!("backend = \"{backend}\"\n{base}")).unwrap();
    path
}

/// `kiln train` of `config` into `dir/name`, at most 6 steps.
fn train(config: &Path, dir: &Path, name: &str, env: &[(&str, &str)]) -> Output {
    let out = dir.join(name);
    let args = [
        "train",
        "--config",
        config.to_str().unwrap(),
        "--max-steps",
        "6",
        "--output",
        out.to_str().unwrap(),
    ];
    run(Path::new(KILN), &args, env)
}

/// The end of a run's summary: `validation loss ..., accuracy ...` (no timing).
fn results(stdout: &str) -> String {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("kiln: done in"))
        .unwrap_or_else(|| panic!("no summary in\n{stdout}"));
    line.split_once("steps; ").unwrap().1.to_owned()
}

#[test]
fn help_and_version_print_no_tensorflow_lines() {
    for args in [&["--help"][..], &["--version"], &["train", "--help"]] {
        let out = run(Path::new(KILN), args, &[]);
        assert!(out.status.success(), "kiln {args:?}");
        let stderr = text(&out.stderr);
        assert!(
            tensorflow_lines(&stderr).is_empty(),
            "kiln {args:?} printed TensorFlow's lines:\n{stderr}"
        );
        assert!(!out.stdout.is_empty());
    }
}

/// The `NEEDED` entries of an ELF file's dynamic section, from `readelf -d`;
/// `None` after `kiln_testkit::skip`ping `test` where readelf is not installed
/// (a failure in CI, whose `.ci/run` installs binutils).
fn needed(test: &str, path: &str) -> Option<Vec<String>> {
    let out = match Command::new("readelf").args(["-d", path]).output() {
        Ok(out) => out,
        Err(e) => {
            kiln_testkit::skip(test, &format!("cannot run readelf ({e}): install binutils"));
            return None;
        }
    };
    assert!(out.status.success(), "readelf -d {path}");
    Some(
        text(&out.stdout)
            .lines()
            .filter(|l| l.contains("(NEEDED)"))
            .filter_map(|l| {
                l.split_once('[')?
                    .1
                    .split_once(']')
                    .map(|(n, _)| n.to_owned())
            })
            .collect(),
    )
}

#[test]
fn kiln_does_not_link_tensorflow_and_kiln_tensorflow_does() {
    let test = "kiln_does_not_link_tensorflow_and_kiln_tensorflow_does";
    let Some(kiln) = needed(test, KILN) else {
        return;
    };
    assert!(
        kiln.iter().any(|n| n.starts_with("libtorch_cpu")),
        "{kiln:?}"
    );
    assert!(
        !kiln.iter().any(|n| n.contains("tensorflow")),
        "kiln links TensorFlow: {kiln:?}"
    );
    let tensorflow = needed(test, KILN_TENSORFLOW).unwrap();
    assert!(
        tensorflow.iter().any(|n| n.contains("tensorflow")),
        "{tensorflow:?}"
    );
}

#[test]
fn a_torch_run_prints_no_tensorflow_lines() {
    if !digits_available() {
        return;
    }
    let _one = serial();
    let dir = scratch("quiet-torch");
    let config = tiny_config(&dir, "torch");
    let out = train(&config, &dir, "run", &[("RUST_LOG", "debug")]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(text(&out.stdout).contains("kiln: torch on cpu"));
    assert!(
        tensorflow_lines(&stderr).is_empty(),
        "a torch run loaded TensorFlow:\n{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tensorflow_logs_follow_kilns_level_and_a_users_setting_wins() {
    if !digits_available() {
        return;
    }
    let _one = serial();
    let dir = scratch("quiet-tf");
    let config = tiny_config(&dir, "tensorflow");

    // Default: Kiln's own lines only, and the run trains and writes its outputs.
    let quiet = train(&config, &dir, "quiet", &[]);
    let stderr = text(&quiet.stderr);
    assert!(quiet.status.success(), "{stderr}");
    assert!(
        tensorflow_lines(&stderr).is_empty(),
        "TensorFlow's lines by default:\n{stderr}"
    );
    let stdout = text(&quiet.stdout);
    assert!(stdout.contains("kiln: tensorflow on cpu"), "{stdout}");
    assert!(dir.join("quiet/model.safetensors").is_file());

    // Kiln at debug: TensorFlow's start-up lines too. Which ones depends on
    // the CPU (the oneDNN notice where TensorFlow turns oneDNN on by default,
    // AVX-512 machines; the CPU-feature and MLIR notices elsewhere): Kiln
    // controls whether they show, not what they say.
    let debug = train(&config, &dir, "debug", &[("RUST_LOG", "debug")]);
    let stderr = text(&debug.stderr);
    assert!(debug.status.success(), "{stderr}");
    assert!(
        !tensorflow_lines(&stderr).is_empty(),
        "no TensorFlow line at debug:\n{stderr}"
    );

    // The user's TF_CPP_MIN_LOG_LEVEL: TensorFlow's INFO lines, start-up's and
    // after it (a session's), whatever Kiln's level.
    let user = train(&config, &dir, "user", &[("TF_CPP_MIN_LOG_LEVEL", "0")]);
    let stderr = text(&user.stderr);
    assert!(user.status.success(), "{stderr}");
    assert!(
        !tensorflow_lines(&stderr).is_empty(),
        "no TensorFlow line with TF_CPP_MIN_LOG_LEVEL=0:\n{stderr}"
    );
    assert!(
        stderr
            .lines()
            .any(|l| is_glog_info(l) && !is_start_up_notice(l)),
        "no INFO line past start-up with TF_CPP_MIN_LOG_LEVEL=0:\n{stderr}"
    );

    // Logging changes nothing in what is computed: the same results as with
    // TensorFlow's own defaults (the user's level 0 leaves everything on).
    let expected = results(&text(&user.stdout));
    assert_eq!(results(&text(&quiet.stdout)), expected);
    assert_eq!(results(&text(&debug.stdout)), expected);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A directory holding `kiln` (a hard link, else a copy) and, when given, a
/// `kiln-tensorflow` shell script.
fn lone_kiln(name: &str, sibling_script: Option<&str>) -> (PathBuf, PathBuf) {
    let dir = scratch(name);
    let kiln = dir.join("kiln");
    if std::fs::hard_link(KILN, &kiln).is_err() {
        std::fs::copy(KILN, &kiln).unwrap();
    }
    if let Some(script) = sibling_script {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join("kiln-tensorflow");
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    (dir, kiln)
}

#[test]
fn a_missing_kiln_tensorflow_is_a_clear_error() {
    let (dir, kiln) = lone_kiln("quiet-missing", None);
    let config = tiny_config(&dir, "tensorflow");
    let out = dir.join("run");
    let result = run(
        &kiln,
        &[
            "train",
            "--config",
            config.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ],
        &[],
    );
    let stderr = text(&result.stderr);
    // 78: what `cargo xtask kiln` takes as "build kiln-tensorflow, then run again".
    assert_eq!(result.status.code(), Some(78), "{stderr}");
    let expected = dir.join("kiln-tensorflow");
    assert!(
        stderr.contains(&format!("{} does not exist", expected.display())),
        "{stderr}"
    );
    assert!(
        stderr.contains("cargo build --release --bins -p kiln"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!out.exists(), "nothing is written");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn what_tensorflow_printed_before_dying_at_start_is_shown() {
    // A stand-in that dies before any `main` (as TensorFlow aborting while it
    // loads): what it printed reaches the user, and kiln dies of the same signal.
    let script = "#!/bin/sh\n\
                  echo \"F0000 cpu_feature_guard.cc:1] this CPU lacks AVX (level $TF_CPP_MIN_LOG_LEVEL)\" >&2\n\
                  kill -ABRT $$\n";
    let (dir, kiln) = lone_kiln("quiet-abort", Some(script));
    let config = tiny_config(&dir, "tensorflow");
    let result = run(
        &kiln,
        &[
            "eval",
            "--config",
            config.to_str().unwrap(),
            "--checkpoint",
            "x",
        ],
        &[],
    );
    let stderr = text(&result.stderr);
    use std::os::unix::process::ExitStatusExt;
    // A core-dumping signal is reported as the shell reports it (128 + 6).
    assert_eq!(
        result.status.code(),
        Some(134),
        "{:?} {stderr}",
        result.status.signal()
    );
    assert!(
        stderr.contains("F0000 cpu_feature_guard.cc:1] this CPU lacks AVX (level 1)"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `kiln` decides from the command line and the config alone that a command
/// needs TensorFlow, and runs it in `kiln-tensorflow` before it reads anything
/// else: a stand-in sibling that prints its arguments runs even though the
/// checkpoint does not exist (`kiln` itself refuses it as soon as it reads it,
/// as it still does for the commands it runs itself).
#[test]
fn commands_that_need_tensorflow_go_to_kiln_tensorflow_before_anything_is_read() {
    let script = "#!/bin/sh\necho \"kiln-tensorflow ran: $*\"\n";
    let (dir, kiln) = lone_kiln("quiet-decided", Some(script));
    let path = |name: &str| dir.join(name).to_str().unwrap().to_owned();
    let missing = path("missing.safetensors");
    // A TensorFlow model with a SavedModel feature extractor (which does not exist either).
    let saved_model = dir.join("saved_model.toml");
    std::fs::write(
        &saved_model,
        format!(
            r#"
backend = "tensorflow"
output_dir = "{run}"

[data]
dataset = "digits"
batch_size = 16

[model]
type = "sequential"
layers = [
  {{ type = "saved_model", path = "{features}" }},
  {{ type = "linear", in_features = 16, out_features = 10 }},
]

[loss]
type = "cross_entropy"

[optimizer]
type = "adam"
lr = 0.01
"#,
            run = path("run"),
            features = path("no-such-savedmodel"),
        ),
    )
    .unwrap();
    let saved_model = saved_model.to_str().unwrap();
    let torch = tiny_config(&dir, "torch");
    let torch = torch.to_str().unwrap();
    let (out, onnx) = (path("out"), path("out.onnx"));
    let forwarded: [&[&str]; 5] = [
        &[
            "export",
            "--format",
            "savedmodel",
            "--checkpoint",
            &missing,
            "--output",
            &out,
        ],
        &[
            "export",
            "--format",
            "onnx",
            "--config",
            saved_model,
            "--checkpoint",
            &missing,
            "--output",
            &onnx,
        ],
        &["eval", "--config", saved_model, "--checkpoint", &missing],
        // The flags are applied to the config before the decision.
        &[
            "train",
            "--config",
            torch,
            "--backend",
            "tensorflow",
            "--output",
            &out,
        ],
        &["inspect", dir.to_str().unwrap()],
    ];
    for args in forwarded {
        let result = run(&kiln, args, &[]);
        let (stdout, stderr) = (text(&result.stdout), text(&result.stderr));
        assert!(result.status.success(), "{args:?}: {stderr}");
        assert_eq!(
            stdout.trim(),
            format!("kiln-tensorflow ran: {}", args.join(" ")),
            "{args:?}: {stderr}"
        );
    }
    // Torch's commands run in `kiln`, which reads the checkpoint and refuses it.
    let own: [&[&str]; 2] = [
        &[
            "export",
            "--format",
            "onnx",
            "--config",
            torch,
            "--checkpoint",
            &missing,
            "--output",
            &onnx,
        ],
        &["eval", "--config", torch, "--checkpoint", &missing],
    ];
    for args in own {
        let result = run(&kiln, args, &[]);
        let (stdout, stderr) = (text(&result.stdout), text(&result.stderr));
        assert_eq!(result.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            !stdout.contains("kiln-tensorflow ran"),
            "{args:?}: {stdout}"
        );
        assert!(stderr.contains("missing.safetensors"), "{args:?}: {stderr}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
