//! `cargo xtask`: provisions Kiln's native libraries on first use, then runs cargo.
//!
//! ```text
//! cargo xtask setup            provision .kiln/ (idempotent) and say what is where
//! cargo xtask test [ARGS]      setup, then `cargo test --workspace --no-fail-fast ARGS` (with
//!                              `--features kiln/cuda` where libtorch has CUDA and nvcc is there),
//!                              the test binaries one per CPU at a time (`KILN_TEST_JOBS=1`:
//!                              one at a time, as cargo runs them)
//! cargo xtask run [ARGS]       setup, then `cargo run ARGS`
//! cargo xtask kiln [ARGS]      setup, then the `kiln` CLI in release mode with ARGS (built with
//!                              libtorch only, and without the optional features until a command
//!                              needs one; kiln-tensorflow is built when a command first needs it;
//!                              on a fresh machine, the build runs while the virtualenv installs,
//!                              the torch wheel first)
//! cargo xtask cargo ARGS       setup, then `cargo ARGS` (clippy, doc, bench, ...)
//! cargo xtask env              print shell `export` lines for the provisioned libraries
//! cargo xtask book             build the guide (docs/) into target/book and check its links
//! ```

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

use kiln_build::{setup, Setup};

mod prebuild;
mod test_runner;

const USAGE: &str =
    "usage: cargo xtask <setup | test [ARGS] | run [ARGS] | kiln [ARGS] | cargo ARGS | env | book>";

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format(|buf, record| writeln!(buf, "kiln: {}", record.args()))
        .init();
    // Python keeps the bytecode of what it imports in Kiln's virtualenv
    // (`import torch, transformers` takes 16 s from source and 7 s from that
    // cache, and the tests start Python for each reference they compute): a
    // PYTHONDONTWRITEBYTECODE from the environment, as container images set
    // it, is not passed on to what this command runs. Nothing else runs yet.
    if std::env::var_os("PYTHONDONTWRITEBYTECODE").is_some() {
        std::env::remove_var("PYTHONDONTWRITEBYTECODE");
    }
    let mut args = std::env::args_os().skip(1);
    let Some(command) = args.next() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let rest: Vec<OsString> = args.collect();
    let cargo_args: Vec<OsString> = match command.to_str() {
        Some("setup") | Some("env") => Vec::new(),
        // The guide needs no native library: no provisioning.
        Some("book") if rest.is_empty() => return book(),
        // Every test binary runs, whatever fails before it; cargo names each
        // failed one at the end.
        Some("test") => ["test", "--workspace", "--no-fail-fast"]
            .into_iter()
            .map(OsString::from)
            .chain(rest.iter().cloned())
            .collect(),
        Some("run") => std::iter::once(OsString::from("run"))
            .chain(rest.iter().cloned())
            .collect(),
        // libtorch only, and at first without the optional features: neither
        // the TensorFlow crates nor tokenizers, parquet, the image decoders and
        // ONNX are compiled for a torch run that does not need them.
        Some("kiln") => kiln_run(kiln_features(), &rest),
        Some("cargo") if !rest.is_empty() => rest.clone(),
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };

    // The CLI's build starts while a fresh machine installs the virtualenv.
    let prebuild = match command.to_str() {
        Some("kiln") => prebuild::Prebuild::start(&workspace_root(), &cargo_args),
        _ => None,
    };
    let ready = match setup(&workspace_root()) {
        Ok(ready) => ready,
        Err(error) => {
            eprintln!("error: {}", error.display_chain());
            return ExitCode::FAILURE;
        }
    };
    if let Some(prebuild) = prebuild {
        prebuild.finish();
    }
    match command.to_str() {
        Some("setup") => {
            describe(&ready);
            ExitCode::SUCCESS
        }
        Some("env") => {
            for (key, value) in ready.cargo_env() {
                println!("export {key}='{value}'");
            }
            ExitCode::SUCCESS
        }
        // `kiln` runs the commands that need TensorFlow in `kiln-tensorflow`, the
        // executable beside it. It is built the first time a command needs it:
        // `kiln` then exits with TENSORFLOW_MISSING having read and written
        // nothing, and the command runs again once it is there.
        Some("kiln") => match cargo_status(&ready, &cargo_args) {
            Some(FEATURES_MISSING) if kiln_features() == LEAN_FEATURES => {
                log::info!(
                    "this command needs more of Kiln than the main job: building kiln with every \
                     feature (once; later runs use that build)"
                );
                let full = kiln_run(FULL_FEATURES, &rest);
                let build: Vec<OsString> = std::iter::once(OsString::from("build"))
                    .chain(full[1..].iter().take_while(|a| *a != "--").cloned())
                    .collect();
                match run_cargo(&ready, &build) {
                    built if built == ExitCode::SUCCESS => {
                        if let Err(error) = std::fs::write(full_features_marker(), FULL_FEATURES) {
                            log::warn!("cannot remember that kiln has every feature: {error}");
                        }
                        run_cargo(&ready, &full)
                    }
                    failed => failed,
                }
            }
            Some(TENSORFLOW_MISSING) if !tensorflow_exe().is_file() => {
                log::info!(
                    "this command needs TensorFlow: building kiln-tensorflow (once; later runs \
                     reuse it)"
                );
                let sibling = [
                    "build",
                    "--release",
                    "-p",
                    "kiln",
                    "--bin",
                    "kiln-tensorflow",
                ]
                .map(OsString::from);
                match run_cargo(&ready, &sibling) {
                    built if built == ExitCode::SUCCESS => run_cargo(&ready, &cargo_args),
                    failed => failed,
                }
            }
            status => exit_code(status),
        },
        // The CUDA code (kernels, CUDA graphs, NCCL) is compiled and its tests run
        // (skipping without a GPU) wherever libtorch is a CUDA build and nvcc is
        // there, as with the provisioned wheels: one build for every test.
        Some("test") => {
            let mut args = cargo_args.clone();
            if cuda_buildable(&ready) {
                // Before the test binaries' own arguments.
                let at = args.iter().position(|a| a == "--").unwrap_or(args.len());
                args.splice(at..at, ["--features", "kiln/cuda"].map(OsString::from));
            }
            let jobs = test_runner::jobs();
            if jobs > 1 && test_runner::runs_everything(&args[1..]) {
                let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
                test_runner::run(
                    &cargo,
                    &ready.cargo_env(),
                    &workspace_root(),
                    &args[1..],
                    jobs,
                )
            } else {
                run_cargo(&ready, &args)
            }
        }
        _ => run_cargo(&ready, &cargo_args),
    }
}

