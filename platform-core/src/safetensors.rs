//! State dicts as safetensors files, the format `safetensors.torch` reads and writes.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use ::safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::state_dict::StateDict;
use crate::tensor::HostTensor;

/// The header key safetensors reserves for string metadata.
const METADATA_KEY: &str = "__metadata__";

/// The dtypes Kiln reads, as a message lists them.
const SUPPORTED: &str = "U8, I32, I64, F32, F64";

fn from_safetensors_dtype(dtype: Dtype) -> Option<DType> {
    match dtype {
        Dtype::U8 => Some(DType::U8),
        Dtype::I32 => Some(DType::I32),
        Dtype::I64 => Some(DType::I64),
        Dtype::F32 => Some(DType::F32),
        Dtype::F64 => Some(DType::F64),
        _ => None,
    }
}

/// Converts between native and little-endian (safetensors) element bytes.
/// A no-op on little-endian targets; swaps each element on big-endian ones.
fn swap_to_le(bytes: &[u8], dtype: DType) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") || dtype.size_in_bytes() == 1 {
        Cow::Borrowed(bytes)
    } else {
        Cow::Owned(
            bytes
                .chunks_exact(dtype.size_in_bytes())
                .flat_map(|element| element.iter().rev().copied())
                .collect(),
        )
    }
}

fn corrupt(path: &Path, reason: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

impl StateDict {
    /// Writes the state dict to `path` as a safetensors file with the string
    /// `metadata` (readable by `safetensors.torch.load_file` and `safe_open`).
    ///
    /// The write is atomic: the bytes go to `<path>.tmp-<pid>` in the same
    /// directory, which is flushed to disk and renamed over `path`, and the
    /// directory is then synced; a crash leaves either the old file or the
    /// new one, never a torn file.
    ///
    /// Fails with [`Error::Io`] naming the file or directory that could not be
    /// written (the temporary file is removed), or [`Error::InvalidArgument`]
    /// for an entry named `__metadata__`, which the format reserves.
    ///
    /// ```
    /// use std::collections::BTreeMap;
    /// use kiln_core::{HostTensor, StateDict};
    ///
    /// let mut sd = StateDict::new();
    /// sd.insert("fc.weight", HostTensor::new(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2])?);
    /// sd.insert("step", HostTensor::scalar(7i64));
    /// let path = std::env::temp_dir().join(format!("kiln-doc-{}.safetensors", std::process::id()));
    /// let meta = BTreeMap::from([("epoch".to_string(), "3".to_string())]);
    /// sd.save_safetensors(&path, &meta)?;
    ///
    /// let (loaded, loaded_meta) = StateDict::load_safetensors(&path)?;
    /// assert_eq!(loaded, sd);
    /// assert_eq!(loaded_meta, meta);
    /// # std::fs::remove_file(&path).ok();
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn save_safetensors(
        &self,
        path: impl AsRef<Path>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<()> {
        save_entries(
            path.as_ref(),
            self.iter().map(|(k, t)| (k.as_str(), t)),
            metadata,
        )
    }

    /// Reads a safetensors file written by [`save_safetensors`](StateDict::save_safetensors),
    /// `safetensors.torch.save_file` or any other writer, returning its
    /// tensors and string metadata.
    ///
    /// Fails with [`Error::Io`] naming the file when it cannot be read, and
    /// with [`Error::Checkpoint`] naming it and saying what is wrong when it
    /// is truncated, is not a safetensors file, or holds a dtype Kiln does not
    /// model (only U8, I32, I64, F32 and F64 are supported).
    pub fn load_safetensors(
        path: impl AsRef<Path>,
    ) -> Result<(StateDict, BTreeMap<String, String>)> {
        let path = path.as_ref();
        let bytes = fs::read(path).map_err(|e| Error::io(path, e))?;
        let loaded = decode(&bytes, path)?;
        log::debug!(
            "loaded {} tensors ({} bytes) from {}",
            loaded.0.len(),
            bytes.len(),
            path.display()
        );
        Ok(loaded)
    }
}

/// The dtype's name in a safetensors header.
fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::U8 => "U8",
        DType::I32 => "I32",
        DType::I64 => "I64",
        DType::F32 => "F32",
        DType::F64 => "F64",
    }
}

