//! WebDataset-style `.tar` shards: samples grouped by basename, read with
//! positioned reads from an index of the members.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::image::decode::{decode_image, ColorMode};
use crate::image::folder::OnError;
use crate::prefetch::{EpochOrder, PrefetchLoader};
use crate::transform::TransformRng;
use crate::Dataset;
use kiln_core::error::{Error, Result};
use kiln_core::rng::{permutation, SplitMix64};
use kiln_core::tensor::HostTensor;

/// A tar block.
const BLOCK: u64 = 512;
/// Image extensions tried in turn unless [`WebDataset::image_key`] says otherwise.
const DEFAULT_IMAGE_KEYS: [&str; 4] = ["jpg", "jpeg", "png", "webp"];
/// Most bytes of a GNU long name or a pax header Kiln reads.
const MAX_META: u64 = 1 << 20;
/// Most shard paths a pattern may expand to: far more shards than any data
/// set has, far fewer than would exhaust memory listing them.
pub const MAX_SHARDS: u64 = 1_000_000;

/// One member of a sample: `000123.jpg` has extension `jpg`.
#[derive(Clone, Debug)]
struct Member {
    ext: Box<str>,
    offset: u64,
    size: u64,
}

/// The members sharing a key, consecutive in one shard.
#[derive(Clone, Debug)]
struct Sample {
    shard: usize,
    key: Box<str>,
    members: Vec<Member>,
}

/// Samples stored in WebDataset `.tar` shards: each sample is the run of
/// consecutive members sharing a key (the member's path up to the first dot
/// of its file name: `train/000123.jpg` and `train/000123.cls` make sample
/// `train/000123`, as the `webdataset` package groups them), its image the
/// first of `jpg`, `jpeg`, `png`, `webp` present
/// ([`image_key`](WebDataset::image_key)) and its label the `cls` member
/// (ASCII integer) or a `json` member's `"label"` field
/// ([`label_key`](WebDataset::label_key)). Items are `(image, label)`: a u8
/// `[C, H, W]` tensor and an i64 scalar.
///
/// [`open`](WebDataset::open) reads only the tar headers (seeking over the
/// data) to index every member's offset and size; [`get`](Dataset::get)
/// reads a sample's members with positioned reads and decodes the image in
/// the calling (worker) thread. Nothing else is held in memory.
///
/// **Order and workers.** [`epoch_order`](WebDataset::epoch_order) gives a
/// [`ShardOrder`]: shards shuffled per epoch, read through a shuffle buffer,
/// split across ranks. The loader's workers then split the work *by batch*,
/// not by shard (as PyTorch's `IterableDataset` workers do): the whole
/// epoch's order is computed from the index before loading starts, so the
/// batches are bitwise the same for any number of workers, and a run
/// resumed mid-epoch ([`batches_from`](crate::DataLoader::batches_from))
/// starts at its batch without reading or decoding any skipped sample. Reads
/// stay mostly sequential within a shard, since consecutive batches come
/// from the same few shards.
///
/// ```no_run
/// use kiln_data::{DataLoader, WebDataset};
///
/// let shards = WebDataset::from_pattern("data/train-{000000..000099}.tar")?;
/// let loader = shards.loader(64, 0, 1000)?.num_workers(8);
/// for batch in loader.batches(0) {
///     let batch = batch?;
///     # let _ = batch;
/// }
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct WebDataset {
    shards: Vec<PathBuf>,
    /// Sample indices of each shard.
    shard_samples: Vec<Range<usize>>,
    samples: Vec<Sample>,
    image_keys: Vec<String>,
    label_key: String,
    color_mode: ColorMode,
    on_error: OnError,
    /// The labels a sample may have ([`WebDataset::num_classes`]).
    classes: Option<LabelRange>,
}

/// Class indices `0..classes`, and a label a loss ignores.
#[derive(Clone, Copy, Debug)]
struct LabelRange {
    classes: usize,
    ignore_index: Option<i64>,
}

