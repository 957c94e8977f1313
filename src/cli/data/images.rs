//! Image data (`image_folder`, `webdataset`): opened, its classes checked
//! against the model, its transforms built; decoded by the loader's workers.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::{DataSource, ImageFolderSource, RunConfig, ShardSource};
use crate::engines::Engines;
use anyhow::{Context, Result};
use kiln_core::{loss::Loss, HostTensor};
use kiln_data::{
    split_indices, Compose, Dataset, Subset, Transform, TransformRng, TransformedDataset,
};
use kiln_vision::transforms::{BatchTransform, CutMix, MixUp, MixUpOrCutMix, TransformSpec};
use kiln_vision::{ImageFolder, WebDataset};

use super::{check_fits, Data, ImageSplit, LabelOrigin, SampleDataset, Split};

/// The train and validation transforms of image data: `transforms` and
/// `val_transforms`, or their defaults (see `DataConfig`).
fn image_transforms(config: &RunConfig) -> Result<(Vec<TransformSpec>, Vec<TransformSpec>)> {
    let data = config.data.images();
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
        .color_mode(config.data.images().color_mode.unwrap_or_default())
        .on_error(config.data.images().on_error.unwrap_or_default()))
}

/// Image data: the files are listed (folders) or indexed (shard headers),
/// nothing is decoded but one example, which checks the transforms and the model.
pub(super) fn load_images<E: Engines>(config: &RunConfig) -> Result<Data> {
    let (train_t, val_t) = image_transforms(config)?;
    let train_transform = kiln_vision::transforms::compose(&train_t).context("data.transforms")?;
    let val_transform = || kiln_vision::transforms::compose(&val_t).context("data.val_transforms");
    val_transform()?;
    check_mix_loss(config)?;
    let (mut train, val, classes, shards) = match &config.data.source {
        DataSource::ImageFolder(folder) => {
            let (train, val, classes) =
                folder_splits(config, folder, train_transform, &val_transform)?;
            (train, val, Some(classes), None)
        }
        DataSource::Webdataset(shards) => {
            let (train, val) = shard_splits::<E>(config, shards, train_transform, &val_transform)?;
            (train, val, None, shards.shards.as_deref())
        }
        other => anyhow::bail!("dataset {} is not image data", other.kind().name()),
    };
    let (x, y) = check_examples(config, &train, val.as_ref())?;
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
            path: Path::new(shards.unwrap_or_default()),
            split: "training",
        },
    };
    check_fits::<E>(config, &probe, &label, &origin)?;
    if let (Some(mix), Split::Images(split)) = (mix_transform::<E>(config, &probe)?, &mut train) {
        split.mix = Some(mix);
    }
    Ok(Data {
        train,
        val,
        probe,
        class_names: classes.map(|(_, names)| names),
    })
}

/// An image folder's path and its classes' names, in index order.
type FolderClasses = (PathBuf, Vec<String>);

/// `base` through transform `t`, seeded by the config.
fn transformed(base: SampleDataset, t: Compose, seed: u64) -> SampleDataset {
    Arc::new(TransformedDataset::new(base, t, seed))
}

/// An image folder's splits (`data.path`, and `data.val_path` or
/// `data.val_fraction`) with their transforms, and the folder's classes.
fn folder_splits(
    config: &RunConfig,
    source: &ImageFolderSource,
    train_transform: Compose,
    val_transform: &dyn Fn() -> Result<Compose>,
) -> Result<(Split, Option<Split>, FolderClasses)> {
    let data = &config.data;
    let path = source.path.as_deref().context("data.path is required")?;
    let folder = open_folder(path, config)?;
    let classes = (path.to_path_buf(), folder.classes().to_vec());
    let folder = Arc::new(folder);
    let (train_base, val_base): (SampleDataset, Option<SampleDataset>) =
        if let Some(val_path) = &source.val_path {
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
        dataset: transformed(train_base, train_transform, config.seed),
        shards: None,
        mix: None,
    });
    let val = match val_base {
        Some(v) => Some(Split::Images(ImageSplit {
            dataset: transformed(v, val_transform()?, config.seed),
            shards: None,
            mix: None,
        })),
        None => None,
    };
    Ok((train, val, classes))
}

