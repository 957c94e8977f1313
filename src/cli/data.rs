//! The configured data set: read, checked against the model and the loss, split.
//!
//! Tabular data (digits, MNIST, CSV) is read whole into memory; images
//! (`image_folder`, `webdataset`) stay on disk and are decoded and transformed
//! by the loader's workers, batch by batch.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::config::{ColorModeName, DatasetKind, OnErrorName, RunConfig};
use crate::engines::Engines;
use crate::prelude::*;
use anyhow::{Context, Result};
use kiln_core::{loss::Loss, HostTensor};
use kiln_data::vision::TransformSpec;
use kiln_data::{
    load_digits, split_indices, train_test_split, Batch, ColorMode, Compose, DataLoader, Dataset,
    ImageFolder, InMemoryDataset, OnError, PrefetchLoader, Subset, Transform, TransformRng,
    TransformedDataset, WebDataset,
};

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
pub(crate) type SampleDataset = Arc<dyn Dataset<Item = (HostTensor, HostTensor)>>;

/// One split of the configured data.
pub(crate) enum Split {
    /// Examples held in memory: features and labels.
    Tensors(HostTensor, HostTensor),
    /// Image files, decoded and transformed by the loader's workers.
    Images(ImageSplit),
}

/// A split of image files.
pub(crate) struct ImageSplit {
    /// The transformed samples.
    dataset: SampleDataset,
    /// A webdataset's shards, which order each epoch (shards shuffled, then a
    /// shuffle buffer, then a block per rank) instead of the loader's shuffle.
    shards: Option<Arc<WebDataset>>,
}

impl Split {
    /// Number of examples.
    pub(crate) fn len(&self) -> usize {
        match self {
            Split::Tensors(_, y) => y.dims().first().copied().unwrap_or(0),
            Split::Images(s) => s.dataset.len(),
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
    if data.dataset.is_images() {
        return load_images::<E>(config);
    }
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
            });
        }
        DatasetKind::Csv => {
            let options = kiln_data::CsvOptions {
                has_header: data.has_header,
                label_column: match &data.label_column {
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
            (x, y, path, if data.has_header { 2 } else { 1 })
        }
        DatasetKind::ImageFolder | DatasetKind::Webdataset => {
            anyhow::bail!("image data is read by load_images")
        }
    };
    let features = scale_and_shape(features, data)?;
    check_fits::<E>(
        config,
        &features,
        &labels,
        &LabelOrigin::Lines {
            path: &origin_path,
            first_line,
        },
    )?;
    let probe = first_example(&features)?;
    if data.val_fraction() == 0.0 {
        return Ok(Data {
            train: Split::Tensors(features, labels),
            val: None,
            probe,
        });
    }
    let ((x, y), (vx, vy)) =
        train_test_split(&features, &labels, data.val_fraction(), config.seed)?;
    Ok(Data {
        train: Split::Tensors(x, y),
        val: Some(Split::Tensors(vx, vy)),
        probe,
    })
}

/// Example 0 of `features`, as a batch of one.
fn first_example(features: &HostTensor) -> Result<HostTensor> {
    if features.dims().first().is_none_or(|&n| n == 0) {
        anyhow::bail!("the data set has no examples");
    }
    Ok(features.select_rows(&[0])?)
}