impl WebDataset {
    /// Indexes `shards`, in that order.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] naming a shard that cannot be opened or read;
    /// [`Error::Data`] naming the shard (and the member) for a malformed
    /// header, a member whose data runs past the end of the file (a
    /// truncated shard), or a sample with the same extension twice.
    pub fn open(shards: &[PathBuf]) -> Result<Self> {
        let mut samples: Vec<Sample> = Vec::new();
        let mut shard_samples = Vec::with_capacity(shards.len());
        for (s, shard) in shards.iter().enumerate() {
            let first = samples.len();
            for (name, offset, size) in scan_tar(shard)? {
                let Some((key, ext)) = split_key(&name) else {
                    log::debug!("WebDataset {}: ignoring member {name}", shard.display());
                    continue;
                };
                let member = Member {
                    ext: ext.to_lowercase().into(),
                    offset,
                    size,
                };
                let in_shard = samples.len() > first;
                match samples.last_mut() {
                    Some(last) if in_shard && *last.key == *key => {
                        if last.members.iter().any(|m| m.ext == member.ext) {
                            return Err(Error::data(
                                shard,
                                Some(offset - BLOCK),
                                format!("member {name}: sample {key} already has a `{ext}` member"),
                            ));
                        }
                        last.members.push(member);
                    }
                    _ => samples.push(Sample {
                        shard: s,
                        key: key.into(),
                        members: vec![member],
                    }),
                }
            }
            shard_samples.push(first..samples.len());
        }
        log::debug!(
            "WebDataset: {} samples in {} shards",
            samples.len(),
            shards.len()
        );
        Ok(WebDataset {
            shards: shards.to_vec(),
            shard_samples,
            samples,
            image_keys: DEFAULT_IMAGE_KEYS.iter().map(|s| s.to_string()).collect(),
            label_key: "cls".to_string(),
            color_mode: ColorMode::Rgb,
            on_error: OnError::Fail,
            classes: None,
        })
    }

    /// Indexes the shards `pattern` names after brace expansion, as the
    /// `webdataset` package writes them: `train-{000000..000099}.tar` (a
    /// numeric range, zero-padded when either end has a leading zero) and
    /// `{train,val}-0.tar` (alternatives); several groups multiply.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty pattern, unbalanced braces, a
    /// malformed range, or a pattern that names more than [`MAX_SHARDS`] paths
    /// (counted before any is listed), and [`open`](WebDataset::open)'s errors (a missing shard is an
    /// [`Error::Io`] naming it).
    pub fn from_pattern(pattern: &str) -> Result<Self> {
        if pattern.trim().is_empty() {
            return Err(Error::invalid_argument(
                "pattern",
                "the shard pattern is empty; expected the path of the `.tar` shards, \
                 such as `data/train-{000000..000099}.tar`",
            ));
        }
        let count = count_expansions(pattern)?;
        if count > MAX_SHARDS {
            return Err(Error::invalid_argument(
                "pattern",
                format!(
                    "{pattern:?} expands to {count} shard paths, more than the {MAX_SHARDS} \
                     Kiln reads; check the brace ranges (`{{000000..000099}}` names 100 shards)"
                ),
            ));
        }
        let shards: Vec<PathBuf> = expand_braces(pattern)?
            .into_iter()
            .map(PathBuf::from)
            .collect();
        Self::open(&shards)
    }

    /// The image member's extension; `;` separates alternatives, the first
    /// present is used (default `jpg;jpeg;png;webp`).
    pub fn image_key(mut self, key: &str) -> Self {
        self.image_keys = key.split(';').map(|k| k.trim().to_lowercase()).collect();
        self
    }

    /// The label member's extension (default `cls`). A `json` member's label
    /// is its `"label"` field; any other member holds an ASCII integer.
    pub fn label_key(mut self, key: &str) -> Self {
        self.label_key = key.trim().to_lowercase();
        self
    }

    /// Checks each label read against `classes` class indices: a label outside
    /// `0..classes`, other than `ignore_index` (a loss's ignored target),
    /// fails its sample ([`get`](Dataset::get)) with an [`Error::Data`]
    /// naming the member (`shard.tar:key.cls`), the label and the range,
    /// rather than reaching the loss. Unchecked by default.
    pub fn num_classes(mut self, classes: usize, ignore_index: Option<i64>) -> Self {
        self.classes = Some(LabelRange {
            classes,
            ignore_index,
        });
        self
    }

    /// Decodes into `mode`'s channels (default [`ColorMode::Rgb`]).
    pub fn color_mode(mut self, mode: ColorMode) -> Self {
        self.color_mode = mode;
        self
    }

    /// Whether a sample that fails to read or decode fails its batch (the
    /// default) or is skipped by the [`loader`](WebDataset::loader).
    pub fn on_error(mut self, on_error: OnError) -> Self {
        self.on_error = on_error;
        self
    }

