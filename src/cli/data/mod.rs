//! The configured data set: read, checked against the model and the loss, split.
//!
//! Tabular data (digits, MNIST, CSV) is read whole into memory; images
//! (`image_folder`, `webdataset`) stay on disk and are decoded and transformed
//! by the loader's workers, batch by batch (`images.rs`). `loader.rs` makes a
//! split's loader, sharded per rank.

use std::path::{Path, PathBuf};

use crate::config::{DataSource, RunConfig};
use crate::engines::Engines;
#[cfg(not(all(feature = "text", feature = "vision")))]
use crate::features::{Feature, FeatureMissing};
use crate::prelude::*;
use anyhow::{Context, Result};
use kiln_core::{loss::Loss, HostTensor};
use kiln_data::{load_digits, train_test_split};
#[cfg(feature = "vision")]
use kiln_vision::WebDataset;

#[cfg(feature = "vision")]
mod images;
mod loader;
#[cfg(feature = "text")]
mod text;

#[cfg(feature = "vision")]
use images::load_images;
pub(crate) use loader::{loader, RecordTargets};
#[cfg(feature = "text")]
use text::load_text;

/// The workspace's provisioned data directory, for the default digits path
/// (this crate is `src/cli/` in the workspace).
pub(crate) fn default_digits() -> PathBuf {
    let cli = Path::new(env!("CARGO_MANIFEST_DIR"));
    cli.ancestors()
        .nth(2)
        .unwrap_or(cli)
        .join(".kiln/data/digits.csv.gz")
}

/// Image samples, transformed: `([C, H, W]` float image, label`)`.
#[cfg(any(feature = "text", feature = "vision"))]
pub(crate) type SampleDataset =
    std::sync::Arc<dyn kiln_data::Dataset<Item = (HostTensor, HostTensor)>>;

/// One split of the configured data.
pub(crate) enum Split {
    /// Examples held in memory: features and labels.
    Tensors(HostTensor, HostTensor),
    /// Image files, decoded and transformed by the loader's workers.
    #[cfg(feature = "vision")]
    Images(ImageSplit),
    /// Text rows, tokenized by the loader's workers and padded per batch.
    #[cfg(feature = "text")]
    Text(TextSplit),
}

/// A split of tokenized text examples, padded per batch.
#[cfg(feature = "text")]
pub(crate) struct TextSplit {
    pub(crate) dataset: SampleDataset,
    /// The id padding inputs.
    pub(crate) pad_id: i64,
    /// Whether targets are a language model's (flattened with the logits).
    pub(crate) causal: bool,
    /// Whether inputs carry their attention mask (`[batch, 2, len]`): a
    /// classifier over rows of several lengths.
    pub(crate) attention_mask: bool,
}

/// A split of image files.
#[cfg(feature = "vision")]
pub(crate) struct ImageSplit {
    /// The transformed samples.
    dataset: SampleDataset,
    /// A webdataset's shards, which order each epoch (shards shuffled, then a
    /// shuffle buffer, then a block per rank) instead of the loader's shuffle.
    shards: Option<std::sync::Arc<WebDataset>>,
    /// Training batches' MixUp / CutMix (`data.mixup_alpha`, `data.cutmix_alpha`).
    mix: Option<std::sync::Arc<dyn kiln_vision::transforms::BatchTransform>>,
}

impl Split {
    /// Number of examples.
    pub(crate) fn len(&self) -> usize {
        match self {
            Split::Tensors(_, y) => y.dims().first().copied().unwrap_or(0),
            #[cfg(feature = "vision")]
            Split::Images(s) => s.dataset.len(),
            #[cfg(feature = "text")]
            Split::Text(s) => s.dataset.len(),
        }
    }
}

/// The training and validation splits of the configured dataset (no validation
/// split when there is none), and one example as the model takes it.
pub(crate) struct Data {
    pub(crate) train: Split,
    pub(crate) val: Option<Split>,
    /// One example as a batch of one, `[1, ...]`: the model's input shape and dtype.
    pub(crate) probe: HostTensor,
    /// The classes' names by index, where the data names them (an image
    /// folder's folders).
    pub(crate) class_names: Option<Vec<String>>,
}

/// Where a data set's labels come from, to name a bad one.
pub(crate) enum LabelOrigin<'a> {
    /// Line `first_line + i` of `path` holds example `i`.
    Lines { path: &'a Path, first_line: usize },
    /// Record `i` of the IDX labels of `split` in the MNIST directory `path`.
    Records { path: &'a Path, split: &'a str },
}

