//! Where a training run starts: afresh, or from a checkpoint, and the checks a
//! checkpoint passes before a run continues from it: the same model definition
//! and seed, the same data (kind, size, fingerprint: [`data_identity`]), and a
//! position inside that data.

use std::path::{Path, PathBuf};

use crate::prelude::*;
use anyhow::Result;
use kiln_train::{Checkpoint, Checkpointer, RunDirectory, RunStart};

use crate::config::RunConfig;
use crate::data::{Data, Split};

/// Where a rank other than 0 resumes from: the checkpoint rank 0 resumes from
/// (the run directory must be visible to every rank, as in PyTorch); rank 0
/// alone checks and writes the directory.
pub(crate) fn follower_resume(config: &RunConfig, resume: Option<&str>) -> Result<Option<PathBuf>> {
    Ok(match resume {
        None => None,
        Some("auto") => Checkpointer::latest(&config.output_dir.join("checkpoints"))?,
        Some(path) => Some(PathBuf::from(path)),
    })
}

/// Where a training run starts: afresh, or from a checkpoint.
pub(crate) fn resolve_resume(config: &RunConfig, resume: Option<&str>) -> Result<Option<PathBuf>> {
    let out = &config.output_dir;
    match resume {
        None => {
            RunDirectory::check(out, RunStart::New)?;
            Ok(None)
        }
        Some("auto") => {
            RunDirectory::check(out, RunStart::Resume)?;
            if let Some(path) = Checkpointer::latest(&out.join("checkpoints"))? {
                return Ok(Some(path));
            }
            // A run killed before its first checkpoint (no clean-up ran): its
            // own files only, so it starts again there (`kiln launch
            // --max-restarts` relies on it).
            if let Some(removed) = RunDirectory::discard_killed_start(out)? {
                log::info!(
                    "--resume auto: {} holds what a run stopped before its first checkpoint \
                     left ({}); removed it, and the run starts afresh",
                    out.display(),
                    if removed.is_empty() {
                        "its lock file".to_owned()
                    } else {
                        removed.join(", ")
                    }
                );
            }
            // Nothing to resume: a new run, but only where it destroys nothing.
            if RunDirectory::check(out, RunStart::New).is_err() {
                anyhow::bail!(
                    "output directory {}: --resume auto found no checkpoint to resume from \
                     (neither checkpoints/last.safetensors nor checkpoints/step-*.safetensors), \
                     and the directory is not empty, so a new run there would write over what \
                     it holds; start the run elsewhere with --output DIR",
                    out.display()
                );
            }
            log::info!(
                "--resume auto: no run in {} yet; starting a new one",
                out.display()
            );
            Ok(None)
        }
        Some(path) => {
            RunDirectory::check(out, RunStart::Resume)?;
            Ok(Some(PathBuf::from(path)))
        }
    }
}

/// Reads the checkpoint to resume from and checks it against the config: a
/// Kiln checkpoint (not a pipe, a TorchScript file or an ONNX model) of the same
/// model definition and seed.
pub(crate) fn load_resume_checkpoint(
    config: &RunConfig,
    model: &Layer,
    path: &Path,
) -> Result<Checkpoint> {
    crate::formats::refuse_other_formats(path)?;
    let checkpoint = Checkpoint::load(path)?;
    checkpoint.check_definition(model, path)?;
    check_resume_lora(config.lora.as_ref(), checkpoint.lora.as_ref(), path)?;
    if checkpoint.seed != config.seed {
        anyhow::bail!(
            "checkpoint {}: the run it continues used seed {}, this one seed {}; data order \
             and dropout derive from the seed, so another one would not continue that run \
             (pass --seed {} to resume it)",
            path.display(),
            checkpoint.seed,
            config.seed,
            checkpoint.seed
        );
    }
    Ok(checkpoint)
}

