//! `kiln`'s side of a TensorFlow command: it runs `kiln-tensorflow`, the sibling
//! executable, with the same arguments, and TensorFlow's logging follows Kiln's:
//!
//! - `TF_CPP_MIN_LOG_LEVEL` set by the user: `kiln-tensorflow` replaces this
//!   process (`exec`) with the environment as it is, and TensorFlow prints what
//!   that level lets through.
//! - Kiln logging at debug for `kiln::tensorflow` (`RUST_LOG=debug`,
//!   `RUST_LOG=kiln=debug`): the same, with `TF_CPP_MIN_LOG_LEVEL=0`: all of
//!   TensorFlow's lines, as TensorFlow prints them.
//! - Otherwise (quiet): `TF_CPP_MIN_LOG_LEVEL` is [`QUIET_LEVEL`] (no INFO
//!   lines), and what TensorFlow prints while its libraries load, before any
//!   setting applies (absl's `WARNING: All log messages before
//!   absl::InitializeLog()`, oneDNN's notice), goes to an anonymous file: the child
//!   starts with it as fd 2 and the real stderr as another descriptor (named by
//!   [`STDERR_FD_VAR`](crate::output::STDERR_FD_VAR)), which its `main` puts back
//!   first. This process waits for the child, passing it the signals it gets, and
//!   exits as the child did; when the child died before its `main` (TensorFlow
//!   aborting as it loads), the capture, which the child empties when it takes
//!   over, is printed, so the reason is not lost.

use std::convert::Infallible;
use std::ffi::OsString;
use std::fmt;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};

use anyhow::{Context, Result};

use crate::output::{CAPTURE_NAME, STDERR_FD_VAR, TENSORFLOW_LOG_TARGET};

/// The file name of the executable that runs the TensorFlow commands, in the
/// directory of the `kiln` executable.
pub(crate) const TENSORFLOW_EXE: &str = "kiln-tensorflow";

/// `TF_CPP_MIN_LOG_LEVEL` when Kiln is quiet: TensorFlow's WARNING and ERROR lines
/// only (its INFO lines, `cpu_feature_guard`'s and the SavedModel loader's, are hidden).
pub(crate) const QUIET_LEVEL: &str = "1";

/// The signals the waiting `kiln` passes on to `kiln-tensorflow`.
const FORWARDED: [libc::c_int; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

/// A command of `kiln` reached TensorFlow, which runs in `kiln-tensorflow`.
#[derive(Debug)]
pub(crate) struct NeedsTensorflow {
    what: &'static str,
}

impl NeedsTensorflow {
    /// `what` needs TensorFlow (`"training on the TensorFlow backend"`).
    pub(crate) fn new(what: &'static str) -> NeedsTensorflow {
        NeedsTensorflow { what }
    }
}

impl fmt::Display for NeedsTensorflow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} needs TensorFlow, which Kiln runs in a second executable",
            self.what
        )
    }
}

impl std::error::Error for NeedsTensorflow {}

/// How TensorFlow logs in `kiln-tensorflow`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Logging {
    /// The user set `TF_CPP_MIN_LOG_LEVEL`: left as it is.
    User,
    /// Kiln logs at debug: everything TensorFlow prints.
    Debug,
    /// TensorFlow's warnings and errors only; its start-up lines captured.
    Quiet,
}

fn logging() -> Logging {
    if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_some() {
        Logging::User
    } else if log::log_enabled!(target: TENSORFLOW_LOG_TARGET, log::Level::Debug) {
        Logging::Debug
    } else {
        Logging::Quiet
    }
}

/// The exit status of `kiln` when a command needs `kiln-tensorflow` and it is
/// not beside `kiln`: nothing was read or written, so `cargo xtask kiln`, which
/// builds `kiln` alone at first, builds `kiln-tensorflow` on this status and
/// runs the command again (`EX_CONFIG` of `sysexits.h`).
pub const TENSORFLOW_MISSING_EXIT_CODE: i32 = 78;

/// `kiln-tensorflow` is not beside `kiln`.
#[derive(Debug)]
pub(crate) struct TensorflowMissing {
    path: PathBuf,
    exe: PathBuf,
}

impl fmt::Display for TensorflowMissing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} does not exist (it must be in the directory of {}); build both \
             executables with `cargo build --release --bins -p kiln`, or run \
             `cargo xtask kiln ...`, which builds it when a command first needs it",
            self.path.display(),
            self.exe.display()
        )
    }
}

impl std::error::Error for TensorflowMissing {}

/// `kiln-tensorflow`, beside this executable (symbolic links resolved).
fn sibling() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("finding the kiln executable")?;
    let path = exe.with_file_name(TENSORFLOW_EXE);
    if !path.is_file() {
        return Err(TensorflowMissing { path, exe }.into());
    }
    Ok(path)
}

/// Runs the command line of this process in `kiln-tensorflow` and exits as it
/// does; returns only the error that kept it from running.
pub(crate) fn run_tensorflow(needs: &NeedsTensorflow) -> anyhow::Error {
    match try_run(needs) {
        Ok(never) => match never {},
        Err(error) => error.context(needs.to_string()),
    }
}