/// The train and validation transforms of image data: `transforms` and
/// `val_transforms`, or their defaults (see `DataConfig`).
fn image_transforms(config: &RunConfig) -> Result<(Vec<TransformSpec>, Vec<TransformSpec>)> {
    let data = &config.data;
    let spec = |value: serde_json::Value| -> Result<TransformSpec> {
        serde_json::from_value(value).context("a default transform")
    };
    // Resize (shorter side) and centre-crop to `size`: what evaluation does.
    let fit = |size: serde_json::Value| -> Result<Vec<TransformSpec>> {
        let shorter = match &size {
            serde_json::Value::Array(hw) => hw
                .iter()
                .filter_map(serde_json::Value::as_u64)
                .min()
                .unwrap_or(0),
            other => other.as_u64().unwrap_or(0),
        };
        Ok(vec![
            spec(serde_json::json!({ "type": "resize", "size": shorter }))?,
            spec(serde_json::json!({ "type": "center_crop", "size": size }))?,
        ])
    };
    let image_size = data.image_size.map(|s| match s {
        crate::config::ImageSize::Square(n) => serde_json::json!(n),
        crate::config::ImageSize::Rect(hw) => serde_json::json!(hw),
    });
    let train = match &data.transforms {
        Some(t) => t.clone(),
        None => {
            let size = image_size.clone().context("data.image_size is required")?;
            let mut t = fit(size)?;
            t.push(spec(serde_json::json!({ "type": "to_tensor" }))?);
            t
        }
    };
    let val = match &data.val_transforms {
        Some(t) => t.clone(),
        None => {
            // The size the training transforms crop to, when image_size is not set.
            let size = match image_size {
                Some(size) => size,
                None => {
                    let mut found = None;
                    for t in &train {
                        let value = serde_json::to_value(t)?;
                        if matches!(
                            value.get("type").and_then(|v| v.as_str()),
                            Some("random_resized_crop" | "center_crop")
                        ) {
                            found = value.get("size").cloned();
                        }
                    }
                    found.context(
                        "data.val_transforms: set them, or data.image_size (validation \
                         images are resized and centre-cropped to it)",
                    )?
                }
            };
            let mut t = fit(size)?;
            for step in &train {
                if matches!(step.name(), "to_tensor" | "normalize") {
                    t.push(step.clone());
                }
            }
            t
        }
    };
    Ok((train, val))
}

/// The image folder (or list file) at `path`.
fn open_folder(path: &Path, config: &RunConfig) -> Result<ImageFolder> {
    let folder = if path.is_file() {
        ImageFolder::from_list(path)
    } else {
        ImageFolder::new(path)
    }
    .with_context(|| format!("data set {}", path.display()))?;
    Ok(folder
        .color_mode(color_mode(config))
        .on_error(on_error(config)))
}

fn on_error(config: &RunConfig) -> OnError {
    match config.data.on_error.unwrap_or_default() {
        OnErrorName::Fail => OnError::Fail,
        OnErrorName::Skip => OnError::Skip,
    }
}

fn color_mode(config: &RunConfig) -> ColorMode {
    match config.data.color_mode.unwrap_or_default() {
        ColorModeName::Rgb => ColorMode::Rgb,
        ColorModeName::Gray => ColorMode::Gray,
        ColorModeName::Rgba => ColorMode::Rgba,
    }
}

