//! `dataset = "text"`: rows of a JSON Lines or CSV file, tokenized with the
//! model directory's `tokenizer.json` by the loader's workers; every row is
//! tokenized once here first, so a bad row (a missing column, a row longer
//! than `max_length` without truncation, a label outside the model's classes)
//! stops the run before anything is written.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use kiln_data::{split_indices, Dataset, Subset};
use kiln_hf::{Pretrained, TextTokenizer};
use kiln_text::{PackedText, TextDataset, TextOptions, TextTask};

use super::{Data, SampleDataset, Split, TextSplit};
use crate::config::RunConfig;
use crate::engines::Engines;
use crate::prelude::*;

/// The directory of the tokenizer: `data.tokenizer`, else `model.pretrained`.
pub(crate) fn tokenizer_dir(config: &RunConfig) -> Result<PathBuf> {
    let tokenizer = match &config.data.source {
        crate::config::DataSource::Text(text) => text.tokenizer.clone(),
        _ => None,
    };
    tokenizer
        .or_else(|| config.pretrained.as_ref().map(|p| p.dir.clone()))
        .context(
            "data.tokenizer: text data needs a tokenizer: set data.tokenizer to the directory \
             holding tokenizer.json (default: model.pretrained)",
        )
}

/// The EOS and padding ids of the model directory `dir` (its config.json),
/// when it is one.
fn special_tokens(dir: &Path, tokenizer: &TextTokenizer) -> (Option<i64>, i64) {
    let from_model = Pretrained::open(dir).ok().map(|p| {
        let eos = p.eos_token_ids().ok().and_then(|e| e.first().copied());
        (eos, p.pad_token_id().ok().flatten())
    });
    let (eos, pad) = from_model.unwrap_or((None, None));
    let eos = eos.or_else(|| tokenizer.token_id("</s>"));
    (eos, pad.or(eos).unwrap_or(0))
}

/// The chat template conversations render through: `data.chat_template`'s
/// file, else the tokenizer directory's, with `chat_template_kwargs` and
/// `system_prompt`.
fn chat_tokenizer(
    source: &crate::config::TextSource,
    dir: &Path,
    tokenizer: Arc<TextTokenizer>,
) -> Result<Arc<dyn kiln_text::TokenizeChat>> {
    let from_dir = kiln_hf::ChatTemplate::open(dir)
        .with_context(|| format!("the chat template of {}", dir.display()))?;
    let template = match &source.chat_template {
        Some(file) => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("data.chat_template ({})", file.display()))?;
            let origin = file.display().to_string();
            match &from_dir {
                Some(own) => own.with_source(text, origin),
                None => kiln_hf::ChatTemplate::new(text, Vec::<(String, String)>::new(), origin),
            }
            .context("data.chat_template")?
        }
        None => from_dir.with_context(|| {
            format!(
                "data.messages_column: conversations are rendered by the model's chat template, \
                 and {} has none (no chat_template.jinja, and tokenizer_config.json has no \
                 chat_template): set data.chat_template to a .jinja file",
                dir.display()
            )
        })?,
    };
    let mut options = kiln_hf::ChatOptions::default();
    if let Some(kwargs) = &source.chat_template_kwargs {
        options.variables = kwargs.clone();
    }
    let mut chat = kiln_hf::ChatTokenizer::new(template, tokenizer, options);
    if let Some(system) = &source.system_prompt {
        chat = chat.with_system_prompt(system.clone());
    }
    Ok(Arc::new(chat))
}

