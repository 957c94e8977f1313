//! What the CLI tests share: the `kiln` binary, scratch directories, a small
//! run config, and readers of what a run writes.

#![allow(dead_code)] // each test file uses its own part

pub mod distributed;

use std::path::{Path, PathBuf};
use std::process::Command;

pub const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// One `kiln` run at a time: the runs compare numbers bitwise, and concurrent
/// runs competing for the two cores were seen to perturb the last bits.
pub static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub fn scratch(name: &str) -> PathBuf {
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A small, quick run: an MLP with dropout on the digits, checkpoints every 5 steps.
pub fn config(dir: &Path, workers: usize) -> PathBuf {
    let text = format!(
        r#"
seed = 3
output_dir = "{out}"

[data]
dataset = "digits"
batch_size = 32
workers = {workers}
scale = 16.0

[model]
type = "sequential"
layers = [
  {{ type = "linear", in_features = 64, out_features = 64 }},
  {{ type = "relu" }},
  {{ type = "dropout", p = 0.2 }},
  {{ type = "linear", in_features = 64, out_features = 10 }},
]

[loss]
type = "cross_entropy"

[optimizer]
type = "adam"
lr = 0.003

[schedule]
type = "step_lr"
step_size = 1
gamma = 0.7

[training]
epochs = 3
log_every = 1

[checkpoint]
every_n_steps = 5
keep_last = 3

[logging]
tensorboard = false
plots = false
progress = false
"#,
        out = dir.join("default-out").display()
    );
    let path = dir.join("config.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Whether the provisioned digits are there (a skip otherwise, which fails
/// under `KILN_REQUIRE_REFERENCES`, as in CI).
pub fn digits_available() -> bool {
    kiln_testkit::digits("a CLI test on the digits").is_some()
}

/// Runs `kiln args` (Kiln's logs at `warn`, TensorFlow's banners quiet), which
/// must succeed; what it returned.
pub fn kiln(args: &[&str]) -> std::process::Output {
    let out = Command::new(KILN)
        .args(args)
        .env("RUST_LOG", "warn")
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kiln {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `kiln train --config config --output output` with `extra` flags: what it printed.
pub fn train(config: &str, output: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "train",
        "--config",
        config,
        "--output",
        output.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    String::from_utf8(kiln(&args).stdout).unwrap()
}

/// The `loss` column of steps.csv, as written (exact decimal of the f64).
pub fn losses(run: &Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(run.join("steps.csv")).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == "loss").unwrap();
    lines
        .map(|l| {
            let cells: Vec<&str> = l.split(',').collect();
            (cells[0].to_owned(), cells[col].to_owned())
        })
        .collect()
}

/// What `kiln args` printed on standard output (it must succeed).
pub fn kiln_stdout(args: &[&str]) -> String {
    String::from_utf8_lossy(&kiln(args).stdout).into_owned()
}

/// The value of `name` in `kiln eval`'s table.
pub fn metric(table: &str, name: &str) -> f64 {
    table
        .lines()
        .find_map(|l| {
            let mut parts = l.split_whitespace();
            (parts.next() == Some(name)).then(|| parts.next().unwrap().parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no {name} in\n{table}"))
}

/// Runs `kiln args`, which must fail: what it printed on standard error.
pub fn kiln_fails(args: &[&str]) -> String {
    let out = Command::new(KILN)
        .args(args)
        .env("RUST_LOG", "warn")
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .output()
        .unwrap();
    assert!(!out.status.success(), "kiln {args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The example's tiny LLaMA (`examples/pretrained/make_tiny_llama.py`), made
/// once per test run and linked at `at` (where a config's relative path finds
/// it). Read-only, as every shared fixture.
pub fn tiny_llama(python: &Path, at: &Path) {
    let made = kiln_testkit::made_once_per_run(
        python,
        &kiln_testkit::workspace_root().join("examples/pretrained/make_tiny_llama.py"),
        &[] as &[&str],
        "tiny-llama",
    );
    if let Some(parent) = at.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::os::unix::fs::symlink(&made, at).unwrap();
}

/// The directory that `tests/reference/{script} make DIR` fills, made once per
/// test run and shared by every test binary ([`kiln_testkit::made_once_per_run`],
/// under the name `name`; `cell` keeps it for this binary), or `None` where the
/// Python reference cannot run. Read-only: a test copies what it changes.
pub fn made_once(
    test: &str,
    cell: &'static std::sync::OnceLock<PathBuf>,
    script: &str,
    name: &str,
) -> Option<PathBuf> {
    let python = kiln_testkit::python(test)?;
    Some(
        cell.get_or_init(|| {
            kiln_testkit::made_once_per_run(
                &python,
                &kiln_testkit::workspace_root()
                    .join("tests/reference")
                    .join(script),
                &[Path::new("make")],
                name,
            )
        })
        .clone(),
    )
}