/// Checks the config's `[lora]` against the one the checkpoint was trained
/// with, every setting of it (rank, alpha, dropout, targets, rsLoRA): another
/// alpha alone would continue silently at another adapter scale.
fn check_resume_lora(
    config: Option<&kiln_core::lora::LoraConfig>,
    recorded: Option<&kiln_core::lora::LoraConfig>,
    path: &Path,
) -> Result<()> {
    match (config, recorded) {
        (None, None) => Ok(()),
        (Some(c), Some(r)) if c == r => Ok(()),
        (Some(_), None) => anyhow::bail!(
            "checkpoint {}: the run it continues trained without LoRA adapters, and this \
             config has a [lora] table; remove it to resume that run, or start a new run",
            path.display()
        ),
        (None, Some(r)) => anyhow::bail!(
            "checkpoint {}: the run it continues trained LoRA adapters (r = {}, lora_alpha = \
             {}, target_modules {:?}), and this config has no [lora] table; give it the \
             checkpoint's (`kiln inspect` shows it)",
            path.display(),
            r.r,
            r.alpha,
            r.target_modules
        ),
        (Some(c), Some(r)) => {
            let json =
                |l: &kiln_core::lora::LoraConfig| serde_json::to_value(l).unwrap_or_default();
            let (at, ours, theirs) = kiln_train::first_difference(&json(c), &json(r), "lora");
            anyhow::bail!(
                "checkpoint {}: was trained with another LoRA setting: at `{at}` the config \
                 has {ours} and the checkpoint {theirs}; the adapters' scale and shapes come \
                 from these, so resume with the checkpoint's [lora] (`kiln inspect` shows it)",
                path.display()
            )
        }
    }
}

/// Moves a checkpoint's position in its epoch to `world_size` ranks: each rank
/// counts its own batches, so the same global position is `batch_in_epoch *
/// old / new` batches per rank (with the same batch size), which must be whole.
/// Every rank then takes its share of the rest of the epoch's global order.
pub(crate) fn reshard(checkpoint: &mut Checkpoint, world_size: u64, path: &Path) -> Result<()> {
    let old = checkpoint.world_size.max(1);
    if old == world_size {
        return Ok(());
    }
    let consumed = checkpoint.batch_in_epoch * old;
    if !consumed.is_multiple_of(world_size) {
        anyhow::bail!(
            "checkpoint {}: written by {old} ranks after {} batches each of epoch {}, which is \
             not a whole number of batches for {world_size} ranks; resume with {old} ranks, or \
             from a checkpoint written at the end of an epoch",
            path.display(),
            checkpoint.batch_in_epoch,
            checkpoint.epoch
        );
    }
    log::info!(
        "resuming a run of {old} ranks on {world_size}: epoch {} continues at batch {} of each rank",
        checkpoint.epoch,
        consumed / world_size
    );
    checkpoint.batch_in_epoch = consumed / world_size;
    checkpoint.world_size = world_size;
    Ok(())
}

/// What identifies a run's training data, recorded in its checkpoints: the
/// dataset's kind and path (or shard pattern), the sizes of the training and
/// validation splits, and a fingerprint (FNV-1a, 64 bits) of the training
/// split's examples and labels as the model sees them (for image data, of its
/// first example).
pub(crate) fn data_identity(config: &RunConfig, data: &Data) -> serde_json::Value {
    let mut hash = Fnv1a::default();
    match &data.train {
        Split::Tensors(x, y) => {
            hash.eat(x.as_bytes());
            hash.eat(y.as_bytes());
        }
        #[cfg(feature = "vision")]
        Split::Images(_) => hash.eat(data.probe.as_bytes()),
        #[cfg(feature = "text")]
        Split::Text(_) => hash.eat(data.probe.as_bytes()),
    }
    let location = match &config.data.source {
        crate::config::DataSource::Webdataset(s) => s.shards.clone(),
        source => source.path().map(|p| p.display().to_string()),
    };
    serde_json::json!({
        "dataset": config.data.kind().name(),
        "path": location,
        "train_samples": data.train.len(),
        "val_samples": data.val.as_ref().map_or(0, Split::len),
        "fingerprint": format!("{:016x}", hash.0),
    })
}

