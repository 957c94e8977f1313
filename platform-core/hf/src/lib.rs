//! Kiln's Hugging Face formats.
//!
//! A model directory as `save_pretrained` writes it (`config.json` and
//! `model.safetensors`, or shards listed in `model.safetensors.index.json`)
//! becomes a Kiln [`Layer`] definition and its weights under Kiln's names
//! ([`Pretrained`]); Kiln's weights go back to the same format, which
//! `from_pretrained` reads ([`Pretrained::save`]). The families built are
//! LLaMA (and the Mistral, Qwen2 and Qwen3 variants of its block) and GPT-2
//! (causal language models), BERT (a sequence classifier, or the bare encoder)
//! and ViT (an image classifier).
//! [`TextTokenizer`] reads the directory's `tokenizer.json` with the
//! `tokenizers` crate, the code Python's `tokenizers` runs.
//!
//! ```no_run
//! use kiln_hf::Pretrained;
//!
//! let pretrained = Pretrained::open("models/tiny-llama")?;
//! let spec = pretrained.layer();          // a kiln_core::model::Layer
//! let weights = pretrained.load_weights()?; // a StateDict under Kiln's names
//! // ... build it on a backend, fine-tune, then:
//! pretrained.save(&weights, "runs/tuned-llama")?;
//! # Ok::<(), kiln_hf::HfError>(())
//! ```

mod bert;
mod bounds;
mod chat;
mod cohere;
mod config;
mod download;
mod error;
mod family;
mod gemma;
mod gpt2;
mod gpt_neox;
mod hub;
mod layer_types;
mod llama;
mod moe;
mod names;
mod olmo2;
mod peft;
mod peft_fused;
mod peft_targets;
mod phi3;
mod rope;
mod stablelm;
mod tokenizer;
mod vit;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use kiln_core::model::Layer;
use kiln_core::state_dict::StateDict;
use kiln_core::{DType, HostTensor};

pub use chat::{ChatOptions, ChatTemplate, ChatTokenizer, RenderedChat, TokenizedChat};
pub use config::HfConfig;
pub use download::HubClient;
pub use error::{DownloadFailure, HfError, Result};
pub use family::{Family, FamilyTask, FAMILIES};
pub use hub::{is_repo_id, resolve_model, HubCache};
pub use names::{Mapping, NameMap, RowOrder};
pub use peft::{ADAPTER_CONFIG, ADAPTER_WEIGHTS};
pub use tokenizer::TextTokenizer;

/// A Hugging Face model directory's configuration file.
pub const CONFIG: &str = "config.json";
/// The other file names of a model directory.
const WEIGHTS: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// A pretrained model directory, read: its config, the Kiln definition it
/// describes and how its tensors map to Kiln's.
#[derive(Clone, Debug)]
pub struct Pretrained {
    dir: PathBuf,
    config: HfConfig,
    family: &'static Family,
    layer: Layer,
    names: NameMap,
    /// Whether [`with_head`](Pretrained::with_head) replaced the LM head.
    head_replaced: bool,
}

