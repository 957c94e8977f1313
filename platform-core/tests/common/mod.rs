//! Helpers shared by the integration tests that compare with Python PyTorch.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The project's virtualenv interpreter, or `None` after a skip (a failure
/// under `KILN_REQUIRE_REFERENCES`, as in CI).
pub fn python(test: &str) -> Option<PathBuf> {
    kiln_testkit::python(test)
}

/// Path of a committed reference script under `tests/reference/`.
pub fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/reference")
        .join(name)
}

/// Runs `python script args...` and returns its standard output; panics with
/// the script's standard error if it fails.
pub fn run(python: &Path, script_name: &str, args: &[&std::ffi::OsStr]) -> String {
    kiln_testkit::run_reference(python, &script(script_name), args)
}

/// A fresh, empty directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kiln-core-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[allow(unused_imports)] // not every test binary that includes this module compares floats
pub use kiln_testkit::close;
