//! Sharded checkpoints: under a strategy that shards the state over its ranks
//! (ZeRO, full sharding), each rank writes its own part, and no rank gathers
//! the whole (as PyTorch's distributed checkpoint does).
//!
//! The files of step `n` of a job of `N` ranks, in the checkpoint directory:
//!
//! | file | holds |
//! | --- | --- |
//! | `step-<n>.shard-<r>-of-<N>.safetensors` | rank `r`'s tensors, named as in the whole state, with the checkpoint's metadata and `kiln.shard` (JSON: the set, the rank, the number of ranks, and which rows of the whole each sliced tensor holds) |
//! | `step-<n>.safetensors` | the index: no tensors; the checkpoint's metadata and `kiln.shards` (JSON: the set and its shard files, in rank order) |
//!
//! The index is written last, once every rank has written its shard, and
//! atomically: a set without an index is incomplete and never read, so the
//! set is written all or nothing. `last.safetensors` points to the newest
//! index, and [`Checkpoint::load`] of an index reads every shard and puts
//! the whole state together, so a sharded checkpoint resumes on any number
//! of ranks, under any strategy, and `kiln eval`, `kiln export` and
//! `kiln consolidate` read it as they read one file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_core::distributed::{Collectives, ReduceOp};
use kiln_core::error::{Error, Result};
use kiln_core::state_dict::StateDict;
use kiln_core::state_tensors::{RowSlice, WritableState};
use kiln_core::HostTensor;
use serde::{Deserialize, Serialize};

use super::{check_format, checkpoint_path, Checkpoint, Checkpointer};

/// The metadata key of a shard's record.
pub(super) const SHARD_KEY: &str = "kiln.shard";
/// The metadata key of an index's list of shards.
pub(super) const INDEX_KEY: &str = "kiln.shards";

/// What `kiln.shard` records in a shard file.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ShardRecord {
    /// The set the shard belongs to (the same in its index).
    set: String,
    rank: u64,
    world_size: u64,
    /// For each tensor (`model.<name>`, `optimizer.<key>`) that is a slice of
    /// rows of a larger one: which rows. Any other is whole.
    rows: BTreeMap<String, RowSlice>,
}

/// What `kiln.shards` records in an index.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ShardIndex {
    set: String,
    /// The shard files, in rank order, in the index's directory.
    shards: Vec<String>,
}

/// `<dir>/step-<step>.shard-<rank>-of-<world>.safetensors`.
pub fn shard_path(dir: &Path, step: u64, rank: usize, world: usize) -> PathBuf {
    dir.join(shard_name(step, rank, world))
}

fn shard_name(step: u64, rank: usize, world: usize) -> String {
    format!("step-{step:08}.shard-{rank}-of-{world}.safetensors")
}

/// The step of a shard file's name (`step-<n>.shard-<r>-of-<N>.safetensors`).
pub(super) fn shard_step(name: &str) -> Option<u64> {
    let (step, rest) = name.strip_prefix("step-")?.split_once(".shard-")?;
    rest.strip_suffix(".safetensors")?;
    step.parse().ok()
}