/// Reads the configured dataset and checks it against the model before anything
/// is written: the model's output shape for the data's input shape, and every
/// label against the loss and that output.
pub(crate) fn load_data<E: Engines>(config: &RunConfig) -> Result<Data> {
    let data = &config.data;
    let path = || {
        data.source
            .path()
            .map(Path::to_path_buf)
            .context("data.path is required for this dataset")
    };
    // The file the labels come from, and the line of its first example (None
    // for a labels array, whose examples are its records).
    let (features, labels, origin_path, first_line) = match &data.source {
        #[cfg(feature = "vision")]
        DataSource::ImageFolder(_) | DataSource::Webdataset(_) => return load_images::<E>(config),
        #[cfg(not(feature = "vision"))]
        DataSource::ImageFolder(_) | DataSource::Webdataset(_) => {
            return Err(FeatureMissing::new(Feature::Vision, "image data").into());
        }
        #[cfg(feature = "text")]
        DataSource::Text(_) => return load_text::<E>(config),
        #[cfg(not(feature = "text"))]
        DataSource::Text(_) => {
            return Err(FeatureMissing::new(Feature::Text, "text data").into());
        }
        DataSource::Digits(digits) => {
            let path = digits.path.clone().unwrap_or_else(default_digits);
            let (x, y) = load_digits(&path).with_context(|| {
                format!(
                    "loading the digits data set from {} (run `cargo xtask setup` to provision it)",
                    path.display()
                )
            })?;
            (x, y, path, Some(1))
        }
        DataSource::Mnist(_) => {
            // MNIST has its own test split: it is the validation set.
            let dir = path()?;
            let mnist = kiln_data::load_mnist(&dir)?;
            let train = scale_and_shape(mnist.train_images, data)?;
            check_fits::<E>(
                config,
                &train,
                &mnist.train_labels,
                &LabelOrigin::Records {
                    path: &dir,
                    split: "training",
                },
            )?;
            let test = scale_and_shape(mnist.test_images, data)?;
            check_fits::<E>(
                config,
                &test,
                &mnist.test_labels,
                &LabelOrigin::Records {
                    path: &dir,
                    split: "test",
                },
            )?;
            let probe = first_example(&train)?;
            return Ok(Data {
                train: Split::Tensors(train, mnist.train_labels),
                val: Some(Split::Tensors(test, mnist.test_labels)),
                probe,
                class_names: None,
            });
        }
        DataSource::Csv(csv) => {
            let options = kiln_data::CsvOptions {
                has_header: csv.has_header,
                label_column: match &csv.label_column {
                    None => kiln_data::LabelColumn::Last,
                    Some(c) => match c.parse::<usize>() {
                        Ok(index) => kiln_data::LabelColumn::Index(index),
                        Err(_) => kiln_data::LabelColumn::Name(c.clone()),
                    },
                },
                ..Default::default()
            };
            let path = path()?;
            let (x, y) = kiln_data::load_csv(&path, &options)?;
            (x, y, path, Some(if csv.has_header { 2 } else { 1 }))
        }
        DataSource::Npy(npy) => {
            let path = path()?;
            let labels = npy
                .labels
                .clone()
                .context("data.labels is required for dataset = \"npy\"")?;
            let (x, y) = npy_arrays(&path, &labels)?;
            (x, y, labels, None)
        }
    };
    let features = scale_and_shape(features, data)?;
    // A model that starts with a token embedding takes int64 ids.
    let features = if config.model.input_dtype() == Some(DType::I64) {
        token_ids(&features, &origin_path)?
    } else {
        features
    };
    let origin = match first_line {
        Some(first_line) => LabelOrigin::Lines {
            path: &origin_path,
            first_line,
        },
        None => LabelOrigin::Records {
            path: &origin_path,
            split: "training",
        },
    };
    check_fits::<E>(config, &features, &labels, &origin)?;
    let probe = first_example(&features)?;
    if data.val_fraction() == 0.0 {
        return Ok(Data {
            train: Split::Tensors(features, labels),
            val: None,
            probe,
            class_names: None,
        });
    }
    let ((x, y), (vx, vy)) =
        train_test_split(&features, &labels, data.val_fraction(), config.seed)?;
    Ok(Data {
        train: Split::Tensors(x, y),
        val: Some(Split::Tensors(vx, vy)),
        probe,
        class_names: None,
    })
}

/// The features and labels of `dataset = "npy"`: as many examples in each,
/// the labels one number each, integer labels as int64 class indices and
/// float ones as float32 regression targets.
fn npy_arrays(path: &Path, labels: &Path) -> Result<(HostTensor, HostTensor)> {
    let x = kiln_data::read_npy(path).context("data.path")?;
    let y = kiln_data::read_npy(labels).context("data.labels")?;
    let n = match x.dims().first() {
        Some(&n) if n > 0 => n,
        _ => anyhow::bail!(
            "data.path: {} holds an array of shape {}; expected [examples, ...] with at least \
             one example",
            path.display(),
            x.shape()
        ),
    };
    if y.dims() != [n] {
        anyhow::bail!(
            "data.labels: {} holds an array of shape {}; expected [{n}], one label for each of \
             the {n} examples of {}",
            labels.display(),
            y.shape(),
            path.display()
        );
    }
    let y = match y.dtype() {
        DType::U8 | DType::I32 | DType::I64 => y.to_dtype(DType::I64),
        _ => y.to_dtype(DType::F32),
    };
    Ok((x, y))
}

