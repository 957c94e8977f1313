//! The run directory's files: a failed start undone, new files only, the
//! resolved config.

use std::path::Path;

use anyhow::{Context, Result};
use kiln_train::RunDirectory;

use crate::config::RunConfig;

/// Holds a run's directory; when the run fails before its first checkpoint,
/// removes what it wrote there ([`RunDirectory::discard_failed_start`]), so
/// that the same command can run again once the cause is fixed.
pub(crate) struct UndoFailedStart(Option<RunDirectory>);

impl UndoFailedStart {
    /// Holds `run` until it [`succeeded`](Self::succeeded).
    pub(crate) fn new(run: RunDirectory) -> UndoFailedStart {
        UndoFailedStart(Some(run))
    }

    /// The run finished: its directory stays as it is.
    pub(crate) fn succeeded(&mut self) {
        self.0.take();
    }
}

impl Drop for UndoFailedStart {
    fn drop(&mut self) {
        let Some(run) = self.0.take() else {
            return;
        };
        let dir = run.path().to_path_buf();
        match run.discard_failed_start() {
            Ok(removed) if !removed.is_empty() => log::info!(
                "the run failed before its first checkpoint: removed what it wrote in {} ({}), \
                 so that it can start there again",
                dir.display(),
                removed.join(", ")
            ),
            Ok(_) => {}
            Err(error) => log::warn!(
                "the run failed before its first checkpoint, and removing what it wrote in {} \
                 failed too: {error}",
                dir.display()
            ),
        }
    }
}

/// Writes `bytes` to a new file at `path`, refusing to replace one.
pub(crate) fn write_new_file(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .and_then(|mut file| file.write_all(bytes))
        .with_context(|| format!("writing {}", path.display()))
}

/// The resolved config, as the run directory's `config.toml` holds it.
pub(crate) fn toml_string(config: &RunConfig) -> Result<String> {
    toml::to_string_pretty(config).context("writing the resolved config")
}