/// Writes one rank's part of a sharded checkpoint: every rank of `group`
/// calls it at the same point, with its own part in `part` (tensors named as
/// in the whole state, `model.`/`optimizer.` prefixes aside) and `rows` (for
/// each sliced tensor, by its prefixed name, which rows of the whole it
/// holds). `checkpointer` is rank 0's (which it needs), and is not used on
/// any other rank.
///
/// Every rank writes its shard atomically; the ranks then agree that all of
/// them succeeded before rank 0 writes the index, points `last.safetensors`
/// at it and prunes by its policy. When any rank fails, every rank returns an
/// error naming the ranks that failed, and removes its shard: the last
/// complete checkpoint stays the newest. Returns the index's path.
pub fn save_sharded_checkpoint<S: WritableState>(
    dir: &Path,
    part: &Checkpoint<S>,
    rows: BTreeMap<String, RowSlice>,
    group: &dyn Collectives,
    checkpointer: Option<&mut Checkpointer>,
) -> Result<PathBuf> {
    let (rank, world) = (group.rank(), group.world_size());
    let index = checkpoint_path(dir, part.step);
    // A name for this set, rank 0's, which every shard and the index record.
    let mut set = if rank == 0 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{:x}-{nanos:x}", std::process::id()).into_bytes()
    } else {
        Vec::new()
    };
    group.broadcast_bytes(&mut set, 0)?;
    let set = String::from_utf8(set)
        .map_err(|_| Error::distributed("sharded checkpoint", "rank 0 sent a bad set name"))?;

    let own = shard_path(dir, part.step, rank, world);
    let record = ShardRecord {
        set: set.clone(),
        rank: rank as u64,
        world_size: world as u64,
        rows,
    };
    let written = serde_json::to_string(&record)
        .map_err(|e| Error::checkpoint_caused_by(&own, "cannot serialise `kiln.shard`", e))
        .and_then(|json| part.save_with(&own, BTreeMap::from([(SHARD_KEY.to_owned(), json)])));
    let failed = ranks_that_failed(group, written.is_err())?;
    if !failed.is_empty() {
        remove_if_written(&own);
        return Err(match written {
            Err(e) => e,
            Ok(()) => Error::checkpoint(
                &index,
                format!(
                    "was not written: rank(s) {} could not write their shards (their errors \
                     name why); the last complete checkpoint is kept",
                    list(&failed)
                ),
            ),
        });
    }

    // Rank 0 commits the set: the index, then `last` and pruning.
    let mut committed = None;
    let mut outcome = Ok(());
    if rank == 0 && checkpointer.is_none() {
        committed = Some(false);
        outcome = Err(Error::invalid_argument(
            "checkpointer",
            "rank 0 writes the index of a sharded checkpoint, and has no Checkpointer \
             (give it one: Trainer::with_checkpointer)",
        ));
    }
    if let Some(checkpointer) = checkpointer.filter(|_| rank == 0) {
        let shards = (0..world)
            .map(|r| shard_name(part.step, r, world))
            .collect();
        let listing = ShardIndex { set, shards };
        let header = Checkpoint::<StateDict> {
            model: StateDict::new(),
            optimizer: StateDict::new(),
            step: part.step,
            epoch: part.epoch,
            batch_in_epoch: part.batch_in_epoch,
            seed: part.seed,
            world_size: part.world_size,
            backend: part.backend.clone(),
            optimizer_kind: part.optimizer_kind.clone(),
            model_definition: part.model_definition.clone(),
            lora: part.lora.clone(),
            data: part.data.clone(),
            data_order: part.data_order.clone(),
            scheduler: part.scheduler.clone(),
            metrics: part.metrics.clone(),
            epoch_loss: part.epoch_loss,
            epoch_metrics: part.epoch_metrics.clone(),
            averaged: None,
            callbacks: part.callbacks.clone(),
        };
        let wrote_index = serde_json::to_string(&listing)
            .map_err(|e| Error::checkpoint_caused_by(&index, "cannot serialise `kiln.shards`", e))
            .and_then(|json| {
                header.save_with(&index, BTreeMap::from([(INDEX_KEY.to_owned(), json)]))
            });
        outcome = match wrote_index {
            Ok(()) => {
                committed = Some(true);
                checkpointer.commit(&index, part.step, &part.metrics)
            }
            Err(e) => {
                committed = Some(false);
                Err(e)
            }
        };
    }
    // Every rank learns whether the set was committed; without an index its
    // shards are removed.
    let mut flag = [match committed {
        Some(false) => 0.0,
        _ => 1.0,
    }];
    group.broadcast_f32(&mut flag, 0)?;
    if flag[0] == 0.0 {
        remove_if_written(&own);
        return Err(match outcome {
            Err(e) => e,
            Ok(()) => Error::checkpoint(
                &index,
                "was not written: rank 0 could not write the index of the shards (its error \
                 names why); the last complete checkpoint is kept",
            ),
        });
    }
    outcome?;
    Ok(index)
}

/// The ranks of `group` for which `failed` holds (every rank calls it).
fn ranks_that_failed(group: &dyn Collectives, failed: bool) -> Result<Vec<usize>> {
    let mut flags = vec![0.0; group.world_size()];
    flags[group.rank()] = f64::from(u8::from(failed));
    group.all_reduce_f64(&mut flags, ReduceOp::Sum)?;
    Ok(flags
        .iter()
        .enumerate()
        .filter(|(_, &f)| f > 0.0)
        .map(|(r, _)| r)
        .collect())
}

fn list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn remove_if_written(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => log::warn!("could not remove {}: {e}", path.display()),
    }
}

/// The error for a shard file given where a checkpoint is expected.
pub(super) fn refuse_lone_shard(path: &Path, record: &str) -> Error {
    let which = serde_json::from_str::<ShardRecord>(record)
        .map(|r| format!("shard {} of {}", r.rank, r.world_size))
        .unwrap_or_else(|_| "a shard".to_owned());
    Error::checkpoint(
        path,
        format!(
            "is {which} of a sharded checkpoint, not a whole one: give its index, the \
             `step-<n>.safetensors` beside it (or `last.safetensors`), which reads every shard"
        ),
    )
}

