//! [`WebDataset`]: the index of the samples of a list of shards, and reading
//! one sample's image and label with positioned reads.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::label::{check_label, parse_label, LabelRange};
use super::order::ShardOrder;
use super::pattern::{count_expansions, expand_braces, MAX_SHARDS};
use super::tar::{scan_tar, split_key, BLOCK};
use crate::image::decode::{decode_image, ColorMode};
use crate::image::folder::OnError;
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;
use kiln_data::Dataset;
use kiln_data::PrefetchLoader;

/// Image extensions tried in turn unless [`WebDataset::image_key`] says otherwise.
const DEFAULT_IMAGE_KEYS: [&str; 10] = [
    "jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif", "ppm", "pgm",
];

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
/// first of `jpg`, `jpeg`, `png`, `webp`, `bmp`, `tif`, `tiff`, `gif`, `ppm`, `pgm` present
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
/// resumed mid-epoch ([`batches_from`](kiln_data::DataLoader::batches_from))
/// starts at its batch without reading or decoding any skipped sample. Reads
/// stay mostly sequential within a shard, since consecutive batches come
/// from the same few shards.
///
/// ```no_run
/// use kiln_data::DataLoader;
/// use kiln_vision::WebDataset;
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
    /// present is used (default `jpg;jpeg;png;webp;bmp;tif;tiff;gif;ppm;pgm`).
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
                    "sample has no {what} member `{keys}` (it has: {}; `{what}_key` chooses \
                     another)",
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
        let file = kiln_core::fs::open_regular_file(shard)?;
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
