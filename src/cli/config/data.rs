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
    /// Text rows of a JSON Lines, CSV or Parquet file `path`, tokenized by the loader's
    /// workers: a language model's text (`text_column`), instruction pairs
    /// (`prompt_template` and `response_template`), or text and a label
    /// (`text_column` and `label_column`).
    Text,
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
            DatasetKind::Text => "text",
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
    /// webdataset: the image member's extension, `;` between alternatives
    /// (webdataset's `to_tuple("jpg;png", ...)`; default every image format Kiln decodes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_key: Option<String>,
    /// webdataset: the label member's extension: `cls` (an ASCII class
    /// index, the default), `json` (its `"label"` field), or another that holds
    /// an ASCII class index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_key: Option<String>,
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
    pub color_mode: Option<kiln_data::ColorMode>,
    /// Images: whether a corrupt image stops the run or is skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_error: Option<kiln_data::OnError>,
    /// Images: the training transforms, in order (torchvision's names:
    /// `resize`, `center_crop`, `random_resized_crop`, `random_horizontal_flip`,
    /// `color_jitter`, `to_tensor`, `normalize`, `pad`, `random_crop`,
    /// `random_rotation`, `random_affine`, `random_perspective`,
    /// `gaussian_blur`, `random_grayscale`, `random_erasing`, `auto_augment`,
    /// `rand_augment`, `trivial_augment_wide`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transforms: Option<Vec<TransformSpec>>,
    /// Images: MixUp on the training batches, Beta(`mixup_alpha`,
    /// `mixup_alpha`) (torchvision's recipe's `--mixup-alpha`); with
    /// `cutmix_alpha`, MixUp or CutMix for each batch. Targets become class
    /// probabilities: the loss must be `cross_entropy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mixup_alpha: Option<f64>,
    /// Images: CutMix on the training batches (the recipe's `--cutmix-alpha`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cutmix_alpha: Option<f64>,
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
    /// text: the column holding a language model's text (or, with
    /// `label_column`, the text to classify).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_column: Option<String>,
    /// text: the prompt of an instruction pair, with `{column}` fields
    /// (`"### Question:\n{question}\n\n### Answer:\n"`); no loss on its tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_template: Option<String>,
    /// text: the response of an instruction pair (`"{answer}"`); EOS is appended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_template: Option<String>,
    /// text: tokens per example at most (with `packing`, the block length).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_length: Option<usize>,
    /// text: cut examples longer than `max_length` instead of refusing the data.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncation: bool,
    /// text: join the examples and cut them into blocks of `max_length`
    /// tokens, instead of padding each batch to its longest example.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub packing: bool,
    /// text: the directory of `tokenizer.json` (default: `model.pretrained`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
}

fn batch() -> usize {
    64
}
fn unit() -> f64 {
    1.0
}

