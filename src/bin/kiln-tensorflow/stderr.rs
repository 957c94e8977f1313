//! `kiln-tensorflow`'s side of the start-up capture (`src/cli/forward.rs`): when
//! `kiln` started it with fd 2 on an anonymous file and the real stderr as the
//! descriptor [`STDERR_FD_VAR`] names, `main` puts the real stderr back on fd 2,
//! reads what TensorFlow printed while loading and empties the capture (which
//! tells `kiln` that this process reached `main`).

use std::fs::File;
use std::io::{Read, Seek};
use std::os::fd::{FromRawFd, OwnedFd};

use kiln_cli::{CAPTURE_NAME, STDERR_FD_VAR, TENSORFLOW_LOG_TARGET};

/// What TensorFlow printed before `main`, when `kiln` captured it; fd 2 is the
/// real stderr again. `None` when nothing was captured (this process was run
/// directly, or TensorFlow's lines were let through).
pub(crate) fn take_back() -> Option<Vec<u8>> {
    let value = std::env::var(STDERR_FD_VAR).ok()?;
    let mut parts = value.split(':').map(str::parse::<u64>);
    let (Some(Ok(fd)), Some(Ok(dev)), Some(Ok(ino)), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    let fd = libc::c_int::try_from(fd).ok().filter(|&fd| fd > 2)?;
    // Only `kiln`'s anonymous file is read and emptied, never a file of the user's.
    let target = std::fs::read_link("/proc/self/fd/2").ok()?;
    if !target
        .to_string_lossy()
        .starts_with(&format!("/memfd:{CAPTURE_NAME} "))
    {
        return None;
    }
    // The descriptor must still be the stderr `kiln` passed: a process this one
    // starts inherits the variable, but not the descriptor (closed below).
    // SAFETY: fstat(2) writes only into `stat`, a valid, writable struct.
    let same = unsafe {
        let mut stat: libc::stat = std::mem::zeroed();
        libc::fstat(fd, &mut stat) == 0 && stat.st_dev as u64 == dev && stat.st_ino as u64 == ino
    };
    if !same {
        return None;
    }
    // SAFETY: fcntl(2) duplicates a descriptor and has no memory effects.
    let capture = unsafe { libc::fcntl(2, libc::F_DUPFD_CLOEXEC, 3) };
    // SAFETY: dup2(2) and close(2) have no memory effects; `fd` was passed to this
    // process for this and nothing else owns it.
    let restored = unsafe { libc::dup2(fd, 2) == 2 && libc::close(fd) == 0 };
    if capture < 0 || !restored {
        return None;
    }
    // SAFETY: `capture` is the descriptor fcntl just opened, owned by nothing else.
    let mut capture = File::from(unsafe { OwnedFd::from_raw_fd(capture) });
    let mut text = Vec::new();
    let _ = capture
        .rewind()
        .and_then(|()| capture.read_to_end(&mut text));
    let _ = capture.set_len(0);
    Some(text)
}

/// TensorFlow's start-up lines as Kiln debug lines (target `kiln::tensorflow`),
/// when Kiln logs at debug; otherwise they are dropped.
pub(crate) fn replay(start: Option<Vec<u8>>) {
    let Some(text) = start else {
        return;
    };
    if !log::log_enabled!(target: TENSORFLOW_LOG_TARGET, log::Level::Debug) {
        return;
    }
    for line in String::from_utf8_lossy(&text).lines() {
        log::debug!(target: TENSORFLOW_LOG_TARGET, "{line}");
    }
}
