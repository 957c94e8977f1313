//! A run's output directory, held by one run at a time.
//!
//! A new run goes only into a directory that does not exist or is empty; a
//! resumed run only into one that holds a run. Either way the run holds an
//! exclusive advisory lock on `<dir>/.kiln.lock` for as long as the
//! [`RunDirectory`] lives (the operating system releases it when the process
//! exits or crashes), and a second run on the same directory fails at once,
//! naming the holder's PID.
//!
//! The checks come in two steps so that a command can check everything before
//! it writes anything: [`RunDirectory::check`] only reads, and
//! [`RunDirectory::acquire`] creates the directory and the lock file.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use kiln_core::error::{Error, Result};

/// The lock file's name inside a run directory.
pub const LOCK_FILE: &str = ".kiln.lock";

/// Whether a run starts afresh or continues the run already in the directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunStart {
    /// A new run: the directory must not exist, or be empty.
    New,
    /// A resumed run: the directory holds the run it continues.
    Resume,
}

/// An output directory locked for one run: a new run only into an absent or
/// empty directory, one run at a time (the lock file records its PID).
#[derive(Debug)]
pub struct RunDirectory {
    dir: PathBuf,
    start: RunStart,
    /// Whether [`acquire`](RunDirectory::acquire) created the directory.
    created: bool,
    // Held for the lock; closing it releases the lock.
    _lock: File,
}

/// What a run writes into its directory, by name: the run's config, the CSV
/// logs, TensorBoard's event files, the checkpoints, the final weights and the
/// curves. [`RunDirectory::discard_failed_start`] removes these and nothing else.
pub const RUN_OUTPUTS: [&str; 7] = [
    "config.toml",
    crate::logger::STEPS_FILE,
    crate::logger::EPOCHS_FILE,
    "tensorboard",
    "checkpoints",
    "model.safetensors",
    "curves.png",
];