/// Reads the configured text data set.
pub(crate) fn load_text<E: Engines>(config: &RunConfig) -> Result<Data> {
    let data = &config.data;
    let crate::config::DataSource::Text(text_source) = &data.source else {
        anyhow::bail!("dataset {} is not text data", data.kind().name());
    };
    let task = text_source.task()?;
    let dir = tokenizer_dir(config)?;
    let tokenizer = Arc::new(
        TextTokenizer::open(&dir).with_context(|| format!("data.tokenizer ({})", dir.display()))?,
    );
    let (eos, pad_id) = special_tokens(&dir, &tokenizer);
    // An id past the model's embedding would fail steps later, inside the model.
    if let Some(source) = &config.pretrained {
        let vocab = source
            .open()
            .ok()
            .and_then(|p| p.config().opt_usize("vocab_size").ok().flatten());
        if let Some(vocab) = vocab.filter(|&v| tokenizer.vocab_size() > v) {
            anyhow::bail!(
                "data.tokenizer ({}): the tokenizer gives ids up to {}, but the model's \
                 vocabulary (config.json's vocab_size) has {vocab}: a tokenizer of another \
                 model? Use the model's own tokenizer.json",
                dir.display(),
                tokenizer.vocab_size() - 1
            );
        }
    }
    // Packed, `max_length` is the block: the documents themselves are never cut.
    let options = TextOptions {
        max_length: if text_source.packing {
            None
        } else {
            text_source.max_length
        },
        truncation: text_source.truncation && !text_source.packing,
        eos_token: if task.is_causal() { eos } else { None },
    };
    let threads = data
        .loader
        .workers
        .max(std::thread::available_parallelism().map_or(1, usize::from));
    let chat = if task.is_conversational() {
        Some(chat_tokenizer(text_source, &dir, tokenizer.clone())?)
    } else {
        None
    };
    let open = |key: &str, path: &Path| -> Result<SampleDataset> {
        let mut text = TextDataset::open(path, task.clone(), options.clone(), tokenizer.clone())
            .with_context(|| format!("data.{key} ({})", path.display()))?;
        if let Some(chat) = &chat {
            text = text
                .with_chat(chat.clone())
                .context("data.assistant_only_loss")?;
        }
        if let TextTask::Classification { .. } = &task {
            check_labels::<E>(config, &text)?;
        }
        Ok(if text_source.packing {
            let block = text_source
                .max_length
                .context("data.packing needs data.max_length")?;
            let packed = PackedText::new(text, block, threads)
                .with_context(|| format!("data.{key} ({})", path.display()))?;
            log::info!(
                "{}: {} tokens packed into {} blocks of {block}",
                path.display(),
                packed.total_tokens(),
                packed.len()
            );
            Arc::new(packed)
        } else {
            let lengths = text
                .check_lengths(threads)
                .with_context(|| format!("data.{key} ({})", path.display()))?;
            log::info!(
                "{}: {} examples, {} tokens",
                path.display(),
                lengths.len(),
                lengths.iter().sum::<usize>()
            );
            Arc::new(text)
        })
    };
    let path = text_source
        .path
        .as_deref()
        .context("data.path is required")?;
    let all = open("path", path)?;
    let (train, val): (SampleDataset, Option<SampleDataset>) = match &text_source.val_path {
        Some(val_path) => (all, Some(open("val_path", val_path)?)),
        None if data.val_fraction() > 0.0 => {
            let (tr, te) = split_indices(all.len(), data.val_fraction(), config.seed)
                .context("data.val_fraction")?;
            (
                Arc::new(Subset::new(all.clone(), tr)?),
                Some(Arc::new(Subset::new(all, te)?)),
            )
        }
        None => (all, None),
    };
    if train.is_empty() {
        anyhow::bail!("{}: the training split has no examples", path.display());
    }
    let (x, _) = train.get(0).context("the first training example")?;
    let len = x.numel();
    let probe = x.reshape([1, len])?;
    let split = |dataset: SampleDataset| {
        Split::Text(TextSplit {
            dataset,
            pad_id,
            causal: task.is_causal(),
            attention_mask: !task.is_causal() && data.loader.batch_size > 1,
        })
    };
    // The model takes a batch of token ids.
    let model = crate::model::resolve_model::<E>(config, &probe, config.device)?;
    model
        .output_shape(&[data.loader.batch_size, len])
        .context("the model does not take batches of token ids [batch, length]")?;
    Ok(Data {
        train: split(train),
        val: val.map(split),
        probe,
        class_names: None,
    })
}

/// Checks every label of a classification file against the model's classes.
fn check_labels<E: Engines>(config: &RunConfig, text: &TextDataset) -> Result<()> {
    let records = text.records();
    let probe = HostTensor::new(vec![0i64; 2], [1, 2])?;
    let model = crate::model::resolve_model::<E>(config, &probe, config.device)?;
    let classes = model.output_shape(&[1, 2])?.get(1).copied().unwrap_or(0) as i64;
    for i in 0..records.len() {
        let label = &records.get(i)?[1];
        let value: i64 = label.trim().parse().map_err(|_| {
            anyhow::anyhow!(
                "{}: label {label:?} is not a whole number",
                records.place(i)
            )
        })?;
        if !(0..classes).contains(&value) {
            anyhow::bail!(
                "{}: label {value} is outside the model's {classes} classes (0 to {})",
                records.place(i),
                classes - 1
            );
        }
    }
    Ok(())
}
