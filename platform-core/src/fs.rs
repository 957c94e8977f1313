//! Opening the files a user names (checkpoints, models): only regular files.
//!
//! Opening a named pipe for reading blocks until a writer comes, and a device
//! such as `/dev/zero` reads forever or reports a length of 0: a path given as a
//! checkpoint that is not a regular file is refused before it is opened, with
//! an error that says what it is.
//!
//! ```
//! use kiln_core::fs::check_regular_file;
//!
//! use std::error::Error as _;
//!
//! let err = check_regular_file(std::path::Path::new("/dev/null")).unwrap_err();
//! let cause = err.source().map(ToString::to_string).unwrap_or_default();
//! assert!(cause.starts_with("a character device, not a regular file"));
//! ```

use std::fs::{File, FileType};
use std::io;
use std::path::Path;

use crate::error::{Error, Result};

/// What kind of file `file_type` is, in words (`"a named pipe (FIFO)"`).
pub fn describe_file_type(file_type: FileType) -> &'static str {
    if file_type.is_file() {
        "a regular file"
    } else if file_type.is_dir() {
        "a directory"
    } else {
        describe_special(file_type)
    }
}

#[cfg(unix)]
fn describe_special(file_type: FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if file_type.is_fifo() {
        "a named pipe (FIFO)"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_block_device() {
        "a block device"
    } else if file_type.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

#[cfg(not(unix))]
fn describe_special(_: FileType) -> &'static str {
    "not a regular file"
}

/// Checks that `path` is a regular file (or a symbolic link to one) without
/// opening it: anything else is [`Error::Io`] naming the path and what it is
/// (kind [`io::ErrorKind::InvalidInput`]), a missing file the error of `stat`.
pub fn check_regular_file(path: &Path) -> Result<()> {
    let metadata = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if metadata.is_file() {
        return Ok(());
    }
    Err(Error::io(
        path,
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{}, not a regular file: expected a file to read",
                describe_file_type(metadata.file_type())
            ),
        ),
    ))
}

/// Opens `path` for reading after [`check_regular_file`]: a named pipe or a
/// device is refused instead of blocking or reading forever.
pub fn open_regular_file(path: &Path) -> Result<File> {
    check_regular_file(path)?;
    File::open(path).map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_open() {
        let dir = std::env::temp_dir().join(format!("kiln-fs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("f");
        std::fs::write(&file, b"x").unwrap();
        assert!(open_regular_file(&file).is_ok());
        let message = |p: &Path| {
            let err = check_regular_file(p).unwrap_err();
            let cause = std::error::Error::source(&err).map(ToString::to_string);
            format!("{err}: {}", cause.unwrap_or_default())
        };
        assert!(message(&dir).contains("a directory, not a regular file"));
        assert!(message(Path::new("/dev/zero")).contains("a character device"));
        assert!(message(&dir.join("missing")).contains("missing"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
