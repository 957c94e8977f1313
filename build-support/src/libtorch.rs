//! Finding libtorch and checking its version.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{BuildError, Result};
use crate::versions::TORCH_VERSION;

const WHY: &str = "the version tch 0.24 is written against";

/// A libtorch tree: a libtorch zip's root or a torch wheel's `torch/` directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Libtorch {
    /// The directory holding `include/` and `lib/`.
    pub root: PathBuf,
    /// The version it reports, without the `+cu130`-style suffix.
    pub version: String,
}

impl Libtorch {
    /// Checks that `root` holds libtorch [`TORCH_VERSION`]; `source` names where
    /// the path came from, for the message ("LIBTORCH", "the project virtualenv").
    pub fn at(root: &Path, source: &str) -> Result<Self> {
        let lib = root.join("lib");
        if !lib.join("libtorch_cpu.so").exists() {
            return Err(BuildError::LibraryNotFound {
                what: "libtorch",
                path: root.to_path_buf(),
                missing: "lib/libtorch_cpu.so".into(),
                fix: format!(
                    "{source} must point at a libtorch {TORCH_VERSION} directory (with include/ and \
                     lib/) or at the torch/ directory of a torch=={TORCH_VERSION} wheel"
                ),
            });
        }
        let version = read_version(root).ok_or_else(|| BuildError::LibraryNotFound {
            what: "libtorch version",
            path: root.to_path_buf(),
            missing: "build-version or version.py".into(),
            fix: format!("{source} must point at a complete libtorch {TORCH_VERSION}"),
        })?;
        let base = version
            .split('+')
            .next()
            .unwrap_or(&version)
            .trim()
            .to_owned();
        if base != TORCH_VERSION {
            return Err(BuildError::WrongVersion {
                library: "libtorch",
                path: root.to_path_buf(),
                found: version,
                expected: TORCH_VERSION,
                why: WHY,
                fix: format!(
                    "Point {source} at libtorch {TORCH_VERSION} (pip install torch=={TORCH_VERSION}), \
                     or unset it to let Kiln provision one"
                ),
            });
        }
        Ok(Self {
            root: root.to_path_buf(),
            version,
        })
    }

    /// The directory of the shared libraries.
    pub fn lib_dir(&self) -> PathBuf {
        self.root.join("lib")
    }

    /// Whether this is a CUDA build (has `libtorch_cuda.so`).
    pub fn has_cuda(&self) -> bool {
        self.lib_dir().join("libtorch_cuda.so").exists()
    }
}

/// `build-version` in a libtorch zip, `version.py` in a wheel.
fn read_version(root: &Path) -> Option<String> {
    if let Ok(text) = fs::read_to_string(root.join("build-version")) {
        return Some(text.trim().to_owned());
    }
    let text = fs::read_to_string(root.join("version.py")).ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix("__version__ = "))
        .map(|v| v.trim().trim_matches(['\'', '"']).to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_libtorch(name: &str, version_file: &str, content: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-libtorch-{name}-{}", std::process::id()));
        fs::create_dir_all(dir.join("lib")).unwrap();
        fs::write(dir.join("lib/libtorch_cpu.so"), "").unwrap();
        fs::write(dir.join(version_file), content).unwrap();
        dir
    }

    #[test]
    fn wheel_version_with_suffix_is_accepted() {
        let dir = fake_libtorch(
            "ok",
            "version.py",
            "__version__ = '2.11.0+cu130'\ndebug = False\n",
        );
        let lt = Libtorch::at(&dir, "LIBTORCH").unwrap();
        assert_eq!(lt.version, "2.11.0+cu130");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn wrong_version_names_found_and_expected() {
        let dir = fake_libtorch("old", "build-version", "2.9.1+cpu\n");
        let err = Libtorch::at(&dir, "LIBTORCH").unwrap_err().to_string();
        assert!(err.contains("2.9.1+cpu") && err.contains("2.11.0"), "{err}");
        assert!(err.contains("LIBTORCH"), "{err}");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn empty_dir_is_not_libtorch() {
        let err = Libtorch::at(Path::new("/nonexistent/libtorch"), "LIBTORCH").unwrap_err();
        assert!(matches!(err, BuildError::LibraryNotFound { .. }), "{err}");
    }
}