/// Writes named tensors as a safetensors file, atomically (see
/// [`StateDict::save_safetensors`]), streaming each tensor's bytes to the file
/// instead of assembling the whole file in memory first: a checkpoint of a
/// large model costs no second copy of its weights.
///
/// Tensors are laid out as the `safetensors` crate lays them out, larger
/// elements first and then by name, so that every tensor's data is aligned
/// to its element size (the header is padded to a multiple of 8 bytes).
pub(crate) fn save_entries<'a>(
    path: &Path,
    entries: impl IntoIterator<Item = (&'a str, &'a HostTensor)>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let mut entries: Vec<(&str, &HostTensor)> = entries.into_iter().collect();
    if entries.iter().any(|(name, _)| *name == METADATA_KEY) {
        return Err(Error::invalid_argument(
            METADATA_KEY,
            "safetensors reserves this name for metadata; rename the entry",
        ));
    }
    entries.sort_by(|(a, ta), (b, tb)| {
        let size = |t: &HostTensor| t.dtype().size_in_bytes();
        size(tb).cmp(&size(ta)).then_with(|| a.cmp(b))
    });
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert(METADATA_KEY.to_owned(), serde_json::json!(metadata));
    }
    let mut offset = 0usize;
    for (name, tensor) in &entries {
        let end = offset + tensor.size_in_bytes();
        header.insert(
            (*name).to_owned(),
            serde_json::json!({
                "dtype": dtype_name(tensor.dtype()),
                "shape": tensor.dims(),
                "data_offsets": [offset, end],
            }),
        );
        offset = end;
    }
    let mut header = Value::Object(header).to_string().into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    write_atomically(path, |file| {
        file.write_all(&(header.len() as u64).to_le_bytes())?;
        file.write_all(&header)?;
        for (_, tensor) in &entries {
            file.write_all(&swap_to_le(tensor.as_bytes(), tensor.dtype()))?;
        }
        Ok(())
    })?;
    log::debug!(
        "saved {} tensors ({} bytes) to {}",
        entries.len(),
        8 + header.len() + offset,
        path.display()
    );
    Ok(())
}

/// Writes a temporary sibling of `path` with `write`, syncs it, renames it
/// over `path` and syncs the directory.
fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<()> {
    let file_name = path.file_name().ok_or_else(|| {
        Error::invalid_argument("path", format!("{} does not name a file", path.display()))
    })?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut tmp_name = file_name.to_os_string();
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = dir.join(tmp_name);

    let written = (|| {
        let file = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        let mut writer = BufWriter::with_capacity(1 << 20, file);
        write(&mut writer).map_err(|e| Error::io(&tmp, e))?;
        let file = writer.into_inner().map_err(|e| Error::io(&tmp, e.into_error()))?;
        file.sync_all().map_err(|e| Error::io(&tmp, e))?;
        drop(file);
        fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
    })();
    if let Err(e) = written {
        // Best effort: the write already failed, and a leftover temporary
        // file is harmless, so a failure to remove it is only logged.
        if let Err(rm) = fs::remove_file(&tmp) {
            if rm.kind() != std::io::ErrorKind::NotFound {
                log::warn!("cannot remove {}: {rm}", tmp.display());
            }
        }
        return Err(e);
    }
    sync_dir(&dir)
}

/// Makes the rename durable: on Unix a directory entry is only persistent
/// once the directory itself is synced.
#[cfg(unix)]
fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> Result<()> {
    Ok(())
}