    /// The shards, in index order.
    pub fn shards(&self) -> &[PathBuf] {
        &self.shards
    }

    /// The sample indices of each shard.
    pub fn shard_samples(&self) -> &[Range<usize>] {
        &self.shard_samples
    }

    /// Sample `index`'s shard and key (`train/000123`).
    pub fn sample_key(&self, index: usize) -> Option<(&Path, &str)> {
        let s = self.samples.get(index)?;
        Some((self.shards[s.shard].as_path(), &s.key))
    }

    /// The epoch order of a run with `world_size` ranks as rank `rank`:
    /// shards shuffled per epoch by `seed`, samples through a shuffle buffer
    /// of `shuffle_buffer` (0 or 1: none), this rank's block. See
    /// [`ShardOrder`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] unless `world_size >= 1` and `rank < world_size`.
    pub fn epoch_order(
        &self,
        seed: u64,
        shuffle_buffer: usize,
        rank: usize,
        world_size: usize,
    ) -> Result<ShardOrder> {
        ShardOrder::new(
            self.shard_samples.clone(),
            seed,
            shuffle_buffer,
            rank,
            world_size,
        )
    }

    /// A single-process [`PrefetchLoader`] over these shards with batches of
    /// `batch_size`, in [`epoch_order`](WebDataset::epoch_order)`(seed,
    /// shuffle_buffer, 0, 1)`, skipping failed samples when
    /// [`on_error`](WebDataset::on_error) is [`OnError::Skip`]. For several
    /// ranks, build the loader with [`PrefetchLoader::order`].
    pub fn loader(
        self,
        batch_size: usize,
        seed: u64,
        shuffle_buffer: usize,
    ) -> Result<PrefetchLoader<WebDataset>> {
        let order = self.epoch_order(seed, shuffle_buffer, 0, 1)?;
        let skip = self.on_error == OnError::Skip;
        Ok(PrefetchLoader::new(self, batch_size)?
            .order(order)
            .skip_failed_samples(skip))
    }

    /// Reads member `m` of sample `s`.
    fn read_member(&self, file: &File, s: &Sample, m: &Member) -> Result<Vec<u8>> {
        let shard = &self.shards[s.shard];
        let len = usize::try_from(m.size).map_err(|_| {
            Error::data(
                shard,
                Some(m.offset),
                format!("member {}.{} is too large", s.key, m.ext),
            )
        })?;
        let mut buf = vec![0u8; len];
        file.read_exact_at(&mut buf, m.offset)
            .map_err(|e| Error::io(member_name(shard, s, &m.ext), e))?;
        Ok(buf)
    }
}

/// `shard.tar:key.ext`, how errors name a member.
fn member_name(shard: &Path, s: &Sample, ext: &str) -> PathBuf {
    PathBuf::from(format!("{}:{}.{ext}", shard.display(), s.key))
}

impl Dataset for WebDataset {
    type Item = (HostTensor, HostTensor);

    fn len(&self) -> usize {
        self.samples.len()
    }

    /// Reads and decodes sample `index`; errors name `shard.tar:key.ext`.
    fn get(&self, index: usize) -> Result<Self::Item> {
        let Some(s) = self.samples.get(index) else {
            return Err(Error::invalid_argument(
                "index",
                format!(
                    "index {index} is out of range for a WebDataset of {} samples",
                    self.samples.len()
                ),
            ));
        };
        let shard = &self.shards[s.shard];
        let missing = |what: &str, keys: &str| {
            let has: Vec<&str> = s.members.iter().map(|m| &*m.ext).collect();
            Error::data(
                PathBuf::from(format!("{}:{}", shard.display(), s.key)),
                None,
                format!(
                    "sample has no {what} member `{keys}` (it has: {})",
                    has.join(", ")
                ),
            )
        };
        let image = self
            .image_keys
            .iter()
            .find_map(|k| s.members.iter().find(|m| *m.ext == **k))
            .ok_or_else(|| missing("image", &self.image_keys.join(";")))?;
        let label = s
            .members
            .iter()
            .find(|m| *m.ext == *self.label_key)
            .ok_or_else(|| missing("label", &self.label_key))?;
        let file = File::open(shard).map_err(|e| Error::io(shard, e))?;
        let bytes = self.read_member(&file, s, image)?;
        let image = decode_image(&bytes, self.color_mode, &member_name(shard, s, &image.ext))?;
        let text = self.read_member(&file, s, label)?;
        let name = member_name(shard, s, &label.ext);
        let label = parse_label(&text, &label.ext, &name)?;
        if let Some(range) = self.classes {
            check_label(label, range, &name)?;
        }
        Ok((image, HostTensor::scalar(label)))
    }
}

