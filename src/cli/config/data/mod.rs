//! `[data]`: the dataset, how it is split, batched and shaped.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use kiln_core::error::{Error, Result};
#[cfg(feature = "vision")]
use kiln_vision::{transforms::TransformSpec, ColorMode, OnError};

/// Without the `vision` feature the image keys are kept as written, and image
/// data is refused as needing the feature ([`ImageKeys`]' validation).
#[cfg(not(feature = "vision"))]
type TransformSpec = toml::Value;
#[cfg(not(feature = "vision"))]
type ColorMode = toml::Value;
#[cfg(not(feature = "vision"))]
type OnError = toml::Value;

use super::yes;

mod parse;

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
    /// NumPy arrays (`numpy.save`): the features `path`, `[N, ...]`, and the
    /// labels `labels`, `[N]`.
    Npy,
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
            DatasetKind::Npy => "npy",
            DatasetKind::ImageFolder => "image_folder",
            DatasetKind::Webdataset => "webdataset",
            DatasetKind::Text => "text",
        }
    }

    /// Every kind, in the order the guide lists them.
    pub const ALL: [DatasetKind; 7] = [
        DatasetKind::Digits,
        DatasetKind::Mnist,
        DatasetKind::Csv,
        DatasetKind::Npy,
        DatasetKind::ImageFolder,
        DatasetKind::Webdataset,
        DatasetKind::Text,
    ];

    /// Whether the examples are image files, decoded and transformed by the loader.
    pub fn is_images(self) -> bool {
        matches!(self, DatasetKind::ImageFolder | DatasetKind::Webdataset)
    }

    /// Whether the examples are rows of numbers (digits, mnist, csv, npy),
    /// scaled and shaped by `scale` and `input_shape`.
    pub fn is_tabular(self) -> bool {
        matches!(
            self,
            DatasetKind::Digits | DatasetKind::Mnist | DatasetKind::Csv | DatasetKind::Npy
        )
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

/// The data section: where the examples come from (`dataset` and the keys of
/// that source), what image or tabular examples are made into, and how the
/// loader splits and batches them. A key that another source takes is a
/// parse error naming the sources it applies to.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DataConfig {
    /// The source, tagged by `dataset`, with its own keys.
    #[serde(flatten)]
    pub source: DataSource,
    /// Image sources' decoding, transforms and mixing (`Some` for them, `None`
    /// for the others).
    #[serde(flatten)]
    pub images: Option<ImageKeys>,
    /// Tabular sources' scale and shape (`Some` for digits, mnist, csv and npy).
    #[serde(flatten)]
    pub tabular: Option<TabularKeys>,
    /// The loader's keys, for every source.
    #[serde(flatten)]
    pub loader: LoaderKeys,
}

/// Where the examples come from: `dataset = "..."` and that source's keys.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "dataset", rename_all = "snake_case")]
pub enum DataSource {
    /// The UCI digits; `path` defaults to `.kiln/data/digits.csv.gz`.
    Digits(FileSource),
    /// MNIST IDX files in the directory `path`.
    Mnist(FileSource),
    /// A CSV file of numeric features and an integer label column.
    Csv(CsvSource),
    /// NumPy arrays of features and labels.
    Npy(NpySource),
    /// Images in class folders, or a list of `path,label`.
    ImageFolder(ImageFolderSource),
    /// WebDataset `.tar` shards.
    Webdataset(ShardSource),
    /// Text rows of a JSON Lines, CSV or Parquet file.
    Text(Box<TextSource>),
}

/// digits and mnist: the file or directory.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSource {
    /// The file (digits, optional) or directory (mnist, required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
}

/// csv: the file and its label column.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CsvSource {
    /// The CSV file (required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// The label column's name or 0-based index (default: the last column).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_column: Option<String>,
    /// Whether the first line names the columns.
    #[serde(default = "yes")]
    pub has_header: bool,
}

/// npy: the features and the labels, each a `.npy` file (`numpy.save`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NpySource {
    /// The features, `[N, ...]`, of any numeric dtype (required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// The labels, `[N]`: integers are class indices, floats regression
    /// targets (required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<PathBuf>,
}