/// Parses a whole safetensors file, with messages that say what is wrong.
fn decode(bytes: &[u8], path: &Path) -> Result<(StateDict, BTreeMap<String, String>)> {
    let Some((len_bytes, rest)) = bytes.split_first_chunk::<8>() else {
        return Err(corrupt(
            path,
            format!(
                "file is {} bytes, too short for the 8-byte header length of a safetensors file",
                bytes.len()
            ),
        ));
    };
    let header_len = u64::from_le_bytes(*len_bytes);
    let header_end = usize::try_from(header_len)
        .ok()
        .filter(|&n| n <= rest.len())
        .ok_or_else(|| {
            corrupt(
                path,
                format!(
                    "header length field says {header_len} bytes, but only {} bytes follow it \
                     (truncated, or not a safetensors file)",
                    rest.len()
                ),
            )
        })?;
    let (header, data) = rest.split_at(header_end);
    let header = std::str::from_utf8(header).map_err(|e| {
        corrupt(
            path,
            format!("header is not UTF-8 text ({e}); not a safetensors file"),
        )
    })?;
    let header: serde_json::Map<String, Value> =
        serde_json::from_str(header.trim_end()).map_err(|e| {
            corrupt(
                path,
                format!("header is not a JSON object ({e}); not a safetensors file"),
            )
        })?;

    let mut data_end = 0usize;
    for (name, info) in &header {
        if name == METADATA_KEY {
            continue;
        }
        let dtype = info.get("dtype").and_then(Value::as_str).ok_or_else(|| {
            corrupt(
                path,
                format!("header entry of tensor `{name}` has no dtype"),
            )
        })?;
        let supported = matches!(dtype, "U8" | "I32" | "I64" | "F32" | "F64");
        if !supported {
            return Err(corrupt(
                path,
                format!("dtype {dtype} of tensor `{name}` is not supported ({SUPPORTED})"),
            ));
        }
        let end = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .and_then(|offsets| offsets.get(1))
            .and_then(Value::as_u64)
            .ok_or_else(|| {
                corrupt(
                    path,
                    format!("header entry of tensor `{name}` has no valid data_offsets"),
                )
            })?;
        data_end = data_end.max(usize::try_from(end).unwrap_or(usize::MAX));
    }
    if data_end > data.len() {
        return Err(corrupt(
            path,
            format!(
                "header claims {data_end} bytes of tensor data, file has {} \
                 (the file is truncated)",
                data.len()
            ),
        ));
    }

    let invalid =
        |e: ::safetensors::SafeTensorError| corrupt(path, format!("invalid safetensors file: {e}"));
    let (_, file_metadata) = SafeTensors::read_metadata(bytes).map_err(invalid)?;
    let metadata: BTreeMap<String, String> = file_metadata
        .metadata()
        .iter()
        .flat_map(|m| m.iter())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let tensors = SafeTensors::deserialize(bytes).map_err(invalid)?;
    let mut state = StateDict::new();
    for (name, view) in tensors.tensors() {
        let dtype = from_safetensors_dtype(view.dtype()).ok_or_else(|| {
            corrupt(
                path,
                format!(
                    "dtype {} of tensor `{name}` is not supported ({SUPPORTED})",
                    view.dtype()
                ),
            )
        })?;
        let tensor = HostTensor::from_bytes(dtype, view.shape(), &swap_to_le(view.data(), dtype))
            .map_err(|e| corrupt(path, format!("tensor `{name}`: {e}")))?;
        state.insert(name, tensor);
    }
    Ok((state, metadata))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("kiln-core-st-{tag}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).expect("create temp dir");
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn sample() -> Result<StateDict> {
        let mut sd = StateDict::new();
        sd.insert(
            "layer.weight",
            HostTensor::new(vec![1.5f32, -2.0, 0.0, 3.25, 1e-30, -7.0], [2, 3])?,
        );
        sd.insert(
            "layer.bias",
            HostTensor::new(vec![1.0 / 3.0, f64::MAX], [2])?,
        );
        sd.insert("counts", HostTensor::new(vec![i64::MIN, -1, 1 << 40], [3])?);
        sd.insert("ids", HostTensor::new(vec![7i32, -3], [1, 2])?);
        sd.insert("mask", HostTensor::new(vec![0u8, 1, 255], [3])?);
        sd.insert("step", HostTensor::scalar(12i64));
        sd.insert("empty", HostTensor::zeros(DType::F32, [0, 4])?);
        Ok(sd)
    }

    fn message(err: &Error) -> String {
        match err {
            Error::Checkpoint { reason, .. } => reason.clone(),
            other => panic!("expected a checkpoint error, got {other:?}"),
        }
    }

    #[test]
    fn round_trip_every_dtype_with_metadata() -> Result<()> {
        let dir = TempDir::new("round-trip");
        let path = dir.0.join("model.safetensors");
        let sd = sample()?;
        let meta = BTreeMap::from([
            ("format".to_string(), "pt".to_string()),
            ("step".to_string(), "12".to_string()),
        ]);
        sd.save_safetensors(&path, &meta)?;
        let (loaded, loaded_meta) = StateDict::load_safetensors(&path)?;
        assert_eq!(loaded, sd);
        assert_eq!(loaded_meta, meta);
        // Only the final file remains.
        let names: Vec<_> = fs::read_dir(&dir.0)
            .map_err(|e| Error::io(&dir.0, e))?
            .filter_map(|e| e.ok().map(|e| e.file_name()))
            .collect();
        assert_eq!(names, ["model.safetensors"]);

        // Overwriting replaces the file; no metadata gives an empty map.
        let mut smaller = StateDict::new();
        smaller.insert("x", HostTensor::scalar(1.0f32));
        smaller.save_safetensors(&path, &BTreeMap::new())?;
        let (loaded, loaded_meta) = StateDict::load_safetensors(&path)?;
        assert_eq!(loaded, smaller);
        assert!(loaded_meta.is_empty());

        // An empty state dict is a valid file too.
        StateDict::new().save_safetensors(&path, &BTreeMap::new())?;
        assert!(StateDict::load_safetensors(&path)?.0.is_empty());
        Ok(())
    }

    #[test]
    fn relative_paths_and_reserved_names() -> Result<()> {
        let mut sd = StateDict::new();
        sd.insert(METADATA_KEY, HostTensor::scalar(1u8));
        let err = sd
            .save_safetensors("unused.safetensors", &BTreeMap::new())
            .expect_err("reserved name");
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        let err = sample()?
            .save_safetensors("", &BTreeMap::new())
            .expect_err("no file name");
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        Ok(())
    }

    #[test]
    fn io_errors_name_the_path() -> Result<()> {
        let dir = TempDir::new("io");
        let missing = dir.0.join("nope.safetensors");
        let err = StateDict::load_safetensors(&missing).expect_err("missing");
        assert!(
            matches!(err, Error::Io { ref path, .. } if *path == missing),
            "{err}"
        );
        assert!(err.to_string().contains("nope.safetensors"), "{err}");

        let in_missing_dir = dir.0.join("no/such/dir/model.safetensors");
        let err = sample()?
            .save_safetensors(&in_missing_dir, &BTreeMap::new())
            .expect_err("no directory");
        assert!(matches!(err, Error::Io { .. }), "{err}");
        assert!(err.to_string().contains("no/such/dir"), "{err}");
        Ok(())
    }

    #[test]
    fn truncated_and_garbage_files_are_checkpoint_errors() -> Result<()> {
        let dir = TempDir::new("corrupt");
        let path = dir.0.join("model.safetensors");
        sample()?.save_safetensors(&path, &BTreeMap::new())?;
        let bytes = fs::read(&path).map_err(|e| Error::io(&path, e))?;
        let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
        let data_len = bytes.len() - 8 - header_len;

        let cut = dir.0.join("cut.safetensors");
        fs::write(&cut, &bytes[..bytes.len() - 10]).map_err(|e| Error::io(&cut, e))?;
        let err = StateDict::load_safetensors(&cut).expect_err("truncated data");
        assert!(
            err.to_string()
                .starts_with(&format!("checkpoint {}", cut.display())),
            "{err}"
        );
        assert_eq!(
            message(&err),
            format!(
                "header claims {data_len} bytes of tensor data, file has {} (the file is truncated)",
                data_len - 10
            )
        );

        fs::write(&cut, &bytes[..20]).map_err(|e| Error::io(&cut, e))?;
        let err = StateDict::load_safetensors(&cut).expect_err("truncated header");
        assert_eq!(
            message(&err),
            format!(
                "header length field says {header_len} bytes, but only 12 bytes follow it \
                 (truncated, or not a safetensors file)"
            )
        );

        fs::write(&cut, [1u8, 2, 3]).map_err(|e| Error::io(&cut, e))?;
        let err = StateDict::load_safetensors(&cut).expect_err("tiny");
        assert!(message(&err).contains("too short"), "{err}");

        let garbage = dir.0.join("garbage.safetensors");
        fs::write(
            &garbage,
            b"this is certainly not a tensor file, just some text\n",
        )
        .map_err(|e| Error::io(&garbage, e))?;
        let err = StateDict::load_safetensors(&garbage).expect_err("garbage");
        assert!(err.to_string().contains("garbage.safetensors"), "{err}");
        assert!(message(&err).contains("not a safetensors file"), "{err}");

        let mut not_json = 6u64.to_le_bytes().to_vec();
        not_json.extend_from_slice(b"{nope}");
        fs::write(&garbage, &not_json).map_err(|e| Error::io(&garbage, e))?;
        let err = StateDict::load_safetensors(&garbage).expect_err("bad JSON");
        assert!(
            message(&err).starts_with("header is not a JSON object"),
            "{err}"
        );
        Ok(())
    }

    fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(data);
        bytes
    }

    #[test]
    fn unsupported_and_inconsistent_entries_are_named() -> Result<()> {
        let dir = TempDir::new("entries");
        let path = dir.0.join("x.safetensors");
        let write = |bytes: Vec<u8>| fs::write(&path, bytes).map_err(|e| Error::io(&path, e));

        write(raw_file(
            r#"{"x":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}"#,
            &[0; 4],
        ))?;
        let err = StateDict::load_safetensors(&path).expect_err("bf16");
        assert_eq!(
            message(&err),
            "dtype BF16 of tensor `x` is not supported (U8, I32, I64, F32, F64)"
        );

        // The offsets do not match shape and dtype (3 f32 need 12 bytes).
        write(raw_file(
            r#"{"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            &[0; 8],
        ))?;
        let err = StateDict::load_safetensors(&path).expect_err("inconsistent");
        assert!(
            message(&err).starts_with("invalid safetensors file"),
            "{err}"
        );

        write(raw_file(
            r#"{"x":{"shape":[1],"data_offsets":[0,4]}}"#,
            &[0; 4],
        ))?;
        let err = StateDict::load_safetensors(&path).expect_err("no dtype");
        assert_eq!(message(&err), "header entry of tensor `x` has no dtype");

        // Padding spaces after the JSON (as writers align the header) are fine.
        write(raw_file(
            r#"{"__metadata__":{"a":"b"},"x":{"dtype":"I32","shape":[],"data_offsets":[0,4]}}   "#,
            &7i32.to_le_bytes(),
        ))?;
        let (sd, meta) = StateDict::load_safetensors(&path)?;
        assert_eq!(sd.get("x"), Some(&HostTensor::scalar(7i32)));
        assert_eq!(meta.get("a").map(String::as_str), Some("b"));
        Ok(())
    }
}
