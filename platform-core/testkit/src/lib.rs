//! What Kiln's tests share, across its crates: where the project virtualenv
//! (which computes the reference numbers with Python PyTorch and TensorFlow)
//! and the provisioned data sets are, and how a test that cannot reach them
//! skips.
//!
//! A test that needs a reference skips with a `kiln-testkit: SKIPPED <test>:
//! <why>` line ([`SKIP_MARKER`]) on a machine without the virtualenv, so `cargo
//! test` works before `cargo xtask setup`. Where [`REQUIRE_REFERENCES`] is set
//! (`.ci/run` sets it), the same test fails instead: CI never passes a reference
//! test that did not run. A test that needs a GPU skips with the same line
//! everywhere ([`skip_without_gpu`]), and `.ci/run`'s closing line counts it as
//! skipped, not passed.
//!
//! ```no_run
//! let Some(python) = kiln_testkit::python("my_test") else {
//!     return; // skipped, with a message
//! };
//! # let _ = python;
//! ```

pub mod ranks;

use std::path::{Path, PathBuf};

/// The environment variable that turns every reference skip into a failure.
pub const REQUIRE_REFERENCES: &str = "KILN_REQUIRE_REFERENCES";

/// Whether skipping a reference test is a failure here ([`REQUIRE_REFERENCES`]
/// set to anything but `0` or empty).
pub fn references_required() -> bool {
    std::env::var(REQUIRE_REFERENCES).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// The start of the line a skipped test prints (`kiln-testkit: SKIPPED <test>:
/// <why>`); `.ci/run` counts these lines as skipped tests.
pub const SKIP_MARKER: &str = "kiln-testkit: SKIPPED";

/// Skips `test` because `why`: prints the [`SKIP_MARKER`] line, or panics with
/// that reason where [`references_required`].
///
/// # Panics
///
/// Where [`REQUIRE_REFERENCES`] is set.
pub fn skip(test: &str, why: &str) {
    if references_required() {
        panic!("{test} cannot run here ({why}), and {REQUIRE_REFERENCES} is set: a skip fails");
    }
    report_skip(test, why);
}

/// Skips `test`, which needs a CUDA device (or a build with a `cuda` feature)
/// that this machine or build lacks: prints the [`SKIP_MARKER`] line, also
/// under [`REQUIRE_REFERENCES`] (CI has no GPU), so the run counts it as skipped.
/// Call it once per test, as the test returns.
pub fn skip_without_gpu(test: &str, why: &str) {
    report_skip(test, why);
}

fn report_skip(test: &str, why: &str) {
    use std::io::Write;
    // Written to the process's stderr, not through `eprintln!`: libtest captures
    // what the print macros write in a passing test and never shows it, and this
    // line must reach `cargo test`'s output, where `.ci/run` counts it. One write,
    // so that parallel tests cannot split it.
    let line = format!("{SKIP_MARKER} {test}: {why}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// The workspace root (the directory holding `.kiln/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The project virtualenv's interpreter (`.kiln/venv/bin/python`, made by
/// `cargo xtask`), or `None` after [`skip`]ping `test`.
pub fn python(test: &str) -> Option<PathBuf> {
    provisioned(
        test,
        workspace_root().join(".kiln/venv/bin/python"),
        "the project virtualenv",
    )
}

/// The UCI digits file that `cargo xtask setup` provisions
/// (`.kiln/data/digits.csv.gz`), or `None` after [`skip`]ping `test`.
pub fn digits(test: &str) -> Option<PathBuf> {
    provisioned(
        test,
        workspace_root().join(".kiln/data/digits.csv.gz"),
        "the digits data set",
    )
}

fn provisioned(test: &str, path: PathBuf, what: &str) -> Option<PathBuf> {
    if path.exists() {
        return Some(path);
    }
    skip(
        test,
        &format!(
            "{what} is not provisioned ({} is missing); run `cargo xtask setup`",
            path.display()
        ),
    );
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workspace_root_holds_the_workspace_manifest() {
        let manifest =
            std::fs::read_to_string(workspace_root().join("Cargo.toml")).unwrap_or_default();
        assert!(manifest.contains("[workspace]"), "{manifest}");
    }
}

/// Tolerances the parity suites share: [`F32`](tolerance::F32) and
/// [`TF32`](tolerance::TF32) relative to `max(1, |expected|)` (for
/// [`assert_close`]); [`BF16`](tolerance::BF16) as `torch.testing` states it
/// (for [`assert_allclose`]).
pub mod tolerance {
    /// float32 on the CPU against Python float32 (summation order differs).
    pub const F32: f64 = 1e-5;
    /// float32 on CUDA, where cuDNN convolutions use TF32 by default (as in
    /// PyTorch), rounding inputs to 10 mantissa bits.
    pub const TF32: f64 = 2e-3;
    /// `torch.testing.assert_close`'s default for bfloat16 (8 significant
    /// bits): rtol 1.6e-2, atol 1e-5.
    pub const BF16: AllClose = AllClose {
        rtol: 1.6e-2,
        atol: 1e-5,
    };

    /// A tolerance as `torch.testing.assert_close` and `numpy.allclose` state
    /// it: `|actual - expected| <= atol + rtol * |expected|`.
    #[derive(Clone, Copy, Debug, PartialEq)]
    pub struct AllClose {
        /// The part relative to `|expected|`.
        pub rtol: f64,
        /// The absolute part, which alone bounds values near zero.
        pub atol: f64,
    }
}

/// Runs `python script args...` (TensorFlow's C++ logging quietened) and
/// returns its standard output; panics with the script's standard error if it
/// fails, naming the script.
pub fn run_reference<A: AsRef<std::ffi::OsStr>>(
    python: &Path,
    script: &Path,
    args: &[A],
) -> String {
    let output = std::process::Command::new(python)
        .arg(script)
        .args(args)
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .output()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", python.display()));
    assert!(
        output.status.success(),
        "{} failed ({}):\n{}",
        script.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .unwrap_or_else(|e| panic!("{}: output is not UTF-8: {e}", script.display()))
}

/// The directory that `python script args... DIR` fills, made once per test
/// run and shared by every test binary of it: under the target directory's
/// `kiln-fixtures/`, named `name` and a hash of the script's text, its
/// arguments and the interpreter (so an edited script or another virtualenv
/// makes it anew). The script writes into a fresh directory that is then
/// renamed into place, so a binary never sees half a fixture; a binary that
/// wants it while another makes it waits for that one (a file lock).
///
/// Tests must treat the directory as read-only: copy what they change.
pub fn made_once_per_run<A: AsRef<std::ffi::OsStr>>(
    python: &Path,
    script: &Path,
    args: &[A],
    name: &str,
) -> PathBuf {
    let text =
        std::fs::read(script).unwrap_or_else(|e| panic!("cannot read {}: {e}", script.display()));
    let mut hash = Fnv64::new();
    hash.write(&text);
    for arg in args {
        hash.write(arg.as_ref().as_encoded_bytes());
        hash.write(b"\0");
    }
    hash.write(python.as_os_str().as_encoded_bytes());
    let root = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
        .join("kiln-fixtures");
    let dir = root.join(format!("{name}-{:016x}", hash.0));
    // The tests of one binary run on threads: one makes it, the others wait.
    static MAKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _making = MAKING.lock().unwrap_or_else(|p| p.into_inner());
    if dir.join(DONE).is_file() {
        return dir;
    }
    std::fs::create_dir_all(&root)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", root.display()));
    // So do the binaries that `cargo xtask test` runs at once, under a file lock
    // (released when the file closes, even if this process dies).
    let lock_path = root.join(format!(".{name}-{:016x}.lock", hash.0));
    let lock = std::fs::File::create(&lock_path)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", lock_path.display()));
    lock.lock()
        .unwrap_or_else(|e| panic!("cannot lock {}: {e}", lock_path.display()));
    if dir.join(DONE).is_file() {
        return dir;
    }
    let fresh = root.join(format!(".{name}-{}-{:016x}", std::process::id(), hash.0));
    let _ = std::fs::remove_dir_all(&fresh);
    std::fs::create_dir_all(&fresh)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", fresh.display()));
    let mut all: Vec<&std::ffi::OsStr> = args.iter().map(AsRef::as_ref).collect();
    all.push(fresh.as_os_str());
    run_reference(python, script, &all);
    std::fs::write(fresh.join(DONE), b"")
        .unwrap_or_else(|e| panic!("cannot write into {}: {e}", fresh.display()));
    // Another binary may have put its copy in place meanwhile: keep that one.
    if std::fs::rename(&fresh, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&fresh);
        assert!(
            dir.join(DONE).is_file(),
            "cannot move the fixture {} into {}",
            fresh.display(),
            dir.display()
        );
    }
    dir
}

/// Copies the files of the fixture `from` (a [`made_once_per_run`] directory,
/// flat) into `to`, for a test that writes beside them.
pub fn copy_fixture(from: &Path, to: &Path) {
    let entries =
        std::fs::read_dir(from).unwrap_or_else(|e| panic!("cannot list {}: {e}", from.display()));
    for entry in entries {
        let path = entry
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", from.display()))
            .path();
        if path.is_file() && path.file_name().is_some_and(|n| n != DONE) {
            let name = path.file_name().unwrap_or_default();
            std::fs::copy(&path, to.join(name))
                .unwrap_or_else(|e| panic!("cannot copy {}: {e}", path.display()));
        }
    }
}

/// The file that marks a [`made_once_per_run`] directory complete.
const DONE: &str = ".kiln-fixture-done";

/// FNV-1a, 64 bits: a stable hash of a fixture's inputs (std's hasher is
/// seeded per process).
struct Fnv64(u64);

impl Fnv64 {
    fn new() -> Self {
        Fnv64(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// Runs the calling crate's committed reference script `tests/reference/<name>`
/// with [`run_reference`] and returns its standard output.
///
/// ```no_run
/// # let python = std::path::PathBuf::from("python3");
/// let stdout = kiln_testkit::run_reference_script!(&python, "schedulers.py", &[] as &[&str]);
/// ```
#[macro_export]
macro_rules! run_reference_script {
    ($python:expr, $name:expr, $args:expr $(,)?) => {
        $crate::run_reference(
            $python,
            &::std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/reference")
                .join($name),
            $args,
        )
    };
}

/// A fresh, empty directory under the system temp dir, removed on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates `<temp>/kiln-<tag>-<pid>-<n>`, empty.
    pub fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kiln-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        TempDir(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh, empty directory `<parent>/<name>-<pid>` (a test passes its
/// `CARGO_TARGET_TMPDIR`).
pub fn scratch_dir(parent: &Path, name: &str) -> PathBuf {
    let dir = parent.join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}

/// Asserts `actual` is within `tol` of `expected` elementwise, relative to
/// `max(1, |expected|)`, naming `what`, the worst element and `reference` (the
/// library that computed `expected`) on failure. NaN anywhere fails.
///
/// ```
/// kiln_testkit::assert_close("loss", &[1.0, 2.000001], &[1.0, 2.0], 1e-5, "PyTorch");
/// ```
pub fn assert_close(what: &str, actual: &[f64], expected: &[f64], tol: f64, reference: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: element count");
    let mut worst = (0.0f64, 0usize);
    for (i, (x, y)) in actual.iter().zip(expected).enumerate() {
        let err = (x - y).abs() / y.abs().max(1.0);
        if err.is_nan() || err > worst.0 {
            worst = (err, i);
        }
    }
    if actual.is_empty() {
        return;
    }
    assert!(
        !worst.0.is_nan() && worst.0 <= tol,
        "{what}: element {} is {} but {reference} gives {} (relative error {:.3e} > {tol:.0e})",
        worst.1,
        actual[worst.1],
        expected[worst.1],
        worst.0
    );
}

/// Asserts `|actual - expected| <= atol + rtol * |expected|` elementwise
/// (`torch.testing.assert_close`'s rule), naming `what`, the worst element
/// (the largest ratio of its difference to its allowance) and `reference` on
/// failure. NaN anywhere fails.
///
/// ```
/// use kiln_testkit::tolerance::BF16;
/// kiln_testkit::assert_allclose("y", &[1.01, 1e-3 + 5e-6], &[1.0, 1e-3], BF16, "PyTorch");
/// ```
///
/// ```should_panic
/// // A difference of 1e-4 at 1e-3 is 10% relative: outside bf16's tolerance.
/// use kiln_testkit::tolerance::BF16;
/// kiln_testkit::assert_allclose("y", &[1.1e-3], &[1e-3], BF16, "PyTorch");
/// ```
pub fn assert_allclose(
    what: &str,
    actual: &[f64],
    expected: &[f64],
    tol: tolerance::AllClose,
    reference: &str,
) {
    assert_eq!(actual.len(), expected.len(), "{what}: element count");
    let mut worst = (0.0f64, 0usize);
    for (i, (x, y)) in actual.iter().zip(expected).enumerate() {
        // Equal values agree, also where the allowance is zero (or both are infinite).
        let ratio = if x == y {
            0.0
        } else {
            (x - y).abs() / (tol.atol + tol.rtol * y.abs())
        };
        if ratio.is_nan() || ratio > worst.0 {
            worst = (ratio, i);
        }
        if ratio.is_nan() {
            break;
        }
    }
    if actual.is_empty() {
        return;
    }
    let (x, y) = (actual[worst.1], expected[worst.1]);
    assert!(
        !worst.0.is_nan() && worst.0 <= 1.0,
        "{what}: element {} is {x} but {reference} gives {y} (|difference| {:.3e} > atol {:.0e} + \
         rtol {:.1e} * |expected| = {:.3e})",
        worst.1,
        (x - y).abs(),
        tol.atol,
        tol.rtol,
        tol.atol + tol.rtol * y.abs()
    );
}

/// `a` and `b` agree to `rel` relative tolerance (exactly equal values always agree).
pub fn close(a: f64, b: f64, rel: f64) -> bool {
    a == b || (a - b).abs() <= rel * a.abs().max(b.abs())
}

/// `n` deterministic pseudo-random floats in `[-1, 1)` (xorshift64 from
/// `seed`): the inputs the layer suites feed every backend and exporter.
pub fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `n` deterministic indices in `[0, high)`, drawn as [`noise`] (embedding inputs).
pub fn noise_indices(n: usize, high: usize, seed: u64) -> Vec<i64> {
    noise(n, seed)
        .iter()
        .map(|v| ((v + 1.0) * 0.5 * high as f32) as i64 % high as i64)
        .collect()
}

/// Labels a model can learn, for training tests: for each row of `features`
/// values in `x`, the index of the largest of its first `classes` values.
///
/// ```
/// let x = [0.1, 0.7, 0.2, 9.0, /* row 2 */ 0.5, -1.0, 0.4, 9.0];
/// assert_eq!(kiln_testkit::argmax_labels(&x, 4, 3), [1, 0]);
/// ```
pub fn argmax_labels<T: PartialOrd>(x: &[T], features: usize, classes: usize) -> Vec<i64> {
    assert!(
        (1..=features).contains(&classes) && x.len().is_multiple_of(features),
        "{} values in rows of {features}, labelled by the first {classes}",
        x.len()
    );
    x.chunks(features)
        .map(|row| (0..classes).fold(0, |best, i| if row[i] > row[best] { i } else { best }) as i64)
        .collect()
}

/// The largest absolute difference between `a` and `b` (NaN if either has one).
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "element count");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, |m, d| {
            if d.is_nan() || m.is_nan() {
                f64::NAN
            } else {
                m.max(d)
            }
        })
}

/// One case of the layer suite every backend and exporter runs
/// (`tests/fixtures/layer_cases.json`).
#[derive(Clone, Debug)]
pub struct LayerCase {
    /// The case's name (`conv2d_stride_dilation_groups`).
    pub name: String,
    /// The layer definition, as the JSON of a `kiln_core::model::Layer`.
    pub layer: serde_json::Value,
    /// The input's shape, batch first.
    pub input: Vec<usize>,
    /// For integer (embedding) inputs, the exclusive upper bound of the indices.
    pub int_high: Option<usize>,
    /// Whether the case runs in training mode.
    pub train: bool,
}

impl LayerCase {
    /// Whether the case's layer is, or holds, a layer of type `ty`
    /// (`"sparse_moe"`), for the exporters that refuse one by name.
    pub fn has_layer_type(&self, ty: &str) -> bool {
        fn walk(v: &serde_json::Value, ty: &str) -> bool {
            match v {
                serde_json::Value::Object(map) => {
                    map.get("type").and_then(|t| t.as_str()) == Some(ty)
                        || map.values().any(|v| walk(v, ty))
                }
                serde_json::Value::Array(items) => items.iter().any(|v| walk(v, ty)),
                _ => false,
            }
        }
        walk(&self.layer, ty)
    }
}

/// Every case of `tests/fixtures/layer_cases.json`.
pub fn layer_cases() -> Vec<LayerCase> {
    let path = workspace_root().join("tests/fixtures/layer_cases.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let values: Vec<serde_json::Value> = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
    fn field<T: serde::de::DeserializeOwned>(v: &serde_json::Value, key: &str, path: &Path) -> T {
        serde_json::from_value(v[key].clone())
            .unwrap_or_else(|e| panic!("{}: case field `{key}`: {e}", path.display()))
    }
    values
        .iter()
        .map(|v| LayerCase {
            name: field(v, "name", &path),
            layer: v["layer"].clone(),
            input: field(v, "input", &path),
            int_high: field(v, "int_high", &path),
            train: field(v, "train", &path),
        })
        .collect()
}
