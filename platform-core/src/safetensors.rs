//! State dicts as safetensors files, the format `safetensors.torch` reads and writes.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use serde_json::Value;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::state_dict::StateDict;
use crate::tensor::HostTensor;

/// A tensor a safetensors writer can save: its dtype and dims, and its
/// elements' native-endian bytes, row-major, handed over on demand.
///
/// Implemented by [`HostTensor`] and
/// [`StateTensor`](crate::state_tensors::StateTensor); the writers are
/// [`StateDict::save_safetensors`],
/// [`StateTensors::save_safetensors`](crate::state_tensors::StateTensors::save_safetensors)
/// and `Checkpoint::save`.
pub trait WritableTensor {
    /// The element type.
    fn dtype(&self) -> Result<DType>;

    /// The dims, outermost first.
    fn dims(&self) -> Vec<usize>;

    /// Calls `write` once with all the elements' bytes (`numel * dtype size`
    /// of them).
    fn with_bytes(&self, write: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()>;
}

impl WritableTensor for HostTensor {
    fn dtype(&self) -> Result<DType> {
        Ok(HostTensor::dtype(self))
    }

    fn dims(&self) -> Vec<usize> {
        HostTensor::dims(self).to_vec()
    }

    fn with_bytes(&self, write: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        write(self.as_bytes())
    }
}

/// Named tensors a checkpoint can hold: host copies ([`StateDict`]) or backend
/// tensors read when the file is written
/// ([`StateTensors`](crate::state_tensors::StateTensors)).
pub trait WritableState {
    /// Every tensor with its name, in any order (writers lay them out themselves).
    fn writable_tensors(&self) -> Vec<(&str, &dyn WritableTensor)>;
}

impl WritableState for StateDict {
    fn writable_tensors(&self) -> Vec<(&str, &dyn WritableTensor)> {
        self.iter()
            .map(|(name, t)| (name.as_str(), t as &dyn WritableTensor))
            .collect()
    }
}

/// The header key safetensors reserves for string metadata.
const METADATA_KEY: &str = "__metadata__";

/// The dtypes Kiln reads, as a message lists them.
const SUPPORTED: &str = "U8, I32, I64, F32, F64, BF16, F16";

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
    Error::checkpoint(path, reason)
}

impl StateDict {
    /// Writes the state dict to `path` as a safetensors file with the string
    /// `metadata` (readable by `safetensors.torch.load_file` and `safe_open`).
    ///
    /// The write is atomic: the bytes go to a new `<path>.tmp-<pid>-<random>`
    /// (created exclusively: a link planted there is never followed) in the same
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
    /// use kiln_core::{state_dict::StateDict, HostTensor};
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
        save_entries(path.as_ref(), self.writable_tensors(), metadata)
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
        let mut file = crate::fs::open_regular_file(path)?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let loaded = read_file(&mut file, len, path)?;
        log::debug!(
            "loaded {} tensors ({len} bytes) from {}",
            loaded.0.len(),
            path.display()
        );
        Ok(loaded)
    }
}

/// The string metadata of the safetensors file at `path`, read from its header
/// alone (no tensor data is read), after the same checks as
/// [`StateDict::load_safetensors`] makes of the header.
pub fn load_safetensors_metadata(path: &Path) -> Result<BTreeMap<String, String>> {
    let mut file = crate::fs::open_regular_file(path)?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    Ok(read_header(&mut file, len, path)?.1)
}

/// The name, dtype and shape of every tensor in the safetensors file at
/// `path`, in the file's order, read from its header alone (no tensor data
/// is read) after the same checks as [`StateDict::load_safetensors`] makes of
/// the header: what a loader compares a config with before allocating.
pub fn load_safetensors_shapes(path: &Path) -> Result<Vec<(String, DType, Vec<usize>)>> {
    let mut file = crate::fs::open_regular_file(path)?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let (entries, _) = read_header(&mut file, len, path)?;
    Ok(entries
        .into_iter()
        .map(|e| (e.name, e.dtype, e.shape))
        .collect())
}

