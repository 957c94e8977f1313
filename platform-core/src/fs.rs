//! Opening the files a user names (checkpoints, models, data): only regular
//! files; and writing Kiln's own files atomically, through temporaries that
//! nobody can plant in advance.
//!
//! Opening a named pipe for reading blocks until a writer comes, and a device
//! such as `/dev/zero` reads forever or reports a length of 0: a path given as a
//! checkpoint that is not a regular file is refused before it is opened, with
//! an error that says what it is.
//!
//! Every file Kiln writes goes first to a temporary beside it, created
//! exclusively ([`std::fs::OpenOptions::create_new`], which neither follows nor
//! replaces a link) under a name with a random part ([`create_temporary_beside`]),
//! then is renamed over the target ([`write_atomically`]): a link planted at a
//! predictable temporary name cannot redirect the write.
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

use std::ffi::OsString;
use std::fs::{File, FileType, OpenOptions};
use std::hash::BuildHasher;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Reads the whole of `path` after [`check_regular_file`]: a named pipe or a
/// device (a link to `/dev/zero`) is refused instead of blocking or reading
/// until memory runs out.
pub fn read_regular_file(path: &Path) -> Result<Vec<u8>> {
    check_regular_file(path)?;
    std::fs::read(path).map_err(|e| Error::io(path, e))
}

/// [`read_regular_file`] as UTF-8 text; a file of other bytes is
/// [`Error::Io`] of kind [`io::ErrorKind::InvalidData`] naming it.
pub fn read_regular_to_string(path: &Path) -> Result<String> {
    check_regular_file(path)?;
    std::fs::read_to_string(path).map_err(|e| Error::io(path, e))
}

/// The marker between a file's name and its temporary's suffix: a temporary
/// of `model.safetensors` is `model.safetensors.tmp-<pid>-<random>`.
pub const TEMPORARY_MARKER: &str = ".tmp-";

/// The process id that wrote a temporary named `<name>.tmp-<pid>[-<random>]`
/// (what a clean-up of a crashed writer's leftovers reads), or `None` for
/// any other name.
pub fn temporary_owner(file_name: &str) -> Option<u32> {
    let (_, suffix) = file_name.rsplit_once(TEMPORARY_MARKER)?;
    let pid = suffix.split_once('-').map_or(suffix, |(pid, _)| pid);
    pid.parse().ok()
}

/// A name no other call (in this process or another) produces, and that
/// cannot be guessed in advance: the process id, a counter and a random part.
fn temporary_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    // RandomState's keys come from the operating system's random source.
    let random = std::collections::hash_map::RandomState::new().hash_one((count, nanos));
    format!("{}{}-{random:016x}", TEMPORARY_MARKER, std::process::id())
}

/// The directory `path` is in (`.` for a bare file name).
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// A new file beside `path`, named `<name>.tmp-<pid>-<random>` and created
/// exclusively: it never opens a file or link that was already there.
pub fn create_temporary_beside(path: &Path) -> Result<(PathBuf, File)> {
    claim_temporary(path, "", |tmp| {
        OpenOptions::new().write(true).create_new(true).open(tmp)
    })
}

/// A new directory beside `path`, named `.<name>.tmp-<pid>-<random>` and
/// created with `mkdir` (which never follows a link).
pub fn create_temporary_dir_beside(path: &Path) -> Result<PathBuf> {
    claim_temporary(path, ".", |tmp: &Path| std::fs::create_dir(tmp)).map(|(tmp, ())| tmp)
}