/// Whether Kiln's `cuda` feature builds here: libtorch has CUDA and an nvcc
/// is where kiln-build looks (`NVCC`, `CUDA_HOME`, the virtualenv's wheels).
fn cuda_buildable(ready: &Setup) -> bool {
    let given = ["NVCC", "CUDA_HOME", "CUDA_PATH"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|v| !v.is_empty()));
    let provisioned = ready
        .venv
        .site_packages
        .join("nvidia/cu13/bin/nvcc")
        .is_file();
    ready.libtorch.has_cuda() && (given || provisioned)
}

/// The features of `kiln` (the CLI with libtorch only; TensorFlow is in
/// `kiln-tensorflow`) for the main job: libtorch and nothing optional.
const LEAN_FEATURES: &str = "torch";

/// Every feature of `kiln` but TensorFlow: Kiln's fused ops, language models
/// (tokenizers, text data, Hugging Face checkpoints), image data and ONNX.
const FULL_FEATURES: &str = "torch,ops,text,vision,onnx";

/// `kiln`'s exit status when a command needs a feature it was built without
/// (`kiln_cli::FEATURES_MISSING_EXIT_CODE`): nothing was read or written.
const FEATURES_MISSING: i32 = 69;

/// `cargo run` of the release `kiln` with `features` and the arguments `rest`.
fn kiln_run(features: &str, rest: &[OsString]) -> Vec<OsString> {
    [
        "run",
        "--release",
        "-p",
        "kiln",
        "--no-default-features",
        "--features",
        features,
        "--bin",
        "kiln",
        "--",
    ]
    .into_iter()
    .map(OsString::from)
    .chain(rest.iter().cloned())
    .collect()
}

