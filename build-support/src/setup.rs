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
        vec![
            ("LIBTORCH".into(), self.libtorch.root.display().to_string()),
            ("PKG_CONFIG_PATH".into(), pkg_config_path(&self.layout)),
        ]
    }
}

/// The `PKG_CONFIG_PATH` a child `cargo` gets: `.kiln/pkgconfig`, then the
/// user's own value, if any.
pub fn pkg_config_path(layout: &Layout) -> String {
    let ours = layout.pkgconfig();
    match user_path_var("PKG_CONFIG_PATH", &ours) {
        Some(existing) => format!("{}:{}", ours.display(), existing.display()),
        None => ours.display().to_string(),
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
    replace_symlink(&venv_torch, &layout.libtorch())?;
    // The virtualenv's libtorch is named through `.kiln/libtorch`, as
    // `.cargo/config.toml` names it for a plain `cargo build` and as the build
    // that starts while the virtualenv installs names it: the same `LIBTORCH`
    // for every build, so none recompiles another's C++.
    let libtorch = match user_path_var("LIBTORCH", &layout.libtorch()) {
        Some(dir) => Libtorch::at(&dir, "LIBTORCH")?,
        None => Libtorch::at(&layout.libtorch(), "the project virtualenv")?,
    };

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
    ensure_shapes(workspace_root, &venv, &data.join("shapes"))?;

    Ok(Setup {
        layout,
        venv,
        libtorch,
        tensorflow,
    })
}

/// The script that renders the shapes image set (class folders and tar shards).
const SHAPES_SCRIPT: &str = "examples/images/make_shapes.py";

/// Writes the shapes image set to `dir` (`.kiln/data/shapes`) with
/// [`SHAPES_SCRIPT`], unless it is there already from the same script: a
/// `VERSION` file holds the script's SHA-256. The set is written to a temporary
/// directory and renamed into place, so an interrupted run leaves nothing half-made.
fn ensure_shapes(workspace_root: &Path, venv: &Venv, dir: &Path) -> Result<()> {
    use sha2::{Digest, Sha256};

    let script = workspace_root.join(SHAPES_SCRIPT);
    let source = fs::read(&script).map_err(|e| BuildError::io("reading", &script, e))?;
    let version = format!("{:x}\n", Sha256::digest(&source));
    let marker = dir.join("VERSION");
    if fs::read_to_string(&marker).is_ok_and(|v| v == version) {
        return Ok(());
    }
    let staging = dir.with_extension(format!("tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    let output = std::process::Command::new(&venv.python)
        .arg(&script)
        .arg(&staging)
        .output()
        .map_err(|e| BuildError::Command {
            command: format!("{} {}", venv.python.display(), script.display()),
            detail: e.to_string(),
        })?;
    if !output.status.success() {
        let _ = fs::remove_dir_all(&staging);
        return Err(BuildError::Command {
            command: format!(
                "{} {} {}",
                venv.python.display(),
                script.display(),
                staging.display()
            ),
            detail: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        });
    }
    fs::write(staging.join("VERSION"), &version)
        .map_err(|e| BuildError::io("writing", staging.join("VERSION"), e))?;
    if dir.exists() {
        fs::remove_dir_all(dir).map_err(|e| BuildError::io("replacing", dir, e))?;
    }
    fs::rename(&staging, dir).map_err(|e| BuildError::io("renaming into", dir, e))?;
    Ok(())
}

/// A path-valued variable set by the user, ignoring the value `.cargo/config.toml`
/// gives it (`ours`), which cargo also passes to programs it runs.
fn user_path_var(name: &str, ours: &Path) -> Option<PathBuf> {
    let value = std::env::var_os(name).filter(|v| !v.is_empty())?;
    let path = PathBuf::from(value);
    (path != ours).then_some(path)
}