/// Creates `<dir>/<prefix><name>.tmp-<pid>-<random>` beside `path` with
/// `create`, which must fail with `AlreadyExists` for a name already taken
/// (by accident or by design): that name is skipped for a fresh one. An
/// error names `path`, the file the user asked for (a missing directory is
/// its directory's), not the temporary.
fn claim_temporary<T>(
    path: &Path,
    prefix: &str,
    create: impl Fn(&Path) -> io::Result<T>,
) -> Result<(PathBuf, T)> {
    let file_name = path.file_name().ok_or_else(|| {
        Error::invalid_argument("path", format!("{} does not name a file", path.display()))
    })?;
    let dir = parent_dir(path);
    let mut last = None;
    for _ in 0..16 {
        let mut name = OsString::from(prefix);
        name.push(file_name);
        name.push(temporary_suffix());
        let tmp = dir.join(name);
        match create(&tmp) {
            Ok(made) => return Ok((tmp, made)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(Error::io(path, e)),
        }
    }
    let e = last.ok_or_else(|| Error::invalid_argument("path", "no temporary name"))?;
    Err(Error::io(path, e))
}

/// Writes `path` atomically: `write` fills a new exclusive temporary beside it
/// ([`create_temporary_beside`]), which is synced, renamed over `path` (a link
/// at `path` is replaced, never written through) and made durable by syncing
/// the directory. On any failure the temporary is removed and `path` is as it
/// was.
///
/// ```
/// use std::io::Write as _;
///
/// let dir = std::env::temp_dir().join(format!("kiln-fs-doc-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// let path = dir.join("notes.txt");
/// kiln_core::fs::write_atomically(&path, |out| {
///     out.write_all(b"hello").map_err(|e| kiln_core::Error::io(&path, e))
/// })?;
/// assert_eq!(std::fs::read(&path)?, b"hello");
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> Result<()>,
) -> Result<()> {
    let (tmp, file) = create_temporary_beside(path)?;
    let written = (|| {
        let mut writer = BufWriter::with_capacity(1 << 20, file);
        write(&mut writer)?;
        let file = writer
            .into_inner()
            .map_err(|e| Error::io(path, e.into_error()))?;
        file.sync_all().map_err(|e| Error::io(path, e))?;
        drop(file);
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
    })();
    if let Err(e) = written {
        // Best effort: the write already failed, and a leftover temporary is
        // harmless (the next run's clean-up takes it), so this is only logged.
        if let Err(rm) = std::fs::remove_file(&tmp) {
            if rm.kind() != io::ErrorKind::NotFound {
                log::warn!("cannot remove {}: {rm}", tmp.display());
            }
        }
        return Err(e);
    }
    sync_dir(&parent_dir(path))
}

/// [`write_atomically`] with the whole content at once.
pub fn replace_file(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically(path, |out| {
        out.write_all(bytes).map_err(|e| Error::io(path, e))
    })
}

/// Makes a rename durable: on Unix a directory entry is only persistent once
/// the directory itself is synced.
#[cfg(unix)]
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

/// Makes a rename durable (nothing to do off Unix).
#[cfg(not(unix))]
pub fn sync_dir(_dir: &Path) -> Result<()> {
    Ok(())
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

    #[test]
    #[cfg(unix)]
    fn a_planted_link_never_redirects_a_write() {
        let dir = std::env::temp_dir().join(format!("kiln-fs-tmp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let target = dir.join("out");
        // The old predictable name, and a link at the target itself.
        let planted = dir.join(format!("out.tmp-{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        replace_file(&target, b"one").unwrap();
        std::fs::remove_file(&target).unwrap();
        std::os::unix::fs::symlink(&victim, &target).unwrap();
        replace_file(&target, b"two").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        assert_eq!(std::fs::read(&target).unwrap(), b"two");
        assert!(!target.is_symlink());
        let (a, _) = create_temporary_beside(&target).unwrap();
        let (b, _) = create_temporary_beside(&target).unwrap();
        assert_ne!(a, b);
        let name = a.file_name().unwrap().to_str().unwrap();
        assert_eq!(temporary_owner(name), Some(std::process::id()));
        assert_eq!(temporary_owner("x.tmp-42"), Some(42));
        assert_eq!(temporary_owner("x.safetensors"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
