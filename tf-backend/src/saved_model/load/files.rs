//! A SavedModel's files: checking them before TensorFlow's loader reads them,
//! putting a freshly written checkpoint in place, and copying the directory.
//!
//! TensorFlow writes a checkpoint under a prefix as `<prefix>.index` plus
//! `<prefix>.data-NNNNN-of-MMMMM` shards. Kiln lets TensorFlow write under a temporary
//! prefix in the same directory, syncs the files, then renames the shards and, last,
//! the index over `variables.*`: every file is whole at any moment.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use kiln_core::{Error, Result};

/// The checkpoint prefix a SavedModel's loader reads, inside `variables/`.
pub(crate) const VARIABLES_STEM: &str = "variables";

/// A name no other writer uses: `.kiln-<what>-<pid>-<n>`.
pub(crate) fn temp_name(what: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!(".kiln-{what}-{}-{n}", std::process::id())
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> Error + '_ {
    move |e| Error::io(path, e)
}

/// Flushes a file's data to disk.
pub(crate) fn sync_file(path: &Path) -> Result<()> {
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io_err(path))
}

/// Flushes a directory's entries (renames, creations) to disk, where the platform
/// allows opening a directory.
pub(crate) fn sync_dir(path: &Path) -> Result<()> {
    if cfg!(unix) {
        sync_file(path)?;
    }
    Ok(())
}

/// The shard suffix of `<stem>.data-NNNNN-of-MMMMM`, i.e. `.data-NNNNN-of-MMMMM`.
fn data_suffix<'a>(file_name: &'a str, stem: &str) -> Option<&'a str> {
    file_name
        .strip_prefix(stem)
        .filter(|rest| rest.starts_with(".data-"))
}

