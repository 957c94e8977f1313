//! The configured data set: read, checked against the model and the loss, split.

use std::path::{Path, PathBuf};

use crate::config::{DatasetKind, RunConfig};
use anyhow::{Context, Result};
use kiln::core::{loss::Loss, HostTensor};
use kiln::data::{load_digits, train_test_split, DataLoader, InMemoryDataset};
use kiln::prelude::*;

/// The workspace's provisioned data directory, for the default digits path.
pub(crate) fn default_digits() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".kiln/data/digits.csv.gz")
}

/// Features and labels of the configured dataset, scaled and shaped, split into
/// training and validation sets (none when `data.val_fraction` is 0).
pub(crate) struct Data {
    pub(crate) train: (HostTensor, HostTensor),
    pub(crate) val: Option<(HostTensor, HostTensor)>,
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
pub(crate) fn load_data(config: &RunConfig) -> Result<Data> {
    let data = &config.data;
    let path = || {
        data.path
            .clone()
            .context("data.path is required for this dataset")
    };
    let (features, labels, origin_path, first_line) = match data.dataset {
        DatasetKind::Digits => {
            let path = data.path.clone().unwrap_or_else(default_digits);
            let (x, y) = load_digits(&path).with_context(|| {
                format!(
                    "loading the digits data set from {} (run `cargo xtask setup` to provision it)",
                    path.display()
                )
            })?;
            (x, y, path, 1)
        }
        DatasetKind::Mnist => {
            // MNIST has its own test split: it is the validation set.
            let dir = path()?;
            let mnist = kiln::data::load_mnist(&dir)?;
            let train = scale_and_shape(mnist.train_images, data)?;
            check_fits(
                config,
                &train,
                &mnist.train_labels,
                &LabelOrigin::Records {
                    path: &dir,
                    split: "training",
                },
            )?;
            let test = scale_and_shape(mnist.test_images, data)?;
            check_fits(
                config,
                &test,
                &mnist.test_labels,
                &LabelOrigin::Records {
                    path: &dir,
                    split: "test",
                },
            )?;
            return Ok(Data {
                train: (train, mnist.train_labels),
                val: Some((test, mnist.test_labels)),
            });
        }
        DatasetKind::Csv => {
            let options = kiln::data::CsvOptions {
                has_header: data.has_header,
                label_column: match &data.label_column {
                    None => kiln::data::LabelColumn::Last,
                    Some(c) => match c.parse::<usize>() {
                        Ok(index) => kiln::data::LabelColumn::Index(index),
                        Err(_) => kiln::data::LabelColumn::Name(c.clone()),
                    },
                },
                ..Default::default()
            };
            let path = path()?;
            let (x, y) = kiln::data::load_csv(&path, &options)?;
            (x, y, path, if data.has_header { 2 } else { 1 })
        }
    };
    let features = scale_and_shape(features, data)?;
    check_fits(
        config,
        &features,
        &labels,
        &LabelOrigin::Lines {
            path: &origin_path,
            first_line,
        },
    )?;
    if data.val_fraction == 0.0 {
        return Ok(Data {
            train: (features, labels),
            val: None,
        });
    }
    let (train, val) = train_test_split(&features, &labels, data.val_fraction, config.seed)?;
    Ok(Data {
        train,
        val: Some(val),
    })
}

/// Checks that the model takes examples of `features`' shape, and that its
/// output and the loss take every one of `labels`.
pub(crate) fn check_fits(
    config: &RunConfig,
    features: &HostTensor,
    labels: &HostTensor,
    origin: &LabelOrigin<'_>,
) -> Result<()> {
    let mut input = features.dims().to_vec();
    input[0] = config.data.batch_size;
    // A torchscript layer's output shape is found by running it once.
    let model = crate::resolve_model(config, features, config.device)?;
    let output = model.output_shape(&input).with_context(|| {
        let shape = match &config.data.input_shape {
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
    let labels = labels.to_dtype(kiln::core::DType::I64);
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
    let n = features.dims().first().copied().unwrap_or(0);
    let numel = features.numel();
    let scaled: Vec<f32> = features
        .to_dtype(DType::F32)
        .as_slice::<f32>()?
        .iter()
        .map(|v| (*v as f64 / data.scale) as f32)
        .collect();
    let mut shape = vec![n];
    match &data.input_shape {
        Some(dims) => shape.extend(dims),
        None => shape.push(numel / n.max(1)),
    }
    HostTensor::new(scaled, shape)
        .context("data.input_shape does not match the number of features per example")
}

/// The loader of one split; `shard` (rank, world size) gives this rank its
/// share of every epoch, in `torch.utils.data.DistributedSampler`'s order.
pub(crate) fn loader(
    (x, y): (HostTensor, HostTensor),
    config: &RunConfig,
    shuffle: bool,
    shard: Option<(usize, usize)>,
) -> Result<Box<dyn DataLoader>> {
    let data = &config.data;
    let mut loader = kiln::data::PrefetchLoader::new(InMemoryDataset::new(x, y)?, data.batch_size)?
        .num_workers(data.workers)
        .drop_last(shuffle && data.drop_last);
    if shuffle {
        loader = loader.shuffle(config.seed);
    }
    if let Some((rank, world_size)) = shard {
        let mut sampler = kiln::data::DistributedSampler::new(world_size, rank)?;
        if shuffle {
            sampler = sampler.shuffle(config.seed);
        } else {
            // Evaluation: every sample once, the metrics added up across ranks.
            sampler = sampler.without_padding();
        }
        loader = loader.sampler(sampler);
    }
    Ok(Box::new(loader))
}

/// The validation split, which `eval` and `predict` run on.
pub(crate) fn validation_split(config: &RunConfig) -> Result<(HostTensor, HostTensor)> {
    if !config.has_validation() {
        anyhow::bail!(
            "the config has no validation split (data.val_fraction is 0); set a fraction to \
             hold out"
        );
    }
    load_data(config)?
        .val
        .context("the config's data has no validation split")
}
