//! The project virtualenv: created on first use, verified, reused afterwards.
//!
//! A virtualenv is trusted only when its marker file exists and names the exact
//! requirement list of [`PYTHON_REQUIREMENTS`]; the marker is written last, so an
//! install cut short (disk full, network down, Ctrl-C) is discarded and redone
//! on the next run instead of being mistaken for a good one.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

use crate::error::{BuildError, Result};
use crate::layout::Layout;
use crate::tensorflow::replace_symlink;
use crate::versions::{PYTHON_REQUIREMENTS, TORCH_VERSION, VENV_SIZE_GB};

/// The file provisioning writes last into a virtualenv: the requirements'
/// fingerprint, `site-packages`, and the requirement list.
pub(crate) const MARKER: &str = "kiln-provisioned";

/// A verified project virtualenv.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Venv {
    /// Its interpreter.
    pub python: PathBuf,
    /// Its `site-packages` directory (holds `torch/`, `tensorflow/`, `sklearn/`).
    pub site_packages: PathBuf,
}

/// Fingerprint of the requirement list, stored in the marker.
fn requirements_fingerprint() -> String {
    let mut hasher = Sha256::new();
    for req in PYTHON_REQUIREMENTS {
        hasher.update(req.as_bytes());
        hasher.update(b"\n");
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Returns the virtualenv if it is complete and current, without changing anything.
pub fn existing_venv(layout: &Layout) -> Option<Venv> {
    venv_at(&layout.venv())
}

/// Whether [`ensure_venv`] would find a complete, current virtualenv (in the
/// workspace or in the shared cache) instead of installing one.
pub fn venv_is_provisioned(layout: &Layout) -> bool {
    existing_venv(layout).is_some()
        || shared_cache_dir().is_some_and(|cache| venv_at(&shared_venv_dir(&cache)).is_some())
}

/// The complete, current virtualenv in `dir`, if there is one.
fn venv_at(dir: &Path) -> Option<Venv> {
    let marker = fs::read_to_string(dir.join(MARKER)).ok()?;
    let mut lines = marker.lines();
    if lines.next()? != requirements_fingerprint() {
        return None;
    }
    let site_packages = PathBuf::from(lines.next()?);
    let python = python_in(dir);
    (python.exists() && site_packages.join("torch").is_dir()).then_some(Venv {
        python,
        site_packages,
    })
}

/// The interpreter of the virtualenv in `dir`.
pub(crate) fn python_in(dir: &Path) -> PathBuf {
    dir.join("bin").join("python")
}

/// Removes what stands at `path`: a link (only the link), or a directory tree.
fn discard(path: &Path) -> Result<()> {
    let removed = if path.is_symlink() {
        fs::remove_file(path)
    } else {
        fs::remove_dir_all(path)
    };
    removed.map_err(|e| BuildError::io("removing", path, e))
}

/// The directory where provisioned virtualenvs are shared by every Kiln checkout
/// of this user: `KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`.
///
/// `None` when none of those variables is set; the virtualenv then lives in the
/// workspace's own `.kiln/venv`.
pub fn shared_cache_dir() -> Option<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("KILN_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("kiln")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("kiln")))
}

/// The shared virtualenv for the current requirement list, inside `cache`.
///
/// Its name carries the requirements' fingerprint, so checkouts pinned to other
/// versions never share (or overwrite) each other's virtualenv.
pub fn shared_venv_dir(cache: &Path) -> PathBuf {
    cache.join(format!("venv-{}", &requirements_fingerprint()[..16]))
}

/// Makes sure the project virtualenv exists with exactly the pinned packages.
///
/// The virtualenv (about [`VENV_SIZE_GB`] GB) is installed once per user, in
/// [`shared_cache_dir`], and `.kiln/venv` links to it, so a second clone or
/// worktree of Kiln reuses it instead of installing it again. Where no cache
/// directory can be made, it is installed in `.kiln/venv` itself. A lock on the
/// directory being provisioned keeps two commands started together from
/// installing twice. Progress goes to stderr; pip's own output goes to
/// `.kiln/pip.log`.
pub fn ensure_venv(layout: &Layout) -> Result<Venv> {
    ensure_venv_in(layout, shared_cache_dir())
}

fn ensure_venv_in(layout: &Layout, cache: Option<PathBuf>) -> Result<Venv> {
    fs::create_dir_all(layout.root()).map_err(|e| BuildError::io("creating", layout.root(), e))?;
    if let Some(venv) = existing_venv(layout) {
        return Ok(venv);
    }
    let shared = cache.filter(|cache| match fs::create_dir_all(cache) {
        Ok(()) => true,
        Err(e) => {
            log::warn!(
                "cannot use {} for the shared virtualenv ({e}); installing it in {}",
                cache.display(),
                layout.venv().display()
            );
            false
        }
    });
    let Some(cache) = shared else {
        let _lock = lock(layout.root())?;
        return provision(&layout.venv(), layout);
    };

    let _lock = lock(&cache)?;
    let target = shared_venv_dir(&cache);
    if venv_at(&target).is_some() {
        log::info!("using the shared virtualenv at {}", target.display());
    } else {
        provision(&target, layout)?;
    }
    let link = layout.venv();
    if link.is_dir() && !link.is_symlink() {
        // An incomplete or outdated virtualenv of an earlier install in the workspace
        // (a link is replaced by `replace_symlink` itself).
        log::info!("discarding the virtualenv at {}", link.display());
        discard(&link)?;
    }
    replace_symlink(&target, &link)?;
    existing_venv(layout).ok_or_else(|| BuildError::Command {
        command: format!("linking {} to {}", link.display(), target.display()),
        detail: "the linked virtualenv is not complete".into(),
    })
}

/// Holds an exclusive lock on `dir/provision.lock` until dropped.
fn lock(dir: &Path) -> Result<fs::File> {
    let path = dir.join("provision.lock");
    let file = fs::File::create(&path).map_err(|e| BuildError::io("creating", &path, e))?;
    file.lock()
        .map_err(|e| BuildError::io("locking", &path, e))?;
    Ok(file)
}

/// Installs a fresh virtualenv in `venv_dir`, discarding whatever was there.
fn provision(venv_dir: &Path, layout: &Layout) -> Result<Venv> {
    if venv_dir.exists() || venv_dir.is_symlink() {
        log::info!(
            "discarding the incomplete or outdated virtualenv at {}",
            venv_dir.display()
        );
        discard(venv_dir)?;
    }
    let parent = venv_dir.parent().unwrap_or(venv_dir);
    check_free_space(parent)?;

    let python = find_python()?;
    log::info!(
        "creating the project virtualenv at {} with {} (first run only)",
        venv_dir.display(),
        python.display()
    );
    create_venv(&python, venv_dir)?;

    let venv_python = python_in(venv_dir);
    log::info!(
        "installing {} from PyPI (about {VENV_SIZE_GB} GB; a few minutes the first time, pip log: {})",
        PYTHON_REQUIREMENTS.join(" "),
        layout.pip_log().display()
    );
    install_libtorch_first(&venv_python, layout)?;
    pip_install(&venv_python, PYTHON_REQUIREMENTS, &layout.pip_log())?;

    let site_packages = verify_imports(&venv_python)?;
    write_marker(venv_dir, &site_packages)?;
    log::info!("virtualenv ready");
    Ok(Venv {
        python: venv_python,
        site_packages,
    })
}

/// Installs the torch wheel alone (without its dependencies, a sixth of the
/// download) and links `.kiln/libtorch` to it: the build's longest chain
/// (tch's and Kiln's C++ against libtorch's headers) can then compile while
/// the rest of the virtualenv downloads. Nothing links or runs against it
/// before the whole install is done (`cargo xtask` builds the executables
/// after it), and the full install that follows keeps this wheel, being the
/// pinned version.
fn install_libtorch_first(python: &Path, layout: &Layout) -> Result<()> {
    let torch = torch_requirement();
    pip_install(python, &["--no-deps", &torch], &layout.pip_log())?;
    let site_packages = purelib(python)?;
    replace_symlink(&site_packages.join("torch"), &layout.libtorch())?;
    log::info!(
        "libtorch is in place ({}); the rest of the virtualenv follows",
        layout.libtorch().display()
    );
    Ok(())
}

/// The pinned torch wheel, as [`PYTHON_REQUIREMENTS`] lists it.
fn torch_requirement() -> String {
    format!("torch=={TORCH_VERSION}")
}

/// The `site-packages` directory of the interpreter `python`.
fn purelib(python: &Path) -> Result<PathBuf> {
    let command = |detail: String| BuildError::Command {
        command: format!("{} -c 'import sysconfig'", python.display()),
        detail,
    };
    let output = Command::new(python)
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ])
        .output()
        .map_err(|e| command(e.to_string()))?;
    if !output.status.success() {
        return Err(command(last_lines(
            &String::from_utf8_lossy(&output.stderr),
            10,
        )));
    }
    Ok(PathBuf::from(
        String::from_utf8_lossy(&output.stdout).trim(),
    ))
}