/// A `cls` member's integer, or a `json` member's `"label"`.
fn parse_label(bytes: &[u8], ext: &str, name: &Path) -> Result<i64> {
    if ext == "json" {
        let value: serde_json::Value = serde_json::from_slice(bytes)
            .map_err(|e| Error::data_caused_by(name, None, "not valid JSON", e))?;
        return value.get("label").and_then(|l| l.as_i64()).ok_or_else(|| {
            Error::data(name, None, "expected an object with an integer \"label\"")
        });
    }
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|t| t.trim().parse::<i64>().ok())
        .ok_or_else(|| {
            Error::data(
                name,
                None,
                format!(
                    "expected an ASCII integer label, got {:?}",
                    String::from_utf8_lossy(&bytes[..bytes.len().min(32)])
                ),
            )
        })
}

/// Checks that `label`, read from the member `name`, is a class of `range`.
fn check_label(label: i64, range: LabelRange, name: &Path) -> Result<()> {
    let classes = range.classes;
    if Some(label) == range.ignore_index
        || usize::try_from(label).is_ok_and(|index| index < classes)
    {
        return Ok(());
    }
    let expected = match classes {
        0 => "there are no classes".to_owned(),
        n => format!("expected a class index from 0 to {}", n - 1),
    };
    let ignored = match range.ignore_index {
        Some(i) => format!(", or {i}, the ignored label"),
        None => String::new(),
    };
    Err(Error::data(
        name,
        None,
        format!("label {label} is outside the {classes} classes: {expected}{ignored}"),
    ))
}

/// `(key, extension)` of a member path as `webdataset` splits it: the
/// extension starts at the first dot of the file name. `None` for names
/// without one, and for `__key__`-style metadata members.
fn split_key(name: &str) -> Option<(&str, &str)> {
    let (dir_len, file) = match name.rfind('/') {
        Some(i) => (i + 1, &name[i + 1..]),
        None => (0, name),
    };
    if dir_len == 0 && file.starts_with("__") && file.ends_with("__") {
        return None;
    }
    let dot = file.find('.')?;
    if dot == 0 {
        return None;
    }
    Some((&name[..dir_len + dot], &file[dot + 1..]))
}

/// Every regular file member of the tar at `path`: `(name, data offset, size)`.
/// Understands ustar (with its prefix field), GNU long names (`L`) and pax
/// headers' `path` and `size`.
fn scan_tar(path: &Path) -> Result<Vec<(String, u64, u64)>> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut out = Vec::new();
    let mut pos = 0u64;
    let mut long_name: Option<String> = None;
    let mut pax_path: Option<String> = None;
    let mut pax_size: Option<u64> = None;
    let mut header = [0u8; BLOCK as usize];
    loop {
        if pos >= file_len {
            // No end-of-archive blocks: accepted, as GNU tar does with a warning.
            break;
        }
        if file_len - pos < BLOCK {
            return Err(Error::data(
                path,
                Some(pos),
                format!(
                    "truncated tar: {} bytes left where a 512-byte header starts",
                    file_len - pos
                ),
            ));
        }
        file.read_exact_at(&mut header, pos)
            .map_err(|e| Error::io(path, e))?;
        if header.iter().all(|&b| b == 0) {
            break;
        }
        check_checksum(&header, path, pos)?;
        let mut name = match long_name.take().or(pax_path.take()) {
            Some(n) => n,
            None => ustar_name(&header),
        };
        let size = match pax_size.take() {
            Some(s) => s,
            None => octal_field(&header[124..136])
                .ok_or_else(|| Error::data(path, Some(pos + 124), "tar header: bad size field"))?,
        };
        let data = pos + BLOCK;
        if data.checked_add(size).is_none_or(|end| end > file_len) {
            if name.is_empty() {
                name = "(unnamed)".to_string();
            }
            return Err(Error::data(
                path,
                Some(pos),
                format!(
                    "truncated tar: member {name} has {size} bytes of data from byte {data}, \
                     but the file ends at byte {file_len}"
                ),
            ));
        }
        let typeflag = header[156];
        match typeflag {
            b'0' | 0 | b'7' => out.push((name, data, size)),
            b'L' => long_name = Some(read_meta(&file, path, data, size)?),
            b'x' => {
                let text = read_meta(&file, path, data, size)?;
                for (key, value) in pax_records(&text) {
                    match key {
                        "path" => pax_path = Some(value.to_string()),
                        "size" => pax_size = value.parse().ok(),
                        _ => {}
                    }
                }
            }
            // Directories, links, global pax headers, ...: no sample data.
            _ => {}
        }
        pos = data + size.div_ceil(BLOCK) * BLOCK;
    }
    Ok(out)
}