/// Writes named tensors as a safetensors file, atomically (see
/// [`StateDict::save_safetensors`]), streaming each tensor's bytes to the file
/// instead of assembling the whole file in memory first, and reading a backend
/// tensor's bytes in place where the backend lends them
/// ([`Backend::with_host_bytes`](crate::backend::Backend::with_host_bytes)): a checkpoint
/// of a large model costs no second copy of its weights.
///
/// Tensors are laid out as the `safetensors` crate lays them out, larger
/// elements first and then by name, so that every tensor's data is aligned
/// to its element size (the header is padded to a multiple of 8 bytes).
pub fn save_entries(
    path: &Path,
    entries: Vec<(&str, &dyn WritableTensor)>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    if entries.iter().any(|(name, _)| *name == METADATA_KEY) {
        return Err(Error::invalid_argument(
            METADATA_KEY,
            "safetensors reserves this name for metadata; rename the entry",
        ));
    }
    let mut layout = Vec::with_capacity(entries.len());
    for (name, tensor) in entries {
        let dtype = tensor.dtype()?;
        let dims = tensor.dims();
        let size = dims.iter().product::<usize>() * dtype.size_in_bytes();
        layout.push((name, tensor, dtype, dims, size));
    }
    layout.sort_by(|(a, _, da, ..), (b, _, db, ..)| {
        db.size_in_bytes()
            .cmp(&da.size_in_bytes())
            .then_with(|| a.cmp(b))
    });
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert(METADATA_KEY.to_owned(), serde_json::json!(metadata));
    }
    let mut offset = 0usize;
    for (name, _, dtype, dims, size) in &layout {
        let end = offset + size;
        header.insert(
            (*name).to_owned(),
            serde_json::json!({
                "dtype": dtype.safetensors_name(),
                "shape": dims,
                "data_offsets": [offset, end],
            }),
        );
        offset = end;
    }
    let mut header = Value::Object(header).to_string().into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    write_atomically(path, |write| {
        write(&(header.len() as u64).to_le_bytes())?;
        write(&header)?;
        for (name, tensor, dtype, _, size) in &layout {
            tensor.with_bytes(&mut |bytes| {
                // A tensor whose bytes disagree with its header would shift every
                // tensor after it: refuse rather than write a corrupt file.
                if bytes.len() != *size {
                    return Err(Error::invalid_argument(
                        *name,
                        format!(
                            "{} bytes of data for a {size}-byte {dtype} tensor",
                            bytes.len()
                        ),
                    ));
                }
                write(&swap_to_le(bytes, *dtype))
            })?;
        }
        Ok(())
    })?;
    log::debug!(
        "saved {} tensors ({} bytes) to {}",
        layout.len(),
        8 + header.len() + offset,
        path.display()
    );
    Ok(())
}