/// image_folder: the training images and, optionally, the validation ones.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageFolderSource {
    /// Class folders, or a CSV or JSON list of `path,label` (required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// The validation images (class folders or a list), instead of holding
    /// out `val_fraction` of `path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_path: Option<PathBuf>,
}

/// webdataset: the shards and their members.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardSource {
    /// The training shards, `"data/train-{000000..000099}.tar"` (brace ranges
    /// and `{a,b}` lists expand; required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<String>,
    /// The validation shards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_shards: Option<String>,
    /// The image member's extension, `;` between alternatives (webdataset's
    /// `to_tuple("jpg;png", ...)`; default every image format Kiln decodes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_key: Option<String>,
    /// The label member's extension: `cls` (an ASCII class index, the
    /// default), `json` (its `"label"` field), or another that holds an ASCII
    /// class index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_key: Option<String>,
    /// Samples in the shuffle buffer the training stream passes through
    /// (after the shards are shuffled); 0 or 1 keeps the stream's order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shuffle_buffer: Option<usize>,
}

/// text: the rows, the task their columns make, and how they are tokenized.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextSource {
    /// The JSON Lines, CSV or Parquet file (required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// A validation file, instead of holding out `val_fraction` of `path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_path: Option<PathBuf>,
    /// The column holding a language model's text (or, with `label_column`,
    /// the text to classify).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_column: Option<String>,
    /// The label column of text classification.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_column: Option<String>,
    /// The prompt of an instruction pair, with `{column}` fields
    /// (`"### Question:\n{question}\n\n### Answer:\n"`); no loss on its tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_template: Option<String>,
    /// The response of an instruction pair (`"{answer}"`); EOS is appended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_template: Option<String>,
    /// The column holding a conversation (`[{"role": "user", "content": ...},
    /// ...]`), rendered by the model's chat template (TRL's conversational
    /// language modelling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages_column: Option<String>,
    /// The column holding a conversational prompt (a list of messages), with
    /// `completion_column` (TRL's conversational prompt-completion).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_column: Option<String>,
    /// The column holding the completion's messages, with `prompt_column`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_column: Option<String>,
    /// A column of tool schemas (a list, its JSON text, or null) given to the
    /// chat template as `tools`, as TRL reads a row's `tools`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools_column: Option<String>,
    /// Train on the assistant's turns only: the tokens of the chat template's
    /// `{% generation %}` blocks (TRL's `assistant_only_loss`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub assistant_only_loss: bool,
    /// With `prompt_column`: the loss on the completion only (default true,
    /// as TRL's `completion_only_loss`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_only_loss: Option<bool>,
    /// A system message put first in every conversation that has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// A Jinja chat template file to render conversations with (default: the
    /// tokenizer directory's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<PathBuf>,
    /// Variables of the chat template (`{ enable_thinking = false }`), as
    /// TRL's `chat_template_kwargs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// Tokens per example at most (with `packing`, the block length).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_length: Option<usize>,
    /// Cut examples longer than `max_length` instead of refusing the data.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncation: bool,
    /// Join the examples and cut them into blocks of `max_length` tokens,
    /// instead of padding each batch to its longest example.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub packing: bool,
    /// The directory of `tokenizer.json` (default: `model.pretrained`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
}