/// The index at `path`'s listing, from its `kiln.shards` metadata.
fn parse_index(path: &Path, listing: &str) -> Result<ShardIndex> {
    serde_json::from_str(listing).map_err(|e| {
        Error::checkpoint_caused_by(path, format!("metadata `{INDEX_KEY}` is damaged"), e)
    })
}

/// The shard file names the index at `path` lists (its `kiln.shards` value).
pub(super) fn listed_shards(path: &Path, listing: &str) -> Result<Vec<String>> {
    Ok(parse_index(path, listing)?.shards)
}

/// Reads the sharded checkpoint whose index is at `path` (with the index's
/// own `tensors` and `meta`): every shard, checked against the index, put
/// together into the whole state.
pub(super) fn load_set(
    path: &Path,
    tensors: StateDict,
    meta: &BTreeMap<String, String>,
) -> Result<Checkpoint> {
    let bad = |reason: String| Error::checkpoint(path, reason);
    if !tensors.is_empty() {
        return Err(bad(format!(
            "is the index of a sharded checkpoint, but holds {} tensors (an index holds none)",
            tensors.len()
        )));
    }
    let listing = parse_index(path, &meta[INDEX_KEY])?;
    let mut checkpoint = Checkpoint::from_parts(StateDict::new(), meta, path)?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let world = listing.shards.len();
    let mut pieces: BTreeMap<String, Vec<Piece>> = BTreeMap::new();
    for (rank, name) in listing.shards.iter().enumerate() {
        if Path::new(name).file_name() != Some(std::ffi::OsStr::new(name)) {
            return Err(bad(format!(
                "names the shard `{name}`, which is not a file name beside the index"
            )));
        }
        let shard = dir.join(name);
        if !shard.exists() {
            return Err(Error::checkpoint(
                &shard,
                format!(
                    "is missing: it is shard {rank} of {world} of the sharded checkpoint {}, \
                     which is incomplete without it; nothing was loaded",
                    path.display()
                ),
            ));
        }
        let (tensors, shard_meta) = StateDict::load_safetensors(&shard)?;
        check_format(&shard_meta, &shard)?;
        let record: ShardRecord = match shard_meta.get(SHARD_KEY) {
            Some(text) => serde_json::from_str(text).map_err(|e| {
                Error::checkpoint_caused_by(&shard, format!("metadata `{SHARD_KEY}` is damaged"), e)
            })?,
            None => {
                return Err(Error::checkpoint(
                    &shard,
                    format!(
                        "is not a shard (it has no `{SHARD_KEY}`), but the sharded checkpoint {} \
                         lists it as shard {rank} of {world}",
                        path.display()
                    ),
                ))
            }
        };
        let part = Checkpoint::from_parts(tensors, &shard_meta, &shard)?;
        if record.set != listing.set || part.step != checkpoint.step {
            return Err(Error::checkpoint(
                &shard,
                format!(
                    "is a shard of another checkpoint (step {}, set {}), not of {} (step {}, \
                     set {}): the set was overwritten or mixed; nothing was loaded",
                    part.step,
                    record.set,
                    path.display(),
                    checkpoint.step,
                    listing.set
                ),
            ));
        }
        if record.rank != rank as u64 || record.world_size != world as u64 {
            return Err(Error::checkpoint(
                &shard,
                format!(
                    "records itself as shard {} of {}, but the index {} lists it as shard \
                     {rank} of {world}",
                    record.rank,
                    record.world_size,
                    path.display()
                ),
            ));
        }
        for (prefix, state) in [("model.", part.model), ("optimizer.", part.optimizer)] {
            for (key, tensor) in state {
                let full = format!("{prefix}{key}");
                let rows = record.rows.get(&full).copied();
                pieces
                    .entry(full)
                    .or_default()
                    .push(Piece { rank, rows, tensor });
            }
        }
    }
    let (mut model, mut optimizer) = (StateDict::new(), StateDict::new());
    for (key, parts) in pieces {
        let whole = assemble(&key, parts).map_err(&bad)?;
        match key.strip_prefix("model.") {
            Some(name) => model.insert(name.to_owned(), whole),
            None => optimizer.insert(key["optimizer.".len()..].to_owned(), whole),
        };
    }
    checkpoint.model = model;
    checkpoint.optimizer = optimizer;
    Ok(checkpoint)
}

/// One shard's part of a tensor.
struct Piece {
    rank: usize,
    rows: Option<RowSlice>,
    tensor: HostTensor,
}