/// Checks that a run resumed from `checkpoint` trains on the data it was
/// trained on (kind, sizes, fingerprint; a moved file with the same contents
/// passes). On other data the run fails naming the first difference, unless
/// `on_other_data` (`--resume-on-other-data`), when the epoch in progress
/// restarts from its first batch of the new data.
pub(crate) fn check_resume_data(
    checkpoint: &mut Checkpoint,
    identity: &serde_json::Value,
    path: &Path,
    on_other_data: bool,
) -> Result<()> {
    let Some(recorded) = &checkpoint.data else {
        return Ok(());
    };
    let same = |key: &str| recorded.get(key) == identity.get(key);
    let key = ["dataset", "train_samples", "val_samples", "fingerprint"]
        .into_iter()
        .find(|k| !same(k));
    let Some(key) = key else {
        if !same("path") {
            log::info!(
                "checkpoint {}: the data moved ({} then, {} now), with the same contents",
                path.display(),
                recorded["path"],
                identity["path"]
            );
        }
        return Ok(());
    };
    let difference = format!(
        "was trained on other data: its `{key}` was {}, this data's is {} (it recorded {}; \
         this run has {})",
        recorded[key], identity[key], recorded, identity
    );
    if !on_other_data {
        anyhow::bail!(
            "checkpoint {} {difference}. Resume on the data the run trained on, or pass \
             --resume-on-other-data to continue training it on this data (the epoch in \
             progress then starts again from its first batch)",
            path.display()
        );
    }
    log::warn!(
        "checkpoint {} {difference}; --resume-on-other-data: epoch {} starts again from its \
         first batch of this data",
        path.display(),
        checkpoint.epoch
    );
    checkpoint.batch_in_epoch = 0;
    checkpoint.epoch_loss = None;
    Ok(())
}

/// Checks that the checkpoint's position in its epoch (after [`reshard`]) lies
/// inside an epoch of `batches` batches per rank.
pub(crate) fn check_resume_position(
    checkpoint: &Checkpoint,
    batches: usize,
    path: &Path,
) -> Result<()> {
    if checkpoint.batch_in_epoch <= batches as u64 {
        return Ok(());
    }
    anyhow::bail!(
        "checkpoint {} stands at batch {} of epoch {}, but an epoch of this data has {batches} \
         batches per rank: it was written on other data, or with another batch size. Resume \
         with the data and `data.batch_size` it was trained with",
        path.display(),
        checkpoint.batch_in_epoch,
        checkpoint.epoch
    )
}

/// Refuses to resume a run that is already complete: its checkpoint stands
/// after the config's last epoch, or at its `max_steps`. Training it again
/// would take no step and only rewrite `model.safetensors`.
pub(crate) fn check_resume_not_complete(
    config: &RunConfig,
    checkpoint: &Checkpoint,
    batches: usize,
    path: &Path,
) -> Result<()> {
    let epochs = config.training.epochs;
    let done_epochs = if batches > 0 && checkpoint.batch_in_epoch >= batches as u64 {
        checkpoint.epoch + 1
    } else {
        checkpoint.epoch
    };
    if done_epochs >= epochs {
        anyhow::bail!(
            "checkpoint {}: the run it continues is complete: it finished {done_epochs} epochs \
             (step {}), and training.epochs is {epochs}; raise --epochs to train further",
            path.display(),
            checkpoint.step
        );
    }
    if let Some(max) = config.training.max_steps {
        if checkpoint.step >= max {
            anyhow::bail!(
                "checkpoint {}: the run it continues is complete: it stands at step {}, and \
                 training.max_steps is {max}; raise --max-steps to train further",
                path.display(),
                checkpoint.step
            );
        }
    }
    Ok(())
}

/// 64-bit FNV-1a: stable across Rust releases and machines, unlike std's hasher.
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    fn eat(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 ^= u64::from(byte);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}
