//! What a path given as a checkpoint is: a Kiln checkpoint, a TorchScript
//! file (a zip archive) or an ONNX model, told apart before anything is loaded.

use std::path::Path;

use anyhow::{Context, Result};
use kiln_train::Checkpoint;

#[cfg(not(feature = "text"))]
use crate::features::{Feature, FeatureMissing};

/// Reads the Kiln checkpoint at `path` to evaluate, predict with or export it,
/// after checking that it is one: a pipe, a device, a TorchScript file or an
/// ONNX model is named as what it is, and a checkpoint holding NaN or infinite
/// values is refused naming them.
pub(crate) fn open_checkpoint(path: &Path) -> Result<Checkpoint> {
    if path.is_dir() {
        return open_pretrained(path);
    }
    refuse_other_formats(path)?;
    let mut checkpoint = Checkpoint::load(path)?;
    checkpoint.check_finite(path)?;
    // Evaluation, prediction, export and generation run the plain model:
    // LoRA adapters folded into the weights they adapt.
    if let Some(lora) = &checkpoint.lora {
        checkpoint.model = lora
            .merge(&checkpoint.model)
            .map_err(|e| kiln_core::Error::checkpoint_caused_by(path, "its LoRA adapters", e))?;
        log::info!(
            "{}: LoRA adapters merged into the base weights",
            path.display()
        );
    }
    Ok(checkpoint)
}

/// Without the `text` feature a directory is refused as needing it.
#[cfg(not(feature = "text"))]
fn open_pretrained(path: &Path) -> Result<Checkpoint> {
    let what = format!("the model directory {}", path.display());
    Err(FeatureMissing::new(Feature::Text, what).into())
}

/// A Hugging Face model directory (`config.json` and its safetensors) as the
/// weights of a checkpoint: what `kiln eval` and `kiln predict` run under the
/// config's model (`[model] pretrained` naming this directory, so that its
/// head is the checkpoint's own), with no training position.
#[cfg(feature = "text")]
fn open_pretrained(path: &Path) -> Result<Checkpoint> {
    if !path.join(kiln_hf::CONFIG).is_file() {
        anyhow::bail!(
            "{} is a directory without {}, so neither a Kiln checkpoint nor a Hugging Face \
             model directory: give a run's `checkpoints/last.safetensors`, or a directory \
             holding config.json and model.safetensors",
            path.display(),
            kiln_hf::CONFIG
        );
    }
    let pretrained = kiln_hf::Pretrained::open(path)?;
    let model = pretrained.load_weights()?;
    log::info!(
        "{}: the {} model's weights, as transformers saved them",
        path.display(),
        pretrained.family()
    );
    // The config's definition decides; the weights must fit it by name and shape.
    Ok(Checkpoint::of_weights(model, "huggingface"))
}

/// Checks that `path` is a regular file that may be a Kiln checkpoint (or a
/// run's `model.safetensors`): not a pipe or device (which would block or read
/// forever), a TorchScript file or an ONNX model.
pub(crate) fn refuse_other_formats(path: &Path) -> Result<()> {
    kiln_core::fs::check_regular_file(path)?;
    if is_zip_archive(path)? {
        anyhow::bail!(
            "{} is a TorchScript file (a zip archive), not a Kiln checkpoint: give the \
             safetensors checkpoint of a Kiln run (`checkpoints/last.safetensors`), or use the \
             TorchScript file as a `torchscript` layer in a config",
            path.display()
        );
    }
    if is_onnx(path) {
        anyhow::bail!(
            "{} is an ONNX model, not a Kiln checkpoint: `kiln predict` runs ONNX models; \
             `kiln eval` and `kiln export` read the safetensors checkpoint of a Kiln run \
             (`checkpoints/last.safetensors`)",
            path.display()
        );
    }
    Ok(())
}

pub(crate) fn is_onnx(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("onnx"))
}

/// Whether `path` starts as a zip archive does (`PK\x03\x04`): how TorchScript
/// files (`torch.jit.save`) are stored, unlike safetensors files.
pub(crate) fn is_zip_archive(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut magic = [0u8; 4];
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    Ok(file.read(&mut magic)? == 4 && magic == *b"PK\x03\x04")
}

/// Whether `path` names a run's config (a `.toml` file) rather than a model file.
pub(crate) fn is_config(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("toml"))
}
