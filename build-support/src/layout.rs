//! Where provisioned things live: the git-ignored `.kiln/` directory at the workspace root.

use std::path::{Path, PathBuf};

/// Paths inside a `.kiln/` directory.
///
/// ```text
/// .kiln/venv             link to the project virtualenv (pinned torch, tensorflow-cpu,
///                        scikit-learn, ...), shared by the user's checkouts (see `ensure_venv`)
/// .kiln/libtorch         link to the libtorch that builds use (LIBTORCH in .cargo/config.toml)
/// .kiln/tensorflow/      lib/ and include/ links to the TensorFlow C API
/// .kiln/pkgconfig/       tensorflow.pc, found by the `tensorflow` crate through pkg-config
/// .kiln/data/            data sets: digits.csv.gz (from a wheel), shapes/ (rendered images)
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    root: PathBuf,
}

impl Layout {
    /// A layout rooted at `kiln_dir` (normally `<workspace>/.kiln`).
    pub fn new(kiln_dir: impl Into<PathBuf>) -> Self {
        Self {
            root: kiln_dir.into(),
        }
    }

    /// The layout of the workspace at `workspace_root`.
    pub fn for_workspace(workspace_root: &Path) -> Self {
        Self::new(workspace_root.join(".kiln"))
    }

    /// The nearest `.kiln/` directory at or above `start`, if one exists.
    pub fn find_from(start: &Path) -> Option<Self> {
        start
            .ancestors()
            .map(|dir| dir.join(".kiln"))
            .find(|dir| dir.is_dir())
            .map(Self::new)
    }

    /// The `.kiln/` directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }
    /// The virtualenv directory.
    pub fn venv(&self) -> PathBuf {
        self.root.join("venv")
    }
    /// The virtualenv's interpreter.
    pub fn venv_python(&self) -> PathBuf {
        crate::provision::python_in(&self.venv())
    }
    /// Written last by provisioning; its presence means the virtualenv is complete.
    pub fn venv_marker(&self) -> PathBuf {
        self.venv().join(crate::provision::MARKER)
    }
    /// pip's output from the last install.
    pub fn pip_log(&self) -> PathBuf {
        self.root.join("pip.log")
    }
    /// Link to the libtorch directory (with `include/` and `lib/`).
    pub fn libtorch(&self) -> PathBuf {
        self.root.join("libtorch")
    }
    /// Directory with `lib/` and `include/` of the TensorFlow C API.
    pub fn tensorflow(&self) -> PathBuf {
        self.root.join("tensorflow")
    }
    /// Directory holding `tensorflow.pc`.
    pub fn pkgconfig(&self) -> PathBuf {
        self.root.join("pkgconfig")
    }
    /// Directory of data sets linked from the virtualenv.
    pub fn data(&self) -> PathBuf {
        self.root.join("data")
    }
}
