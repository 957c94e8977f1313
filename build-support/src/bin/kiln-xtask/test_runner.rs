//! `cargo xtask test`: cargo builds every test binary of the selection once,
//! then the binaries run `jobs` at a time (one per CPU by default), each with
//! what `cargo test` gives it (its package's directory, `CARGO_*`, the library
//! path), and its output is printed whole when it ends; the doctests follow.
//!
//! `cargo test` runs the binaries one after the other, and most of Kiln's wait
//! on a single process (a Python reference, a `kiln` child, a rank), leaving
//! the other CPUs idle. Within a binary nothing changes: its tests keep their
//! threads and their locks (`serial()`), and binaries share nothing but the
//! fixtures made once per run, which are made under a lock.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Arguments that choose targets: with any of them, `cargo test` itself runs
/// what they choose, as it would without Kiln.
const TARGET_FLAGS: &[&str] = &[
    "--lib",
    "--bin",
    "--bins",
    "--example",
    "--examples",
    "--test",
    "--tests",
    "--bench",
    "--benches",
    "--all-targets",
    "--doc",
    "--no-run",
];

/// One test binary cargo built.
struct TestBinary {
    /// The executable.
    executable: PathBuf,
    /// Its package's directory, where `cargo test` runs it.
    package_dir: PathBuf,
    /// Its package's name.
    package: String,
    /// What cargo prints for it (`tests/cli_ops.rs`, `unittests src/lib.rs`).
    label: String,
}

