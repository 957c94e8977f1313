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
    let chat = args.chat || args.messages.is_some();
    let tokenizer = match (&args.tokenizer, args.prompt.is_empty() && !chat) {
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
    let mut chat_stop = Vec::new();
    let prompts: Vec<Vec<i64>> = match &tokenizer {
        Some(tok) if chat => {
            let dir = args.tokenizer.as_ref().or(loaded.dir.as_ref());
            let template = chat_template(&args, dir)?;
            let options = chat_options(&args.chat_vars)?;
            let conversations = conversations(&args)?;
            if let Some(turn_end) = end_of_turn(&template, tok, &options) {
                log::info!("chat: generation stops at the end of a turn, {turn_end:?}");
                chat_stop.push(turn_end.1);
            }
            conversations
                .iter()
                .enumerate()
                .map(|(i, conversation)| {
                    let rendered = template.render(conversation, &options).with_context(|| {
                        match &args.messages {
                            Some(file) => format!("--messages {}", file.display()),
                            None => format!("--prompt {}", i + 1),
                        }
                    })?;
                    log::debug!("chat prompt {i}: {:?}", rendered.text);
                    // apply_chat_template's ids: the template writes the special tokens.
                    tok.encode_with(&rendered.text, false)
                        .map_err(anyhow::Error::from)
                })
                .collect::<Result<_>>()?
        }
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
    let mut stop = if args.stop.is_empty() {
        loaded.eos.clone()
    } else {
        args.stop.clone()
    };
    for id in chat_stop {
        if !stop.contains(&id) {
            stop.push(id);
        }
    }
    let config = GenerationConfig::greedy(args.max_new_tokens)
        .with_decoding(decoding)
        .with_stop_tokens(stop)
        .with_pad_token(loaded.pad)
        .with_seed(args.seed)
        .with_cache(!args.no_cache);
    let out = kiln_torch::generate(&loaded.model, &prompts, &config)?;
    for (i, tokens) in out.iter().enumerate() {
        match &tokenizer {
            // The reply alone, its special tokens (the end of the turn) skipped.
            Some(tok) if chat => outln!("{}", tok.decode(tokens)?),
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

/// The chat template: `--chat-template`'s file (with the special tokens of the
/// tokenizer's directory), else the model's.
fn chat_template(args: &GenerateArgs, dir: Option<&PathBuf>) -> Result<kiln_hf::ChatTemplate> {
    let from_dir = match dir {
        Some(dir) => kiln_hf::ChatTemplate::open(dir)?,
        None => None,
    };
    if let Some(file) = &args.chat_template {
        let source = std::fs::read_to_string(file)
            .with_context(|| format!("--chat-template {}", file.display()))?;
        let origin = file.display().to_string();
        return Ok(match &from_dir {
            Some(own) => own.with_source(source, origin)?,
            None => kiln_hf::ChatTemplate::new(source, Vec::<(String, String)>::new(), origin)?,
        });
    }
    from_dir.with_context(|| {
        format!(
            "--chat: {} has no chat template (no chat_template.jinja, and tokenizer_config.json \
             has no chat_template): give one with --chat-template",
            dir.map_or_else(|| "the model".to_owned(), |d| d.display().to_string())
        )
    })
}

/// The template's variables from `--chat-var NAME=VALUE`, with the
/// assistant header after the conversation.
fn chat_options(vars: &[String]) -> Result<kiln_hf::ChatOptions> {
    let mut options = kiln_hf::ChatOptions::generation_prompt();
    for var in vars {
        let Some((name, value)) = var.split_once('=') else {
            anyhow::bail!("--chat-var {var:?}: expected NAME=VALUE (`enable_thinking=false`)");
        };
        let name = name.trim();
        if name.is_empty() {
            anyhow::bail!("--chat-var {var:?}: the variable has no name");
        }
        let value = serde_json::from_str(value.trim())
            .unwrap_or_else(|_| serde_json::Value::String(value.to_owned()));
        options = options.with_variable(name, value);
    }
    Ok(options)
}

/// The conversations to answer: `--messages`' file, or each `--prompt` as a
/// user's message after `--system`.
fn conversations(args: &GenerateArgs) -> Result<Vec<Vec<serde_json::Value>>> {
    use serde_json::{json, Value};
    if let Some(file) = &args.messages {
        let what = || format!("--messages {}", file.display());
        let text = std::fs::read_to_string(file).with_context(what)?;
        let value: Value = serde_json::from_str(&text).with_context(what)?;
        // A list of messages, or {"messages": [...]} as a data set's row holds it.
        let list = match value {
            Value::Array(list) => list,
            Value::Object(mut row) => match row.remove("messages") {
                Some(Value::Array(list)) => list,
                _ => anyhow::bail!(
                    "{}: expected a list of messages, or an object with a `messages` list",
                    what()
                ),
            },
            _ => anyhow::bail!("{}: expected a list of messages", what()),
        };
        for (i, m) in list.iter().enumerate() {
            if m.get("role").and_then(Value::as_str).is_none() {
                anyhow::bail!("{}: message {i} has no `role` string: {m}", what());
            }
        }
        let mut list = list;
        if let Some(system) = &args.system {
            if list
                .first()
                .and_then(|m| m.get("role"))
                .and_then(Value::as_str)
                != Some("system")
            {
                list.insert(0, json!({"role": "system", "content": system}));
            }
        }
        return Ok(vec![list]);
    }
    Ok(args
        .prompt
        .iter()
        .map(|prompt| {
            let mut conversation = Vec::new();
            if let Some(system) = &args.system {
                conversation.push(json!({"role": "system", "content": system}));
            }
            conversation.push(json!({"role": "user", "content": prompt}));
            conversation
        })
        .collect())
}

/// The special token that ends an assistant's turn in `template` (Qwen's
/// `<|im_end|>`, Llama 3's `<|eot_id|>`, Gemma's `<end_of_turn>`): what the
/// template writes right after an assistant message, when the tokenizer has
/// it as a special token.
fn end_of_turn(
    template: &kiln_hf::ChatTemplate,
    tok: &TextTokenizer,
    options: &kiln_hf::ChatOptions,
) -> Option<(String, i64)> {
    const PROBE: &str = "Kiln probes the end of a turn";
    let conversation = [
        serde_json::json!({"role": "user", "content": "Hello"}),
        serde_json::json!({"role": "assistant", "content": PROBE}),
    ];
    let mut options = options.clone();
    options.add_generation_prompt = false;
    let text = template.render(&conversation, &options).ok()?.text;
    let after = &text[text.rfind(PROBE)? + PROBE.len()..];
    tok.special_token_at_start(after.trim_start_matches([' ', '\t']))
}
