//! Compiling while the virtualenv installs.
//!
//! On a fresh machine, `cargo xtask kiln` first installs the project virtualenv
//! (minutes of downloading and unpacking wheels), and only then can cargo link
//! the CLI: libtorch comes from that virtualenv. But most of the build needs
//! nothing from it (every third-party crate, and Kiln's crates that link no
//! native library), and the C++ against libtorch needs only its headers, which
//! the provisioning installs first (the torch wheel alone, linked as
//! `.kiln/libtorch`) before the rest. [`Prebuild`] runs the same build
//! alongside the install: `cargo build --keep-going` with the same package,
//! features, profile and `LIBTORCH`, so its units are exactly the ones the
//! real build then finds fresh; a unit that reached for the virtualenv too
//! early fails, and the real build makes it. When the virtualenv is ready the
//! real build waits for the prebuild to end rather than stopping it: the
//! machine's cores are busy either way, and what it compiles the real build
//! would compile next. (Measured on two cores, a cold `cargo xtask kiln
//! train` before the torch wheel came first: 555 s and 594 s, as the network's
//! share varied; 591 s stopping the prebuild when the virtualenv was ready,
//! which lost the units in flight; 583 s with the prebuild at the lowest CPU
//! priority, which gave pip the CPU and left more of the build for after it.)

use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use kiln_build::Layout;

/// A `cargo build` running beside the virtualenv's installation.
pub struct Prebuild {
    child: Child,
    log: PathBuf,
    started: Instant,
}

impl Prebuild {
    /// Starts compiling what `cargo_args` (a `cargo run ... -- ARGS` command
    /// line) builds, when the virtualenv is still to be installed; `None` when
    /// it is there already (the build then has nothing to wait for) or when the
    /// prebuild cannot start (the build is then done later, as without it).
    pub fn start(root: &Path, cargo_args: &[OsString]) -> Option<Self> {
        let layout = Layout::for_workspace(root);
        if kiln_build::venv_is_provisioned(&layout) || cargo_args.first()? != "run" {
            return None;
        }
        std::fs::create_dir_all(layout.root()).ok()?;
        let log = layout.root().join("prebuild.log");
        let out = File::create(&log).ok()?;
        let err = out.try_clone().ok()?;
        let until_args = cargo_args
            .iter()
            .skip(1)
            .take_while(|a| a.as_os_str() != "--");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let child = Command::new(cargo)
            .arg("build")
            .args(until_args)
            .arg("--keep-going")
            // As the real build sets it. The provisioning links it to the
            // torch wheel as soon as that is installed (before the rest of the
            // virtualenv), so the C++ against libtorch compiles alongside the
            // install; whatever reaches for it before that fails now and is
            // built afterwards.
            .env("LIBTORCH", layout.libtorch())
            // As the real build sets it, so that no unit's fingerprint differs.
            .env("PKG_CONFIG_PATH", kiln_build::pkg_config_path(&layout))
            .current_dir(root)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .ok()?;
        log::info!(
            "compiling while the virtualenv installs, libtorch first (log: {})",
            log.display()
        );
        Some(Self {
            child,
            log,
            started: Instant::now(),
        })
    }

    /// Waits for the prebuild to end, once the virtualenv is ready (the real
    /// build then finds what it compiled fresh). Its failures are expected:
    /// they are the units that reached for the virtualenv before it was there.
    pub fn finish(mut self) {
        match self.child.wait() {
            Ok(_) => log::info!(
                "compiled alongside the virtualenv in {:.0?} (log: {})",
                self.started.elapsed(),
                self.log.display()
            ),
            Err(error) => log::warn!("cannot wait for the prebuild: {error}"),
        }
    }

    /// Stops cargo (SIGTERM: it stops the compilers it started, as for
    /// Ctrl-C, which reaches the prebuild too: it shares the terminal's
    /// process group) and waits for it to exit.
    fn stop(&mut self) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        let signalled = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !signalled {
            let _ = self.child.kill();
        }
        if let Err(error) = self.child.wait() {
            log::warn!("cannot wait for the prebuild to stop: {error}");
        }
    }
}

impl Drop for Prebuild {
    /// A prebuild still running when the command ends early (provisioning
    /// failed) is stopped.
    fn drop(&mut self) {
        self.stop();
    }
}