/// The error for `data.<key>`, giving the reason.
fn invalid(key: &str, reason: String) -> Result<()> {
    Err(Error::invalid_argument(format!("data.{key}"), reason))
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

    /// The text task the keys describe (`dataset = "text"`).
    pub fn text_task(&self) -> Result<kiln_data::text::TextTask> {
        use kiln_data::text::{PromptTemplate, TextTask};
        let template = |key: &str, source: &str| {
            PromptTemplate::parse(source)
                .map_err(|e| Error::invalid_argument(format!("data.{key}"), e.to_string()))
        };
        match (
            &self.text_column,
            &self.prompt_template,
            &self.response_template,
            &self.label_column,
        ) {
            (Some(text), None, None, None) => Ok(TextTask::LanguageModel { text: text.clone() }),
            (Some(text), None, None, Some(label)) => Ok(TextTask::Classification {
                text: text.clone(),
                label: label.clone(),
            }),
            (None, Some(p), Some(r), None) => Ok(TextTask::Instruction {
                prompt: template("prompt_template", p)?,
                response: template("response_template", r)?,
            }),
            _ => Err(Error::invalid_argument(
                "data",
                "dataset = \"text\" takes `text_column` (a language model's text), \
                 `text_column` and `label_column` (classification), or `prompt_template` and \
                 `response_template` (instruction pairs)",
            )),
        }
    }

    /// Checks the text keys.
    fn validate_text(&self) -> Result<()> {
        let task = self.text_task()?;
        if self.max_length == Some(0) {
            return Err(Error::invalid_argument(
                "data.max_length",
                "must be at least 1, got 0",
            ));
        }
        if self.packing {
            if self.max_length.is_none() {
                return Err(Error::invalid_argument(
                    "data.packing",
                    "packing cuts the examples into blocks of `max_length` tokens: set max_length",
                ));
            }
            if !task.is_causal() {
                return Err(Error::invalid_argument(
                    "data.packing",
                    "packing joins language-model or instruction examples, not classification ones",
                ));
            }
        }
        if self.truncation && self.max_length.is_none() {
            return Err(Error::invalid_argument(
                "data.truncation",
                "truncation cuts examples to `max_length` tokens: set max_length",
            ));
        }
        Ok(())
    }

    /// Checks the keys against the dataset kind and each value.
    pub(super) fn validate(&self) -> Result<()> {
        let kind = self.dataset;
        if let Some(f) = self.val_fraction {
            if !(0.0..1.0).contains(&f) {
                return invalid("val_fraction", format!("must be in [0, 1), got {f}"));
            }
        }
        self.check_keys_apply()?;
        if kind == DatasetKind::Text {
            self.validate_text()?;
        }
        self.check_source()?;
        if kind.is_images() {
            self.validate_images()?;
        }
        Ok(())
    }

    /// Refuses, naming it, a key that does not apply to the dataset kind.
    fn check_keys_apply(&self) -> Result<()> {
        let kind = self.dataset;
        // Keys that only some kinds of data take.
        let set = |present: bool, key: &'static str| present.then_some(key);
        let image_keys = [
            set(self.image_size.is_some(), "image_size"),
            set(self.color_mode.is_some(), "color_mode"),
            set(self.on_error.is_some(), "on_error"),
            set(self.transforms.is_some(), "transforms"),
            set(self.val_transforms.is_some(), "val_transforms"),
            set(self.mixup_alpha.is_some(), "mixup_alpha"),
            set(self.cutmix_alpha.is_some(), "cutmix_alpha"),
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
        if kind.is_images() || kind == DatasetKind::Text {
            only(&table_keys, "tabular (digits, mnist, csv)")?;
        }
        if !kind.is_images() {
            only(&image_keys, "image (image_folder, webdataset)")?;
        }
        if !matches!(kind, DatasetKind::ImageFolder | DatasetKind::Text) {
            only(
                &[set(self.val_path.is_some(), "val_path")],
                "image_folder and text",
            )?;
        }
        if kind != DatasetKind::Webdataset {
            only(
                &[
                    set(self.shards.is_some(), "shards"),
                    set(self.val_shards.is_some(), "val_shards"),
                    set(self.shuffle_buffer.is_some(), "shuffle_buffer"),
                    set(self.image_key.is_some(), "image_key"),
                    set(self.label_key.is_some(), "label_key"),
                ],
                "webdataset",
            )?;
        }
        if !matches!(kind, DatasetKind::Csv | DatasetKind::Text) {
            only(
                &[set(self.label_column.is_some(), "label_column")],
                "csv and text",
            )?;
        }
        if kind != DatasetKind::Text {
            only(
                &[
                    set(self.text_column.is_some(), "text_column"),
                    set(self.prompt_template.is_some(), "prompt_template"),
                    set(self.response_template.is_some(), "response_template"),
                    set(self.max_length.is_some(), "max_length"),
                    set(self.truncation, "truncation"),
                    set(self.packing, "packing"),
                    set(self.tokenizer.is_some(), "tokenizer"),
                ],
                "text",
            )?;
        }
        Ok(())
    }

    /// Checks where the data is read from: `path`, `shards`, and how the
    /// validation split is given.
    fn check_source(&self) -> Result<()> {
        let kind = self.dataset;
        match kind {
            DatasetKind::Digits => {}
            DatasetKind::Mnist
            | DatasetKind::Csv
            | DatasetKind::ImageFolder
            | DatasetKind::Text => {
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
        Ok(())
    }

    /// Checks image data's size, mixing and transforms.
    fn validate_images(&self) -> Result<()> {
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
        for (key, alpha) in [
            ("mixup_alpha", self.mixup_alpha),
            ("cutmix_alpha", self.cutmix_alpha),
        ] {
            if alpha.is_some_and(|a| !(a.is_finite() && a > 0.0)) {
                return invalid(
                    key,
                    format!(
                        "must be positive (the Beta distribution's parameter), got {}",
                        alpha.unwrap_or_default()
                    ),
                );
            }
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
        Ok(())
    }
}
