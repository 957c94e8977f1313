//! `kiln export`: a trained model as ONNX, TorchScript or a SavedModel.
//!
//! The model's definition comes from the config (`--config`, checked against
//! the one the checkpoint records) or from the checkpoint itself; the weights
//! from the checkpoint, or from a run's `model.safetensors` with `--config`.
//! The shape of one input comes from `--input-shape`, else from the config's
//! data, else from the model's first layer when that fixes it (a Linear layer).

use std::path::{Path, PathBuf};

use crate::prelude::*;
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kiln_core::backend::TrainBackend;
use kiln_core::export::ExportOptions;
use kiln_core::module::Module;

use crate::cli::outln;
use crate::config::RunConfig;
use crate::data::validation_split;
use crate::engines::Engines;

/// The formats `kiln export` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum ExportFormat {
    /// An ONNX model of standard operators (IR 10, opset 21), for ONNX Runtime.
    Onnx,
    /// A TorchScript file, for `torch.jit.load`, libtorch and TorchServe.
    Torchscript,
    /// A TensorFlow SavedModel directory with a `serving_default` signature.
    Savedmodel,
}

impl From<ExportFormat> for kiln_core::export::ExportFormat {
    fn from(format: ExportFormat) -> Self {
        match format {
            ExportFormat::Onnx => Self::Onnx,
            ExportFormat::Torchscript => Self::TorchScript,
            ExportFormat::Savedmodel => Self::SavedModel,
        }
    }
}

#[derive(Args)]
pub(crate) struct ExportArgs {
    /// A Kiln checkpoint (`checkpoints/last.safetensors`), or a run's
    /// `model.safetensors` together with --config.
    #[arg(long)]
    checkpoint: PathBuf,
    /// The run config: its model is the definition exported (the checkpoint
    /// must have been trained with it) and its data gives the input shape.
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// What to write.
    #[arg(long, value_enum)]
    pub(crate) format: ExportFormat,
    /// The file (onnx, torchscript) or directory (savedmodel) to create.
    #[arg(long)]
    output: PathBuf,
    /// The shape of one input sample, without the batch dimension (`1,8,8`).
    /// Default: the config's data, else the first layer's input (Linear).
    #[arg(long, value_parser = parse_shape)]
    pub(crate) input_shape: Option<SampleShape>,
    /// A fixed batch size instead of a dynamic batch dimension (onnx).
    #[arg(long)]
    batch_size: Option<usize>,
    /// The input's name in the exported model (onnx, savedmodel; default `input`).
    #[arg(long)]
    input_name: Option<String>,
    /// The output's name in the exported model (onnx, savedmodel; default `output`).
    #[arg(long)]
    output_name: Option<String>,
    /// Replace `--output` if it exists (it is never written over otherwise).
    #[arg(long)]
    overwrite: bool,
}

/// `--input-shape`: one sample's dimensions.
#[derive(Clone, Debug)]
pub(crate) struct SampleShape(Vec<usize>);

fn parse_shape(text: &str) -> std::result::Result<SampleShape, String> {
    text.split(',')
        .map(|d| match d.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "`{text}`: expected positive sizes separated by commas, such as `1,8,8`"
            )),
        })
        .collect::<std::result::Result<_, _>>()
        .map(SampleShape)
}

/// The model, weights and input shape `kiln export` works from.
pub struct Source {
    /// The model's definition.
    pub definition: Layer,
    /// Its weights.
    pub state: StateDict,
    /// The input's shape, batch dimension first.
    pub input_shape: Vec<usize>,
}