impl Pretrained {
    /// Reads `dir/config.json` and builds the definition it describes.
    ///
    /// Fails with [`HfError::NotAModel`] without a `config.json`, with
    /// [`HfError::UnknownFamily`] for a `model_type` outside [`FAMILIES`], and
    /// with [`HfError::UnsupportedKey`] naming a key whose value Kiln does not
    /// implement (scaled RoPE, sliding-window attention, ...).
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        Self::open_with_config(dir, &serde_json::Map::new())
    }

    /// [`open`](Pretrained::open) with `overrides` in place of the keys of
    /// `config.json` they name, as `from_pretrained(dir, **kwargs)` sets
    /// config attributes (`{"output_router_logits": true}` turns a mixture of
    /// experts' load-balancing loss on). The overridden config is what is
    /// checked against the weights, built, and written by
    /// [`save`](Pretrained::save).
    ///
    /// ```no_run
    /// use kiln_hf::Pretrained;
    ///
    /// let overrides = serde_json::json!({ "output_router_logits": true });
    /// let moe = Pretrained::open_with_config("models/tiny-qwen3-moe", overrides.as_object().unwrap())?;
    /// # Ok::<(), kiln_hf::HfError>(())
    /// ```
    pub fn open_with_config(
        dir: impl AsRef<Path>,
        overrides: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self> {
        let dir = dir.as_ref().to_owned();
        match std::fs::metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(m) => {
                return Err(HfError::NotAModel {
                    what: format!(
                        "{}, not a directory (a model directory holds {CONFIG} and the weights)",
                        kiln_core::fs::describe_file_type(m.file_type())
                    ),
                    dir,
                })
            }
            Err(e) => {
                return Err(HfError::NotAModel {
                    what: format!("cannot be read as a model directory: {e}"),
                    dir,
                })
            }
        }
        let path = dir.join(CONFIG);
        if !path.is_file() {
            let what = match std::fs::metadata(&path) {
                Ok(m) => format!(
                    "its {CONFIG} is {}, not a regular file",
                    kiln_core::fs::describe_file_type(m.file_type())
                ),
                Err(_) => format!("no {CONFIG}"),
            };
            return Err(HfError::NotAModel { what, dir });
        }
        let mut config = HfConfig::read(&path)?;
        for (key, value) in overrides {
            config.set(key, value.clone());
        }
        // The sizes are bounded by the weights' headers before the definition
        // is built: a config alone must not decide how much memory Kiln takes.
        // (A directory without weights has nothing to compare; loading it
        // fails, naming what is missing.)
        match weight_files_in(&dir) {
            Ok(files) => bounds::check_config_against_weights(&config, &files)?,
            Err(HfError::NotAModel { .. }) => {}
            Err(e) => return Err(e),
        }
        Self::from_config(dir, config)
    }

    /// The definition `config` describes, for weights in `dir`.
    pub fn from_config(dir: PathBuf, config: HfConfig) -> Result<Self> {
        let model_type = config.str_or("model_type", "")?.to_owned();
        let archs: Vec<String> = config
            .get("architectures")
            .and_then(|v| v.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let Some(family) = Family::of(&model_type) else {
            return Err(HfError::UnknownFamily {
                path: config.path().to_owned(),
                model_type,
                supported: Family::list(FAMILIES.iter().copied()),
            });
        };
        if let Some(arch) = archs
            .iter()
            .find(|a| !family.architectures.iter().any(|s| a.ends_with(s)))
        {
            return Err(config.unsupported(
                "architectures",
                format!(
                    "{arch}: Kiln builds {} as {}",
                    family.name,
                    family.architectures.join(" or ")
                ),
            ));
        }
        let (layer, names) = (family.build)(&config, &archs)?;
        layer.validate()?;
        Ok(Pretrained {
            dir,
            config,
            family,
            layer,
            names,
            head_replaced: false,
        })
    }

    /// The model with `head` in place of its language-model head: the layers
    /// run after the final norm on `[batch, seq, hidden]` (a classifier:
    /// `[{ type = "select", dim = 1, index = -1 }, { type = "linear", ... }]`).
    /// The checkpoint's head is then ignored; the new layers start from their
    /// initialisers. An empty `head` keeps the final hidden states.
    ///
    /// ```no_run
    /// use kiln_core::model::{Layer, LinearConfig};
    /// use kiln_hf::Pretrained;
    ///
    /// let classifier = Pretrained::open("models/tiny-llama")?.with_head(vec![
    ///     Layer::Select { dim: 1, index: -1 },
    ///     LinearConfig::new(32, 2).into(),
    /// ])?;
    /// # Ok::<(), kiln_hf::HfError>(())
    /// ```
    pub fn with_head(mut self, head: Vec<Layer>) -> Result<Self> {
        let Layer::Sequential { layers } = &mut self.layer else {
            return Err(HfError::Core(kiln_core::Error::unsupported(
                "a new head on a model that is not a Sequential",
            )));
        };
        let at = layers.len() - 1;
        layers.truncate(at);
        layers.extend(head);
        let prefix = format!("{at}.");
        for m in self
            .names
            .mappings
            .iter()
            .filter(|m| m.kiln[0].starts_with(&prefix))
        {
            self.names.ignored.push(m.hf.clone());
        }
        self.names
            .mappings
            .retain(|m| !m.kiln[0].starts_with(&prefix));
        self.layer.validate()?;
        self.head_replaced = true;
        Ok(self)
    }

    /// The model as `transformers`' `*ForSequenceClassification` with
    /// `num_labels`: the hidden state of the last token through a new linear
    /// layer without bias (`score`), in place of the language-model head.
    pub fn with_num_labels(self, num_labels: usize) -> Result<Self> {
        let hidden = self.hidden_size()?;
        if !self.is_decoder() {
            // BERT and ViT: a new classifier after their pooling.
            return self.with_head(vec![kiln_core::model::LinearConfig::new(
                hidden, num_labels,
            )
            .into()]);
        }
        self.with_head(vec![
            Layer::Select { dim: 1, index: -1 },
            kiln_core::model::LinearConfig::new(hidden, num_labels)
                .with_bias(false)
                .into(),
        ])
    }

    /// The width of the hidden states (`hidden_size`, GPT-2's `n_embd`).
    pub fn hidden_size(&self) -> Result<usize> {
        self.config.usize(self.family.hidden_size_key)
    }

    /// Whether the model is a causal language model (which generates).
    pub fn is_decoder(&self) -> bool {
        self.family.is_decoder()
    }

    /// The family (`llama`, `qwen2`, `gpt2`, ...; it displays as its `model_type`).
    pub fn family(&self) -> &'static Family {
        self.family
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The config as read.
    pub fn config(&self) -> &HfConfig {
        &self.config
    }

    /// The Kiln definition: it takes `[batch, seq]` int64 token ids and gives
    /// `[batch, seq, vocab_size]` logits.
    pub fn layer(&self) -> &Layer {
        &self.layer
    }

    /// How checkpoint tensors map to the definition's.
    pub fn names(&self) -> &NameMap {
        &self.names
    }

    /// The tokens that end generation (`eos_token_id` of
    /// `generation_config.json`, else of `config.json`).
    pub fn eos_token_ids(&self) -> Result<Vec<i64>> {
        let generation = eos_token_ids_of(&self.dir.join("generation_config.json"))?;
        if !generation.is_empty() {
            return Ok(generation);
        }
        self.config.token_ids("eos_token_id")
    }

    /// The padding token (`pad_token_id`), if the config names one.
    pub fn pad_token_id(&self) -> Result<Option<i64>> {
        Ok(self.config.token_ids("pad_token_id")?.first().copied())
    }

    /// The files holding the weights: `model.safetensors`, or every shard
    /// `model.safetensors.index.json` lists.
    pub fn weight_files(&self) -> Result<Vec<PathBuf>> {
        weight_files_in(&self.dir)
    }

    /// Reads the weights into a state dict under the definition's names, in
    /// float32. A tensor of the checkpoint the model does not have, one it
    /// lacks, or one of the wrong shape is an error naming it.
    pub fn load_weights(&self) -> Result<StateDict> {
        let specs = self.layer.parameter_specs("")?;
        let shapes: HashMap<&str, &[usize]> = specs
            .iter()
            .map(|s| (s.name.as_str(), s.shape.as_slice()))
            .collect();
        let mut out = StateDict::new();
        let mut seen: Vec<&str> = Vec::new();
        for file in self.weight_files()? {
            let (tensors, _) = StateDict::load_safetensors(&file)?;
            for (name, tensor) in tensors {
                let Some(mapping) = self.names.find(&name) else {
                    if self.names.is_ignored(&name) {
                        continue;
                    }
                    return Err(HfError::UnexpectedTensor {
                        file,
                        name,
                        family: self.family.model_type,
                    });
                };
                // Never cast: an integer tensor where the model has float
                // weights is another kind of checkpoint (quantized, damaged).
                if !tensor.dtype().is_float() {
                    return Err(HfError::Config {
                        path: file,
                        key: name,
                        reason: format!(
                            "holds {:?} values where the model has floating-point weights; \
                             Kiln never casts integer tensors to float",
                            tensor.dtype()
                        ),
                    });
                }
                if let Some(bad) = peft::non_finite(&tensor) {
                    return Err(HfError::Config {
                        path: file,
                        key: name,
                        reason: format!("holds {bad}: the checkpoint is damaged or diverged"),
                    });
                }
                let expected = expected_shape(mapping, &shapes);
                if tensor.dims() != expected.as_slice() {
                    return Err(HfError::TensorShape {
                        file,
                        name,
                        expected,
                        actual: tensor.dims().to_vec(),
                    });
                }
                let part_shapes: Vec<&[usize]> = mapping
                    .kiln
                    .iter()
                    .map(|k| shapes.get(k.as_str()).copied().unwrap_or_default())
                    .collect();
                for (kiln, part) in
                    mapping
                        .kiln
                        .iter()
                        .zip(names::split(mapping, &tensor, &part_shapes)?)
                {
                    out.insert(kiln.clone(), part);
                }
                seen.push(mapping.hf.as_str());
            }
        }
        if let Some(missing) = self
            .names
            .mappings
            .iter()
            .find(|m| !seen.contains(&m.hf.as_str()))
        {
            return Err(HfError::MissingTensor {
                dir: self.dir.clone(),
                name: missing.hf.clone(),
                family: self.family.model_type,
            });
        }
        Ok(out)
    }

    /// Writes `weights` (under the definition's names) to `dir` as
    /// `model.safetensors` with this model's `config.json` (its `dtype` set to
    /// `float32`), plus the tokenizer and generation files of the source
    /// directory, so that `from_pretrained(dir)` loads them. `dir` is created
    /// when missing; a file already there is never replaced.
    pub fn save(&self, weights: &StateDict, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        if self.head_replaced {
            return Err(HfError::Core(kiln_core::Error::unsupported(
                "saving a model with a new head in the Hugging Face format: transformers' \
                 causal-LM class would miss it; save Kiln's checkpoint instead",
            )));
        }
        let mut hf = StateDict::new();
        for mapping in &self.names.mappings {
            let parts: Vec<&HostTensor> = mapping
                .kiln
                .iter()
                .map(|k| {
                    weights.get(k).ok_or_else(|| {
                        HfError::Core(kiln_core::Error::MissingKey {
                            key: k.clone(),
                            available: weights.len(),
                        })
                    })
                })
                .collect::<Result<_>>()?;
            hf.insert(
                mapping.hf.clone(),
                names::join(mapping, &parts)?.to_dtype(DType::F32),
            );
        }
        let copies: Vec<&str> = COPIED
            .iter()
            .copied()
            .filter(|f| self.dir.join(f).is_file())
            .collect();
        let mut targets = vec![dir.join(CONFIG), dir.join(WEIGHTS)];
        targets.extend(copies.iter().map(|f| dir.join(f)));
        if let Some(taken) = targets.iter().find(|t| t.exists()) {
            return Err(HfError::Core(kiln_core::Error::invalid_argument(
                "dir",
                format!(
                    "{} exists; Kiln never replaces a file it did not write (choose a new directory)",
                    taken.display()
                ),
            )));
        }
        std::fs::create_dir_all(dir).map_err(|e| kiln_core::Error::io(dir, e))?;
        let metadata = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
        hf.save_safetensors(dir.join(WEIGHTS), &metadata)?;
        let mut config = self.config.clone();
        config.set("dtype", serde_json::Value::from("float32"));
        write_new(&dir.join(CONFIG), config.to_json().as_bytes())?;
        for file in copies {
            let bytes = std::fs::read(self.dir.join(file))
                .map_err(|e| kiln_core::Error::io(self.dir.join(file), e))?;
            write_new(&dir.join(file), &bytes)?;
        }
        log::info!("saved the {} model to {}", self.family, dir.display());
        Ok(())
    }
}