/// The whole tensor `key` from its parts: one whole part, or slices of rows
/// that cover the whole exactly once, in one dtype and with the same rows'
/// shape. The reason it cannot be put together otherwise.
fn assemble(key: &str, mut parts: Vec<Piece>) -> std::result::Result<HostTensor, String> {
    if parts.iter().all(|p| p.rows.is_none()) {
        if parts.len() > 1 {
            let ranks: Vec<usize> = parts.iter().map(|p| p.rank).collect();
            return Err(format!(
                "`{key}` is held whole by more than one shard ({})",
                list(&ranks)
            ));
        }
        return Ok(parts.remove(0).tensor);
    }
    if let Some(p) = parts.iter().find(|p| p.rows.is_none()) {
        return Err(format!(
            "`{key}` is held whole by shard {} and in slices of rows by others",
            p.rank
        ));
    }
    parts.sort_by_key(|p| p.rows.map(|r| r.start));
    let first = &parts[0];
    let (dtype, inner) = (
        first.tensor.dtype(),
        first.tensor.dims().get(1..).map(<[usize]>::to_vec),
    );
    let total = first.rows.map_or(0, |r| r.total);
    let mut next = 0u64;
    let mut bytes = Vec::new();
    for p in &parts {
        let slice = p.rows.unwrap_or(RowSlice { start: 0, total });
        let dims = p.tensor.dims();
        if p.tensor.dtype() != dtype || dims.get(1..).map(<[usize]>::to_vec) != inner {
            return Err(format!(
                "`{key}`: shard {} holds {} {:?}, shard {} holds {dtype} {:?}",
                p.rank,
                p.tensor.dtype(),
                dims,
                first.rank,
                first.tensor.dims()
            ));
        }
        if slice.total != total || slice.start != next {
            return Err(format!(
                "`{key}`: shard {} holds rows from {} of {}, where rows from {next} of {total} \
                 were expected (the shards overlap or leave a gap)",
                p.rank, slice.start, slice.total
            ));
        }
        next += dims.first().copied().unwrap_or(1) as u64;
        bytes.extend_from_slice(p.tensor.as_bytes());
    }
    if next != total {
        return Err(format!(
            "`{key}`: the shards hold rows 0 to {next} of {total}; the rest are missing"
        ));
    }
    let mut shape = vec![total as usize];
    shape.extend(inner.unwrap_or_default());
    HostTensor::from_bytes(dtype, shape, &bytes).map_err(|e| format!("`{key}`: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(rank: usize, rows: Option<(u64, u64)>, data: &[f32], shape: &[usize]) -> Piece {
        Piece {
            rank,
            rows: rows.map(|(start, total)| RowSlice { start, total }),
            tensor: HostTensor::from_slice(data, shape.to_vec()).unwrap(),
        }
    }

    #[test]
    fn slices_of_rows_are_put_together_in_order() {
        let whole = assemble(
            "w",
            vec![
                piece(1, Some((2, 3)), &[5.0, 6.0], &[1, 2]),
                piece(0, Some((0, 3)), &[1.0, 2.0, 3.0, 4.0], &[2, 2]),
            ],
        )
        .unwrap();
        assert_eq!(whole.dims(), &[3, 2]);
        assert_eq!(
            whole.as_slice::<f32>().unwrap(),
            &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        );
        let whole = assemble("b", vec![piece(0, None, &[7.0], &[])]).unwrap();
        assert_eq!(whole.item::<f32>().unwrap(), 7.0);
    }

    #[test]
    fn gaps_overlaps_and_doubles_are_named() {
        let gap = assemble(
            "w",
            vec![
                piece(0, Some((0, 4)), &[1.0, 2.0], &[2]),
                piece(1, Some((3, 4)), &[4.0], &[1]),
            ],
        );
        assert!(gap
            .unwrap_err()
            .contains("rows from 3 of 4, where rows from 2"));
        let short = assemble("w", vec![piece(0, Some((0, 4)), &[1.0, 2.0], &[2])]);
        assert!(short.unwrap_err().contains("rows 0 to 2 of 4"));
        let twice = assemble(
            "b",
            vec![piece(0, None, &[1.0], &[1]), piece(1, None, &[1.0], &[1])],
        );
        assert!(twice
            .unwrap_err()
            .contains("held whole by more than one shard (0, 1)"));
        let shapes = assemble(
            "w",
            vec![
                piece(0, Some((0, 2)), &[1.0, 2.0], &[1, 2]),
                piece(1, Some((1, 2)), &[1.0, 2.0, 3.0], &[1, 3]),
            ],
        );
        assert!(shapes.unwrap_err().contains("shard 1 holds"));
    }

    #[test]
    fn shard_names_carry_their_step() {
        let name = shard_name(12, 1, 4);
        assert_eq!(name, "step-00000012.shard-1-of-4.safetensors");
        assert_eq!(shard_step(&name), Some(12));
        assert_eq!(shard_step("step-00000012.safetensors"), None);
    }
}