/// WebDataset shards' splits (`data.shards`, `data.val_shards`) with their
/// transforms, their labels checked against the model's classes as they are read.
fn shard_splits<E: Engines>(
    config: &RunConfig,
    source: &ShardSource,
    train_transform: Compose,
    val_transform: &dyn Fn() -> Result<Compose>,
) -> Result<(Split, Option<Split>)> {
    let images = config.data.images();
    let member = |key: &str, value: &Option<String>| -> Result<Option<String>> {
        match value.as_deref().map(|v| v.trim().trim_start_matches('.')) {
            Some("") => anyhow::bail!(
                "data.{key} is empty: give a member's extension, such as \"cls\" or \"json\""
            ),
            other => Ok(other.map(str::to_owned)),
        }
    };
    let image_key = member("image_key", &source.image_key)?;
    let label_key = member("label_key", &source.label_key)?;
    let open = |key: &str, pattern: &str| -> Result<WebDataset> {
        let mut shards = WebDataset::from_pattern(pattern)
            .with_context(|| format!("data.{key} = {pattern:?}"))?
            .color_mode(images.color_mode.unwrap_or_default())
            .on_error(images.on_error.unwrap_or_default());
        if let Some(k) = &image_key {
            shards = shards.image_key(k);
        }
        if let Some(k) = &label_key {
            shards = shards.label_key(k);
        }
        Ok(shards)
    };
    let pattern = source
        .shards
        .as_deref()
        .context("data.shards is required")?;
    let train_shards = open("shards", pattern)?;
    let val_shards = match &source.val_shards {
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
        dataset: transformed(shards.clone(), train_transform, config.seed),
        shards: Some(shards),
        mix: None,
    });
    let val = match val_shards {
        Some(shards) => {
            let shards = checked(shards);
            Some(Split::Images(ImageSplit {
                dataset: transformed(shards.clone(), val_transform()?, config.seed),
                shards: Some(shards),
                mix: None,
            }))
        }
        None => None,
    };
    Ok((train, val))
}

/// One example through each split's transforms: they must agree, and fit the
/// model (`data.image_size`, float32). Returns the training example.
fn check_examples(
    config: &RunConfig,
    train: &Split,
    val: Option<&Split>,
) -> Result<(HostTensor, HostTensor)> {
    let data = config.data.images();
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
    let (x, y) = example(train, "training")?;
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
    if let Some(val) = val {
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
    Ok((x, y))
}

/// MixUp and CutMix need a loss that takes class probabilities.
fn check_mix_loss(config: &RunConfig) -> Result<()> {
    let data = config.data.images();
    let key = match (data.mixup_alpha, data.cutmix_alpha) {
        (None, None) => return Ok(()),
        (Some(_), _) => "data.mixup_alpha",
        (None, Some(_)) => "data.cutmix_alpha",
    };
    if !matches!(config.loss, Loss::CrossEntropy(_)) {
        anyhow::bail!(
            "{key}: MixUp and CutMix make soft targets (class probabilities), which only \
             loss = \"cross_entropy\" takes; this run's loss is {:?}",
            config.loss
        );
    }
    Ok(())
}

/// `data.mixup_alpha` and `data.cutmix_alpha` as the training batches'
/// transform (one of the two per batch when both are set, as torchvision's
/// classification recipe), over the model's classes.
fn mix_transform<E: Engines>(
    config: &RunConfig,
    probe: &HostTensor,
) -> Result<Option<Arc<dyn BatchTransform>>> {
    let data = config.data.images();
    let key = match (data.mixup_alpha, data.cutmix_alpha) {
        (None, None) => return Ok(None),
        (Some(_), _) => "data.mixup_alpha",
        (None, Some(_)) => "data.cutmix_alpha",
    };
    let model = crate::model::resolve_model::<E>(config, probe, config.device)?;
    let output = model.output_shape(probe.dims())?;
    let [_, classes] = output[..] else {
        anyhow::bail!(
            "{key}: MixUp and CutMix mix one-hot targets over the model's scores, \
             [batch, classes]; the model gives {output:?}"
        );
    };
    let mixup = data
        .mixup_alpha
        .map(|a| MixUp::new(a, classes))
        .transpose()?;
    let cutmix = data
        .cutmix_alpha
        .map(|a| CutMix::new(a, classes))
        .transpose()?;
    Ok(match (mixup, cutmix) {
        (Some(mixup), Some(cutmix)) => Some(Arc::new(MixUpOrCutMix { mixup, cutmix })),
        (Some(mixup), None) => Some(Arc::new(mixup)),
        (None, Some(cutmix)) => Some(Arc::new(cutmix)),
        (None, None) => None,
    })
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
    let Ok(model) = crate::model::resolve_model::<E>(config, &probe, config.device) else {
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
    let model = crate::model::resolve_model::<E>(config, probe, config.device)?;
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