/// The features `cargo xtask kiln` builds `kiln` with: [`LEAN_FEATURES`] until
/// a command has needed more, then [`FULL_FEATURES`] (remembered beside the
/// build, so that the two builds do not replace each other in turn).
fn kiln_features() -> &'static str {
    if full_features_marker().is_file() {
        FULL_FEATURES
    } else {
        LEAN_FEATURES
    }
}

/// The file that says `target/release/kiln` has every feature.
fn full_features_marker() -> PathBuf {
    release_dir().join("kiln.all-features")
}

/// `kiln`'s exit status when a command needs `kiln-tensorflow` and it is not
/// built (`kiln_cli::TENSORFLOW_MISSING_EXIT_CODE`; this crate builds before
/// the CLI exists, so it cannot name it).
const TENSORFLOW_MISSING: i32 = 78;

/// Where `cargo build --release` puts `kiln-tensorflow`.
fn tensorflow_exe() -> PathBuf {
    release_dir().join("kiln-tensorflow")
}

/// Where `cargo build --release` puts executables.
fn release_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    target.join("release")
}

/// The workspace this binary was built from (cargo sets `CARGO_MANIFEST_DIR` for
/// `cargo run`; the compile-time value is the fallback).
fn workspace_root() -> PathBuf {
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

fn describe(ready: &Setup) {
    println!("virtualenv   {}", ready.venv.python.display());
    println!(
        "libtorch     {} ({}{})",
        ready.libtorch.root.display(),
        ready.libtorch.version,
        if ready.libtorch.has_cuda() {
            ", CUDA build"
        } else {
            ""
        }
    );
    println!(
        "tensorflow   {} ({})",
        ready.tensorflow.c_api.display(),
        ready.tensorflow.version
    );
    println!("pkg-config   {}", ready.layout.pkgconfig().display());
}

fn run_cargo(ready: &Setup, args: &[OsString]) -> ExitCode {
    exit_code(cargo_status(ready, args))
}

/// Runs cargo with `args`: its exit status (`None` when it could not run or
/// was killed by a signal, said on stderr).
fn cargo_status(ready: &Setup, args: &[OsString]) -> Option<i32> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(&cargo)
        .args(args)
        .envs(ready.cargo_env())
        .current_dir(workspace_root())
        .status();
    match status {
        Ok(status) => status.code(),
        Err(error) => {
            eprintln!("error: cannot run {}: {error}", cargo.to_string_lossy());
            None
        }
    }
}

fn exit_code(status: Option<i32>) -> ExitCode {
    match status {
        Some(0) => ExitCode::SUCCESS,
        Some(code) => ExitCode::from(code.clamp(1, 255) as u8),
        None => ExitCode::FAILURE,
    }
}

/// `cargo xtask book`: mdBook (installed on first use: `kiln_build::book::ensure_mdbook`)
/// builds `docs/` into `target/book`, then every link of the guide and the README is
/// checked.
fn book() -> ExitCode {
    match kiln_build::book::build(&workspace_root()) {
        Ok(report) => {
            if let Some(took) = report.installed_in {
                log::info!("installed {} in {:.0?}", report.mdbook.display(), took);
            }
            log::info!(
                "book built in {:.1?} into {}; links of {} files checked",
                report.built_in,
                report.html.display(),
                report.files_checked
            );
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {}", error.display_chain());
            ExitCode::FAILURE
        }
    }
}
