//! The one error type of kiln-build.
//!
//! An error with a cause (an I/O error) keeps it as its
//! [`source`](std::error::Error::source) and leaves it out of its own message, as
//! kiln-core's errors do; show an error to a user with
//! [`BuildError::display_chain`] (or [`ErrorChain`] for any error), which prints
//! each cause once: `creating .kiln/venv: Permission denied (os error 13)`.

use std::fmt;
use std::path::PathBuf;

/// Result alias for kiln-build.
pub type Result<T, E = BuildError> = std::result::Result<T, E>;

/// What can go wrong while finding, provisioning or linking a native library.
///
/// Every message says what was wrong and what to do about it: these end up in
/// front of a user who ran `cargo xtask test` on a fresh machine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// No usable Python interpreter.
    #[error(
        "no Python 3 interpreter found (looked for `{looked_for}`). Kiln uses Python only at build \
         and test time, to install libtorch and TensorFlow from PyPI. Install Python 3.10 or newer \
         (Debian/Ubuntu: `apt-get install python3 python3-venv`), or point KILN_PYTHON at one"
    )]
    PythonNotFound {
        /// The interpreter name or path that was tried.
        looked_for: String,
    },
    /// The interpreter is too old for the pinned wheels.
    #[error("{python} is Python {found}; the pinned torch and tensorflow wheels need Python 3.10 to 3.13. Point KILN_PYTHON at a supported interpreter")]
    PythonTooOld {
        /// The interpreter.
        python: PathBuf,
        /// Its version.
        found: String,
    },
    /// `python -m venv` could not give the virtualenv a pip.
    #[error(
        "{python} cannot create a virtualenv with pip: {detail}. On Debian/Ubuntu install it with \
         `apt-get install python3-venv` (or python3.X-venv for your version), then run the command again"
    )]
    NoPip {
        /// The interpreter.
        python: PathBuf,
        /// What Python printed (last line).
        detail: String,
    },
    /// pip could not reach the package index.
    #[error(
        "cannot reach the Python package index to install {packages}: {detail}. Check the network \
         or proxy (pip honours PIP_INDEX_URL and HTTPS_PROXY); only the first run needs PyPI, later \
         runs reuse the installed virtualenv. Full pip log: {log}"
    )]
    RegistryUnreachable {
        /// The requirement list being installed.
        packages: String,
        /// The line of pip's output that shows the failure.
        detail: String,
        /// Where pip's full output was kept.
        log: PathBuf,
    },
    /// The disk filled up (or there is not enough room to start).
    #[error(
        "not enough disk space in {dir}: {detail}. The pinned wheels need about {needed_gb} GB; free \
         some space and run the command again (the partial virtualenv is discarded automatically)"
    )]
    DiskFull {
        /// The directory being written.
        dir: PathBuf,
        /// What was observed.
        detail: String,
        /// Space the install needs, in GB.
        needed_gb: u64,
    },
    /// pip failed for another reason.
    #[error(
        "pip failed to install {packages} (exit status {status}):\n{tail}\nFull pip log: {log}"
    )]
    PipFailed {
        /// The requirement list being installed.
        packages: String,
        /// pip's exit status.
        status: String,
        /// The last lines of pip's output.
        tail: String,
        /// Where pip's full output was kept.
        log: PathBuf,
    },
    /// A native library of the wrong version.
    #[error("{library} at {path} is version {found}, but Kiln needs {expected} ({why}). {fix}")]
    WrongVersion {
        /// "libtorch" or "TensorFlow".
        library: &'static str,
        /// Where it was found.
        path: PathBuf,
        /// The version found.
        found: String,
        /// The version required.
        expected: &'static str,
        /// Why this version.
        why: &'static str,
        /// What the user can do.
        fix: String,
    },
    /// A directory given by the user (or expected from provisioning) lacks a library.
    #[error("{what} not found: {path} does not exist or lacks {missing}. {fix}")]
    LibraryNotFound {
        /// What was looked for.
        what: &'static str,
        /// The directory looked at.
        path: PathBuf,
        /// The file that is missing.
        missing: String,
        /// What the user can do.
        fix: String,
    },
    /// A file-system operation failed; the I/O error is the source.
    #[error("{action} {path}")]
    Io {
        /// What was being done ("creating", "reading", ...).
        action: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A command could not be run or failed.
    #[error("`{command}` failed: {detail}")]
    Command {
        /// The command line.
        command: String,
        /// What went wrong.
        detail: String,
    },
}

impl BuildError {
    /// This error with all its causes, `context: cause: cause`: the message to
    /// show a user.
    pub fn display_chain(&self) -> ErrorChain<'_> {
        ErrorChain(self)
    }

    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        let path = path.into();
        if is_disk_full(&source) {
            return BuildError::DiskFull {
                dir: path,
                detail: source.to_string(),
                needed_gb: crate::versions::VENV_SIZE_GB,
            };
        }
        BuildError::Io {
            action,
            path,
            source,
        }
    }
}

/// ENOSPC (28) or EDQUOT (122) on Linux.
fn is_disk_full(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(28) | Some(122))
}

/// An error and its [`source`](std::error::Error::source)s displayed as one line,
/// `context: cause: cause` (the text of `anyhow`'s `{:#}`): from
/// [`BuildError::display_chain`], [`BookError::display_chain`](crate::book::BookError::display_chain),
/// or [`ErrorChain::new`] for any error (a build script's boxed one).
///
/// ```
/// let err: Box<dyn std::error::Error> = "no libtorch".into();
/// assert_eq!(kiln_build::ErrorChain::new(&*err).to_string(), "no libtorch");
/// ```
#[derive(Clone, Copy)]
pub struct ErrorChain<'a>(&'a (dyn std::error::Error + 'static));

impl<'a> ErrorChain<'a> {
    /// The chain of `error` and its sources.
    pub fn new(error: &'a (dyn std::error::Error + 'static)) -> Self {
        ErrorChain(error)
    }
}

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            write!(f, ": {cause}")?;
            next = cause.source();
        }
        Ok(())
    }
}

impl fmt::Debug for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chain walked by hand through `source`, independent of [`ErrorChain`].
    fn chain(error: &(dyn std::error::Error + 'static)) -> String {
        let mut out = error.to_string();
        let mut next = error.source();
        while let Some(cause) = next {
            out.push_str(": ");
            out.push_str(&cause.to_string());
            next = cause.source();
        }
        out
    }

    #[test]
    fn an_io_error_prints_its_cause_once() {
        let cause = "disk on fire";
        let error = BuildError::io("creating", ".kiln/venv", std::io::Error::other(cause));
        assert!(matches!(error, BuildError::Io { .. }), "{error:?}");
        let walked = chain(&error);
        assert_eq!(walked, "creating .kiln/venv: disk on fire");
        assert_eq!(walked.matches(cause).count(), 1, "{walked}");
        assert_eq!(error.display_chain().to_string(), walked);
    }
}