fn check_free_space(dir: &Path) -> Result<()> {
    let Ok(free) = fs4::available_space(dir) else {
        return Ok(()); // unknown: let the install itself find out
    };
    let needed = VENV_SIZE_GB * 1_000_000_000;
    if free < needed {
        return Err(BuildError::DiskFull {
            dir: dir.to_path_buf(),
            detail: format!("only {:.1} GB free", free as f64 / 1e9),
            needed_gb: VENV_SIZE_GB,
        });
    }
    Ok(())
}

/// The interpreter named by `KILN_PYTHON`, else `python3` on `PATH`, checked to be 3.10+.
pub fn find_python() -> Result<PathBuf> {
    let name = std::env::var_os("KILN_PYTHON").unwrap_or_else(|| "python3".into());
    let output = Command::new(&name)
        .args([
            "-c",
            "import sys; print('%d.%d.%d' % sys.version_info[:3]); print(sys.executable)",
        ])
        .output()
        .map_err(|_| BuildError::PythonNotFound {
            looked_for: name.to_string_lossy().into_owned(),
        })?;
    if !output.status.success() {
        return Err(BuildError::PythonNotFound {
            looked_for: name.to_string_lossy().into_owned(),
        });
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut lines = stdout.lines();
    let version = lines.next().unwrap_or_default().trim().to_owned();
    let exe = lines
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(&name));
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if major != 3 || minor < 10 {
        return Err(BuildError::PythonTooOld {
            python: exe,
            found: version,
        });
    }
    Ok(exe)
}