/// Image sources (image_folder, webdataset): what the images are decoded and
/// transformed into.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageKeys {
    /// The size the model takes; without `transforms`, images are resized
    /// (shorter side) and centre-cropped to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_size: Option<ImageSize>,
    /// The channels they are decoded to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub color_mode: Option<ColorMode>,
    /// Whether a corrupt image stops the run or is skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_error: Option<OnError>,
    /// The training transforms, in order (torchvision's names: `resize`,
    /// `center_crop`, `random_resized_crop`, `random_horizontal_flip`,
    /// `color_jitter`, `to_tensor`, `normalize`, `pad`, `random_crop`,
    /// `random_rotation`, `random_affine`, `random_perspective`,
    /// `gaussian_blur`, `random_grayscale`, `random_erasing`, `auto_augment`,
    /// `rand_augment`, `trivial_augment_wide`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transforms: Option<Vec<TransformSpec>>,
    /// MixUp on the training batches, Beta(`mixup_alpha`, `mixup_alpha`)
    /// (torchvision's recipe's `--mixup-alpha`); with `cutmix_alpha`, MixUp or
    /// CutMix for each batch. Targets become class probabilities: the loss
    /// must be `cross_entropy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mixup_alpha: Option<f64>,
    /// CutMix on the training batches (the recipe's `--cutmix-alpha`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cutmix_alpha: Option<f64>,
    /// The validation (and `eval`/`predict`) transforms; default the
    /// deterministic ones of `transforms` (`resize`, `center_crop`,
    /// `to_tensor`, `normalize`), or resize and centre-crop to `image_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_transforms: Option<Vec<TransformSpec>>,
}

/// Tabular sources (digits, mnist, csv, npy): the features' scale and shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TabularKeys {
    /// Shape of one example as the model takes it (e.g. `[1, 8, 8]`); default flat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_shape: Option<Vec<usize>>,
    /// Features are divided by this (16 for digits, 255 for MNIST).
    #[serde(default = "unit")]
    pub scale: f64,
}

impl Default for TabularKeys {
    fn default() -> Self {
        Self {
            input_shape: None,
            scale: 1.0,
        }
    }
}

/// Every source: how the examples are split and batched.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoaderKeys {
    /// Fraction held out for validation, in `[0, 1)`, when the dataset has no
    /// split of its own (default 0.2); 0 means no validation split (and no
    /// `val_*` metrics). Not with `val_path` or `val_shards`, which give the split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_fraction: Option<f64>,
    /// Examples per batch.
    #[serde(default = "batch")]
    pub batch_size: usize,
    /// Background loader threads (0 loads on the training thread).
    #[serde(default)]
    pub workers: usize,
    /// Drop the last incomplete training batch.
    #[serde(default)]
    pub drop_last: bool,
}

impl DataSource {
    /// The source's kind (its `dataset`).
    pub fn kind(&self) -> DatasetKind {
        match self {
            DataSource::Digits(_) => DatasetKind::Digits,
            DataSource::Mnist(_) => DatasetKind::Mnist,
            DataSource::Csv(_) => DatasetKind::Csv,
            DataSource::Npy(_) => DatasetKind::Npy,
            DataSource::ImageFolder(_) => DatasetKind::ImageFolder,
            DataSource::Webdataset(_) => DatasetKind::Webdataset,
            DataSource::Text(_) => DatasetKind::Text,
        }
    }

    /// The file or directory read (`path`; shards have none).
    pub fn path(&self) -> Option<&std::path::Path> {
        match self {
            DataSource::Digits(s) | DataSource::Mnist(s) => s.path.as_deref(),
            DataSource::Csv(s) => s.path.as_deref(),
            DataSource::Npy(s) => s.path.as_deref(),
            DataSource::ImageFolder(s) => s.path.as_deref(),
            DataSource::Text(s) => s.path.as_deref(),
            DataSource::Webdataset(_) => None,
        }
    }

    /// Whether `val_fraction` defaults to 0: the source gives a validation
    /// split of its own (`val_path`, MNIST's test set), or is a stream of
    /// shards, whose split is `val_shards` or none.
    fn has_own_split(&self) -> bool {
        match self {
            DataSource::Mnist(_) | DataSource::Webdataset(_) => true,
            DataSource::ImageFolder(s) => s.val_path.is_some(),
            DataSource::Text(s) => s.val_path.is_some(),
            DataSource::Digits(_) | DataSource::Csv(_) | DataSource::Npy(_) => false,
        }
    }
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
    /// The source's kind (its `dataset`).
    pub fn kind(&self) -> DatasetKind {
        self.source.kind()
    }