fn file_names(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        if let Ok(name) = entry.file_name().into_string() {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// Moves the checkpoint written under `dir/<temp_stem>` to `dir/variables`: syncs
/// every file, renames the data shards, then the index, then syncs `dir` and removes
/// shards of an older checkpoint that the new index does not name.
pub(crate) fn install_checkpoint(dir: &Path, temp_stem: &str) -> Result<()> {
    let names = file_names(dir)?;
    let index = format!("{temp_stem}.index");
    if !names.contains(&index) {
        return Err(Error::checkpoint(
            dir.join(temp_stem),
            format!(
                "TensorFlow's save function wrote no {index}; the directory holds {}",
                names.join(", ")
            ),
        ));
    }
    let shards: Vec<&str> = names
        .iter()
        .filter_map(|name| data_suffix(name, temp_stem))
        .collect();
    if shards.is_empty() {
        return Err(Error::checkpoint(
            dir.join(temp_stem),
            "TensorFlow's save function wrote an index but no data shard",
        ));
    }
    for suffix in &shards {
        sync_file(&dir.join(format!("{temp_stem}{suffix}")))?;
    }
    sync_file(&dir.join(&index))?;
    // The data first: until the index is renamed, the old index stays in place. A
    // crash in between leaves whole files whose checksums (kept in the index) no
    // longer match, which TensorFlow reports on restore instead of reading garbage.
    for suffix in &shards {
        let from = dir.join(format!("{temp_stem}{suffix}"));
        let to = dir.join(format!("{VARIABLES_STEM}{suffix}"));
        fs::rename(&from, &to).map_err(io_err(&to))?;
    }
    let to = dir.join(format!("{VARIABLES_STEM}.index"));
    fs::rename(dir.join(&index), &to).map_err(io_err(&to))?;
    sync_dir(dir)?;
    for name in file_names(dir)? {
        if let Some(suffix) = data_suffix(&name, VARIABLES_STEM) {
            if !shards.contains(&suffix) {
                let stale = dir.join(&name);
                if let Err(e) = fs::remove_file(&stale) {
                    log::warn!("cannot remove the stale shard {}: {e}", stale.display());
                }
            }
        }
    }
    Ok(())
}

/// Removes, best effort, whatever a failed save left under `dir/<temp_stem>*`
/// (TensorFlow's `<prefix>_temp/` shard directory included).
pub(crate) fn remove_temp(dir: &Path, temp_stem: &str) {
    let Ok(names) = file_names(dir) else {
        return;
    };
    for name in names.iter().filter(|name| name.starts_with(temp_stem)) {
        let path = dir.join(name);
        let removed = if path.is_dir() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        if let Err(e) = removed {
            log::warn!("cannot remove the temporary {}: {e}", path.display());
        }
    }
}

/// Copies `from` to `to` recursively, leaving out the top-level entries named in
/// `skip`; files are synced.
pub(crate) fn copy_tree(from: &Path, to: &Path, skip: &[&str]) -> Result<()> {
    fs::create_dir_all(to).map_err(io_err(to))?;
    for entry in fs::read_dir(from).map_err(io_err(from))? {
        let entry = entry.map_err(io_err(from))?;
        let name = entry.file_name();
        if skip.iter().any(|s| name.as_os_str() == *s) {
            continue;
        }
        let (src, dst): (PathBuf, PathBuf) = (entry.path(), to.join(&name));
        if src.is_dir() {
            copy_tree(&src, &dst, &[])?;
        } else {
            fs::copy(&src, &dst).map_err(io_err(&src))?;
            sync_file(&dst)?;
        }
    }
    sync_dir(to)
}

/// Checks that `dir` looks like a SavedModel before TensorFlow is asked to load it,
/// so the common mistakes get a message that says what was expected.
pub(crate) fn check_saved_model_dir(dir: &Path) -> Result<()> {
    let meta = fs::metadata(dir).map_err(|e| {
        Error::io(
            dir,
            io::Error::new(
                e.kind(),
                format!(
                    "cannot open the SavedModel directory ({e}); expected a directory holding \
                     saved_model.pb and variables/"
                ),
            ),
        )
    })?;
    if !meta.is_dir() {
        return Err(Error::invalid_argument(
            "dir",
            format!(
                "{} is a file; a SavedModel is a directory holding saved_model.pb and variables/",
                dir.display()
            ),
        ));
    }
    let pb = dir.join("saved_model.pb");
    if !pb.is_file() {
        if dir.join("saved_model.pbtxt").is_file() {
            return Ok(());
        }
        return Err(Error::invalid_argument(
            "dir",
            format!(
                "{} holds no saved_model.pb, so it is not a SavedModel directory (write one with \
                 `tf.saved_model.save` or Keras's `model.export`)",
                dir.display()
            ),
        ));
    }
    check_saved_model_files(dir, &pb)
}

/// Checks what TensorFlow's loader would report without naming a file: a
/// `saved_model.pb` that is empty, cut short or damaged, and variables whose
/// files are missing although the graph restores variables.
fn check_saved_model_files(dir: &Path, pb: &Path) -> Result<()> {
    let bytes = fs::read(pb).map_err(|e| Error::io(pb, e))?;
    let damaged = |offset: Option<u64>, reason: String| Error::data(pb, offset, reason);
    if bytes.is_empty() {
        return Err(damaged(
            Some(0),
            "the file is empty; it should hold the SavedModel's graphs (was the export cut \
             short?)"
                .to_owned(),
        ));
    }
    let graphs = super::saver_def::meta_graphs(&bytes).map_err(|e| {
        damaged(
            None,
            format!(
                "not a SavedModel protobuf, or cut short ({} bytes): {e}",
                bytes.len()
            ),
        )
    })?;
    if graphs.is_empty() {
        return Err(damaged(
            None,
            "holds no MetaGraph; not a SavedModel written by TensorFlow".to_owned(),
        ));
    }
    // A graph with a saver restores variables from variables/variables.{index,data-*}.
    let restores = graphs
        .iter()
        .any(|graph| matches!(super::saver_def::saver_def(graph), Ok(Some(_))));
    if !restores {
        return Ok(());
    }
    let variables = dir.join("variables");
    let index = variables.join(format!("{}.index", VARIABLES_STEM));
    if !index.is_file() {
        return Err(Error::data(
            index,
            None,
            "missing: the SavedModel's graph restores variables, and their index is gone (the \
             weights cannot be loaded; copy the whole SavedModel directory)",
        ));
    }
    let shards: Vec<String> = file_names(&variables)?
        .into_iter()
        .filter_map(|name| data_suffix(&name, VARIABLES_STEM).map(str::to_owned))
        .collect();
    // `.data-00000-of-00002`: every shard of the count must be there.
    let expected = shards
        .iter()
        .filter_map(|suffix| suffix.rsplit_once("-of-")?.1.parse::<usize>().ok())
        .max()
        .unwrap_or(1);
    for shard in 0..expected {
        let suffix = format!(".data-{shard:05}-of-{expected:05}");
        if !shards.contains(&suffix) {
            let name = format!("{VARIABLES_STEM}{suffix}");
            return Err(Error::data(
                variables.join(name),
                None,
                "missing: one of the SavedModel's variable data files is gone",
            ));
        }
    }
    Ok(())
}

/// `saved_model.pb (N bytes), variables/variables.index (N bytes), ...`: the
/// files a failed load read, for its message (TensorFlow's names none).
pub(crate) fn describe_files(dir: &Path) -> String {
    let mut files = Vec::new();
    for sub in ["", "variables"] {
        let Ok(entries) = fs::read_dir(dir.join(sub)) else {
            continue;
        };
        for entry in entries.flatten() {
            if let (Ok(meta), Some(name)) = (entry.metadata(), entry.file_name().to_str()) {
                if meta.is_file() {
                    let name = Path::new(sub).join(name);
                    files.push(format!("{} ({} bytes)", name.display(), meta.len()));
                }
            }
        }
    }
    files.sort();
    files.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-files-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).ok();
        dir
    }

    #[test]
    fn install_renames_shards_and_index_and_drops_stale_shards() -> Result<()> {
        let dir = scratch("install");
        let write = |name: &str, text: &str| fs::write(dir.join(name), text).map_err(io_err(&dir));
        write("variables.index", "old index")?;
        write("variables.data-00000-of-00002", "old 0")?;
        write("variables.data-00001-of-00002", "old 1")?;
        write(".kiln-t.index", "new index")?;
        write(".kiln-t.data-00000-of-00001", "new 0")?;
        install_checkpoint(&dir, ".kiln-t")?;
        assert_eq!(
            file_names(&dir)?,
            ["variables.data-00000-of-00001", "variables.index"]
        );
        let index = fs::read_to_string(dir.join("variables.index")).map_err(io_err(&dir))?;
        assert_eq!(index, "new index");
        fs::remove_dir_all(&dir).map_err(io_err(&dir))
    }

    #[test]
    fn install_without_index_fails_and_keeps_the_old_checkpoint() -> Result<()> {
        let dir = scratch("noindex");
        fs::write(dir.join("variables.index"), "old").map_err(io_err(&dir))?;
        fs::write(dir.join(".kiln-t.data-00000-of-00001"), "x").map_err(io_err(&dir))?;
        let err = install_checkpoint(&dir, ".kiln-t");
        assert!(matches!(err, Err(Error::Checkpoint { .. })), "{err:?}");
        remove_temp(&dir, ".kiln-t");
        assert_eq!(file_names(&dir)?, ["variables.index"]);
        fs::remove_dir_all(&dir).map_err(io_err(&dir))
    }
}
