//! What Kiln's tests share, across its crates: where the project virtualenv
//! (which computes the reference numbers with Python PyTorch and TensorFlow)
//! and the provisioned data sets are, and how a test that cannot reach them
//! skips.
//!
//! A test that needs a reference skips with a `SKIPPED <test>: <why>` line on
//! a machine without the virtualenv, so `cargo test` works before `cargo xtask
//! setup`. Where [`REQUIRE_REFERENCES`] is set (`.ci/run` sets it), the same
//! test fails instead: CI never passes a reference test that did not run.
//!
//! ```no_run
//! let Some(python) = kiln_testkit::python("my_test") else {
//!     return; // skipped, with a message
//! };
//! # let _ = python;
//! ```

use std::path::{Path, PathBuf};

/// The environment variable that turns every reference skip into a failure.
pub const REQUIRE_REFERENCES: &str = "KILN_REQUIRE_REFERENCES";

/// Whether skipping a reference test is a failure here ([`REQUIRE_REFERENCES`]
/// set to anything but `0` or empty).
pub fn references_required() -> bool {
    std::env::var(REQUIRE_REFERENCES).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Skips `test` because `why`: prints `SKIPPED <test>: <why>`, or panics with
/// that reason where [`references_required`].
///
/// # Panics
///
/// Where [`REQUIRE_REFERENCES`] is set.
pub fn skip(test: &str, why: &str) {
    if references_required() {
        panic!("{test} cannot run its reference ({why}), and {REQUIRE_REFERENCES} is set");
    }
    // Printed, not logged: this is test output, read in `cargo test`'s captured
    // stderr, and tests install no logger.
    eprintln!("SKIPPED {test}: {why}");
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
