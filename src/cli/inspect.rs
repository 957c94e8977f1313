//! `kiln inspect`: what a checkpoint, a TorchScript file, an ONNX model or a
//! SavedModel holds.

use std::path::Path;

use crate::prelude::*;
use anyhow::{Context, Result};
use kiln_train::Checkpoint;

use crate::config::RunConfig;
use crate::engines::{run_on, BackendJob, Engines, StrategyEngine};
use crate::formats::{is_config, is_zip_archive};
use crate::output::{out, outln};
use crate::run::prepare::{check_backend_supports, prepare};

/// A TorchScript file's parameters and buffers, as libtorch loads them.
pub(crate) fn inspect_torchscript(path: &Path) -> Result<()> {
    let module = kiln_torch::ScriptModule::load(path, Device::Cpu).with_context(|| {
        format!(
            "{} is a zip archive, as TorchScript files are, but libtorch cannot load it",
            path.display()
        )
    })?;
    outln!("torchscript {}", path.display());
    outln!();
    outln!(
        "{:<40} {:<8} {:<16} {:>10}",
        "tensor",
        "dtype",
        "shape",
        "elements"
    );
    let mut values = 0usize;
    let (mut params, mut buffers) = (0usize, 0usize);
    for (kind, named) in [
        ("parameter", module.named_parameters()?),
        ("buffer", module.named_buffers()?),
    ] {
        for (name, tensor) in named {
            let t = kiln_torch::from_tch(&tensor)?;
            values += t.numel();
            if kind == "parameter" {
                params += 1;
            } else {
                buffers += 1;
            }
            outln!(
                "{:<40} {:<8} {:<16} {:>10}",
                name,
                t.dtype().to_string(),
                t.shape().to_string(),
                t.numel()
            );
        }
    }
    outln!("\n{params} parameter tensors and {buffers} buffers, {values} values");
    Ok(())
}

pub(crate) fn inspect<E: Engines>(path: &Path, depth: Option<i64>) -> Result<()> {
    if is_config(path) {
        kiln_core::fs::check_regular_file(path)?;
        return summarize::<E>(path, depth.unwrap_or(-1));
    }
    if depth.is_some() {
        anyhow::bail!(
            "--depth applies to a config's model summary; {} is not a .toml config",
            path.display()
        );
    }
    if path.is_dir() {
        out!("{}", E::describe_saved_model(path)?);
        return Ok(());
    }
    kiln_core::fs::check_regular_file(path)?;
    if is_zip_archive(path)? {
        return inspect_torchscript(path);
    }
    if crate::formats::is_onnx(path) {
        #[cfg(feature = "onnx")]
        out!("{}", kiln_onnx::ModelInfo::read(path)?);
        #[cfg(not(feature = "onnx"))]
        crate::features::require(crate::features::Feature::Onnx, "inspecting an ONNX model")?;
        return Ok(());
    }
    let checkpoint = Checkpoint::load(path)?;
    outln!("checkpoint  {}", path.display());
    outln!("backend     {}", checkpoint.backend);
    outln!(
        "position    step {}, epoch {}, batch {} of the epoch",
        checkpoint.step,
        checkpoint.epoch,
        checkpoint.batch_in_epoch
    );
    outln!("seed        {}", checkpoint.seed);
    outln!(
        "data order  {}",
        checkpoint
            .data_order
            .as_deref()
            .unwrap_or("not recorded (an older Kiln, which shuffled otherwise)")
    );
    if let Some(def) = &checkpoint.model_definition {
        outln!("model       {}", serde_json::to_string(def)?);
    }
    if let Some(lora) = &checkpoint.lora {
        outln!(
            "lora        r = {}, alpha = {}, dropout = {} on {}",
            lora.r,
            lora.alpha,
            lora.dropout,
            lora.target_modules.join(", ")
        );
    }
    if let Some(s) = &checkpoint.scheduler {
        outln!("schedule    {s}");
    }
    if let Some(averaged) = &checkpoint.averaged {
        outln!(
            "averaged    {} of {} updates, {} tensors (`averaged.*`; the run's \
             model.safetensors holds them when it ends)",
            averaged.method.name().to_uppercase(),
            averaged.updates,
            averaged.tensors.len()
        );
    }
    for (k, v) in &checkpoint.metrics {
        outln!("metric      {k} = {v}");
    }
    outln!();
    outln!(
        "{:<40} {:<8} {:<16} {:>10}",
        "tensor",
        "dtype",
        "shape",
        "elements"
    );
    let mut params = 0usize;
    let averaged = checkpoint.averaged.as_ref().map(|a| &a.tensors);
    for (section, dict) in [
        ("model", Some(&checkpoint.model)),
        ("optimizer", Some(&checkpoint.optimizer)),
        ("averaged", averaged),
    ] {
        let Some(dict) = dict else { continue };
        for (name, t) in dict.iter() {
            if section == "model" {
                params += t.numel();
            }
            outln!(
                "{:<40} {:<8} {:<16} {:>10}",
                format!("{section}.{name}"),
                t.dtype().to_string(),
                t.shape().to_string(),
                t.numel()
            );
        }
    }
    match &checkpoint.averaged {
        Some(a) => outln!(
            "\n{} model values, {} optimizer tensors, {} averaged tensors",
            params,
            checkpoint.optimizer.len(),
            a.tensors.len()
        ),
        None => outln!(
            "\n{} model values, {} optimizer tensors",
            params,
            checkpoint.optimizer.len()
        ),
    }
    let non_finite = checkpoint.non_finite_tensors();
    if !non_finite.is_empty() {
        outln!();
        outln!(
            "non-finite values in {} tensors (eval, predict, export and resume refuse this \
             checkpoint):",
            non_finite.len()
        );
        for tensor in &non_finite {
            outln!("  {tensor}");
        }
    }
    Ok(())
}

/// `kiln inspect CONFIG`: the summary of the model the config trains, on its
/// backend and data (pretrained weights, LoRA and freezing applied), down to
/// `depth` (`-1`: every layer); nothing is written.
fn summarize<E: Engines>(path: &Path, depth: i64) -> Result<()> {
    let config = RunConfig::load(path)?;
    run_on::<E, _>(config.backend, Summary { config, depth })
}

/// `kiln inspect CONFIG`'s work on the config's backend.
struct Summary {
    config: RunConfig,
    /// The depth a summary table lists down to: all for a negative one.
    depth: i64,
}

impl BackendJob for Summary {
    fn on_tensorflow(&self) -> &'static str {
        "summarising a model on the TensorFlow backend"
    }

    fn run<E: Engines, B: TrainBackend, P: StrategyEngine<B>>(self) -> Result<()> {
        let config = &self.config;
        check_backend_supports::<B>(config)?;
        let (prepared, _) = prepare::<E, B>(config, None, true)?;
        let summary = prepared.summary?;
        outln!(
            "{} on {}: the model of {}, for one sample of the training data",
            B::NAME,
            config.device,
            config.output_dir.display()
        );
        outln!("{}", summary.table(usize::try_from(self.depth).ok()));
        Ok(())
    }
}