pub(crate) fn export<E: Engines>(args: ExportArgs) -> Result<()> {
    // Nothing is read or built when the output would be refused anyway.
    crate::cli::check_output(&args.output, args.overwrite, "export")?;
    if args.batch_size == Some(0) {
        bail!(
            "--batch-size 0 would fix the model's batch dimension to 0, so that it takes only \
             empty batches: give the batch size it must take (at least 1), or leave the \
             option out for a model that takes any batch size"
        );
    }
    if args.batch_size.is_some() && args.format != ExportFormat::Onnx {
        bail!(
            "--batch-size applies to --format onnx only: a TorchScript module and a \
             SavedModel's signature take any batch size"
        );
    }
    if args.format == ExportFormat::Torchscript {
        for (flag, given) in [
            ("--input-name", &args.input_name),
            ("--output-name", &args.output_name),
        ] {
            if given.is_some() {
                bail!(
                    "{flag} does not apply to --format torchscript: a TorchScript module's \
                     forward takes and returns positional tensors"
                );
            }
        }
    }
    let source = load_source::<E>(&args)?;
    let dynamic = args.batch_size.is_none();
    let mut options = ExportOptions::new(&source.input_shape)
        .with_dynamic_batch(dynamic)
        .with_overwrite(args.overwrite);
    if let Some(name) = &args.input_name {
        options = options.with_input_name(name);
    }
    if let Some(name) = &args.output_name {
        options = options.with_output_name(name);
    }
    match args.format {
        ExportFormat::Onnx => {
            kiln_onnx::OnnxExport::new(&source.definition, &source.state, &options)
                .write(&args.output)?;
        }
        ExportFormat::Torchscript => {
            let model = build_model::<kiln_torch::TorchBackend>(&source, &args.checkpoint)?;
            kiln_torch::export_torchscript(&model, &args.output, &options)?;
        }
        ExportFormat::Savedmodel => {
            E::export_saved_model(&source, &args.checkpoint, &args.output, &options)?
        }
    }
    let (input_name, output_name) = (&options.input_name, &options.output_name);
    let output_shape = source.definition.output_shape(&source.input_shape)?;
    let shape = |shape: &[usize]| -> String {
        let mut dims: Vec<String> = shape.iter().map(usize::to_string).collect();
        if dynamic {
            dims[0] = "batch".into();
        }
        format!("[{}]", dims.join(", "))
    };
    let (input, output) = (shape(&source.input_shape), shape(&output_shape));
    let what = match args.format {
        ExportFormat::Onnx => format!("input {input_name} {input}, output {output_name} {output}"),
        // A TorchScript module's forward takes positional tensors of any batch size.
        ExportFormat::Torchscript => format!("forward takes {input}, returns {output}"),
        ExportFormat::Savedmodel => format!(
            "signature serving_default: input {input_name} {input}, output {output_name} {output}"
        ),
    };
    outln!(
        "kiln: exported {} to {} ({what})",
        kiln_core::export::ExportFormat::from(args.format),
        args.output.display()
    );
    Ok(())
}

/// The model built on backend `B` with the source's weights, in eval mode.
pub fn build_model<B: TrainBackend>(source: &Source, path: &Path) -> Result<B::Model> {
    let mut model = B::build_model(&source.definition, Device::Cpu)?;
    source
        .state
        .check_dtypes(&model.state_dict()?)
        .and_then(|()| model.load_state_dict(&source.state))
        .map_err(|e| {
            kiln_core::Error::checkpoint_caused_by(path, "does not fit the model definition", e)
        })?;
    model.set_mode(Mode::Eval);
    Ok(model)
}

fn load_source<E: Engines>(args: &ExportArgs) -> Result<Source> {
    let path = &args.checkpoint;
    let config = args
        .config
        .as_deref()
        .map(|p| RunConfig::load(p).with_context(|| format!("config {}", p.display())))
        .transpose()?;
    crate::evaluate::refuse_other_formats(path)?;
    let meta = kiln_core::safetensors::load_safetensors_metadata(path)?;
    // A checkpoint records its model's definition; a run's `model.safetensors` does not.
    let (checkpoint, weights) = if meta.contains_key("kiln.format") {
        (
            Some(crate::evaluate::open_checkpoint(path)?),
            StateDict::new(),
        )
    } else {
        let weights = StateDict::load_safetensors(path)?.0;
        kiln_train::refuse_non_finite(path, &kiln_train::find_non_finite("", &weights))?;
        (None, weights)
    };
    // The data fixes the input shape (and torchscript layers' output shapes).
    let example = match (&config, &args.input_shape) {
        (Some(config), None) => Some(validation_split::<E>(config)?.1),
        _ => None,
    };
    let recorded = checkpoint.as_ref().and_then(|c| c.model_definition.clone());
    let definition = match (&config, recorded) {
        (Some(config), _) => {
            let definition = match &example {
                Some(x) => crate::cli::resolve_model::<E>(config, x, Device::Cpu)?,
                None => config.model.clone(),
            };
            if let Some(checkpoint) = &checkpoint {
                checkpoint.check_definition(&definition, path)?;
            }
            definition
        }
        (None, Some(recorded)) => recorded,
        (None, None) => bail!(
            "{} holds weights only, no model definition: pass the run's --config",
            path.display()
        ),
    };
    let state = checkpoint.map_or(weights, |c| c.model);
    let sample = match (&args.input_shape, &example) {
        (Some(shape), _) => shape.0.clone(),
        (None, Some(x)) => x.dims()[1..].to_vec(),
        (None, None) => first_layer_input(&definition).with_context(|| {
            format!(
                "the input shape is not fixed by the model's first layer ({}): pass \
                 --input-shape (one sample, without the batch dimension, such as `1,8,8`) \
                 or the run's --config",
                definition.first_leaf().unwrap_or(&definition).kind()
            )
        })?,
    };
    let mut input_shape = vec![args.batch_size.unwrap_or(1)];
    input_shape.extend(sample);
    definition
        .output_shape(&input_shape)
        .with_context(|| format!("input shape {input_shape:?}"))?;
    Ok(Source {
        definition,
        state,
        input_shape,
    })
}

/// The sample shape a model's first layer fixes: a Linear layer's `[in_features]`.
fn first_layer_input(layer: &Layer) -> Option<Vec<usize>> {
    match layer.first_leaf() {
        Some(Layer::Linear(c)) => Some(vec![c.in_features]),
        _ => None,
    }
}