/// Image data: the files are listed (folders) or indexed (shard headers),
/// nothing is decoded but one example, which checks the transforms and the model.
fn load_images<E: Engines>(config: &RunConfig) -> Result<Data> {
    let data = &config.data;
    let (train_t, val_t) = image_transforms(config)?;
    let train_transform = kiln_data::vision::compose(&train_t).context("data.transforms")?;
    let val_transform = || kiln_data::vision::compose(&val_t).context("data.val_transforms");
    val_transform()?;
    let transformed = |base: SampleDataset, t: Compose| -> SampleDataset {
        Arc::new(TransformedDataset::new(base, t, config.seed))
    };
    let mut classes = None;
    let (train, val) = match data.dataset {
        DatasetKind::ImageFolder => {
            let path = data.path.as_deref().context("data.path is required")?;
            let folder = open_folder(path, config)?;
            classes = Some((path.to_path_buf(), folder.classes().to_vec()));
            let folder = Arc::new(folder);
            let (train_base, val_base): (SampleDataset, Option<SampleDataset>) =
                if let Some(val_path) = &data.val_path {
                    let val = open_folder(val_path, config)?;
                    if val.classes() != folder.classes() {
                        anyhow::bail!(
                            "data.val_path {} has the classes {:?}, data.path {} has {:?}; \
                             both need the same class folders (a class's index is its place \
                             in the sorted names)",
                            val_path.display(),
                            val.classes(),
                            path.display(),
                            folder.classes()
                        );
                    }
                    (folder, Some(Arc::new(val)))
                } else if data.val_fraction() > 0.0 {
                    let (tr, te) = split_indices(folder.len(), data.val_fraction(), config.seed)
                        .context("data.val_fraction")?;
                    (
                        Arc::new(Subset::new(folder.clone(), tr)?),
                        Some(Arc::new(Subset::new(folder, te)?)),
                    )
                } else {
                    (folder, None)
                };
            let train = Split::Images(ImageSplit {
                dataset: transformed(train_base, train_transform),
                shards: None,
            });
            let val = match val_base {
                Some(v) => Some(Split::Images(ImageSplit {
                    dataset: transformed(v, val_transform()?),
                    shards: None,
                })),
                None => None,
            };
            (train, val)
        }
        DatasetKind::Webdataset => {
            let open = |key: &str, pattern: &str| -> Result<WebDataset> {
                Ok(WebDataset::from_pattern(pattern)
                    .with_context(|| format!("data.{key} = {pattern:?}"))?
                    .color_mode(color_mode(config))
                    .on_error(on_error(config)))
            };
            let pattern = data.shards.as_deref().context("data.shards is required")?;
            let train_shards = open("shards", pattern)?;
            let val_shards = match &data.val_shards {
                Some(pattern) => Some(open("val_shards", pattern)?),
                None => None,
            };
            // Labels are read batch by batch: each is checked against the
            // model's classes as it is read, naming its shard and member.
            let classes = shard_classes::<E>(config, &train_shards, &train_transform)?;
            let checked = |shards: WebDataset| {
                Arc::new(match classes {
                    Some((n, ignore_index)) => shards.num_classes(n, ignore_index),
                    None => shards,
                })
            };
            let shards = checked(train_shards);
            let train = Split::Images(ImageSplit {
                dataset: transformed(shards.clone(), train_transform),
                shards: Some(shards),
            });
            let val = match val_shards {
                Some(shards) => {
                    let shards = checked(shards);
                    Some(Split::Images(ImageSplit {
                        dataset: transformed(shards.clone(), val_transform()?),
                        shards: Some(shards),
                    }))
                }
                None => None,
            };
            (train, val)
        }
        other => anyhow::bail!("dataset {} is not image data", other.name()),
    };
    // One example through each split's transforms: they must agree, and fit the model.
    let example = |split: &Split, which: &str| -> Result<(HostTensor, HostTensor)> {
        let Split::Images(s) = split else {
            anyhow::bail!("not image data")
        };
        if s.dataset.is_empty() {
            anyhow::bail!("the {which} split has no images");
        }
        s.dataset
            .get_for_epoch(0, 0)
            .with_context(|| format!("the first {which} image"))
    };
    let (x, y) = example(&train, "training")?;
    if let Some(size) = data.image_size {
        let (h, w) = size.dims();
        let dims = x.dims();
        if dims.len() != 3 || dims[1] != h || dims[2] != w {
            anyhow::bail!(
                "data.transforms give images of shape {dims:?}, data.image_size is {:?}: \
                 end them with a crop to that size (random_resized_crop, center_crop) and \
                 to_tensor",
                size
            );
        }
    }
    if let Some(val) = &val {
        let (vx, _) = example(val, "validation")?;
        if vx.dims() != x.dims() || vx.dtype() != x.dtype() {
            anyhow::bail!(
                "the training transforms give {} {:?}, the validation transforms {} {:?}; \
                 the model takes one shape: make data.val_transforms crop to the same size",
                x.dtype(),
                x.dims(),
                vx.dtype(),
                vx.dims()
            );
        }
    }
    if x.dtype() != kiln_core::DType::F32 {
        anyhow::bail!(
            "data.transforms give {} images; the model takes float32: add \
             {{ type = \"to_tensor\" }} (scales to [0, 1]) to the transforms",
            x.dtype()
        );
    }
    let batch_dims: Vec<usize> = std::iter::once(1).chain(x.dims().iter().copied()).collect();
    let probe = x.reshape(batch_dims)?;
    let label = y.to_dtype(kiln_core::DType::I64).reshape([1])?;
    let origin = match &classes {
        Some((path, names)) => {
            check_classes::<E>(config, &probe, names.len(), path)?;
            LabelOrigin::Lines {
                path,
                first_line: 1,
            }
        }
        None => LabelOrigin::Records {
            path: Path::new(data.shards.as_deref().unwrap_or_default()),
            split: "training",
        },
    };
    check_fits::<E>(config, &probe, &label, &origin)?;
    Ok(Data { train, val, probe })
}