impl RunDirectory {
    /// Checks, without writing anything, that a run can start in `dir`:
    /// no other run holds it, and for [`RunStart::New`] it is absent or empty.
    ///
    /// Fails with [`Error::RunDirectory`] saying what is in the way and what
    /// to do instead (resume, or another directory).
    pub fn check(dir: &Path, start: RunStart) -> Result<()> {
        if dir.as_os_str().is_empty() {
            return Err(run_error(
                dir,
                "an empty path names no directory; give the run a directory (`output_dir`, `--output`)",
            ));
        }
        if dir.exists() && !dir.is_dir() {
            return Err(run_error(dir, "exists and is not a directory"));
        }
        let lock = dir.join(LOCK_FILE);
        if lock.exists() {
            // Opening and locking an existing file writes nothing.
            let file = File::open(&lock).map_err(|e| Error::io(&lock, e))?;
            try_lock(&file, dir)?;
        }
        if start == RunStart::New {
            let entries = contents(dir)?;
            if !entries.is_empty() {
                return Err(run_error(
                    dir,
                    format!(
                        "is not empty (it holds {}); a new run never writes into a directory \
                         with files in it. Continue the run there (`--resume auto` on the \
                         command line, `RunStart::Resume` from Rust), or start this one in \
                         another directory (`--output DIR`)",
                        describe(&entries)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Creates `dir` if needed and takes its lock, after the checks of
    /// [`check`](Self::check) (repeated, since the directory may have changed
    /// since). The lock file records this process's PID.
    pub fn acquire(dir: &Path, start: RunStart) -> Result<Self> {
        Self::check(dir, start)?;
        let created = !dir.exists();
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        try_lock(&file, dir)?;
        // Only now, holding the lock, is the PID ours to write.
        let io = |e| Error::io(&path, e);
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        writeln!(file, "{}", std::process::id()).map_err(io)?;
        file.sync_all().map_err(io)?;
        if start == RunStart::New && !contents(dir)?.is_empty() {
            return Err(run_error(
                dir,
                "files appeared in it while the run started; choose another directory",
            ));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            start,
            created,
            _lock: file,
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Undoes a new run that failed before its first checkpoint (bad data found
    /// mid-epoch, a non-finite loss at the first step), so that the directory
    /// takes a new run again instead of refusing it: removes the run's outputs
    /// ([`RUN_OUTPUTS`]) and the lock file, and the directory itself when
    /// [`acquire`](Self::acquire) created it and nothing else is left in it.
    /// Anything else in the directory stays. Returns the names it removed.
    ///
    /// Does nothing for a resumed run, or once a checkpoint has been written
    /// (the run can then be resumed with `--resume auto`).
    pub fn discard_failed_start(self) -> Result<Vec<String>> {
        if self.start != RunStart::New
            || super::Checkpointer::latest(&self.dir.join("checkpoints"))?.is_some()
        {
            return Ok(Vec::new());
        }
        let mut removed = Vec::new();
        for name in RUN_OUTPUTS {
            let path = self.dir.join(name);
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            if meta.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            }
            .map_err(|e| Error::io(&path, e))?;
            removed.push(name.to_owned());
        }
        let lock = self.dir.join(LOCK_FILE);
        std::fs::remove_file(&lock).map_err(|e| Error::io(&lock, e))?;
        if self.created && contents(&self.dir)?.is_empty() {
            std::fs::remove_dir(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        }
        Ok(removed)
    }
}

impl RunDirectory {
    /// Clears what a run killed before its first checkpoint (`SIGKILL`, a
    /// lost node) left in `dir`, so that `--resume auto` can start it afresh:
    /// only when `dir` holds Kiln's lock file, no run holds that lock, there
    /// is no checkpoint and no `model.safetensors` (a run that finished wrote
    /// one: its outputs are kept even when its checkpoints were deleted), and
    /// everything else in it is a run's output ([`RUN_OUTPUTS`]: a user's file
    /// anywhere in it leaves it all alone).
    /// Returns the names removed, or `None` when `dir` is not such a directory.
    pub fn discard_killed_start(dir: &Path) -> Result<Option<Vec<String>>> {
        let lock = dir.join(LOCK_FILE);
        if !lock.is_file() {
            return Ok(None);
        }
        // Fails, naming the holder, while a run is using the directory.
        let file = File::open(&lock).map_err(|e| Error::io(&lock, e))?;
        try_lock(&file, dir)?;
        if super::Checkpointer::latest(&dir.join("checkpoints"))?.is_some() {
            return Ok(None);
        }
        let names = contents(dir)?;
        let finished = names.iter().any(|n| n == "model.safetensors");
        if finished || !names.iter().all(|n| RUN_OUTPUTS.contains(&n.as_str())) {
            return Ok(None);
        }
        for name in &names {
            let path = dir.join(name);
            let meta = std::fs::symlink_metadata(&path).map_err(|e| Error::io(&path, e))?;
            if meta.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            }
            .map_err(|e| Error::io(&path, e))?;
        }
        drop(file);
        std::fs::remove_file(&lock).map_err(|e| Error::io(&lock, e))?;
        Ok(Some(names))
    }
}

/// Takes `file`'s exclusive lock, or fails naming the PID written in it.
fn try_lock(file: &File, dir: &Path) -> Result<()> {
    match file.try_lock() {
        Ok(()) => Ok(()),
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut text = String::new();
            let holder = match (&*file).read_to_string(&mut text) {
                Ok(_) if !text.trim().is_empty() => format!("PID {}", text.trim()),
                _ => "another process".to_owned(),
            };
            Err(run_error(
                dir,
                format!(
                    "another run ({holder}) is using it; wait for it to finish, or write to \
                     another directory with `--output DIR`"
                ),
            ))
        }
        Err(std::fs::TryLockError::Error(e)) => Err(Error::io(dir.join(LOCK_FILE), e)),
    }
}

/// The names in `dir` other than the lock file (none when it does not exist).
fn contents(dir: &Path) -> Result<Vec<String>> {
    let mut names: Vec<String> = super::dir_entries(dir)?
        .into_iter()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name != LOCK_FILE)
        .collect();
    names.sort();
    Ok(names)
}

/// `a, b, c and 4 more`.
fn describe(names: &[String]) -> String {
    const SHOWN: usize = 4;
    let mut text = names
        .iter()
        .take(SHOWN)
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        text.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    text
}

fn run_error(dir: &Path, reason: impl Into<String>) -> Error {
    Error::RunDirectory {
        path: dir.to_path_buf(),
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-rundir-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_new_run_needs_an_absent_or_empty_directory() {
        let dir = scratch("new");
        let run = RunDirectory::acquire(&dir, RunStart::New).unwrap();
        assert!(dir.join(LOCK_FILE).is_file());
        drop(run);
        // Only the lock file: still empty for a new run.
        RunDirectory::check(&dir, RunStart::New).unwrap();
        std::fs::write(dir.join("config.toml"), "# mine").unwrap();
        let err = RunDirectory::check(&dir, RunStart::New).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("config.toml") && text.contains("--resume auto"),
            "{text}"
        );
        RunDirectory::check(&dir, RunStart::Resume).unwrap();
        let err = RunDirectory::check(Path::new(""), RunStart::New).unwrap_err();
        assert!(err.to_string().contains("empty path"), "{err}");
    }

    #[test]
    fn a_held_directory_names_the_holder() {
        let dir = scratch("held");
        let _held = RunDirectory::acquire(&dir, RunStart::New).unwrap();
        // A second open file description conflicts with the first, as another process's would.
        let err = RunDirectory::acquire(&dir, RunStart::Resume).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(&format!("PID {}", std::process::id())),
            "{text}"
        );
    }
}
