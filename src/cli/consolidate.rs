//! `kiln consolidate`: a run's checkpoint as one file. A sharded checkpoint
//! (each rank's part and an index) is read shard by shard and put together;
//! the result is a Kiln checkpoint of the whole state, or the model's weights
//! alone as a run's `model.safetensors` holds them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use kiln_train::{Checkpoint, Checkpointer};

use crate::args::ConsolidateArgs;
use crate::output::{check_output, outln};

pub(crate) fn consolidate(args: &ConsolidateArgs) -> Result<()> {
    check_output(&args.output, args.overwrite, "kiln consolidate")?;
    let source = checkpoint_of(&args.run)?;
    // Every file the load reads (a sharded set's index and each shard), not
    // only the one named: `--overwrite` onto a shard would destroy the set.
    for read in Checkpoint::files(&source)? {
        if same_file(&read, &args.output) {
            anyhow::bail!(
                "--output {} is {} ({}); write the consolidated file elsewhere",
                args.output.display(),
                if read == source {
                    "the checkpoint being read".to_owned()
                } else {
                    format!("a shard of the checkpoint being read, {}", source.display())
                },
                read.display()
            );
        }
    }
    let checkpoint = Checkpoint::load(&source)?;
    let what = if args.weights_only {
        let mut metadata = BTreeMap::new();
        metadata.insert("format".to_owned(), "pt".to_owned());
        checkpoint.model.save_safetensors(&args.output, &metadata)?;
        format!("the model's {} tensors", checkpoint.model.len())
    } else {
        checkpoint.save(&args.output)?;
        format!(
            "a Kiln checkpoint ({} model and {} optimizer tensors)",
            checkpoint.model.len(),
            checkpoint.optimizer.len()
        )
    };
    outln!(
        "kiln: {} (step {}, written by {} rank{}) consolidated into {}: {what}",
        source.display(),
        checkpoint.step,
        checkpoint.world_size,
        if checkpoint.world_size == 1 { "" } else { "s" },
        args.output.display()
    );
    Ok(())
}

/// The checkpoint `run` names: a file as it is; a run directory's newest
/// (`checkpoints/last.safetensors`, else its newest step checkpoint), and a
/// checkpoint directory's likewise.
fn checkpoint_of(run: &Path) -> Result<PathBuf> {
    if !run.is_dir() {
        kiln_core::fs::check_regular_file(run)?;
        return Ok(run.to_owned());
    }
    let nested = run.join("checkpoints");
    let dir = if nested.is_dir() {
        nested
    } else {
        run.to_owned()
    };
    Checkpointer::latest(&dir)?.with_context(|| {
        format!(
            "{} holds no checkpoint (no last.safetensors or step-*.safetensors): give a run \
             directory that has written one, or a checkpoint file",
            dir.display()
        )
    })
}

/// Whether `a` and `b` are the same existing file (through links too).
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}
