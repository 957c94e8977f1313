//! `kiln generate`: text (or token ids) from a Hugging Face model directory or
//! a Kiln checkpoint, on libtorch with a key/value cache: greedy by default,
//! sampled with `--temperature`, `--top-k` or `--top-p` from a seeded generator.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use kiln_core::generation::{Decoding, GenerationConfig};
use kiln_core::module::Module;
use kiln_hf::{Pretrained, TextTokenizer};
use kiln_torch::TorchModel;

use crate::args::GenerateArgs;
use crate::formats::open_checkpoint;
use crate::output::outln;
use crate::prelude::*;

/// The model to generate with, its stop and padding tokens, and the
/// directory a tokenizer may be in.
struct Loaded {
    model: TorchModel,
    eos: Vec<i64>,
    pad: i64,
    dir: Option<PathBuf>,
    /// The vocabulary's size, when the model directory's config gives it.
    vocab: Option<usize>,
    /// The positions the model has (`n_positions`, `max_position_embeddings`),
    /// when the config gives them.
    positions: Option<usize>,
}

/// `definition` without the `flatten` that `kiln train` appends to a
/// language model for its loss (`[batch, len, vocab]` logits to `[batch * len, vocab]`).
fn without_loss_flatten(definition: Layer) -> Layer {
    match definition {
        Layer::Sequential { mut layers }
            if matches!(
                layers.last(),
                Some(Layer::Flatten {
                    start_dim: 0,
                    end_dim: 1
                })
            ) =>
        {
            layers.pop();
            Layer::Sequential { layers }
        }
        other => other,
    }
}

fn load(path: &Path, adapter: Option<&Path>, device: Device) -> Result<Loaded> {
    if adapter.is_some() && !path.is_dir() {
        anyhow::bail!(
            "--adapter applies to a Hugging Face model directory (the adapter's base model); a \
             Kiln checkpoint holds its adapters already"
        );
    }
    if path.is_dir() {
        let pretrained = Pretrained::open(path)?;
        if !pretrained.is_decoder() {
            anyhow::bail!(
                "{} is a {} model, not a causal language model: kiln generate runs the {} \
                 families",
                path.display(),
                pretrained.family(),
                kiln_hf::Family::list(kiln_hf::FAMILIES.iter().copied().filter(|f| f.is_decoder()))
            );
        }
        let mut model = TorchModel::new(pretrained.layer(), device)?;
        let mut weights = pretrained.load_weights()?;
        if let Some(dir) = adapter {
            let (lora, adapters) = pretrained
                .load_adapter(dir)
                .with_context(|| format!("--adapter {}", dir.display()))?;
            for (name, tensor) in adapters.iter() {
                weights.insert(name.clone(), tensor.clone());
            }
            weights = lora.merge(&weights)?;
            log::info!(
                "LoRA adapters of {} merged (r = {}, alpha = {})",
                dir.display(),
                lora.r,
                lora.alpha
            );
        }
        model.load_state_dict(&weights)?;
        let eos = pretrained.eos_token_ids()?;
        let pad = pretrained
            .pad_token_id()?
            .or(eos.first().copied())
            .unwrap_or(0);
        let config = pretrained.config();
        let vocab = config.opt_usize("vocab_size")?;
        let positions = match config.opt_usize("n_positions")? {
            Some(n) => Some(n),
            None => config.opt_usize("max_position_embeddings")?,
        };
        return Ok(Loaded {
            model,
            eos,
            pad,
            dir: Some(path.to_owned()),
            vocab,
            positions,
        });
    }
    let checkpoint = open_checkpoint(path)?;
    let definition = checkpoint.model_definition.clone().with_context(|| {
        format!(
            "{}: the checkpoint records no model definition (a run's model.safetensors does \
             not): give `checkpoints/last.safetensors`",
            path.display()
        )
    })?;
    let definition = without_loss_flatten(definition);
    // A language model reads token ids: its first layer is an embedding.
    let vocab = match definition.first_leaf() {
        Some(Layer::Embedding(embedding)) => embedding.num_embeddings,
        first => anyhow::bail!(
            "{}: the checkpoint's model reads {}, not token ids (its first layer is {}): kiln \
             generate runs language models, whose first layer is an Embedding",
            path.display(),
            match definition.input_dtype() {
                Some(dtype) => format!("{dtype} features"),
                None => "a SavedModel's inputs".to_owned(),
            },
            first.map_or("missing: the model is empty", Layer::kind)
        ),
    };
    let mut model = TorchModel::new(&definition, device)?;
    crate::model::load_for_eval::<kiln_torch::TorchBackend>(
        &mut model,
        &checkpoint.model,
        path,
        "does not fit its recorded definition",
    )?;
    Ok(Loaded {
        model,
        eos: Vec::new(),
        pad: 0,
        dir: None,
        vocab: Some(vocab),
        positions: None,
    })
}

