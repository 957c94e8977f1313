//! A config's data and model, ready to train: the loaders (one rank's share
//! under a data-parallel job), the definition resolved on the data, the model
//! built with its pretrained weights, LoRA adapters, precision, frozen
//! parameters and activation checkpointing, and its summary.

use anyhow::{Context, Result};
use kiln_core::backend::TrainBackend;

use crate::config::{FrozenBatchNorm, PretrainedModel, RunConfig};
use crate::data::{load_data, loader, Split};
use crate::engines::Engines;
#[cfg(not(feature = "text"))]
use crate::features::{Feature, FeatureMissing};
use crate::model::resolve_model;
use crate::prelude::*;
use crate::resume::data_identity;

/// What a run has prepared besides its model: the data and what was learnt
/// from it.
pub(crate) struct Prepared {
    /// The model's definition, resolved on the data.
    pub(crate) definition: Layer,
    /// The model's summary for one training sample.
    pub(crate) summary: Result<kiln_core::model::ModelSummary>,
    /// What identifies the data (recorded in checkpoints, checked on resume).
    pub(crate) identity: serde_json::Value,
    /// The training split's loader (this rank's share).
    pub(crate) train_loader: Box<dyn DataLoader>,
    /// The validation split's loader (this rank's share), if there is one.
    pub(crate) val_loader: Option<Box<dyn DataLoader>>,
    /// The number of training and validation examples (all ranks').
    pub(crate) examples: (usize, usize),
    /// The misclassified-images view `[logging]` asks for.
    pub(crate) misclassified: Option<kiln_train::MisclassifiedImages>,
}

/// Refuses, naming the key, what the config asks of backend `B` that it
/// cannot do (freezing, LoRA).
pub(crate) fn check_backend_supports<B: TrainBackend>(config: &RunConfig) -> Result<()> {
    if !config.freeze.is_empty() && !B::CAN_FREEZE {
        anyhow::bail!(
            "config key `freeze`: freezing parameters is not supported on the {} backend",
            B::NAME
        );
    }
    if config.lora.is_some() && !B::CAN_LORA {
        anyhow::bail!(
            "config key `lora`: LoRA adapters are not supported on the {} backend",
            B::NAME
        );
    }
    Ok(())
}

/// Loads the config's data (`shard`: this rank's share, as `(rank, world
/// size)`) and builds its model on backend `B`, seeded by the config; a
/// `fresh` run starts from the pretrained weights (a resumed one gets its
/// checkpoint's later).
pub(crate) fn prepare<E: Engines, B: TrainBackend>(
    config: &RunConfig,
    shard: Option<(usize, usize)>,
    fresh: bool,
) -> Result<(Prepared, B::Model)> {
    let data = load_data::<E>(config)?;
    let misclassified = config.logging.misclassified_view(
        data.probe.dims(),
        data.val.is_some(),
        &config.loss,
        data.class_names.as_deref(),
    )?;
    // Finding a torchscript layer's output shape runs it once (drawing nothing).
    let definition = resolve_model::<E>(config, &data.probe, config.device)?;
    let sample = data.probe.dims().get(1..).unwrap_or_default().to_vec();
    let examples = (data.train.len(), data.val.as_ref().map_or(0, Split::len));
    let identity = data_identity(config, &data);
    let train_loader = loader(data.train, config, true, shard)?;
    // Each rank validates on its share of the split (every sample once); the
    // trainer adds the ranks' metric states up, so every rank gets the values
    // over the whole split and early stopping and plateau schedules decide alike.
    let val_loader = data
        .val
        .map(|v| loader(v, config, false, shard))
        .transpose()?;

    B::manual_seed(config.seed);
    let mut model = B::build_model(&definition, config.device)?;
    if let (Some(source), true) = (&config.pretrained, fresh) {
        load_pretrained::<B>(&mut model, source)?;
    }
    if let Some(lora) = &config.lora {
        add_lora::<B>(&mut model, config, lora)?;
    }
    B::set_precision(&mut model, config.training.precision)?;
    freeze::<B>(&mut model, config)?;
    if !config.activation_checkpointing.is_empty() {
        let patterns: Vec<&str> = config
            .activation_checkpointing
            .iter()
            .map(String::as_str)
            .collect();
        let parts = B::checkpoint_activations(&mut model, &patterns)
            .context("config key `activation_checkpointing`")?;
        log::info!("activation checkpointing: {}", parts.join(", "));
    }
    let summary = model_summary::<B>(&definition, &sample, &model);
    let prepared = Prepared {
        definition,
        summary,
        identity,
        train_loader,
        val_loader,
        examples,
        misclassified,
    };
    Ok((prepared, model))
}