/// Writes `path` through [`crate::fs::write_atomically`] (an exclusive,
/// unpredictable temporary renamed over it).
fn write_atomically(
    path: &Path,
    write_file: impl FnOnce(&mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()>,
) -> Result<()> {
    crate::fs::write_atomically(path, |out| {
        write_file(&mut |bytes| out.write_all(bytes).map_err(|e| Error::io(path, e)))
    })
}

/// One tensor's entry in a safetensors header.
struct HeaderEntry {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    begin: usize,
    end: usize,
}

/// Reads and checks the header of a safetensors file of `len` bytes from
/// `file`, leaving it positioned at the first tensor's data.
fn read_header(
    file: &mut impl Read,
    len: u64,
    path: &Path,
) -> Result<(Vec<HeaderEntry>, BTreeMap<String, String>)> {
    let mut len_bytes = [0u8; 8];
    if len < 8 {
        return Err(corrupt(
            path,
            format!(
                "file is {len} bytes, too short for the 8-byte header length of a safetensors file"
            ),
        ));
    }
    file.read_exact(&mut len_bytes)
        .map_err(|e| Error::io(path, e))?;
    let rest = len - 8;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > rest {
        return Err(corrupt(
            path,
            format!(
                "header length field says {header_len} bytes, but only {rest} bytes follow it \
                 (truncated, or not a safetensors file)"
            ),
        ));
    }
    let too_large = || corrupt(path, format!("file of {len} bytes is too large to address"));
    let mut header = vec![0u8; usize::try_from(header_len).map_err(|_| too_large())?];
    file.read_exact(&mut header)
        .map_err(|e| Error::io(path, e))?;
    let data_len = usize::try_from(rest - header_len).map_err(|_| too_large())?;
    parse_header(&header, data_len, path)
}

/// Reads a safetensors file of `len` bytes from `file`, with messages that say
/// what is wrong. Each tensor's bytes are read straight into its own
/// [`HostTensor`]: the file is never held in memory as a whole besides them.
fn read_file(
    file: &mut impl Read,
    len: u64,
    path: &Path,
) -> Result<(StateDict, BTreeMap<String, String>)> {
    let (entries, metadata) = read_header(file, len, path)?;
    let mut state = StateDict::new();
    for entry in entries {
        let mut tensor = HostTensor::zeros(entry.dtype, entry.shape.as_slice()).map_err(|e| {
            Error::checkpoint_caused_by(path, format!("tensor `{}`", entry.name), e)
        })?;
        file.read_exact(tensor.as_bytes_mut())
            .map_err(|e| Error::io(path, e))?;
        if cfg!(target_endian = "big") {
            let swapped = swap_to_le(tensor.as_bytes(), entry.dtype).into_owned();
            tensor.as_bytes_mut().copy_from_slice(&swapped);
        }
        state.insert(entry.name, tensor);
    }
    Ok((state, metadata))
}

/// Parses and checks a header, for tensor data of `data_len` bytes: the entries
/// in file order, which cover the data exactly, and the string metadata.
fn parse_header(
    header: &[u8],
    data_len: usize,
    path: &Path,
) -> Result<(Vec<HeaderEntry>, BTreeMap<String, String>)> {
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
    let invalid = |reason: String| corrupt(path, format!("invalid safetensors file: {reason}"));

    let mut metadata = BTreeMap::new();
    let mut entries = Vec::new();
    for (name, info) in &header {
        if name == METADATA_KEY {
            let map = info
                .as_object()
                .ok_or_else(|| invalid("`__metadata__` is not an object".into()))?;
            for (k, v) in map {
                let v = v
                    .as_str()
                    .ok_or_else(|| invalid(format!("metadata `{k}` is not a string")))?;
                metadata.insert(k.clone(), v.to_owned());
            }
            continue;
        }
        let dtype = info.get("dtype").and_then(Value::as_str).ok_or_else(|| {
            corrupt(
                path,
                format!("header entry of tensor `{name}` has no dtype"),
            )
        })?;
        let dtype = DType::from_safetensors_name(dtype).ok_or_else(|| {
            corrupt(
                path,
                format!("dtype {dtype} of tensor `{name}` is not supported ({SUPPORTED})"),
            )
        })?;
        let numbers = |key: &str| -> Option<Vec<usize>> {
            info.get(key)?
                .as_array()?
                .iter()
                .map(|v| v.as_u64().and_then(|n| usize::try_from(n).ok()))
                .collect()
        };
        let (begin, end) = match numbers("data_offsets").as_deref() {
            Some(&[begin, end]) if begin <= end => (begin, end),
            _ => {
                return Err(corrupt(
                    path,
                    format!("header entry of tensor `{name}` has no valid data_offsets"),
                ))
            }
        };
        let shape = numbers("shape")
            .ok_or_else(|| invalid(format!("tensor `{name}` has no valid shape")))?;
        entries.push(HeaderEntry {
            name: name.clone(),
            dtype,
            shape,
            begin,
            end,
        });
    }

    let data_end = entries.iter().map(|e| e.end).max().unwrap_or(0);
    if data_end > data_len {
        return Err(corrupt(
            path,
            format!(
                "header claims {data_end} bytes of tensor data, file has {data_len} \
                 (the file is truncated)"
            ),
        ));
    }
    // As the safetensors crate requires: the tensors tile the data exactly, each
    // as large as its shape and dtype say.
    entries.sort_by_key(|e| (e.begin, e.end));
    let mut expected_begin = 0;
    for e in &entries {
        if e.begin != expected_begin {
            return Err(invalid(format!(
                "tensor `{}` starts at byte {} of the data, expected {expected_begin}",
                e.name, e.begin
            )));
        }
        let bytes = e
            .shape
            .iter()
            .try_fold(e.dtype.size_in_bytes(), |n, &d| n.checked_mul(d));
        if bytes != Some(e.end - e.begin) {
            return Err(invalid(format!(
                "tensor `{}` of shape {:?} {} takes {} bytes in the file",
                e.name,
                e.shape,
                e.dtype,
                e.end - e.begin
            )));
        }
        expected_begin = e.end;
    }
    if expected_begin != data_len {
        return Err(invalid(format!(
            "the tensors take {expected_begin} bytes, but {data_len} bytes of data follow the header"
        )));
    }
    Ok((entries, metadata))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::path::PathBuf;

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
        let halves = [1.0f32, -0.3125, 65504.0];
        sd.insert(
            "half.bf16",
            HostTensor::new(halves.map(half::bf16::from_f32).to_vec(), [3])?,
        );
        sd.insert(
            "half.f16",
            HostTensor::new(halves.map(half::f16::from_f32).to_vec(), [3])?,
        );
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

    /// The `safetensors` crate reads what Kiln writes, and Kiln reads what it writes.
    #[test]
    fn the_reference_implementation_agrees_both_ways() -> Result<()> {
        let dir = TempDir::new("reference");
        let ours = dir.0.join("ours.safetensors");
        let sd = sample()?;
        let meta = BTreeMap::from([("k".to_string(), "v".to_string())]);
        sd.save_safetensors(&ours, &meta)?;
        let bytes = fs::read(&ours).map_err(|e| Error::io(&ours, e))?;
        let read = ::safetensors::SafeTensors::deserialize(&bytes).expect("the crate reads it");
        assert_eq!(read.len(), sd.len());
        for (name, tensor) in sd.iter() {
            let view = read.tensor(name).expect("every tensor");
            assert_eq!(view.shape(), tensor.dims(), "{name}");
            assert_eq!(view.data(), tensor.as_bytes(), "{name}");
            // Every tensor's data is aligned to its element size within the file.
            let offset = view.data().as_ptr() as usize - bytes.as_ptr() as usize;
            assert_eq!(offset % tensor.dtype().size_in_bytes(), 0, "{name}");
        }
        let (_, file_meta) = ::safetensors::SafeTensors::read_metadata(&bytes).expect("header");
        assert_eq!(
            file_meta.metadata().as_ref().and_then(|m| m.get("k")),
            Some(&"v".to_string())
        );

        // And the other way round.
        let views: Vec<(String, ::safetensors::tensor::TensorView<'_>)> = sd
            .iter()
            .map(|(k, t)| {
                let dtype = match t.dtype() {
                    DType::U8 => ::safetensors::Dtype::U8,
                    DType::I32 => ::safetensors::Dtype::I32,
                    DType::I64 => ::safetensors::Dtype::I64,
                    DType::F32 => ::safetensors::Dtype::F32,
                    DType::F64 => ::safetensors::Dtype::F64,
                    DType::BF16 => ::safetensors::Dtype::BF16,
                    DType::F16 => ::safetensors::Dtype::F16,
                };
                let view =
                    ::safetensors::tensor::TensorView::new(dtype, t.dims().to_vec(), t.as_bytes())
                        .expect("a valid view");
                (k.clone(), view)
            })
            .collect();
        let theirs = dir.0.join("theirs.safetensors");
        let written = ::safetensors::serialize(views, Some(meta.clone().into_iter().collect()))
            .expect("the crate writes it");
        fs::write(&theirs, written).map_err(|e| Error::io(&theirs, e))?;
        assert_eq!(StateDict::load_safetensors(&theirs)?, (sd, meta));
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
            r#"{"x":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}}"#,
            &[0; 2],
        ))?;
        let err = StateDict::load_safetensors(&path).expect_err("f8");
        assert_eq!(
            message(&err),
            "dtype F8_E4M3 of tensor `x` is not supported (U8, I32, I64, F32, F64, BF16, F16)"
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

        // A hole before the tensor, and bytes after the last one.
        for (header, data) in [
            (
                r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
                8,
            ),
            (
                r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
                6,
            ),
        ] {
            write(raw_file(header, &vec![0; data]))?;
            let err = StateDict::load_safetensors(&path).expect_err("not tiled");
            assert!(
                message(&err).starts_with("invalid safetensors file"),
                "{err}"
            );
        }

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