/// The tokenizer and generation files a saved directory carries over.
const COPIED: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
];

/// The files holding the weights in `dir`: `model.safetensors`, or every
/// shard `model.safetensors.index.json` lists.
fn weight_files_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let dir = dir.to_path_buf();
    let single = dir.join(WEIGHTS);
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join(INDEX);
    if !index.is_file() {
        return Err(HfError::NotAModel {
            dir: dir.clone(),
            what: format!("neither {WEIGHTS} nor {INDEX} (Kiln reads safetensors weights only)"),
        });
    }
    let map = HfConfig::read(&index)?;
    let Some(weight_map) = map.get("weight_map").and_then(|v| v.as_object()) else {
        let found = match map.get("weight_map") {
            None => "missing".to_owned(),
            Some(v) if v.is_array() => "an array".to_owned(),
            Some(v) => format!("{v}"),
        };
        return Err(HfError::Config {
            path: index,
            key: "weight_map".to_owned(),
            reason: format!("{found}; expected an object of tensor name to shard file"),
        });
    };
    let mut files: Vec<PathBuf> = Vec::new();
    for (name, file) in weight_map {
        let Some(file) = file.as_str() else {
            return Err(HfError::Config {
                path: index,
                key: format!("weight_map.{name}"),
                reason: format!("expected a file name, got {file}"),
            });
        };
        if file.contains('/') || file.contains('\\') || file == ".." {
            return Err(HfError::Config {
                path: index,
                key: format!("weight_map.{name}"),
                reason: format!("{file:?} is not a file of the model directory"),
            });
        }
        let path = dir.join(file);
        if !files.contains(&path) {
            files.push(path);
        }
    }
    Ok(files)
}