    /// The image keys: those given for an image source, the defaults otherwise.
    pub fn images(&self) -> std::borrow::Cow<'_, ImageKeys> {
        match &self.images {
            Some(keys) => std::borrow::Cow::Borrowed(keys),
            None => std::borrow::Cow::Owned(ImageKeys::default()),
        }
    }

    /// The tabular keys: those given for a tabular source, the defaults otherwise.
    pub fn tabular(&self) -> std::borrow::Cow<'_, TabularKeys> {
        match &self.tabular {
            Some(keys) => std::borrow::Cow::Borrowed(keys),
            None => std::borrow::Cow::Owned(TabularKeys::default()),
        }
    }

    /// The fraction of the examples held out for validation: `val_fraction`,
    /// by default 0.2 where the data has no split of its own, else 0.
    pub fn val_fraction(&self) -> f64 {
        let own_split = self.source.has_own_split();
        self.loader
            .val_fraction
            .unwrap_or(if own_split { 0.0 } else { 0.2 })
    }

    /// Whether the source gives a validation split of its own (MNIST's test
    /// set, `val_path`, `val_shards`).
    pub fn has_validation_split(&self) -> bool {
        match &self.source {
            DataSource::Mnist(_) => true,
            DataSource::ImageFolder(s) => s.val_path.is_some(),
            DataSource::Text(s) => s.val_path.is_some(),
            DataSource::Webdataset(s) => s.val_shards.is_some(),
            DataSource::Digits(_) | DataSource::Csv(_) | DataSource::Npy(_) => false,
        }
    }

    /// Checks each value against the source.
    pub(super) fn validate(&self) -> Result<()> {
        if let Some(f) = self.loader.val_fraction {
            if !(0.0..1.0).contains(&f) {
                return invalid("val_fraction", format!("must be in [0, 1), got {f}"));
            }
        }
        if let DataSource::Text(text) = &self.source {
            text.validate()?;
        }
        self.check_source()?;
        if let Some(images) = &self.images {
            images.validate()?;
        }
        if self.loader.batch_size == 0 {
            return invalid("batch_size", "must be at least 1".into());
        }
        if let Some(tabular) = &self.tabular {
            if tabular.scale == 0.0 || !tabular.scale.is_finite() {
                return invalid("scale", "must be a finite, non-zero number".into());
            }
        }
        Ok(())
    }

    /// Checks where the data is read from: `path`, `shards`, and how the
    /// validation split is given.
    fn check_source(&self) -> Result<()> {
        let kind = self.kind();
        let fraction = self.loader.val_fraction.filter(|&f| f > 0.0);
        match &self.source {
            DataSource::Digits(_) => {}
            DataSource::Webdataset(shards) => {
                if shards.shards.is_none() {
                    return invalid(
                        "shards",
                        "dataset = \"webdataset\" needs shards, e.g. \"data/train-{000000..000009}.tar\""
                            .into(),
                    );
                }
                if fraction.is_some() {
                    return invalid(
                        "val_fraction",
                        "a webdataset's validation split is its own shards: set `val_shards`"
                            .into(),
                    );
                }
            }
            source => {
                if source.path().is_none() {
                    return invalid(
                        "path",
                        format!("dataset = \"{}\" needs a path", kind.name()),
                    );
                }
            }
        }
        if self.has_validation_split() && kind != DatasetKind::Mnist && fraction.is_some() {
            return invalid(
                "val_fraction",
                "the validation split is given by val_path / val_shards; remove val_fraction"
                    .into(),
            );
        }
        Ok(())
    }
}