/// The text of a GNU long-name or pax member (NULs trimmed).
fn read_meta(file: &File, path: &Path, offset: u64, size: u64) -> Result<String> {
    if size > MAX_META {
        return Err(Error::data(
            path,
            Some(offset),
            format!("tar: a {size}-byte extended header (at most {MAX_META} expected)"),
        ));
    }
    let mut buf = vec![0u8; size as usize];
    file.read_exact_at(&mut buf, offset)
        .map_err(|e| Error::io(path, e))?;
    let text = String::from_utf8_lossy(&buf);
    Ok(text.trim_end_matches('\0').to_string())
}

/// `(key, value)` of pax records `"<len> key=value\n"`.
fn pax_records(text: &str) -> Vec<(&str, &str)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some((len, _)) = rest.split_once(' ') {
        let Ok(n) = len.parse::<usize>() else { break };
        let (Some(record), Some(next)) = (rest.get(..n), rest.get(n..)) else {
            break;
        };
        let Some(body) = record.get(len.len() + 1..) else {
            break;
        };
        if let Some((k, v)) = body.trim_end_matches('\n').split_once('=') {
            out.push((k, v));
        }
        rest = next;
    }
    out
}

/// The header's name, with the ustar prefix when there is one.
fn ustar_name(header: &[u8]) -> String {
    let field = |b: &[u8]| {
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        String::from_utf8_lossy(&b[..end]).into_owned()
    };
    let name = field(&header[..100]);
    if &header[257..262] == b"ustar" {
        let prefix = field(&header[345..500]);
        if !prefix.is_empty() {
            return format!("{prefix}/{name}");
        }
    }
    name
}

/// An octal number field (NUL/space padded), or GNU base-256.
fn octal_field(b: &[u8]) -> Option<u64> {
    if b.first().is_some_and(|&c| c & 0x80 != 0) {
        let mut v: u64 = u64::from(b[0] & 0x7F);
        for &c in &b[1..] {
            v = v.checked_mul(256)?.checked_add(u64::from(c))?;
        }
        return Some(v);
    }
    let text = std::str::from_utf8(b).ok()?;
    let text = text.trim_matches(|c: char| c == '\0' || c == ' ');
    if text.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(text, 8).ok()
}

fn check_checksum(header: &[u8], path: &Path, pos: u64) -> Result<()> {
    let stored = octal_field(&header[148..156]);
    let sum: u64 = header
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            if (148..156).contains(&i) {
                u64::from(b' ')
            } else {
                u64::from(b)
            }
        })
        .sum();
    if stored == Some(sum) {
        Ok(())
    } else {
        Err(Error::data(
            path,
            Some(pos),
            "not a tar header (bad checksum): the shard is corrupt or not a tar file",
        ))
    }
}

/// The first brace group of a pattern: the text before it, its
/// alternatives, and the text after it.
struct BraceGroup<'a> {
    head: &'a str,
    alternatives: Alternatives<'a>,
    tail: &'a str,
}

/// What a brace group stands for.
enum Alternatives<'a> {
    /// `{a..b}`: the integers from `lo` to `hi` (either way round),
    /// zero-padded to `width`.
    Range { lo: u64, hi: u64, width: usize },
    /// `{x,y}`: each part, itself a pattern.
    List(Vec<&'a str>),
}

