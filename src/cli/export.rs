//! `kiln export`: a trained model as ONNX, TorchScript or a SavedModel.
//!
//! The model's definition comes from the config (`--config`, checked against
//! the one the checkpoint records) or from the checkpoint itself; the weights
//! from the checkpoint, or from a run's `model.safetensors` with `--config`.
//! The shape of one input comes from `--input-shape`, else from the config's
//! data, else from the model's first layer when that fixes it (a Linear layer).

use crate::prelude::*;
use anyhow::{bail, Context, Result};
use kiln_core::export::ExportOptions;

use crate::args::{ExportArgs, ExportFormat};
use crate::config::RunConfig;
use crate::data::validation_split;
use crate::engines::Engines;
use crate::engines::Source;
#[cfg(not(feature = "onnx"))]
use crate::features::{require, Feature};
use crate::formats::{open_checkpoint, refuse_other_formats};
use crate::model::{build_model, resolve_model};
use crate::output::{check_output, outln};

pub(crate) fn export<E: Engines>(args: ExportArgs) -> Result<()> {
    // Nothing is read or built when the output would be refused anyway.
    check_output(&args.output, args.overwrite, "export")?;
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
        #[cfg(feature = "onnx")]
        ExportFormat::Onnx => {
            kiln_onnx::OnnxExport::new(&source.definition, &source.state, &options)
                .write(&args.output)?;
        }
        #[cfg(not(feature = "onnx"))]
        ExportFormat::Onnx => require(Feature::Onnx, "exporting ONNX")?,
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
    let ids_shape = source.definition.token_ids_dims(&source.input_shape);
    let (input, output) = (shape(&ids_shape), shape(&output_shape));
    let what = match args.format {
        ExportFormat::Onnx if source.definition.takes_attention_mask() => format!(
            "inputs {input_name} {input} and {} {input}, output {output_name} {output}",
            kiln_core::export::ATTENTION_MASK_INPUT
        ),
        ExportFormat::Onnx => format!("input {input_name} {input}, output {output_name} {output}"),
        // A TorchScript module's forward takes positional tensors of any batch size.
        ExportFormat::Torchscript if source.definition.takes_attention_mask() => format!(
            "forward takes {input} and an optional attention_mask {input}, returns {output}"
        ),
        ExportFormat::Torchscript => format!("forward takes {input}, returns {output}"),
        ExportFormat::Savedmodel if source.definition.takes_attention_mask() => format!(
            "signature serving_default: inputs {input_name} {input} and {} {input}, output \
             {output_name} {output}",
            kiln_core::export::ATTENTION_MASK_INPUT
        ),
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

fn load_source<E: Engines>(args: &ExportArgs) -> Result<Source> {
    let path = &args.checkpoint;
    let config = args
        .config
        .as_deref()
        .map(|p| RunConfig::load(p).with_context(|| format!("config {}", p.display())))
        .transpose()?;
    refuse_other_formats(path)?;
    let meta = kiln_core::safetensors::load_safetensors_metadata(path)?;
    // A checkpoint records its model's definition; a run's `model.safetensors` does not.
    let (checkpoint, weights) = if meta.contains_key("kiln.format") {
        (Some(open_checkpoint(path)?), StateDict::new())
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
                Some(x) => resolve_model::<E>(config, x, Device::Cpu)?,
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
    let mut state = checkpoint.map_or(weights, |c| c.model);
    // A run's final weights hold its LoRA adapters: folded in with the config's settings.
    if state.keys().any(|k| kiln_core::lora::is_adapter_name(k)) {
        let lora = config.as_ref().and_then(|c| c.lora.as_ref()).with_context(|| {
            format!(
                "{} holds LoRA adapters: pass the run's --config (its `lora` settings) to merge them",
                path.display()
            )
        })?;
        state = lora.merge(&state)?;
    }
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