fn try_run(needs: &NeedsTensorflow) -> Result<Infallible> {
    let path = sibling()?;
    let logging = logging();
    log::debug!(
        target: TENSORFLOW_LOG_TARGET,
        "{needs}: running {} ({logging:?} logging)",
        path.display()
    );
    let mut args = std::env::args_os();
    let mut command = Command::new(&path);
    // Usage lines name the program as the user typed it.
    command
        .arg0(args.next().unwrap_or_else(|| OsString::from("kiln")))
        .args(args);
    match logging {
        Logging::User => {}
        Logging::Debug => {
            command.env("TF_CPP_MIN_LOG_LEVEL", "0");
        }
        Logging::Quiet => {
            command.env("TF_CPP_MIN_LOG_LEVEL", QUIET_LEVEL);
            match capture_file() {
                Ok(capture) => return run_captured(command, capture, &path),
                Err(error) => log::debug!(
                    target: TENSORFLOW_LOG_TARGET,
                    "no anonymous file for TensorFlow's start-up lines ({error}); they are shown"
                ),
            }
        }
    }
    let error = command.exec();
    Err(error).with_context(|| format!("running {}", path.display()))
}

/// An anonymous file in memory, closed on exec.
#[cfg(target_os = "linux")]
fn capture_file() -> std::io::Result<File> {
    let name = std::ffi::CString::new(CAPTURE_NAME)?;
    // SAFETY: `name` is a NUL-terminated string that outlives the call;
    // memfd_create(2) has no other memory effects.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a descriptor memfd_create just opened, owned by nothing else.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

#[cfg(not(target_os = "linux"))]
fn capture_file() -> std::io::Result<File> {
    Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
}

/// Starts `command` with `capture` as its stderr and the real stderr passed
/// along, waits for it, and exits as it did.
fn run_captured(
    mut command: Command,
    mut capture: File,
    path: &std::path::Path,
) -> Result<Infallible> {
    // Closed on exec in this process's other children; kept for this one (pre_exec).
    let stderr: OwnedFd = std::io::stderr()
        .as_fd()
        .try_clone_to_owned()
        .context("duplicating stderr")?;
    let identity = File::from(stderr.try_clone().context("duplicating stderr")?)
        .metadata()
        .context("reading what stderr is")?;
    let fd = stderr.as_raw_fd();
    command
        .env(
            STDERR_FD_VAR,
            format!("{fd}:{}:{}", identity.dev(), identity.ino()),
        )
        .stderr(Stdio::from(
            capture
                .try_clone()
                .context("duplicating the capture file")?,
        ));
    let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    // SAFETY: the closure runs in the child between fork and exec and calls only
    // fcntl(2), prctl(2) and getppid(2), which are async-signal-safe, and builds
    // io::Errors from raw codes, which does not allocate.
    unsafe {
        command.pre_exec(move || {
            // The real stderr stays open across exec.
            if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Killed with this process, however it dies (Linux).
            #[cfg(target_os = "linux")]
            {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
            }
            let _ = parent;
            Ok(())
        })
    };
    signals::install()?;
    let mut child = command
        .spawn()
        .with_context(|| format!("running {}", path.display()))?;
    signals::forward_to(child.id());
    let status = child
        .wait()
        .with_context(|| format!("waiting for {}", path.display()))?;
    drop(stderr);

    // Empty unless the child died before its main took over (and emptied it).
    let mut early = Vec::new();
    if capture.rewind().is_ok() && capture.read_to_end(&mut early).is_ok() && !early.is_empty() {
        let mut out = std::io::stderr().lock();
        let _ = out.write_all(&early).and_then(|()| out.flush());
    }
    exit_as(status)
}

/// Exits with the child's code, or dies of the signal that killed it (one that
/// would dump core: exit code 128 + the signal, as a shell reports it).
fn exit_as(status: ExitStatus) -> ! {
    if let Some(code) = status.code() {
        std::process::exit(code);
    }
    let signal = status.signal().unwrap_or(libc::SIGKILL);
    let core = [
        libc::SIGQUIT,
        libc::SIGILL,
        libc::SIGTRAP,
        libc::SIGABRT,
        libc::SIGBUS,
        libc::SIGFPE,
        libc::SIGSEGV,
        libc::SIGSYS,
    ];
    if !core.contains(&signal) {
        // SAFETY: signal(2) with SIG_DFL and raise(3) have no memory effects; the
        // default action of these signals ends the process.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
            libc::raise(signal);
        }
    }
    std::process::exit(128 + signal);
}

/// Passing SIGINT, SIGTERM, SIGHUP and SIGQUIT on to the child. A terminal's
/// Ctrl-C reaches both processes (one group); the second SIGINT changes nothing.
mod signals {
    use std::sync::atomic::{AtomicI32, Ordering};

    use super::FORWARDED;

    /// The child's pid, once started; 0 before.
    static CHILD: AtomicI32 = AtomicI32::new(0);
    /// A signal received before the child's pid was known.
    static PENDING: AtomicI32 = AtomicI32::new(0);

    extern "C" fn pass_on(signal: libc::c_int) {
        // Atomics and kill(2) only: async-signal-safe.
        let child = CHILD.load(Ordering::SeqCst);
        if child > 0 {
            // SAFETY: kill(2) has no memory effects; the child is not reaped
            // while this process runs its handlers before `wait` returns.
            unsafe { libc::kill(child, signal) };
        } else {
            PENDING.store(signal, Ordering::SeqCst);
        }
    }

    /// Handles the forwarded signals instead of dying of them; one that is
    /// ignored (`nohup`) stays ignored, and the child inherits that.
    pub(super) fn install() -> anyhow::Result<()> {
        crate::launch::signals::handle(&FORWARDED, pass_on)
    }

    /// From now on signals go to `pid`, and one received before goes now.
    pub(super) fn forward_to(pid: u32) {
        let pid = libc::pid_t::try_from(pid).unwrap_or(0);
        CHILD.store(pid, Ordering::SeqCst);
        let pending = PENDING.swap(0, Ordering::SeqCst);
        if pending != 0 && pid > 0 {
            // SAFETY: kill(2) has no memory effects; the child is not reaped yet.
            unsafe { libc::kill(pid, pending) };
        }
    }
}