/// Splits off the first brace group of `pattern`, `None` when it has none.
fn first_group(pattern: &str) -> Result<Option<BraceGroup<'_>>> {
    let bad = |why: &str| Error::invalid_argument("pattern", format!("{pattern:?}: {why}"));
    let Some(open) = pattern.find('{') else {
        if pattern.contains('}') {
            return Err(bad("a `}` without its `{`"));
        }
        return Ok(None);
    };
    let mut depth = 0usize;
    let mut close = None;
    let mut commas = Vec::new();
    for (i, c) in pattern[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    close = Some(open + i);
                    break;
                }
            }
            ',' if depth == 1 => commas.push(open + i),
            _ => {}
        }
    }
    let close = close.ok_or_else(|| bad("a `{` without its `}`"))?;
    let body = &pattern[open + 1..close];
    let alternatives = if commas.is_empty() {
        let (a, b) = body
            .split_once("..")
            .ok_or_else(|| bad("expected `{a..b}` or `{x,y}`"))?;
        let (lo, hi): (u64, u64) = match (a.parse(), b.parse()) {
            (Ok(lo), Ok(hi)) => (lo, hi),
            _ => return Err(bad("range ends must be non-negative integers")),
        };
        let padded = (a.len() > 1 && a.starts_with('0')) || (b.len() > 1 && b.starts_with('0'));
        let width = if padded { a.len().max(b.len()) } else { 0 };
        Alternatives::Range { lo, hi, width }
    } else {
        let mut parts = Vec::new();
        let mut start = open + 1;
        for &c in &commas {
            parts.push(&pattern[start..c]);
            start = c + 1;
        }
        parts.push(&pattern[start..close]);
        Alternatives::List(parts)
    };
    Ok(Some(BraceGroup {
        head: &pattern[..open],
        alternatives,
        tail: &pattern[close + 1..],
    }))
}

/// How many paths `pattern` expands to (saturating at `u64::MAX`), counted
/// without expanding it; checks the whole pattern as
/// [`expand_braces`] does.
fn count_expansions(pattern: &str) -> Result<u64> {
    let Some(group) = first_group(pattern)? else {
        return Ok(1);
    };
    // The head has no braces and a group's parts are balanced, so the
    // expansions of a group followed by the tail are every pairing of the two.
    let here = match group.alternatives {
        Alternatives::Range { lo, hi, .. } => lo.abs_diff(hi).saturating_add(1),
        Alternatives::List(parts) => parts.iter().try_fold(0u64, |n, part| {
            Ok::<_, Error>(n.saturating_add(count_expansions(part)?))
        })?,
    };
    Ok(here.saturating_mul(count_expansions(group.tail)?))
}

/// Shell-style brace expansion: `{000..002}` and `{a,b}`, nested and
/// repeated. Callers check the count first ([`count_expansions`]): a range
/// is expanded in full.
fn expand_braces(pattern: &str) -> Result<Vec<String>> {
    let Some(BraceGroup {
        head,
        alternatives,
        tail,
    }) = first_group(pattern)?
    else {
        return Ok(vec![pattern.to_string()]);
    };
    let alternatives: Vec<String> = match alternatives {
        Alternatives::Range { lo, hi, width } => {
            let values: Vec<u64> = if lo <= hi {
                (lo..=hi).collect()
            } else {
                (hi..=lo).rev().collect()
            };
            values.into_iter().map(|v| format!("{v:0width$}")).collect()
        }
        Alternatives::List(parts) => parts.into_iter().map(str::to_owned).collect(),
    };
    let mut out = Vec::new();
    for alt in alternatives {
        out.extend(expand_braces(&format!("{head}{alt}{tail}"))?);
    }
    Ok(out)
}

/// The epoch order of a [`WebDataset`] ([`WebDataset::epoch_order`]), an
/// [`EpochOrder`] for [`PrefetchLoader::order`]. Epoch `e`:
///
/// 1. the shards are permuted by `(seed, e)` (a SplitMix64 permutation, the
///    loaders' order before they took PyTorch's [`kiln_core::rng::epoch_order`]);
/// 2. their samples are concatenated in file order, the order a streaming
///    reader meets them;
/// 3. that stream goes through a shuffle buffer of `shuffle_buffer`
///    samples exactly as [`IterableLoader`](crate::IterableLoader)'s
///    (fill to capacity, take a uniformly drawn one with
///    [`TransformRng::for_sample`]`(seed, e, 0)`, refill), but over indices;
/// 4. the result (`n` samples) is cut into `world_size` contiguous blocks of
///    `ceil(n / world_size)`: rank `r` takes block `r`, so it reads mostly
///    its own shards. The last blocks are padded by wrapping around to the
///    start of the order, as PyTorch's `DistributedSampler` pads, so every
///    rank takes the same number of steps; with padding, `ceil(n / w) * w -
///    n` samples are seen twice in an epoch.
///
/// With one rank every sample is visited exactly once per epoch. Nothing
/// here depends on the loader's workers, which split the work by batch.
///
/// ```
/// use kiln_data::{EpochOrder, ShardOrder};
///
/// // Two shards of 3 and 2 samples, no shuffle buffer, two ranks.
/// let order = ShardOrder::new(vec![0..3, 3..5], 7, 0, 0, 2)?;
/// let rank1 = ShardOrder::new(vec![0..3, 3..5], 7, 0, 1, 2)?;
/// let mut all = order.order(5, 0);
/// all.extend(rank1.order(5, 0));
/// assert_eq!(all.len(), 6); // 5 samples padded to 2 * 3
/// let mut seen = all[..5].to_vec();
/// seen.sort();
/// assert_eq!(seen, [0, 1, 2, 3, 4]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardOrder {
    shards: Arc<[Range<usize>]>,
    seed: u64,
    shuffle_buffer: usize,
    rank: usize,
    world_size: usize,
}

