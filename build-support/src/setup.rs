//! One call that makes a workspace ready to build: virtualenv, libtorch, TensorFlow, data.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{BuildError, Result};
use crate::layout::Layout;
use crate::libtorch::Libtorch;
use crate::provision::{ensure_venv, Venv};
use crate::tensorflow::{replace_symlink, Tensorflow};

/// Everything a build of the workspace needs, found and checked.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Where provisioned things live.
    pub layout: Layout,
    /// The project virtualenv.
    pub venv: Venv,
    /// The libtorch builds link (from `LIBTORCH` or the virtualenv).
    pub libtorch: Libtorch,
    /// The TensorFlow C API builds link (from `LIBTENSORFLOW` or the virtualenv).
    pub tensorflow: Tensorflow,
}

impl Setup {
    /// Environment for a child `cargo`: `LIBTORCH` and `PKG_CONFIG_PATH`, which
    /// `torch-sys` and `tensorflow-sys` read.
    pub fn cargo_env(&self) -> Vec<(String, String)> {
        let mut pkg_config_path = self.layout.pkgconfig().display().to_string();
        if let Some(existing) = user_path_var("PKG_CONFIG_PATH", &self.layout.pkgconfig()) {
            pkg_config_path = format!("{pkg_config_path}:{}", existing.display());
        }
        vec![
            ("LIBTORCH".into(), self.libtorch.root.display().to_string()),
            ("PKG_CONFIG_PATH".into(), pkg_config_path),
        ]
    }
}

/// Provisions the virtualenv if needed, resolves and checks both native
/// libraries, and refreshes the links in `.kiln/` that `.cargo/config.toml` names.
///
/// `LIBTORCH` and `LIBTENSORFLOW`, when set by the user, take the place of the
/// virtualenv's libraries (the virtualenv is still made: tests use its Python
/// packages for reference numbers).
pub fn setup(workspace_root: &Path) -> Result<Setup> {
    let layout = Layout::for_workspace(workspace_root);
    let venv = ensure_venv(&layout)?;

    let venv_torch = venv.site_packages.join("torch");
    let libtorch = match user_path_var("LIBTORCH", &layout.libtorch()) {
        Some(dir) => Libtorch::at(&dir, "LIBTORCH")?,
        None => Libtorch::at(&venv_torch, "the project virtualenv")?,
    };
    replace_symlink(&venv_torch, &layout.libtorch())?;

    let tensorflow = match user_path_var("LIBTENSORFLOW", Path::new("")) {
        Some(dir) => Tensorflow::at(&dir, "LIBTENSORFLOW")?,
        None => Tensorflow::at(
            &venv.site_packages.join("tensorflow"),
            "the project virtualenv",
        )?,
    };
    tensorflow.write_pkg_config(&layout)?;

    let data = layout.data();
    fs::create_dir_all(&data).map_err(|e| BuildError::io("creating", &data, e))?;
    let digits = venv
        .site_packages
        .join("sklearn/datasets/data/digits.csv.gz");
    replace_symlink(&digits, &data.join("digits.csv.gz"))?;

    Ok(Setup {
        layout,
        venv,
        libtorch,
        tensorflow,
    })
}

/// A path-valued variable set by the user, ignoring the value `.cargo/config.toml`
/// gives it (`ours`), which cargo also passes to programs it runs.
fn user_path_var(name: &str, ours: &Path) -> Option<PathBuf> {
    let value = std::env::var_os(name).filter(|v| !v.is_empty())?;
    let path = PathBuf::from(value);
    (path != ours).then_some(path)
}
