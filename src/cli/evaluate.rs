//! `kiln eval` and `kiln predict`: a checkpoint (or an ONNX model) over the
//! config's validation split, as metrics or as a CSV of predictions.

use std::io::Write;
use std::path::Path;

use crate::prelude::*;
use anyhow::{Context, Result};

use crate::args::{CheckpointArgs, PredictArgs};
use crate::config::RunConfig;
use crate::data::{loader, validation_split, RecordTargets};
use crate::engines::{run_on, BackendJob, Engines, StrategyEngine};
#[cfg(not(feature = "onnx"))]
use crate::features::{Feature, FeatureMissing};
use crate::formats::{is_onnx, open_checkpoint};
use crate::model::{load_for_eval, resolve_model};
use crate::output::{check_output, outln};

/// The config's model with the checkpoint's weights, in eval mode. The config
/// is the source of truth: a checkpoint that records another definition is
/// refused before the model is built, and one holding a tensor of another
/// name, shape or dtype before any weight is loaded.
fn restore<E: Engines, B: TrainBackend>(
    checkpoint: &Checkpoint,
    path: &Path,
    config: &RunConfig,
    device: Device,
    inputs: &HostTensor,
) -> Result<B::Model> {
    let definition = resolve_model::<E>(config, inputs, device)?;
    checkpoint.check_definition(&definition, path)?;
    let mut model = B::build_model(&definition, device)?;
    B::set_precision(&mut model, config.training.precision)?;
    load_for_eval::<B>(
        &mut model,
        &checkpoint.model,
        path,
        "does not fit the config's model",
    )?;
    Ok(model)
}

pub(crate) fn eval<E: Engines>(args: CheckpointArgs) -> Result<()> {
    let config = RunConfig::load(&args.config)?;
    run_on::<E, _>(config.backend, Eval { args, config })
}

/// `kiln eval`'s work on one backend.
struct Eval {
    args: CheckpointArgs,
    config: RunConfig,
}

impl BackendJob for Eval {
    fn on_tensorflow(&self) -> &'static str {
        "evaluating on the TensorFlow backend"
    }

    fn run<E: Engines, B: TrainBackend, P: StrategyEngine<B>>(self) -> Result<()> {
        eval_on::<E, B>(&self.args, &self.config)
    }
}

/// `kiln eval` on backend `B`.
fn eval_on<E: Engines, B: TrainBackend>(args: &CheckpointArgs, config: &RunConfig) -> Result<()> {
    let device = args.device.unwrap_or(config.device);
    let checkpoint = open_checkpoint(&args.checkpoint)?;
    let (split, probe) = validation_split::<E>(config)?;
    let mut model = restore::<E, B>(&checkpoint, &args.checkpoint, config, device, &probe)?;
    let val = loader(split, config, false, None)?;
    let mut training = config.training.clone();
    training.device = device;
    let mut trainer = Trainer::<B>::new(training, config.loss.clone())?;
    for name in &config.logging.metrics {
        trainer = trainer.with_metric(
            kiln_train::metric_by_name(name).with_context(|| format!("unknown metric {name}"))?,
        );
    }
    let metrics = trainer.evaluate(&mut model, val.as_ref())?;
    outln!("{:<16} {:>12}", "metric", "value");
    for (name, value) in metrics {
        outln!("{name:<16} {value:>12.6}");
    }
    Ok(())
}

pub(crate) fn predict<E: Engines>(args: PredictArgs) -> Result<()> {
    let config = RunConfig::load(&args.common.config)?;
    if is_onnx(&args.common.checkpoint) {
        return predict_onnx::<E>(&args, &config);
    }
    run_on::<E, _>(config.backend, Predict { args, config })
}

/// `kiln predict`'s work on one backend (a checkpoint, not an ONNX model).
struct Predict {
    args: PredictArgs,
    config: RunConfig,
}

impl BackendJob for Predict {
    fn on_tensorflow(&self) -> &'static str {
        "predicting on the TensorFlow backend"
    }

    fn run<E: Engines, B: TrainBackend, P: StrategyEngine<B>>(self) -> Result<()> {
        predict_on::<E, B>(&self.args, &self.config)
    }
}