impl ShardOrder {
    /// The order of rank `rank` of `world_size` over shards holding the
    /// sample index ranges `shards` (each shard's samples, in file order).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] unless `world_size >= 1` and `rank < world_size`.
    pub fn new(
        shards: Vec<Range<usize>>,
        seed: u64,
        shuffle_buffer: usize,
        rank: usize,
        world_size: usize,
    ) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::invalid_argument(
                "world_size",
                "must be at least 1, got 0",
            ));
        }
        if rank >= world_size {
            return Err(Error::invalid_argument(
                "rank",
                format!("must be in 0..{world_size}, got {rank}"),
            ));
        }
        Ok(ShardOrder {
            shards: shards.into(),
            seed,
            shuffle_buffer,
            rank,
            world_size,
        })
    }

    /// The order of all ranks together (steps 1 to 3, before the split).
    pub fn global_order(&self, epoch: u64) -> Vec<usize> {
        let shard_order = shard_permutation(self.shards.len(), self.seed, epoch);
        let stream = shard_order.into_iter().flat_map(|s| self.shards[s].clone());
        if self.shuffle_buffer <= 1 {
            return stream.collect();
        }
        let mut rng = TransformRng::for_sample(self.seed, epoch, 0);
        let mut stream = stream.peekable();
        let mut buffer = Vec::with_capacity(self.shuffle_buffer);
        let mut out = Vec::new();
        loop {
            while buffer.len() < self.shuffle_buffer {
                match stream.next() {
                    Some(i) => buffer.push(i),
                    None => break,
                }
            }
            if buffer.is_empty() {
                return out;
            }
            let pick = rng.below(buffer.len() as u64) as usize;
            out.push(buffer.swap_remove(pick));
        }
    }

    /// Samples each rank visits per epoch: `ceil(n / world_size)` of `n`.
    pub fn per_rank(&self, n: usize) -> usize {
        n.div_ceil(self.world_size)
    }
}

/// The order of the shards in epoch `epoch` under `seed`: a SplitMix64
/// permutation, the one Kiln's loaders used before they took PyTorch's
/// `randperm` ([`kiln_core::rng::epoch_order`]). Shard streaming keeps it, so
/// that a run on shards resumes on the order it started with.
fn shard_permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let epoch_key = SplitMix64::new(epoch).next_u64();
    permutation(n, seed ^ epoch_key)
}

impl EpochOrder for ShardOrder {
    fn order(&self, len: usize, epoch: u64) -> Vec<usize> {
        let mut global = self.global_order(epoch);
        if global.iter().any(|&i| i >= len) {
            log::error!(
                "ShardOrder: the shards index samples up to {}, but the dataset has {len}; \
                 leaving the extra indices out",
                global.iter().max().copied().unwrap_or(0)
            );
            global.retain(|&i| i < len);
        }
        let n = global.len();
        if n == 0 {
            return global;
        }
        let per_rank = self.per_rank(n);
        (self.rank * per_rank..(self.rank + 1) * per_rank)
            .map(|i| global[i % n])
            .collect()
    }

