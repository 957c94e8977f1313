//! What can go wrong reading or writing a Hugging Face model directory.

use std::path::PathBuf;

/// A problem with a Hugging Face model directory, naming the file, key or
/// tensor at fault and what was expected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HfError {
    /// The directory lacks a file every model directory has.
    #[error("{}: not a Hugging Face model directory: {what}", .dir.display())]
    NotAModel {
        /// The directory.
        dir: PathBuf,
        /// What is missing (`config.json`, the weights).
        what: String,
    },
    /// A model named as on the Hub that the local cache does not hold.
    #[error(
        "Hub model {repo_id:?} at revision {revision:?} {reason}, in the Hugging Face cache {} \
         (HF_HUB_CACHE, or HF_HOME/hub)",
        .cache.display()
    )]
    NotInCache {
        /// The model's id (`"Qwen/Qwen3-0.6B"`).
        repo_id: String,
        /// The revision asked for.
        revision: String,
        /// The cache looked in.
        cache: PathBuf,
        /// What is missing.
        reason: String,
    },
    /// A model the cache lacks, with downloads switched off by `HF_HUB_OFFLINE`.
    #[error(
        "{not_in_cache}; HF_HUB_OFFLINE is set, so Kiln does not download it: unset \
         HF_HUB_OFFLINE, fetch it with `hf download {repo_id}`, or give a local directory"
    )]
    Offline {
        /// What the cache lacks ([`HfError::NotInCache`]).
        not_in_cache: Box<HfError>,
        /// The model's id.
        repo_id: String,
    },
    /// A model the cache lacks, which could not be downloaded.
    #[error("{0}")]
    Download(Box<DownloadFailure>),
    /// `config.json` (or another JSON file) is malformed or lacks a key.
    #[error("{}: `{key}`: {reason}", .path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// The key at fault.
        key: String,
        /// What is wrong and what was expected.
        reason: String,
    },
    /// A `model_type` Kiln does not build.
    #[error("{}: `model_type` {model_type:?} is not a family Kiln builds (supported: {supported})", .path.display())]
    UnknownFamily {
        /// The `config.json`.
        path: PathBuf,
        /// The family named by the file.
        model_type: String,
        /// The families Kiln builds.
        supported: String,
    },
    /// A config key whose value changes the model in a way Kiln does not implement.
    #[error("{}: `{key}` = {value} is not supported: {reason}", .path.display())]
    UnsupportedKey {
        /// The `config.json`.
        path: PathBuf,
        /// The key.
        key: String,
        /// Its value, as JSON.
        value: String,
        /// What Kiln implements instead.
        reason: String,
    },
    /// The weights hold a tensor the model does not have.
    #[error("{}: unexpected tensor `{name}`: a {family} model with this config has no such weight", .file.display())]
    UnexpectedTensor {
        /// The safetensors file.
        file: PathBuf,
        /// The tensor's name.
        name: String,
        /// The family.
        family: &'static str,
    },
    /// The weights lack a tensor the model needs.
    #[error("{}: missing tensor `{name}` of the {family} model", .dir.display())]
    MissingTensor {
        /// The model directory.
        dir: PathBuf,
        /// The tensor's name in the checkpoint.
        name: String,
        /// The family.
        family: &'static str,
    },
    /// A tensor of the wrong shape.
    #[error("{}: tensor `{name}` has shape {actual:?}, the config gives {expected:?}", .file.display())]
    TensorShape {
        /// The file holding it.
        file: PathBuf,
        /// The tensor's name.
        name: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The file's shape.
        actual: Vec<usize>,
    },
    /// A tokenizer file that cannot be read.
    #[error("{}: {reason}", .path.display())]
    Tokenizer {
        /// The `tokenizer.json`.
        path: PathBuf,
        /// The tokenizers crate's message.
        reason: String,
    },
    /// A chat template that cannot be read, parsed or rendered: `origin` is
    /// its file (`tokenizer_config.json`, `chat_template.jinja`), `line` the
    /// template line where it failed when known.
    #[error("{origin}{}: {reason}", .line.map(|l| format!(", template line {l}")).unwrap_or_default())]
    ChatTemplate {
        /// Where the template comes from.
        origin: String,
        /// The template's line (1-based) where parsing or rendering failed.
        line: Option<usize>,
        /// What went wrong, as the template engine or the template says.
        reason: String,
    },
    /// A PEFT adapter that does not fit: another base model, another kind of
    /// adapter, a setting Kiln does not implement.
    #[error("{}: {reason}", .path.display())]
    Adapter {
        /// The adapter directory or file.
        path: PathBuf,
        /// What is wrong, and what was expected.
        reason: String,
    },
    /// Reading or writing a file, or a Kiln check, failed.
    #[error(transparent)]
    Core(#[from] kiln_core::Error),
}

/// A failed download ([`HfError::Download`]): the model, where it was to come
/// from and go, and what failed.
#[derive(Debug, thiserror::Error)]
#[error(
    "Hub model {repo_id:?} at revision {revision:?} {in_cache}, in the Hugging Face cache {} \
     (HF_HUB_CACHE, or HF_HOME/hub), and downloading it from {endpoint} (HF_ENDPOINT) failed: \
     {reason}",
    .cache.display()
)]
#[non_exhaustive]
pub struct DownloadFailure {
    /// The model's id.
    pub repo_id: String,
    /// The revision asked for.
    pub revision: String,
    /// The Hub asked (`HF_ENDPOINT`).
    pub endpoint: String,
    /// The cache it was to go into.
    pub cache: PathBuf,
    /// What the cache lacks (`"is not in the cache"`).
    pub in_cache: String,
    /// What failed, and what to do about it.
    pub reason: String,
}

/// Results of this crate.
pub type Result<T, E = HfError> = std::result::Result<T, E>;

impl From<HfError> for kiln_core::Error {
    fn from(e: HfError) -> Self {
        match e {
            HfError::Core(inner) => inner,
            other => kiln_core::Error::Checkpoint {
                path: match &other {
                    HfError::NotAModel { dir, .. } | HfError::MissingTensor { dir, .. } => {
                        dir.clone()
                    }
                    HfError::NotInCache { cache, .. } => cache.clone(),
                    HfError::Download(failure) => failure.cache.clone(),
                    HfError::Offline { not_in_cache, .. } => match not_in_cache.as_ref() {
                        HfError::NotInCache { cache, .. } => cache.clone(),
                        _ => PathBuf::new(),
                    },
                    HfError::Config { path, .. }
                    | HfError::UnknownFamily { path, .. }
                    | HfError::UnsupportedKey { path, .. }
                    | HfError::Tokenizer { path, .. }
                    | HfError::Adapter { path, .. } => path.clone(),
                    HfError::UnexpectedTensor { file, .. } | HfError::TensorShape { file, .. } => {
                        file.clone()
                    }
                    HfError::Core(_) => PathBuf::new(),
                    HfError::ChatTemplate { origin, .. } => PathBuf::from(origin),
                },
                reason: other.to_string(),
                source: None,
            },
        }
    }
}