/// The classes a shard label must be one of, with the loss's ignored label:
/// the model's scores per image for the first training image, when the loss
/// takes class indices. `None` when that cannot be told here; the checks on
/// the first image then say what is wrong.
fn shard_classes<E: Engines>(
    config: &RunConfig,
    shards: &WebDataset,
    transform: &Compose,
) -> Result<Option<(usize, Option<i64>)>> {
    let ignore_index = match &config.loss {
        Loss::CrossEntropy(c) => c.ignore_index,
        Loss::Nll(c) => c.ignore_index,
        _ => return Ok(None),
    };
    if shards.is_empty() {
        return Ok(None);
    }
    let Ok((image, _)) = shards.get(0) else {
        return Ok(None);
    };
    let mut rng = TransformRng::for_sample(config.seed, 0, 0);
    let Ok(x) = transform.apply(image, &mut rng) else {
        return Ok(None);
    };
    let dims: Vec<usize> = std::iter::once(1).chain(x.dims().iter().copied()).collect();
    let probe = x.reshape(dims)?;
    let Ok(model) = crate::cli::resolve_model::<E>(config, &probe, config.device) else {
        return Ok(None);
    };
    Ok(model
        .output_shape(probe.dims())
        .ok()
        .and_then(|output| output.get(1).copied())
        .map(|classes| (classes, ignore_index)))
}