fn create_venv(python: &Path, venv_dir: &Path) -> Result<()> {
    let output = Command::new(python)
        .args(["-m", "venv"])
        .arg(venv_dir)
        .output()
        .map_err(|e| BuildError::Command {
            command: format!("{} -m venv", python.display()),
            detail: e.to_string(),
        })?;
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let all = format!("{stdout}{stderr}");
    if all.contains("No space left on device") {
        return Err(BuildError::DiskFull {
            dir: venv_dir.to_path_buf(),
            detail: last_line(&all),
            needed_gb: VENV_SIZE_GB,
        });
    }
    if !output.status.success() {
        if all.contains("ensurepip") || all.contains("No module named venv") {
            let detail = all
                .lines()
                .find(|l| l.contains("ensurepip") || l.contains("No module named"))
                .map_or_else(|| last_line(&all), |l| l.trim().to_owned());
            return Err(BuildError::NoPip {
                python: python.to_path_buf(),
                detail,
            });
        }
        return Err(BuildError::Command {
            command: format!("{} -m venv {}", python.display(), venv_dir.display()),
            detail: all.trim().to_owned(),
        });
    }
    let pip = Command::new(venv_dir.join("bin/python"))
        .args(["-m", "pip", "--version"])
        .output();
    match pip {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(BuildError::NoPip {
            python: python.to_path_buf(),
            detail: last_line(&String::from_utf8_lossy(&out.stderr)),
        }),
        Err(e) => Err(BuildError::NoPip {
            python: python.to_path_buf(),
            detail: e.to_string(),
        }),
    }
}

