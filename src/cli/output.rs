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
/// goes on; its results are in the run directory).
pub(crate) fn write_out(text: std::fmt::Arguments<'_>) {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    static CLOSED: AtomicBool = AtomicBool::new(false);
    if CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut stdout = std::io::stdout().lock();
    if let Err(error) = stdout.write_fmt(text).and_then(|()| stdout.flush()) {
        CLOSED.store(true, Ordering::Relaxed);
        if error.kind() != std::io::ErrorKind::BrokenPipe {
            log::warn!("writing to stdout failed ({error}); the rest of the output is dropped");
        }
    }
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