/// The end-of-sequence ids a model directory's files name (what
/// [`Pretrained::eos_token_ids`] reads), for a directory that is only a
/// tokenizer's and generation settings' (a Kiln checkpoint's `--tokenizer`):
/// `generation_config.json`'s, else `config.json`'s, else none.
pub fn eos_token_ids_in(dir: &Path) -> Result<Vec<i64>> {
    for name in ["generation_config.json", CONFIG] {
        let ids = eos_token_ids_of(&dir.join(name))?;
        if !ids.is_empty() {
            return Ok(ids);
        }
    }
    Ok(Vec::new())
}

/// The sampling settings a model's `generation_config.json` gives
/// `generate()` by default (none when the file is absent): `transformers`
/// samples when `do_sample` is true, with these unless a call overrides them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingDefaults {
    /// `do_sample`: sample rather than decode greedily.
    pub do_sample: bool,
    /// `temperature`.
    pub temperature: Option<f64>,
    /// `top_k` (0, no filtering, reads as `None`).
    pub top_k: Option<usize>,
    /// `top_p` (1, no filtering, reads as `None`).
    pub top_p: Option<f64>,
}

/// The [`SamplingDefaults`] of the model directory `dir`.
pub fn sampling_defaults_in(dir: &Path) -> Result<SamplingDefaults> {
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(SamplingDefaults::default());
    }
    let config = HfConfig::read(&path)?;
    let temperature = match config.get("temperature") {
        None => None,
        Some(_) => Some(config.f64_or("temperature", 1.0)?),
    };
    let top_p = match config.get("top_p") {
        None => None,
        Some(_) => Some(config.f64_or("top_p", 1.0)?).filter(|p| *p < 1.0),
    };
    Ok(SamplingDefaults {
        do_sample: config.bool_or("do_sample", false)?,
        temperature,
        top_k: config.opt_usize("top_k")?.filter(|k| *k > 0),
        top_p,
    })
}