/// Checks that the model scores as many classes as an image folder has.
fn check_classes<E: Engines>(
    config: &RunConfig,
    probe: &HostTensor,
    classes: usize,
    path: &Path,
) -> Result<()> {
    let model = crate::cli::resolve_model::<E>(config, probe, config.device)?;
    let output = model.output_shape(probe.dims())?;
    if matches!(config.loss, Loss::CrossEntropy(_) | Loss::Nll(_))
        && output.get(1).is_some_and(|&n| n < classes)
    {
        anyhow::bail!(
            "{} has {classes} classes, the model's last layer gives {} scores per image; \
             make its output size {classes}",
            path.display(),
            output[1]
        );
    }
    Ok(())
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
    input[0] = config.data.batch_size;
    // A torchscript layer's output shape is found by running it once.
    let model = crate::cli::resolve_model::<E>(config, features, config.device)?;
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
/// share of every epoch, in `torch.utils.data.DistributedSampler`'s order (a
/// webdataset: a block of the epoch's shard stream per rank).
pub(crate) fn loader(
    split: Split,
    config: &RunConfig,
    shuffle: bool,
    shard: Option<(usize, usize)>,
) -> Result<Box<dyn DataLoader>> {
    let data = &config.data;
    let sampler = |shuffle: bool| -> Result<Option<kiln_data::DistributedSampler>> {
        let Some((rank, world_size)) = shard else {
            return Ok(None);
        };
        let sampler = kiln_data::DistributedSampler::new(world_size, rank)?;
        // Training: the order of one process (`kiln train`), dealt out to the
        // ranks. With `drop_last` the sampler drops the uneven tail too rather
        // than padding it with samples from the start of the order, so the
        // ranks' k-th batches together are one process's k-th batch of
        // `world_size` times the size. Evaluation: every sample once, the
        // metrics added up across ranks.
        Ok(Some(if shuffle {
            sampler.shuffle(config.seed).drop_last(data.drop_last)
        } else {
            sampler.without_padding()
        }))
    };
    match split {
        Split::Tensors(x, y) => {
            let mut loader = PrefetchLoader::new(InMemoryDataset::new(x, y)?, data.batch_size)?
                .num_workers(data.workers)
                .drop_last(shuffle && data.drop_last);
            if shuffle {
                loader = loader.shuffle(config.seed);
            }
            if let Some(sampler) = sampler(shuffle)? {
                loader = loader.sampler(sampler);
            }
            Ok(Box::new(loader))
        }
        Split::Images(split) => {
            let mut loader = PrefetchLoader::new(split.dataset, data.batch_size)?
                .num_workers(data.workers)
                .drop_last(shuffle && data.drop_last)
                .skip_failed_samples(config.data.on_error == Some(OnErrorName::Skip));
            match &split.shards {
                // Training on shards: each epoch the shards are shuffled, the
                // stream goes through the shuffle buffer, and each rank takes a block.
                // (Validation reads the shards in order, as a folder is read.)
                Some(shards) if shuffle => {
                    let (rank, world_size) = shard.unwrap_or((0, 1));
                    let buffer = data.shuffle_buffer.unwrap_or(DEFAULT_SHUFFLE_BUFFER);
                    loader =
                        loader.order(shards.epoch_order(config.seed, buffer, rank, world_size)?);
                }
                _ => {
                    if shuffle {
                        loader = loader.shuffle(config.seed);
                    }
                    if let Some(sampler) = sampler(shuffle)? {
                        loader = loader.sampler(sampler);
                    }
                }
            }
            Ok(Box::new(loader))
        }
    }
}

/// `data.shuffle_buffer` when not set: webdataset's common choice.
pub(crate) const DEFAULT_SHUFFLE_BUFFER: usize = 1000;

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

/// A loader that keeps the targets of the batches it gives, in order: the
/// labels `predict` writes beside each prediction.
pub(crate) struct RecordTargets {
    inner: Box<dyn DataLoader>,
    targets: Mutex<Vec<i64>>,
}

impl RecordTargets {
    pub(crate) fn new(inner: Box<dyn DataLoader>) -> Self {
        RecordTargets {
            inner,
            targets: Mutex::new(Vec::new()),
        }
    }

    /// The targets seen so far, as class indices (-1 where a target is not one).
    pub(crate) fn targets(&self) -> Vec<i64> {
        self.targets.lock().map(|t| t.clone()).unwrap_or_default()
    }
}

impl DataLoader for RecordTargets {
    fn num_batches(&self) -> usize {
        self.inner.num_batches()
    }

    fn skipped_samples(&self) -> u64 {
        self.inner.skipped_samples()
    }

    fn batches(
        &self,
        epoch: u64,
    ) -> Box<dyn Iterator<Item = kiln_core::Result<Batch>> + Send + '_> {
        let targets = &self.targets;
        Box::new(self.inner.batches(epoch).inspect(move |batch| {
            if let (Ok(batch), Ok(mut targets)) = (batch, targets.lock()) {
                let n = batch.targets.dims().first().copied().unwrap_or(0);
                let classes = batch.targets.to_dtype(kiln_core::DType::I64);
                match classes.as_slice::<i64>() {
                    Ok(values) if values.len() == n && !batch.targets.dtype().is_float() => {
                        targets.extend_from_slice(values)
                    }
                    _ => targets.extend(std::iter::repeat_n(-1, n)),
                }
            }
        }))
    }
}