/// The number of binaries run at once: `KILN_TEST_JOBS`, else one per CPU.
pub(crate) fn jobs() -> usize {
    std::env::var("KILN_TEST_JOBS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// Whether `args` (what follows `cargo test`) leave the selection of targets
/// to the runner: no target flag before `--`.
pub(crate) fn runs_everything(args: &[OsString]) -> bool {
    args.iter()
        .take_while(|a| *a != "--")
        .filter_map(|a| a.to_str())
        .all(|a| {
            !TARGET_FLAGS
                .iter()
                .any(|f| a == *f || a.starts_with(&format!("{f}=")))
        })
}

/// Runs the tests that `cargo test ARGS` would (`args` holds them, `--` and
/// the test binaries' arguments included), `jobs` binaries at a time, with
/// cargo at `cargo` in `env` from `workspace`. Every binary runs whatever
/// fails before it; the failures are listed at the end.
pub(crate) fn run(
    cargo: &OsString,
    env: &[(String, String)],
    workspace: &Path,
    args: &[OsString],
    jobs: usize,
) -> ExitCode {
    let split = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let (cargo_args, test_args) = (&args[..split], args.get(split + 1..).unwrap_or_default());
    let started = Instant::now();
    let built = match build(cargo, env, workspace, cargo_args) {
        Ok(built) => built,
        Err(code) => return code,
    };
    let (binaries, library_path) = built;
    log::info!(
        "{} test binaries built in {:.0?}; running them {jobs} at a time",
        binaries.len(),
        started.elapsed()
    );
    let ran = Instant::now();
    let mut failed = run_binaries(binaries, test_args, cargo, env, &library_path, jobs);
    log::info!("test binaries ran in {:.0?}", ran.elapsed());

    // The doctests, as `cargo test` runs them after the binaries.
    let doc = Instant::now();
    let mut doc_args: Vec<OsString> = vec!["test".into()];
    doc_args.extend(cargo_args.iter().cloned());
    doc_args.push("--doc".into());
    if !test_args.is_empty() {
        doc_args.push("--".into());
        doc_args.extend(test_args.iter().cloned());
    }
    let status = Command::new(cargo)
        .args(&doc_args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(workspace)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(_) | Err(_) => failed.push("the doctests (cargo test --doc)".to_owned()),
    }
    log::info!("doctests ran in {:.0?}", doc.elapsed());
    if failed.is_empty() {
        return ExitCode::SUCCESS;
    }
    log::error!(
        "{} test targets failed:\n    {}",
        failed.len(),
        failed.join("\n    ")
    );
    // `cargo test`'s exit status for failing tests.
    ExitCode::from(101)
}

/// `cargo test --no-run`: the binaries built, and the directories the
/// library path needs (the target's `deps` and build scripts' native search
/// paths inside it), or cargo's exit status when the build failed.
fn build(
    cargo: &OsString,
    env: &[(String, String)],
    workspace: &Path,
    cargo_args: &[OsString],
) -> Result<(Vec<TestBinary>, Vec<PathBuf>), ExitCode> {
    let mut child = Command::new(cargo)
        .arg("test")
        .args(cargo_args)
        .args(["--no-run", "--message-format=json-render-diagnostics"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(workspace)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| {
            log::error!("cannot run {}: {e}", cargo.to_string_lossy());
            ExitCode::FAILURE
        })?;
    let mut binaries = Vec::new();
    let mut linked: Vec<PathBuf> = Vec::new();
    let mut target_dir: Option<PathBuf> = None;
    let stdout = child.stdout.take().ok_or(ExitCode::FAILURE)?;
    for line in BufReader::new(stdout).lines() {
        let Ok(line) = line else { break };
        let Ok(message) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        match message["reason"].as_str() {
            Some("compiler-artifact") if message["profile"]["test"] == true => {
                let Some(executable) = message["executable"].as_str().map(PathBuf::from) else {
                    continue;
                };
                if target_dir.is_none() {
                    target_dir = executable
                        .parent()
                        .and_then(Path::parent)
                        .map(Path::to_path_buf);
                }
                let manifest = PathBuf::from(message["manifest_path"].as_str().unwrap_or_default());
                let package_dir = manifest
                    .parent()
                    .map_or_else(|| workspace.to_path_buf(), Path::to_path_buf);
                let src = PathBuf::from(message["target"]["src_path"].as_str().unwrap_or_default());
                let src = src
                    .strip_prefix(&package_dir)
                    .unwrap_or(&src)
                    .display()
                    .to_string();
                let kind = message["target"]["kind"][0].as_str().unwrap_or_default();
                let label = match kind {
                    "test" | "bench" | "example" => src,
                    _ => format!("unittests {src}"),
                };
                let package = message["package_id"]
                    .as_str()
                    .and_then(|id| id.rsplit('#').next())
                    .and_then(|n| n.split('@').next())
                    .unwrap_or_default()
                    .to_owned();
                binaries.push(TestBinary {
                    executable,
                    package_dir,
                    package,
                    label,
                });
            }
            Some("build-script-executed") => {
                if let Some(paths) = message["linked_paths"].as_array() {
                    for p in paths.iter().filter_map(Value::as_str) {
                        // `native=/dir`, `dependency=/dir` or a bare directory.
                        let dir = PathBuf::from(p.split_once('=').map_or(p, |(_, d)| d));
                        if !linked.contains(&dir) {
                            linked.push(dir);
                        }
                    }
                }
            }
            _ => {}
        }
    }
    let status = child.wait().map_err(|_| ExitCode::FAILURE)?;
    if !status.success() {
        return Err(ExitCode::from(
            status.code().unwrap_or(101).clamp(1, 255) as u8
        ));
    }
    // As cargo does: the target's own directories, and the build scripts'
    // search paths that lie inside it.
    let mut library_path = Vec::new();
    if let Some(target) = &target_dir {
        library_path.push(target.join("deps"));
        library_path.push(target.clone());
        library_path.extend(linked.into_iter().filter(|d| d.starts_with(target)));
    }
    Ok((binaries, library_path))
}

/// Runs `binaries`, `jobs` at a time, each printed whole (cargo's `Running`
/// line, then its output) as it ends: the labels of those that failed.
fn run_binaries(
    binaries: Vec<TestBinary>,
    test_args: &[OsString],
    cargo: &OsString,
    env: &[(String, String)],
    library_path: &[PathBuf],
    jobs: usize,
) -> Vec<String> {
    let queue = Arc::new(Mutex::new(binaries.into_iter().collect::<VecDeque<_>>()));
    let failed = Arc::new(Mutex::new(Vec::new()));
    let mut path: Vec<PathBuf> = library_path.to_vec();
    if let Some(existing) = std::env::var_os("LD_LIBRARY_PATH") {
        path.extend(std::env::split_paths(&existing));
    }
    let library_path = std::env::join_paths(path).unwrap_or_default();
    std::thread::scope(|scope| {
        for _ in 0..jobs.max(1) {
            let (queue, failed, library_path) = (&queue, &failed, &library_path);
            scope.spawn(move || loop {
                let next = queue.lock().map(|mut q| q.pop_front()).ok().flatten();
                let Some(binary) = next else { break };
                let (ok, output, took) = run_one(&binary, test_args, cargo, env, library_path);
                let relative = binary
                    .executable
                    .strip_prefix(std::env::current_dir().unwrap_or_default())
                    .unwrap_or(&binary.executable)
                    .display()
                    .to_string();
                let mut out = std::io::stdout().lock();
                let _ = writeln!(
                    out,
                    "     Running {} ({relative}; {:.1?})",
                    binary.label, took
                );
                let _ = out.write_all(&output);
                let _ = out.flush();
                if !ok {
                    if let Ok(mut f) = failed.lock() {
                        f.push(format!("-p {} {}", binary.package, binary.label));
                    }
                }
            });
        }
    });
    Arc::try_unwrap(failed)
        .ok()
        .and_then(|m| m.into_inner().ok())
        .unwrap_or_default()
}

/// Runs one binary with its stdout and stderr in one file (beside the
/// executable, so that a process it leaves behind holding them cannot keep
/// the runner waiting): whether it passed, what it printed, and how long it took.
fn run_one(
    binary: &TestBinary,
    test_args: &[OsString],
    cargo: &OsString,
    env: &[(String, String)],
    library_path: &OsString,
) -> (bool, Vec<u8>, Duration) {
    let started = Instant::now();
    let mut log = binary.executable.clone().into_os_string();
    log.push(".kiln-test.log");
    let log = PathBuf::from(log);
    let ran = std::fs::File::create(&log).and_then(|file| {
        let status = Command::new(&binary.executable)
            .args(test_args)
            .current_dir(&binary.package_dir)
            // What cargo gives a test binary: the provisioned libraries' variables,
            // its package, the library path.
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("CARGO", cargo)
            .env("CARGO_MANIFEST_DIR", &binary.package_dir)
            .env("CARGO_PKG_NAME", &binary.package)
            .env("LD_LIBRARY_PATH", library_path)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .status()?;
        let mut output = Vec::new();
        std::fs::File::open(&log)?.read_to_end(&mut output)?;
        Ok((status.success(), output))
    });
    let _ = std::fs::remove_file(&log);
    match ran {
        Ok((ok, output)) => (ok, output, started.elapsed()),
        Err(e) => (
            false,
            format!("error: cannot run {}: {e}\n", binary.executable.display()).into_bytes(),
            started.elapsed(),
        ),
    }
}
