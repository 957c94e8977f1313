//! `[data]`: the dataset, how it is split, batched and shaped.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use kiln_core::error::{Error, Result};
use kiln_data::vision::TransformSpec;

use super::yes;

/// Where the examples come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DatasetKind {
    /// The UCI handwritten digits (8x8) that scikit-learn's wheel ships; `path`
    /// defaults to the project's `.kiln/data/digits.csv.gz`.
    Digits,
    /// MNIST IDX files (raw or gzip) in the directory `path`; its test split is
    /// the validation set.
    Mnist,
    /// A CSV file `path` of numeric features and an integer label column.
    Csv,
    /// Images in class folders under `path` (torchvision's `ImageFolder`), or a
    /// CSV or JSON list of `path,label`; decoded in the loader's workers.
    ImageFolder,
    /// WebDataset `.tar` shards (`shards`), streamed by the loader's workers.
    Webdataset,
}

impl DatasetKind {
    /// The name the config uses.
    pub fn name(self) -> &'static str {
        match self {
            DatasetKind::Digits => "digits",
            DatasetKind::Mnist => "mnist",
            DatasetKind::Csv => "csv",
            DatasetKind::ImageFolder => "image_folder",
            DatasetKind::Webdataset => "webdataset",
        }
    }

    /// Whether the examples are image files, decoded and transformed by the loader.
    pub fn is_images(self) -> bool {
        matches!(self, DatasetKind::ImageFolder | DatasetKind::Webdataset)
    }
}

/// `data.image_size`: one number for square images, or `[height, width]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ImageSize {
    /// Square.
    Square(usize),
    /// `[height, width]`.
    Rect([usize; 2]),
}

impl ImageSize {
    /// `(height, width)`.
    pub fn dims(self) -> (usize, usize) {
        match self {
            ImageSize::Square(s) => (s, s),
            ImageSize::Rect([h, w]) => (h, w),
        }
    }
}

/// `data.color_mode`: the channels images are decoded to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ColorModeName {
    /// Three channels (what torchvision's `ImageFolder` gives: PIL's `convert("RGB")`).
    #[default]
    Rgb,
    /// One channel (PIL's `convert("L")`).
    Gray,
    /// Four channels, alpha last.
    Rgba,
}

/// `data.on_error`: what a corrupt or unreadable image does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnErrorName {
    /// Stops the run with an error naming the file.
    #[default]
    Fail,
    /// Leaves the image out of its batch with a warning naming it, and counts it.
    Skip,
}

/// The data section: the dataset, how it is split, batched and shaped.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// The source.
    pub dataset: DatasetKind,
    /// The file or directory (required for `mnist` and `csv`).
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// CSV only: the label column's name or 0-based index (default: the last column).
    #[serde(default)]
    pub label_column: Option<String>,
    /// CSV only: whether the first line names the columns.
    #[serde(default = "yes")]
    pub has_header: bool,
    /// Fraction held out for validation, in `[0, 1)`, when the dataset has no
    /// test split (default 0.2); 0 means no validation split (and no `val_*`
    /// metrics). Not with `val_path` or `val_shards`, which give the split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_fraction: Option<f64>,
    /// image_folder: the validation images (class folders or a list), instead
    /// of holding out `val_fraction` of `path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_path: Option<PathBuf>,
    /// webdataset: the training shards, `"data/train-{000000..000099}.tar"`
    /// (brace ranges and `{a,b}` lists expand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<String>,
    /// webdataset: the validation shards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_shards: Option<String>,
    /// webdataset: samples in the shuffle buffer the training stream passes
    /// through (after the shards are shuffled); 0 or 1 keeps the stream's order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shuffle_buffer: Option<usize>,
    /// Images: the size the model takes; without `transforms`, images are
    /// resized (shorter side) and centre-cropped to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_size: Option<ImageSize>,
    /// Images: the channels they are decoded to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub color_mode: Option<ColorModeName>,
    /// Images: whether a corrupt image stops the run or is skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_error: Option<OnErrorName>,
    /// Images: the training transforms, in order (torchvision's names:
    /// `resize`, `center_crop`, `random_resized_crop`, `random_horizontal_flip`,
    /// `color_jitter`, `to_tensor`, `normalize`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transforms: Option<Vec<TransformSpec>>,
    /// Images: the validation (and `eval`/`predict`) transforms; default the
    /// deterministic ones of `transforms` (`resize`, `center_crop`,
    /// `to_tensor`, `normalize`), or resize and centre-crop to `image_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_transforms: Option<Vec<TransformSpec>>,
    /// Examples per batch.
    #[serde(default = "batch")]
    pub batch_size: usize,
    /// Background loader threads (0 loads on the training thread).
    #[serde(default)]
    pub workers: usize,
    /// Shape of one example as the model takes it (e.g. `[1, 8, 8]`); default flat.
    #[serde(default)]
    pub input_shape: Option<Vec<usize>>,
    /// Features are divided by this (16 for digits, 255 for MNIST).
    #[serde(default = "unit")]
    pub scale: f64,
    /// Drop the last incomplete training batch.
    #[serde(default)]
    pub drop_last: bool,
}