/// Example 0 of `features`, as a batch of one.
fn first_example(features: &HostTensor) -> Result<HostTensor> {
    if features.dims().first().is_none_or(|&n| n == 0) {
        anyhow::bail!("the data set has no examples");
    }
    Ok(features.select_rows(&[0])?)
}

/// Checks that the model takes examples of `features`' shape, and that its
/// output and the loss take every one of `labels`.
pub(crate) fn check_fits<E: Engines>(
    config: &RunConfig,
    features: &HostTensor,
    labels: &HostTensor,
    origin: &LabelOrigin<'_>,
) -> Result<()> {
    let mut input = features.dims().to_vec();
    input[0] = config.data.loader.batch_size;
    // A torchscript layer's output shape is found by running it once.
    let model = crate::model::resolve_model::<E>(config, features, config.device)?;
    let output = model.output_shape(&input).with_context(|| {
        let shape = match &config.data.tabular().input_shape {
            Some(dims) => format!("data.input_shape = {dims:?}"),
            None => "flat examples: data.input_shape is not set".to_owned(),
        };
        format!("the model does not take the data's batches of shape {input:?} ({shape})")
    })?;
    let label_dims = &labels.dims()[1..];
    let (ignore_index, needs_classes) = match &config.loss {
        Loss::CrossEntropy(c) => (c.ignore_index, true),
        Loss::Nll(c) => (c.ignore_index, true),
        _ => (None, false),
    };
    let mismatch = |what: String| {
        anyhow::anyhow!(
            "the loss `{}` does not fit the model's output: {what}",
            config.loss.torch_name()
        )
    };
    if !needs_classes || labels.dtype().is_float() {
        // Targets of the output's own shape per example (regression, probabilities).
        if label_dims.iter().product::<usize>() != output[1..].iter().product::<usize>() {
            return Err(mismatch(format!(
                "the model gives {:?} per example, the targets are {label_dims:?}",
                &output[1..]
            )));
        }
        return Ok(());
    }
    let Some(&classes) = output.get(1) else {
        return Err(mismatch(format!(
            "it needs [batch, classes] scores, the model gives {output:?}"
        )));
    };
    let labels = labels.to_dtype(kiln_core::DType::I64);
    let values = labels.as_slice::<i64>()?;
    let bad = values
        .iter()
        .enumerate()
        .find(|(_, &v)| Some(v) != ignore_index && !(0..classes as i64).contains(&v));
    if let Some((i, &label)) = bad {
        let place = match origin {
            LabelOrigin::Lines { path, first_line } => {
                format!("{}, line {}", path.display(), first_line + i)
            }
            LabelOrigin::Records { path, split } => {
                format!("{} ({split} labels), record {i}", path.display())
            }
        };
        anyhow::bail!(
            "{place}: label {label} is outside the model's {classes} classes (0 to {}); \
             the model's last layer gives {classes} scores per example",
            classes - 1
        );
    }
    Ok(())
}

/// Divides by `data.scale` and reshapes each example to `data.input_shape`.
pub(crate) fn scale_and_shape(
    features: HostTensor,
    data: &crate::config::DataConfig,
) -> Result<HostTensor> {
    let tabular = data.tabular();
    let n = features.dims().first().copied().unwrap_or(0);
    let numel = features.numel();
    let scaled: Vec<f32> = features
        .to_dtype(DType::F32)
        .as_slice::<f32>()?
        .iter()
        .map(|v| (*v as f64 / tabular.scale) as f32)
        .collect();
    let mut shape = vec![n];
    match &tabular.input_shape {
        Some(dims) => shape.extend(dims),
        None => shape.push(numel / n.max(1)),
    }
    HostTensor::new(scaled, shape)
        .context("data.input_shape does not match the number of features per example")
}

/// `features` as int64 token ids, every one a non-negative whole number.
fn token_ids(features: &HostTensor, path: &Path) -> Result<HostTensor> {
    let values = features.as_slice::<f32>()?;
    if let Some((i, v)) = values
        .iter()
        .enumerate()
        .find(|(_, v)| !(v.fract() == 0.0 && **v >= 0.0 && **v < 16_777_216.0))
    {
        let row_len = features.numel() / features.dims()[0].max(1);
        anyhow::bail!(
            "{}: example {}, feature {}: {v} is not a token id (the model starts with an \
             embedding and takes whole numbers >= 0; with data.scale = 1)",
            path.display(),
            i / row_len.max(1),
            i % row_len.max(1)
        );
    }
    let ids: Vec<i64> = values.iter().map(|&v| v as i64).collect();
    Ok(HostTensor::new(ids, features.dims().to_vec())?)
}

/// The validation split, which `eval` and `predict` run on, and one example.
pub(crate) fn validation_split<E: Engines>(config: &RunConfig) -> Result<(Split, HostTensor)> {
    if !config.has_validation() {
        anyhow::bail!(
            "the config has no validation split (data.val_fraction is 0); set a fraction to \
             hold out"
        );
    }
    let data = load_data::<E>(config)?;
    let val = data
        .val
        .context("the config's data has no validation split")?;
    Ok((val, data.probe))
}