/// `kiln generate`.
pub(crate) fn generate(args: GenerateArgs) -> Result<()> {
    if args.temperature == Some(0.0) {
        anyhow::bail!(
            "--temperature 0 is greedy decoding: leave out --temperature and give --greedy (or a \
             temperature above 0 to sample)"
        );
    }
    let model = kiln_hf::resolve_model(&args.model, args.revision.as_deref())
        .with_context(|| format!("--model {}", args.model))?;
    let mut loaded = load(&model, args.adapter.as_deref(), args.device)
        .with_context(|| format!("--model {}", args.model))?;
    loaded.model.set_mode(Mode::Eval);
    let tokenizer = match (&args.tokenizer, args.prompt.is_empty()) {
        (_, true) => None,
        (Some(dir), false) => Some(TextTokenizer::open(dir)?),
        (None, false) => match &loaded.dir {
            Some(dir) => Some(TextTokenizer::open(dir)?),
            None => anyhow::bail!(
                "--tokenizer is needed to read text prompts with a checkpoint (the model \
                 directory holding tokenizer.json), or give --prompt-ids"
            ),
        },
    };
    let prompts: Vec<Vec<i64>> = match &tokenizer {
        Some(tok) => args
            .prompt
            .iter()
            .map(|p| tok.encode(p).map_err(anyhow::Error::from))
            .collect::<Result<_>>()?,
        None => args
            .prompt_ids
            .iter()
            .map(|p| {
                p.split(',')
                    .map(|t| {
                        t.trim()
                            .parse::<i64>()
                            .with_context(|| format!("--prompt-ids {p:?}: {t:?} is not a token id"))
                    })
                    .collect::<Result<Vec<i64>>>()
            })
            .collect::<Result<_>>()?,
    };
    check_prompts(&prompts, args.max_new_tokens, &loaded)?;
    // A Kiln checkpoint records no EOS: the tokenizer's model directory names it.
    if loaded.eos.is_empty() {
        if let Some(dir) = &args.tokenizer {
            loaded.eos = kiln_hf::eos_token_ids_in(dir)
                .with_context(|| format!("--tokenizer {}", dir.display()))?;
        }
    }
    // The model's generation_config.json decides, as in transformers'
    // generate(), unless a flag says otherwise.
    let defaults = match loaded.dir.as_ref().or(args.tokenizer.as_ref()) {
        Some(dir) => kiln_hf::sampling_defaults_in(dir)
            .with_context(|| format!("{}", dir.join("generation_config.json").display()))?,
        None => kiln_hf::SamplingDefaults::default(),
    };
    let flags = args.temperature.is_some() || args.top_k.is_some() || args.top_p.is_some();
    let decoding = if !args.greedy && (flags || defaults.do_sample) {
        Decoding::Sample {
            temperature: args.temperature.or(defaults.temperature).unwrap_or(1.0),
            top_k: args.top_k.or(defaults.top_k),
            top_p: args.top_p.or(defaults.top_p),
        }
    } else {
        Decoding::Greedy
    };
    let stop = if args.stop.is_empty() {
        loaded.eos.clone()
    } else {
        args.stop.clone()
    };
    let config = GenerationConfig::greedy(args.max_new_tokens)
        .with_decoding(decoding)
        .with_stop_tokens(stop)
        .with_pad_token(loaded.pad)
        .with_seed(args.seed)
        .with_cache(!args.no_cache);
    let out = kiln_torch::generate(&loaded.model, &prompts, &config)?;
    for (i, tokens) in out.iter().enumerate() {
        match &tokenizer {
            Some(tok) => outln!("{}{}", args.prompt[i], tok.decode(tokens)?),
            None => outln!(
                "{}",
                tokens
                    .iter()
                    .map(i64::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
    }
    Ok(())
}

/// Refuses, before the first step, token ids outside the vocabulary and
/// sequences longer than the model's positions (GPT-2's learned positions end
/// there; a longer prompt costs memory quadratic in its length).
fn check_prompts(prompts: &[Vec<i64>], max_new_tokens: usize, loaded: &Loaded) -> Result<()> {
    for (i, prompt) in prompts.iter().enumerate() {
        if prompt.is_empty() {
            anyhow::bail!("prompt {i} has no tokens");
        }
        if let Some(vocab) = loaded.vocab {
            if let Some(bad) = prompt.iter().find(|&&t| t < 0 || t as u64 >= vocab as u64) {
                anyhow::bail!(
                    "prompt {i}: token id {bad} is outside the model's vocabulary of {vocab} \
                     tokens (ids 0 to {}); check the tokenizer or --prompt-ids",
                    vocab - 1
                );
            }
        }
        if let Some(positions) = loaded.positions {
            let total = prompt.len().saturating_add(max_new_tokens);
            if total > positions {
                anyhow::bail!(
                    "prompt {i}: {} tokens and --max-new-tokens {max_new_tokens} make {total} \
                     positions, more than the model's {positions} (its config's \
                     max_position_embeddings / n_positions); shorten the prompt or lower \
                     --max-new-tokens",
                    prompt.len()
                );
            }
        }
    }
    Ok(())
}