/// Loads the weights of `[model] pretrained` into `model`: every tensor of the
/// checkpoint's model (a new head keeps its initial values).
#[cfg(feature = "text")]
fn load_pretrained<B: TrainBackend>(model: &mut B::Model, source: &PretrainedModel) -> Result<()> {
    let pretrained = source
        .open()
        .with_context(|| format!("config key `model.pretrained` ({})", source.dir.display()))?;
    let weights = pretrained
        .load_weights()
        .with_context(|| format!("config key `model.pretrained` ({})", source.dir.display()))?;
    let mut state = model.state_dict()?;
    let count = weights.len();
    for (name, tensor) in weights {
        state.insert(name, tensor);
    }
    model.load_state_dict(&state)?;
    log::info!(
        "loaded {count} pretrained tensors ({} model) from {}",
        pretrained.family(),
        source.dir.display()
    );
    Ok(())
}

/// Without the `text` feature a pretrained model is refused as needing it.
#[cfg(not(feature = "text"))]
fn load_pretrained<B: TrainBackend>(_: &mut B::Model, _: &PretrainedModel) -> Result<()> {
    Err(FeatureMissing::new(Feature::Text, "a Hugging Face model").into())
}

/// Adds `[lora]`'s adapters to `model`; the adapter is written in PEFT's
/// format at the end of the run, so a target PEFT cannot hold (GPT-2's fused
/// `c_attn`) is refused now.
fn add_lora<B: TrainBackend>(
    model: &mut B::Model,
    config: &RunConfig,
    lora: &kiln_core::lora::LoraConfig,
) -> Result<()> {
    let adapters = B::add_lora(model, lora).context("config key `lora`")?;
    if let Some(source) = &config.pretrained {
        check_peft_targets(source, &adapters)?;
    }
    log::info!(
        "LoRA: {} adapter tensors (r = {}, alpha = {}) on {}; the rest is frozen",
        adapters.len(),
        lora.r,
        lora.alpha,
        lora.target_modules.join(", ")
    );
    Ok(())
}

/// Refuses adapters PEFT's format cannot hold on `source`'s model (GPT-2's
/// fused `c_attn`), given the adapters' tensor names.
#[cfg(feature = "text")]
fn check_peft_targets(source: &PretrainedModel, adapters: &[String]) -> Result<()> {
    let modules: Vec<&str> = adapters
        .iter()
        .filter_map(|n| n.strip_suffix(&format!(".{}", kiln_core::lora::LORA_A)))
        .collect();
    source
        .open()?
        .check_adapter_modules(modules)
        .context("config key `lora.target_modules`")?;
    Ok(())
}

#[cfg(not(feature = "text"))]
fn check_peft_targets(_: &PretrainedModel, _: &[String]) -> Result<()> {
    Err(FeatureMissing::new(Feature::Text, "a Hugging Face model").into())
}

/// Freezes the parameters `freeze` names (and, with `frozen_batch_norm =
/// "eval"`, keeps their batch norm in eval mode).
fn freeze<B: TrainBackend>(model: &mut B::Model, config: &RunConfig) -> Result<()> {
    let patterns: Vec<&str> = config.freeze.iter().map(String::as_str).collect();
    let (frozen, pinned) = B::freeze(
        model,
        &patterns,
        config.frozen_batch_norm == FrozenBatchNorm::Eval,
    )
    .context("config key `freeze`")?;
    if !frozen.is_empty() {
        log::info!(
            "frozen: {} parameters ({})",
            frozen.len(),
            frozen.join(", ")
        );
    }
    if !pinned.is_empty() {
        log::info!("batch norm kept in eval mode: {}", pinned.join(", "));
    }
    Ok(())
}

/// The summary of `model`, built from `definition`, for one sample of `sample`.
fn model_summary<B: TrainBackend>(
    definition: &Layer,
    sample: &[usize],
    model: &B::Model,
) -> Result<kiln_core::model::ModelSummary> {
    let parameters: Vec<(String, usize)> = model
        .named_parameters()?
        .iter()
        .map(|(name, t)| (name.clone(), B::shape(t).numel()))
        .collect();
    let frozen = model.frozen_parameters()?;
    Ok(kiln_core::model::ModelSummary::new(
        definition,
        sample,
        &parameters,
        &frozen,
    )?)
}