fn batch() -> usize {
    64
}
fn unit() -> f64 {
    1.0
}

impl DataConfig {
    /// The fraction of the examples held out for validation: `val_fraction`,
    /// by default 0.2 where the data has no split of its own, else 0.
    pub fn val_fraction(&self) -> f64 {
        let own_split = self.dataset == DatasetKind::Mnist
            || self.val_path.is_some()
            || self.val_shards.is_some()
            || self.dataset == DatasetKind::Webdataset;
        self.val_fraction
            .unwrap_or(if own_split { 0.0 } else { 0.2 })
    }

    /// Checks the keys against the dataset kind and each value.
    pub(super) fn validate(&self) -> Result<()> {
        let kind = self.dataset;
        let invalid =
            |key: &str, reason: String| Err(Error::invalid_argument(format!("data.{key}"), reason));
        if let Some(f) = self.val_fraction {
            if !(0.0..1.0).contains(&f) {
                return invalid("val_fraction", format!("must be in [0, 1), got {f}"));
            }
        }
        // Keys that only some kinds of data take.
        let set = |present: bool, key: &'static str| present.then_some(key);
        let image_keys = [
            set(self.image_size.is_some(), "image_size"),
            set(self.color_mode.is_some(), "color_mode"),
            set(self.on_error.is_some(), "on_error"),
            set(self.transforms.is_some(), "transforms"),
            set(self.val_transforms.is_some(), "val_transforms"),
        ];
        let table_keys = [
            set(self.input_shape.is_some(), "input_shape"),
            set(self.scale != 1.0, "scale"),
        ];
        let only = |keys: &[Option<&'static str>], kinds: &str| -> Result<()> {
            if let Some(key) = keys.iter().flatten().next() {
                return invalid(
                    key,
                    format!("applies to {kinds} data, not dataset = \"{}\"", kind.name()),
                );
            }
            Ok(())
        };
        if kind.is_images() {
            only(&table_keys, "tabular (digits, mnist, csv)")?;
        } else {
            only(&image_keys, "image (image_folder, webdataset)")?;
        }
        if kind != DatasetKind::ImageFolder {
            only(&[set(self.val_path.is_some(), "val_path")], "image_folder")?;
        }
        if kind != DatasetKind::Webdataset {
            only(
                &[
                    set(self.shards.is_some(), "shards"),
                    set(self.val_shards.is_some(), "val_shards"),
                    set(self.shuffle_buffer.is_some(), "shuffle_buffer"),
                ],
                "webdataset",
            )?;
        }
        if kind != DatasetKind::Csv {
            only(&[set(self.label_column.is_some(), "label_column")], "csv")?;
        }
        match kind {
            DatasetKind::Digits => {}
            DatasetKind::Mnist | DatasetKind::Csv | DatasetKind::ImageFolder => {
                if self.path.is_none() {
                    return invalid(
                        "path",
                        format!("dataset = \"{}\" needs a path", kind.name()),
                    );
                }
            }
            DatasetKind::Webdataset => {
                if self.path.is_some() {
                    return invalid(
                        "path",
                        "a webdataset is read from `shards` (and `val_shards`), not `path`".into(),
                    );
                }
                if self.shards.is_none() {
                    return invalid(
                        "shards",
                        "dataset = \"webdataset\" needs shards, e.g. \"data/train-{000000..000009}.tar\""
                            .into(),
                    );
                }
                if self.val_fraction.is_some_and(|f| f > 0.0) {
                    return invalid(
                        "val_fraction",
                        "a webdataset's validation split is its own shards: set `val_shards`"
                            .into(),
                    );
                }
            }
        }
        if (self.val_path.is_some() || self.val_shards.is_some())
            && self.val_fraction.is_some_and(|f| f > 0.0)
        {
            return invalid(
                "val_fraction",
                "the validation split is given by val_path / val_shards; remove val_fraction"
                    .into(),
            );
        }
        if kind.is_images() {
            if let Some(size) = self.image_size {
                let (h, w) = size.dims();
                if h == 0 || w == 0 {
                    return invalid("image_size", format!("must be positive, got {size:?}"));
                }
            }
            if self.transforms.is_none() && self.image_size.is_none() {
                return invalid(
                    "image_size",
                    "image data needs image_size (images are resized and centre-cropped to it), \
                     or a transforms list"
                        .into(),
                );
            }
            for (key, specs) in [
                ("transforms", &self.transforms),
                ("val_transforms", &self.val_transforms),
            ] {
                for (i, spec) in specs.iter().flatten().enumerate() {
                    spec.validate().map_err(|e| {
                        Error::invalid_argument(format!("data.{key}[{i}]"), e.to_string())
                    })?;
                }
            }
        }
        Ok(())
    }
}