impl TextSource {
    /// The text task the keys describe.
    #[cfg(feature = "text")]
    pub fn task(&self) -> Result<kiln_text::TextTask> {
        use kiln_text::{PromptTemplate, TextTask};
        let template = |key: &str, source: &str| {
            PromptTemplate::parse(source)
                .map_err(|e| Error::invalid_argument(format!("data.{key}"), e.to_string()))
        };
        let conversational = self.messages_column.is_some()
            || self.prompt_column.is_some()
            || self.completion_column.is_some();
        if conversational {
            return self.chat_task();
        }
        for (key, given) in [
            ("assistant_only_loss", self.assistant_only_loss),
            ("completion_only_loss", self.completion_only_loss.is_some()),
            ("system_prompt", self.system_prompt.is_some()),
            ("chat_template", self.chat_template.is_some()),
            ("chat_template_kwargs", self.chat_template_kwargs.is_some()),
            ("tools_column", self.tools_column.is_some()),
        ] {
            if given {
                return Err(Error::invalid_argument(
                    format!("data.{key}"),
                    "applies to conversations (`messages_column`, or `prompt_column` and \
                     `completion_column`), rendered through a chat template",
                ));
            }
        }
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

    /// The conversational task the keys describe.
    #[cfg(feature = "text")]
    fn chat_task(&self) -> Result<kiln_text::TextTask> {
        use kiln_text::TextTask;
        let plain = [
            ("text_column", self.text_column.is_some()),
            ("label_column", self.label_column.is_some()),
            ("prompt_template", self.prompt_template.is_some()),
            ("response_template", self.response_template.is_some()),
        ];
        if let Some((key, _)) = plain.iter().find(|(_, given)| *given) {
            return Err(Error::invalid_argument(
                format!("data.{key}"),
                "conversations (`messages_column`, `prompt_column`) are rendered by the chat \
                 template: remove the plain-text keys",
            ));
        }
        match (
            &self.messages_column,
            &self.prompt_column,
            &self.completion_column,
        ) {
            (Some(messages), None, None) => {
                if self.completion_only_loss.is_some() {
                    return Err(Error::invalid_argument(
                        "data.completion_only_loss",
                        "applies to a prompt and a completion (`prompt_column`, \
                         `completion_column`); a conversation trains on every token or, with \
                         assistant_only_loss, on the assistant's turns",
                    ));
                }
                Ok(TextTask::Conversation {
                    messages: messages.clone(),
                    tools: self.tools_column.clone(),
                    assistant_only: self.assistant_only_loss,
                })
            }
            (None, Some(prompt), Some(completion)) => Ok(TextTask::ChatCompletion {
                prompt: prompt.clone(),
                completion: completion.clone(),
                tools: self.tools_column.clone(),
                completion_only: self.completion_only_loss.unwrap_or(true),
                assistant_only: self.assistant_only_loss,
            }),
            _ => Err(Error::invalid_argument(
                "data",
                "conversations are `messages_column` (a conversation per row), or \
                 `prompt_column` and `completion_column` (a prompt and its completion, both \
                 lists of messages)",
            )),
        }
    }

    /// Without the `text` feature, text data is refused as needing it.
    #[cfg(not(feature = "text"))]
    fn validate(&self) -> Result<()> {
        let missing =
            crate::features::FeatureMissing::new(crate::features::Feature::Text, "text data");
        Err(Error::invalid_argument("data.dataset", missing.to_string()))
    }

    /// Checks the text keys.
    #[cfg(feature = "text")]
    fn validate(&self) -> Result<()> {
        let task = self.task()?;
        if self.max_length == Some(0) {
            return invalid("max_length", "must be at least 1, got 0".into());
        }
        if self.packing {
            if self.max_length.is_none() {
                return invalid(
                    "packing",
                    "packing cuts the examples into blocks of `max_length` tokens: set max_length"
                        .into(),
                );
            }
            if !task.is_causal() {
                return invalid(
                    "packing",
                    "packing joins language-model or instruction examples, not classification ones"
                        .into(),
                );
            }
        }
        if self.truncation && self.max_length.is_none() {
            return invalid(
                "truncation",
                "truncation cuts examples to `max_length` tokens: set max_length".into(),
            );
        }
        Ok(())
    }
}

impl ImageKeys {
    /// Without the `vision` feature, image data is refused as needing it.
    #[cfg(not(feature = "vision"))]
    fn validate(&self) -> Result<()> {
        let missing =
            crate::features::FeatureMissing::new(crate::features::Feature::Vision, "image data");
        Err(Error::invalid_argument("data.dataset", missing.to_string()))
    }

    /// Checks image data's size, mixing and transforms.
    #[cfg(feature = "vision")]
    fn validate(&self) -> Result<()> {
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
