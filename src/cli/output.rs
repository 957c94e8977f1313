//! What the commands print: their output on stdout (`outln!`, `out!`, through
//! [`write_out`]), Kiln's log lines, the names shared with `kiln-tensorflow`
//! for TensorFlow's own lines, and the check every command that writes a file
//! makes first ([`check_output`]). A leaf.

use std::path::Path;

use anyhow::Result;

/// The log target of TensorFlow's own lines (`RUST_LOG=kiln=debug` shows them).
pub const TENSORFLOW_LOG_TARGET: &str = "kiln::tensorflow";

/// The name of the anonymous file (memfd) that captures TensorFlow's start-up lines.
pub const CAPTURE_NAME: &str = "kiln-tensorflow-start";

/// Set by `kiln` for `kiln-tensorflow` when it captures what TensorFlow prints
/// while its libraries load: `FD:DEV:INO`, the descriptor of the real stderr and
/// the device and inode it refers to (fd 2 is the capture, an anonymous file).
pub const STDERR_FD_VAR: &str = "KILN_TENSORFLOW_STDERR";

/// Writes a command's output to stdout. A reader that went away (`kiln inspect
/// CKPT | head -1`) ends the output, as it does for Unix tools: the rest is
/// dropped without a word, and the command finishes its work (a training run
/// goes on; its results are in the run directory). Any other failure (stdout
/// closed, a full disk) drops the rest too, and the command then fails
/// ([`stdout_failure`]): its output is lost.
pub(crate) fn write_out(text: std::fmt::Arguments<'_>) {
    use std::io::Write;
    use std::sync::atomic::Ordering;
    if CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut stdout = std::io::stdout().lock();
    if let Err(error) = stdout.write_fmt(text).and_then(|()| stdout.flush()) {
        CLOSED.store(true, Ordering::Relaxed);
        if error.kind() != std::io::ErrorKind::BrokenPipe {
            log::warn!("writing to stdout failed ({error}); the rest of the output is dropped");
            let _ = FAILURE.set(error.to_string());
        }
    }
}

/// Set once stdout has refused a write: nothing more is written to it.
static CLOSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Why stdout refused a write, unless its reader went away.
static FAILURE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Why the command's output could not be written to stdout (`kiln generate
/// >&-`, a full disk), if it could not; a reader that went away is not a failure.
pub(crate) fn stdout_failure() -> Option<&'static str> {
    FAILURE.get().map(String::as_str)
}

/// Whether fd 1 was closed when the process started (`kiln generate >&-`).
/// Rust's runtime then opens `/dev/null` there before `main`, so that writes
/// vanish; this is read earlier, by the loader's constructors.
static STDOUT_CLOSED_AT_START: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Runs [`note_closed_stdout`] when the executable is loaded, before Rust's
/// runtime starts.
#[cfg(target_os = "linux")]
#[used]
#[link_section = ".init_array"]
static NOTE_CLOSED_STDOUT: extern "C" fn() = note_closed_stdout;

#[cfg(target_os = "linux")]
extern "C" fn note_closed_stdout() {
    // SAFETY: F_GETFD only reads a descriptor's flags, and fails with EBADF
    // for a closed one; it touches no memory.
    let closed = unsafe { libc::fcntl(1, libc::F_GETFD) } == -1;
    STDOUT_CLOSED_AT_START.store(closed, std::sync::atomic::Ordering::Relaxed);
}

/// Refuses to run `command`, whose output is what it prints, when stdout was
/// closed at start (`>&-`): the output would be lost.
pub(crate) fn check_stdout_open(command: &str) -> Result<()> {
    if STDOUT_CLOSED_AT_START.load(std::sync::atomic::Ordering::Relaxed) {
        anyhow::bail!(
            "stdout is closed; {command} prints its output there: redirect it to a file (or to \
             /dev/null to discard it) instead of closing it"
        );
    }
    Ok(())
}

/// `println!` for a command's output, through [`write_out`].
macro_rules! outln {
    () => {
        $crate::output::write_out(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::output::write_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use outln;

/// `print!` for a command's output, through [`write_out`].
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::write_out(format_args!($($arg)*))
    };
}
pub(crate) use out;

/// Kiln's log lines on stderr, at `RUST_LOG`'s level (default `info`).
pub fn init_logging() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_target(false)
        .init();
}

/// Checks, before anything is read or written, that `command` (`predict`,
/// `export`) may write its output at `output`: its directory exists, and
/// nothing is there unless `overwrite` (a link whose target is missing is named
/// as such).
pub(crate) fn check_output(output: &Path, overwrite: bool, command: &str) -> Result<()> {
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        anyhow::bail!(
            "--output {}: the directory {} does not exist; {command} writes into an existing \
             directory: create it first, or choose another --output",
            output.display(),
            parent.display()
        );
    }
    if overwrite {
        return Ok(());
    }
    let Ok(meta) = std::fs::symlink_metadata(output) else {
        return Ok(());
    };
    if meta.file_type().is_symlink() && !output.exists() {
        let target = std::fs::read_link(output).unwrap_or_default();
        anyhow::bail!(
            "--output {} is a symbolic link to {}, which does not exist; {command} never \
             writes through or over a link unless told to: pass --overwrite to replace the \
             link, or choose another --output",
            output.display(),
            target.display()
        );
    }
    anyhow::bail!(
        "{} exists; {command} never writes over a file unless told to: pass --overwrite to \
         replace it, or choose another --output",
        output.display()
    )
}
