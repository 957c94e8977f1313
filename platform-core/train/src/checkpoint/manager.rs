//! When to save, and which checkpoints to keep: the strategy, apart from the format.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{checkpoint_path, Checkpoint};
use kiln_core::error::{Error, Result};
use kiln_core::state_tensors::WritableState;

/// Whether a smaller or a larger monitored value is better.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MonitorMode {
    /// Smaller is better (a loss).
    #[default]
    Min,
    /// Larger is better (an accuracy).
    Max,
}

impl MonitorMode {
    /// Whether `candidate` is better than `current`.
    pub fn better(self, candidate: f64, current: f64) -> bool {
        match self {
            MonitorMode::Min => candidate < current,
            MonitorMode::Max => candidate > current,
        }
    }
}

/// When checkpoints are written and which are kept (like Lightning's `ModelCheckpoint`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointPolicy {
    /// Save every this many optimizer steps.
    #[serde(default)]
    pub every_n_steps: Option<u64>,
    /// Save at the end of every this many epochs (default 1).
    #[serde(default = "one")]
    pub every_n_epochs: Option<u64>,
    /// How many of the most recent checkpoints to keep (at least 1).
    #[serde(default = "one_usize")]
    pub keep_last: usize,
    /// How many of the best checkpoints by `monitor` to keep besides.
    #[serde(default)]
    pub keep_best: usize,
    /// The metric that ranks checkpoints (e.g. `"val_loss"`).
    #[serde(default)]
    pub monitor: Option<String>,
    /// Whether smaller or larger `monitor` values are better.
    #[serde(default)]
    pub mode: MonitorMode,
}

fn one() -> Option<u64> {
    Some(1)
}
fn one_usize() -> usize {
    1
}

impl Default for CheckpointPolicy {
    fn default() -> Self {
        Self {
            every_n_steps: None,
            every_n_epochs: Some(1),
            keep_last: 1,
            keep_best: 0,
            monitor: None,
            mode: MonitorMode::Min,
        }
    }
}

impl CheckpointPolicy {
    /// Whether a checkpoint is written after optimizer step `step`.
    pub fn due_after_step(&self, step: u64) -> bool {
        self.every_n_steps.is_some_and(|n| step.is_multiple_of(n))
    }

    /// Whether a checkpoint is written after finishing epoch `epoch` (0-based).
    pub fn due_after_epoch(&self, epoch: u64) -> bool {
        self.every_n_epochs
            .is_some_and(|n| (epoch + 1).is_multiple_of(n))
    }