/// Runs `pip install` with output to `log`, and turns a failure into the error that explains it.
pub fn pip_install(python: &Path, requirements: &[&str], log: &Path) -> Result<()> {
    let log_file = fs::File::create(log).map_err(|e| BuildError::io("creating", log, e))?;
    let log_err = log_file
        .try_clone()
        .map_err(|e| BuildError::io("opening", log, e))?;
    let status = Command::new(python)
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-input",
            "--progress-bar",
            "off",
            // The virtualenv is the cache: keeping the wheels too would double the disk used.
            "--no-cache-dir",
            // No bytecode for the tens of thousands of modules installed: Python
            // compiles (and caches) the few that are imported, on first import.
            "--no-compile",
        ])
        .args(requirements)
        .stdin(Stdio::null())
        .stdout(log_file)
        .stderr(log_err)
        .status()
        .map_err(|e| BuildError::Command {
            command: format!("{} -m pip install", python.display()),
            detail: e.to_string(),
        })?;
    if status.success() {
        return Ok(());
    }
    let mut text = String::new();
    if let Ok(mut f) = fs::File::open(log) {
        // A log that cannot be read only loses detail from the message.
        let _ = f.read_to_string(&mut text);
    }
    Err(classify_pip_failure(
        &text,
        &requirements.join(" "),
        &status.to_string(),
        log,
        python.parent().and_then(Path::parent).unwrap_or(python),
    ))
}

/// Reads pip's output and names the cause a user can act on.
fn classify_pip_failure(
    text: &str,
    packages: &str,
    status: &str,
    log: &Path,
    dir: &Path,
) -> BuildError {
    const DISK: &[&str] = &[
        "No space left on device",
        "[Errno 28]",
        "Disk quota exceeded",
    ];
    const NETWORK: &[&str] = &[
        "Failed to establish a new connection",
        "NewConnectionError",
        "Temporary failure in name resolution",
        "Name or service not known",
        "Network is unreachable",
        "Connection refused",
        "ConnectTimeoutError",
        "Read timed out",
        "ProxyError",
        "SSLError",
        "Max retries exceeded",
    ];
    let find = |needles: &[&str]| {
        text.lines()
            .find(|line| needles.iter().any(|n| line.contains(n)))
            .map(|line| line.trim().to_owned())
    };
    if let Some(line) = find(DISK) {
        return BuildError::DiskFull {
            dir: dir.to_path_buf(),
            detail: line,
            needed_gb: VENV_SIZE_GB,
        };
    }
    if let Some(line) = find(NETWORK) {
        return BuildError::RegistryUnreachable {
            packages: packages.to_owned(),
            detail: line,
            log: log.to_path_buf(),
        };
    }
    let tail: Vec<&str> = text.lines().rev().take(15).collect();
    BuildError::PipFailed {
        packages: packages.to_owned(),
        status: status.to_owned(),
        tail: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
        log: log.to_path_buf(),
    }
}

/// Imports every pinned package once, so a broken install is caught here and not in a test.
fn verify_imports(python: &Path) -> Result<PathBuf> {
    let output = Command::new(python)
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .args([
            "-c",
            "import sysconfig, torch, tensorflow, sklearn, onnx, onnxruntime, safetensors, tensorboard, \
             torchvision, PIL; \
             print(sysconfig.get_path('purelib'))",
        ])
        .output()
        .map_err(|e| BuildError::Command {
            command: format!("{} -c 'import torch, tensorflow'", python.display()),
            detail: e.to_string(),
        })?;
    if !output.status.success() {
        return Err(BuildError::Command {
            command: format!(
                "{} -c 'import torch, tensorflow, sklearn, safetensors'",
                python.display()
            ),
            detail: last_lines(&String::from_utf8_lossy(&output.stderr), 10),
        });
    }
    let site = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    Ok(PathBuf::from(site))
}

fn write_marker(venv_dir: &Path, site_packages: &Path) -> Result<()> {
    let marker = venv_dir.join(MARKER);
    let tmp = marker.with_extension("tmp");
    let content = format!(
        "{}\n{}\n{}\n",
        requirements_fingerprint(),
        site_packages.display(),
        PYTHON_REQUIREMENTS.join(" ")
    );
    fs::write(&tmp, content).map_err(|e| BuildError::io("writing", &tmp, e))?;
    fs::rename(&tmp, &marker).map_err(|e| BuildError::io("renaming", &marker, e))
}