/// The `eos_token_id`s the JSON file at `path` names (none when it is absent).
fn eos_token_ids_of(path: &Path) -> Result<Vec<i64>> {
    if !path.is_file() {
        return Ok(Vec::new());
    }
    HfConfig::read(path)?.token_ids("eos_token_id")
}

/// Writes a file that must not exist yet.
fn write_new(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| kiln_core::Error::io(path, e))?;
    file.write_all(bytes)
        .map_err(|e| kiln_core::Error::io(path, e))?;
    Ok(())
}

/// The checkpoint shape of `mapping`'s tensor: its Kiln tensors' rows stacked,
/// transposed back where the checkpoint stores `[in, out]`.
fn expected_shape(mapping: &Mapping, shapes: &HashMap<&str, &[usize]>) -> Vec<usize> {
    if let Some(shape) = &mapping.hf_shape {
        return shape.clone();
    }
    let mut dims: Vec<usize> = shapes
        .get(mapping.kiln[0].as_str())
        .map(|s| s.to_vec())
        .unwrap_or_default();
    if let Some(first) = dims.first_mut() {
        // Fused tensors stack their parts' rows.
        *first = mapping
            .kiln
            .iter()
            .filter_map(|k| shapes.get(k.as_str()).and_then(|s| s.first()))
            .sum();
    }
    if mapping.transposed && dims.len() == 2 {
        dims.swap(0, 1);
    }
    dims
}