    /// Rejects settings that cannot work, naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.every_n_steps == Some(0) || self.every_n_epochs == Some(0) {
            return Err(Error::invalid_argument(
                "checkpoint.every_n_steps / every_n_epochs",
                "must be at least 1 (leave it out to not save on that schedule)",
            ));
        }
        if self.keep_last == 0 {
            return Err(Error::invalid_argument(
                "checkpoint.keep_last",
                "must be at least 1: resuming needs the last checkpoint",
            ));
        }
        if self.keep_best > 0 && self.monitor.is_none() {
            return Err(Error::invalid_argument(
                "checkpoint.monitor",
                "keep_best needs a metric to rank checkpoints by (e.g. \"val_loss\")",
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct Saved {
    path: PathBuf,
    step: u64,
    metric: Option<f64>,
}

/// Writes checkpoints into a directory by a [`CheckpointPolicy`], keeps
/// `last.safetensors` pointing at the newest, and deletes the ones the policy
/// no longer keeps.
///
/// `last.safetensors` is a symbolic link to the newest `step-*.safetensors`
/// (replaced atomically), so it never holds bytes of its own that another
/// file shares: replacing it by hand cannot silently rewrite a step checkpoint
/// through a second name.
#[derive(Debug)]
pub struct Checkpointer {
    dir: PathBuf,
    policy: CheckpointPolicy,
    saved: Vec<Saved>,
}

impl Checkpointer {
    /// A checkpointer writing into `dir` (created if needed). Checkpoints already
    /// there (from an interrupted run) count as saved, newest last, each with
    /// the monitored metric it recorded, so `keep_best` ranks them after a
    /// resume as before it. Temporary files that a crashed writer left in `dir`
    /// (`*.tmp-<pid>` of a process that no longer runs) are removed.
    pub fn new(dir: impl Into<PathBuf>, policy: CheckpointPolicy) -> Result<Self> {
        policy.validate()?;
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        remove_stale_temporaries(&dir)?;
        remove_incomplete_sets(&dir)?;
        let mut saved = Vec::new();
        for (step, path) in step_files(&dir)? {
            let metric = match &policy.monitor {
                Some(monitor) => match Checkpoint::load_metrics(&path) {
                    Ok(metrics) => metrics.get(monitor).copied(),
                    Err(e) => {
                        log::warn!("{}; it is not ranked by `{monitor}`", e.display_chain());
                        None
                    }
                },
                None => None,
            };
            saved.push(Saved { path, step, metric });
        }
        Ok(Self { dir, policy, saved })
    }

    /// The checkpoint to resume the run in `dir` from: what `last.safetensors`
    /// points to, or, when that is missing or dangling, the newest
    /// `step-*.safetensors` (with a warning); `None` when there is neither.
    pub fn latest(dir: &Path) -> Result<Option<PathBuf>> {
        let last = Self::last_path(dir);
        if last.exists() {
            return Ok(Some(last));
        }
        let newest = step_files(dir)?.pop().map(|(_, path)| path);
        if let Some(path) = &newest {
            log::warn!(
                "{} is missing; resuming from the newest step checkpoint, {}",
                last.display(),
                path.display()
            );
        }
        Ok(newest)
    }

    /// The directory checkpoints go to.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `last.safetensors` in `dir`: the newest checkpoint, the one to resume from.
    pub fn last_path(dir: &Path) -> PathBuf {
        dir.join("last.safetensors")
    }

    /// Whether the policy saves after optimizer step `step` (1-based count).
    pub fn due_after_step(&self, step: u64) -> bool {
        self.policy.due_after_step(step)
    }

    /// Whether the policy saves after finishing epoch `epoch` (0-based).
    pub fn due_after_epoch(&self, epoch: u64) -> bool {
        self.policy.due_after_epoch(epoch)
    }

    /// The best checkpoint kept so far by the monitored metric.
    pub fn best(&self) -> Option<&Path> {
        let mode = self.policy.mode;
        self.saved
            .iter()
            .filter_map(|s| s.metric.map(|m| (m, s)))
            .reduce(|a, b| if mode.better(b.0, a.0) { b } else { a })
            .map(|(_, s)| s.path.as_path())
    }

    /// Writes `checkpoint` (atomically), points `last.safetensors` at it, and prunes.
    pub fn save<S: WritableState>(&mut self, checkpoint: &Checkpoint<S>) -> Result<PathBuf> {
        let path = checkpoint_path(&self.dir, checkpoint.step);
        checkpoint.save(&path)?;
        self.commit(&path, checkpoint.step, &checkpoint.metrics)?;
        Ok(path)
    }

    /// Counts the checkpoint just written at `path` as saved: points
    /// `last.safetensors` at it and prunes.
    pub(super) fn commit(
        &mut self,
        path: &Path,
        step: u64,
        metrics: &std::collections::BTreeMap<String, f64>,
    ) -> Result<()> {
        point_last_at(&self.dir, path)?;
        let metric = self
            .policy
            .monitor
            .as_ref()
            .and_then(|m| metrics.get(m).copied());
        self.saved.retain(|s| s.step != step);
        self.saved.push(Saved {
            path: path.to_owned(),
            step,
            metric,
        });
        self.prune()?;
        log::info!("checkpoint written: {}", path.display());
        Ok(())
    }

    fn prune(&mut self) -> Result<()> {
        let keep_last = self.policy.keep_last;
        let recent: Vec<u64> = self
            .saved
            .iter()
            .rev()
            .take(keep_last)
            .map(|s| s.step)
            .collect();
        let mut ranked: Vec<&Saved> = self.saved.iter().filter(|s| s.metric.is_some()).collect();
        let mode = self.policy.mode;
        ranked.sort_by(|a, b| {
            let (x, y) = (a.metric.unwrap_or(f64::NAN), b.metric.unwrap_or(f64::NAN));
            if mode.better(x, y) {
                std::cmp::Ordering::Less
            } else if mode.better(y, x) {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        });
        let best: Vec<u64> = ranked
            .iter()
            .take(self.policy.keep_best)
            .map(|s| s.step)
            .collect();
        let (keep, drop): (Vec<Saved>, Vec<Saved>) = self
            .saved
            .drain(..)
            .partition(|s| recent.contains(&s.step) || best.contains(&s.step));
        for old in drop {
            // The index first: a sharded set without it is no checkpoint.
            remove_existing(&old.path)?;
            for (_, shard) in shard_files(&self.dir)?
                .into_iter()
                .filter(|(step, _)| *step == old.step)
            {
                remove_existing(&shard)?;
            }
        }
        self.saved = keep;
        Ok(())
    }
}

/// Removes `path`; one deleted already (by someone else) is removed all the same.
fn remove_existing(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other.map_err(|e| Error::io(path, e)),
    }
}

/// The shard files of sharded checkpoints in `dir` with their step.
fn shard_files(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut files = Vec::new();
    for entry in super::dir_entries(dir)? {
        let path = entry.path();
        if let Some(step) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(super::sharded::shard_step)
        {
            files.push((step, path));
        }
    }
    Ok(files)
}

/// Removes the shards of sharded checkpoints whose index is not in `dir`:
/// what a job that stopped while writing a set left (its index is written
/// last), never read.
fn remove_incomplete_sets(dir: &Path) -> Result<()> {
    for (step, shard) in shard_files(dir)? {
        if !checkpoint_path(dir, step).exists() {
            remove_existing(&shard)?;
            log::info!(
                "removed {}, a shard of a checkpoint that was never completed",
                shard.display()
            );
        }
    }
    Ok(())
}

/// The `step-<n>.safetensors` files in `dir` with their step, oldest first
/// (none when `dir` does not exist).
fn step_files(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut files = Vec::new();
    for entry in super::dir_entries(dir)? {
        let path = entry.path();
        let step = path.file_name().and_then(|n| n.to_str()).and_then(|n| {
            n.strip_prefix("step-")?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()
        });
        if let Some(step) = step {
            files.push((step, path));
        }
    }
    files.sort();
    Ok(files)
}

/// Points `<dir>/last.safetensors` at `target` (a file in `dir`): a relative
/// symbolic link made under a temporary name and renamed over `last`, which is
/// atomic. Where there are no symbolic links, a hard link the same way.
fn point_last_at(dir: &Path, target: &Path) -> Result<()> {
    let last = Checkpointer::last_path(dir);
    let tmp = dir.join(format!(".last.tmp-{}", std::process::id()));
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&tmp, e)),
        _ => {}
    }
    #[cfg(unix)]
    {
        let name = target.file_name().unwrap_or(target.as_os_str());
        std::os::unix::fs::symlink(name, &tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    #[cfg(not(unix))]
    std::fs::hard_link(target, &tmp).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, &last).map_err(|e| Error::io(&last, e))
}

/// Removes the temporary files (`<name>.tmp-<pid>-<random>`, `.last.tmp-<pid>`) that a
/// writer which no longer runs left in `dir` when it crashed mid-write.
fn remove_stale_temporaries(dir: &Path) -> Result<()> {
    for entry in super::dir_entries(dir)? {
        let path = entry.path();
        let Some(pid) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(kiln_core::fs::temporary_owner)
        else {
            continue;
        };
        if pid == std::process::id() || process_is_running(pid) {
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => log::info!("removed {}, left by a crashed run", path.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&path, e)),
        }
    }
    Ok(())
}

/// Whether a process `pid` runs on this machine (Linux: it has a `/proc`
/// entry; elsewhere it is assumed to, so nothing of a live writer is removed).
fn process_is_running(pid: u32) -> bool {
    if cfg!(target_os = "linux") {
        Path::new("/proc").join(pid.to_string()).exists()
    } else {
        true
    }
}