/// `kiln predict` on backend `B`.
fn predict_on<E: Engines, B: TrainBackend>(args: &PredictArgs, config: &RunConfig) -> Result<()> {
    let common = &args.common;
    let device = common.device.unwrap_or(config.device);
    check_output(&args.output, args.overwrite, "predict")?;
    let checkpoint = open_checkpoint(&common.checkpoint)?;
    let (split, probe) = validation_split::<E>(config)?;
    let mut model = restore::<E, B>(&checkpoint, &common.checkpoint, config, device, &probe)?;
    let val = RecordTargets::new(loader(split, config, false, None)?);
    let mut training = config.training.clone();
    training.device = device;
    let outputs = Trainer::<B>::new(training, config.loss.clone())?.predict(&mut model, &val)?;
    write_predictions(&args.output, &val.targets(), outputs)
}

/// Without the `onnx` feature an ONNX model is refused as needing it (the
/// signature of the ONNX build's, engines and all).
#[cfg(not(feature = "onnx"))]
#[allow(clippy::extra_unused_type_parameters)]
fn predict_onnx<E: Engines>(args: &PredictArgs, _: &RunConfig) -> Result<()> {
    let what = format!("the ONNX model {}", args.common.checkpoint.display());
    Err(FeatureMissing::new(Feature::Onnx, what).into())
}

/// `kiln predict` with an ONNX model: ONNX Runtime over the config's
/// validation split, in batches of `data.batch_size`.
#[cfg(feature = "onnx")]
fn predict_onnx<E: Engines>(args: &PredictArgs, config: &RunConfig) -> Result<()> {
    if args.common.device.is_some_and(|d| d != Device::Cpu) {
        anyhow::bail!("--device: ONNX models run on the CPU (ONNX Runtime's CPU provider)");
    }
    check_output(&args.output, args.overwrite, "predict")?;
    let path = &args.common.checkpoint;
    kiln_core::fs::check_regular_file(path)?;
    let model = kiln_onnx::OnnxModel::load(path)?;
    let (split, _) = validation_split::<E>(config)?;
    let val = RecordTargets::new(loader(split, config, false, None)?);
    let mut outputs = Vec::new();
    for batch in val.batches(0) {
        outputs.push(
            model
                .predict(&batch?.inputs)
                .with_context(|| format!("running {}", path.display()))?,
        );
    }
    write_predictions(&args.output, &val.targets(), outputs)
}

/// Writes one CSV row per sample: index, predicted class, label, scores.
fn write_predictions(output: &Path, labels: &[i64], outputs: Vec<HostTensor>) -> Result<()> {
    // Written beside the output and renamed over it: a file the output replaces
    // is replaced whole, never written through (a link to a checkpoint stays intact).
    let (tmp, file) = kiln_core::fs::create_temporary_beside(output)
        .with_context(|| format!("writing {}", output.display()))?;
    let mut file = std::io::BufWriter::new(file);
    let mut index = 0usize;
    for batch in outputs {
        let classes = batch.dims().get(1).copied().unwrap_or(1);
        if index == 0 {
            let scores: Vec<String> = (0..classes).map(|c| format!("score_{c}")).collect();
            writeln!(file, "index,predicted,label,{}", scores.join(","))?;
        }
        for row in batch.to_f64_vec().chunks(classes) {
            let predicted = row
                .iter()
                .enumerate()
                .fold((0, f64::NEG_INFINITY), |best, (i, v)| {
                    if *v > best.1 {
                        (i, *v)
                    } else {
                        best
                    }
                })
                .0;
            let scores: Vec<String> = row.iter().map(|v| format!("{v}")).collect();
            let label = labels.get(index).copied().unwrap_or(-1);
            writeln!(file, "{index},{predicted},{label},{}", scores.join(","))?;
            index += 1;
        }
    }
    file.into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.sync_all())
        .and_then(|()| std::fs::rename(&tmp, output))
        .with_context(|| format!("writing {}", output.display()))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })?;
    outln!("kiln: {index} predictions written to {}", output.display());
    Ok(())
}