fn last_line(text: &str) -> String {
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
        .to_owned()
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().rev().take(n).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wheel_installed_first_is_the_pinned_torch() {
        assert!(PYTHON_REQUIREMENTS.contains(&torch_requirement().as_str()));
    }

    #[test]
    fn pip_offline_is_reported_as_registry_unreachable() {
        let log = "Collecting torch==2.11.0\n  WARNING: Retrying (Retry(total=4)) after connection broken by \
                   'NewConnectionError(...: Failed to establish a new connection: [Errno 101] Network is unreachable')\n\
                   ERROR: Could not find a version that satisfies the requirement torch==2.11.0 (from versions: none)\n";
        let err = classify_pip_failure(
            log,
            "torch==2.11.0",
            "exit status: 1",
            Path::new("/x/pip.log"),
            Path::new("/x"),
        );
        assert!(
            matches!(err, BuildError::RegistryUnreachable { .. }),
            "{err}"
        );
        assert!(err
            .to_string()
            .contains("cannot reach the Python package index"));
    }

    #[test]
    fn pip_enospc_is_reported_as_disk_full() {
        let log = "Installing collected packages: torch\nERROR: Could not install packages due to an OSError: \
                   [Errno 28] No space left on device\n";
        let err = classify_pip_failure(
            log,
            "torch",
            "exit status: 1",
            Path::new("/x/pip.log"),
            Path::new("/x"),
        );
        assert!(matches!(err, BuildError::DiskFull { .. }), "{err}");
    }

    #[test]
    fn other_pip_failures_keep_the_tail() {
        let log = "ERROR: No matching distribution found for torch==9.9.9\n";
        let err = classify_pip_failure(
            log,
            "torch==9.9.9",
            "exit status: 1",
            Path::new("/x/pip.log"),
            Path::new("/x"),
        );
        match err {
            BuildError::PipFailed { tail, .. } => assert!(tail.contains("torch==9.9.9")),
            other => panic!("unexpected {other}"),
        }
    }

    /// A virtualenv that passes `venv_at` without being one.
    fn fake_venv(dir: &Path) {
        fs::create_dir_all(dir.join("bin")).unwrap();
        fs::write(dir.join("bin/python"), "").unwrap();
        let site = dir.join("site");
        fs::create_dir_all(site.join("torch")).unwrap();
        write_marker(dir, &site).unwrap();
    }

    #[test]
    fn a_shared_venv_is_linked_not_installed_again() {
        let dir = std::env::temp_dir().join(format!("kiln-build-shared-{}", std::process::id()));
        let cache = dir.join("cache");
        let shared = shared_venv_dir(&cache);
        fake_venv(&shared);

        // An outdated virtualenv left in the workspace by an earlier install.
        let layout = Layout::new(dir.join("workspace/.kiln"));
        fs::create_dir_all(layout.venv().join("bin")).unwrap();
        fs::write(layout.venv_marker(), "deadbeef\n/nowhere\n").unwrap();

        let venv = ensure_venv_in(&layout, Some(cache.clone())).unwrap();
        assert!(layout.venv().is_symlink(), "{}", layout.venv().display());
        assert_eq!(fs::read_link(layout.venv()).unwrap(), shared);
        assert_eq!(venv.site_packages, shared.join("site"));
        assert_eq!(venv.python, layout.venv_python());
        // A second workspace gets the same one.
        let other = Layout::new(dir.join("other/.kiln"));
        let again = ensure_venv_in(&other, Some(cache)).unwrap();
        assert_eq!(again.site_packages, venv.site_packages);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn shared_venvs_of_other_pins_have_other_names() {
        let name = shared_venv_dir(Path::new("/c"));
        let name = name.file_name().unwrap().to_string_lossy();
        assert!(name.starts_with("venv-") && name.len() == 21, "{name}");
        assert!(requirements_fingerprint().starts_with(&name[5..]));
    }

    #[test]
    fn marker_for_other_requirements_is_not_trusted() {
        let dir = std::env::temp_dir().join(format!("kiln-build-marker-{}", std::process::id()));
        let layout = Layout::new(&dir);
        fs::create_dir_all(layout.venv().join("bin")).unwrap();
        fs::write(layout.venv_python(), "").unwrap();
        let site = dir.join("site");
        fs::create_dir_all(site.join("torch")).unwrap();
        fs::write(
            layout.venv_marker(),
            format!("deadbeef\n{}\n", site.display()),
        )
        .unwrap();
        assert_eq!(existing_venv(&layout), None);
        write_marker(&layout.venv(), &site).unwrap();
        assert_eq!(existing_venv(&layout).map(|v| v.site_packages), Some(site));
        fs::remove_dir_all(&dir).unwrap();
    }
}