    fn num_samples(&self, len: usize) -> usize {
        let n = self
            .shards
            .iter()
            .map(|r| r.clone().filter(|&i| i < len).count())
            .sum();
        self.per_rank(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_split_at_the_first_dot_of_the_file_name() {
        assert_eq!(split_key("000123.jpg"), Some(("000123", "jpg")));
        assert_eq!(split_key("a.b/c.seg.png"), Some(("a.b/c", "seg.png")));
        assert_eq!(split_key("dir/noext"), None);
        assert_eq!(split_key("__key__"), None);
    }

    #[test]
    fn braces_expand_ranges_and_lists() -> Result<()> {
        assert_eq!(
            expand_braces("s-{000..002}.tar")?,
            ["s-000.tar", "s-001.tar", "s-002.tar"]
        );
        assert_eq!(
            expand_braces("{a,b}-{8..10}")?,
            ["a-8", "a-9", "a-10", "b-8", "b-9", "b-10"]
        );
        assert_eq!(expand_braces("{x,{y,z}}")?, ["x", "y", "z"]);
        assert_eq!(expand_braces("plain.tar")?, ["plain.tar"]);
        for bad in ["{1..", "a}", "{a}", "{x..2}"] {
            let err = expand_braces(bad).expect_err(bad);
            assert!(matches!(err, Error::InvalidArgument { .. }), "{bad}: {err}");
            let err = count_expansions(bad).expect_err(bad);
            assert!(matches!(err, Error::InvalidArgument { .. }), "{bad}: {err}");
        }
        Ok(())
    }

    #[test]
    fn counts_match_expansions_without_listing_them() -> Result<()> {
        for pattern in [
            "s-{000..002}.tar",
            "{a,b}-{8..10}",
            "{x,{y,z}}",
            "p",
            "{3..1}{a,{b,c}d{0..1}}",
        ] {
            assert_eq!(
                count_expansions(pattern)?,
                expand_braces(pattern)?.len() as u64,
                "{pattern}"
            );
        }
        assert_eq!(count_expansions("x-{0..99999999999}.tar")?, 100_000_000_000);
        assert_eq!(count_expansions(&"{0..99999}".repeat(8))?, u64::MAX);
        Ok(())
    }

    #[test]
    fn labels_outside_the_classes_name_member_value_and_range() {
        let name = Path::new("s.tar:000001.cls");
        let range = LabelRange {
            classes: 10,
            ignore_index: Some(-100),
        };
        for ok in [0, 9, -100] {
            assert!(check_label(ok, range, name).is_ok(), "{ok}");
        }
        for bad in [-1, 10, 99] {
            let err = check_label(bad, range, name).unwrap_err().to_string();
            for wanted in [
                "s.tar:000001.cls",
                &format!("label {bad} "),
                "10 classes",
                "0 to 9",
                "-100",
            ] {
                assert!(err.contains(wanted), "{wanted}: {err}");
            }
        }
    }

    #[test]
    fn huge_and_empty_patterns_are_refused_before_listing() {
        let err = WebDataset::from_pattern("x-{0..99999999999}.tar").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("x-{0..99999999999}.tar"), "{text}");
        assert!(text.contains("100000000000 shard paths"), "{text}");
        assert!(text.contains(&MAX_SHARDS.to_string()), "{text}");
        let err = WebDataset::from_pattern(" ").unwrap_err();
        assert!(err.to_string().contains("pattern is empty"), "{err}");
    }

    #[test]
    fn pax_records_are_parsed() {
        let text = "29 path=a/very/long/name.jpg\n11 size=42\n";
        assert_eq!(
            pax_records(text),
            [("path", "a/very/long/name.jpg"), ("size", "42")]
        );
    }

    #[test]
    fn octal_and_base256_sizes() {
        assert_eq!(octal_field(b"00000000012\0"), Some(10));
        assert_eq!(octal_field(b"\x80\0\0\0\0\0\0\0\0\0\x01\x00"), Some(256));
        assert_eq!(octal_field(b"zz"), None);
    }

    #[test]
    fn shard_order_blocks_cover_the_padded_order() -> Result<()> {
        let shards = vec![0..4, 4..5, 5..9];
        for buffer in [0, 3] {
            let global = ShardOrder::new(shards.clone(), 1, buffer, 0, 1)?.global_order(2);
            let mut sorted = global.clone();
            sorted.sort();
            assert_eq!(sorted, (0..9).collect::<Vec<_>>());
            let mut joined = Vec::new();
            for rank in 0..4 {
                let o = ShardOrder::new(shards.clone(), 1, buffer, rank, 4)?;
                assert_eq!(o.num_samples(9), 3);
                joined.extend(o.order(9, 2));
            }
            let padded: Vec<usize> = (0..12).map(|i| global[i % 9]).collect();
            assert_eq!(joined, padded);
        }
        assert!(ShardOrder::new(shards.clone(), 0, 0, 2, 2).is_err());
        assert!(ShardOrder::new(shards, 0, 0, 0, 0).is_err());
        Ok(())
    }
}
