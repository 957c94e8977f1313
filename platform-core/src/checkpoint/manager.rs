//! When to save, and which checkpoints to keep: the strategy, apart from the format.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{checkpoint_path, Checkpoint};
use crate::error::{Error, Result};
use crate::state_tensors::WritableState;

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
#[derive(Debug)]
pub struct Checkpointer {
    dir: PathBuf,
    policy: CheckpointPolicy,
    saved: Vec<Saved>,
}

impl Checkpointer {
    /// A checkpointer writing into `dir` (created if needed). Checkpoints already
    /// there (from an interrupted run) count as saved, newest last.
    pub fn new(dir: impl Into<PathBuf>, policy: CheckpointPolicy) -> Result<Self> {
        policy.validate()?;
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        let mut saved = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))? {
            let path = entry.map_err(|e| Error::io(&dir, e))?.path();
            let step = path.file_name().and_then(|n| n.to_str()).and_then(|n| {
                n.strip_prefix("step-")?
                    .strip_suffix(".safetensors")?
                    .parse()
                    .ok()
            });
            if let Some(step) = step {
                saved.push(Saved {
                    path,
                    step,
                    metric: None,
                });
            }
        }
        saved.sort_by_key(|s| s.step);
        Ok(Self { dir, policy, saved })
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
        self.policy
            .every_n_steps
            .is_some_and(|n| step.is_multiple_of(n))
    }

    /// Whether the policy saves after finishing epoch `epoch` (0-based).
    pub fn due_after_epoch(&self, epoch: u64) -> bool {
        self.policy
            .every_n_epochs
            .is_some_and(|n| (epoch + 1).is_multiple_of(n))
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
        // A hard link renamed over `last`: atomic, and no second copy of the data.
        let last = Self::last_path(&self.dir);
        let tmp = self.dir.join(format!(".last.tmp-{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::fs::hard_link(&path, &tmp).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &last).map_err(|e| Error::io(&last, e))?;
        let metric = self
            .policy
            .monitor
            .as_ref()
            .and_then(|m| checkpoint.metrics.get(m).copied());
        self.saved.retain(|s| s.step != checkpoint.step);
        self.saved.push(Saved {
            path: path.clone(),
            step: checkpoint.step,
            metric,
        });
        self.prune()?;
        log::info!("checkpoint written: {}", path.display());
        Ok(path)
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
            std::fs::remove_file(&old.path).map_err(|e| Error::io(&old.path, e))?;
        }
        self.saved = keep;
        Ok(())
    }
}
