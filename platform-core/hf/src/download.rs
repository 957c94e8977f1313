//! Hub models downloaded into the local cache through the `hf-hub` crate, as
//! `huggingface_hub` lays it out: blobs under `blobs/`, linked from
//! `snapshots/<commit>/`, and `refs/<revision>` naming the commit.
//!
//! Only what Kiln reads is fetched: `config.json`, the tokenizer and
//! generation files, and the safetensors weights (`model.safetensors`, or the
//! index and every shard it lists). The files come from one commit; each
//! blob named by its sha256 (every LFS file) is checked against it.

use std::collections::BTreeSet;
use std::io::{IsTerminal, Read};
use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use sha2::{Digest, Sha256};

use crate::error::{DownloadFailure, HfError, Result};
use crate::hub::{is_commit, HubCache};
use crate::{CONFIG, INDEX, WEIGHTS};

/// The files of a model repository Kiln reads, beside the weights, when the
/// repository has them.
const OPTIONAL: [&str; 6] = [
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// Weight files Kiln does not read, named when a repository has only those.
const OTHER_WEIGHTS: [&str; 4] = [".bin", ".pt", ".pth", ".gguf"];

/// Where and how models are downloaded from the Hub: its endpoint, the token,
/// and whether to draw progress bars.
///
/// ```no_run
/// use kiln_hf::{HubCache, HubClient};
///
/// let dir = HubClient::from_env().download(&HubCache::from_env(), "Qwen/Qwen3-0.6B", "main")?;
/// assert!(dir.join("config.json").is_file());
/// # Ok::<(), kiln_hf::HfError>(())
/// ```
#[derive(Clone, Debug)]
pub struct HubClient {
    endpoint: String,
    token: Option<String>,
    progress: bool,
}

impl HubClient {
    /// The client `huggingface_hub` configures from the environment:
    /// `HF_ENDPOINT` (default `https://huggingface.co`), the token from
    /// `HF_TOKEN`, else the file `HF_TOKEN_PATH`, else `HF_HOME/token` (where
    /// `hf auth login` writes it), and progress bars on a terminal unless
    /// `HF_HUB_DISABLE_PROGRESS_BARS` is set.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let endpoint = var("HF_ENDPOINT")
            .map(|e| e.trim_end_matches('/').to_owned())
            .unwrap_or_else(|| "https://huggingface.co".to_owned());
        let token_file = var("HF_TOKEN_PATH")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home().join("token"));
        let token = var("HF_TOKEN")
            .or_else(|| std::fs::read_to_string(token_file).ok())
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty());
        let progress = std::io::stderr().is_terminal() && !flag("HF_HUB_DISABLE_PROGRESS_BARS");
        HubClient {
            endpoint,
            token,
            progress,
        }
    }

    /// The Hub at `endpoint` (`"https://huggingface.co"`), without a token
    /// or progress bars.
    pub fn new(endpoint: impl Into<String>) -> Self {
        HubClient {
            endpoint: endpoint.into().trim_end_matches('/').to_owned(),
            token: None,
            progress: false,
        }
    }

    /// With `token` sent as `Authorization: Bearer` (gated models).
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }

    /// The endpoint downloads come from.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Downloads model `repo_id` at `revision` (a branch, tag or commit) into
    /// `cache`, unless the cache already holds every file Kiln reads, and
    /// returns its snapshot directory.
    ///
    /// Processes downloading the same model (the ranks of one job) wait for
    /// each other; the second finds the first's files. Errors:
    /// [`HfError::Download`] naming the endpoint and what failed (no such
    /// model or revision, a gated model without a token, no connection, a
    /// repository without safetensors weights, a file whose sha256 is not
    /// the Hub's).
    pub fn download(&self, cache: &HubCache, repo_id: &str, revision: &str) -> Result<PathBuf> {
        cache.check_names(repo_id, revision)?;
        let what_cache_has = || match cache.snapshot(repo_id, revision) {
            Ok(dir) if complete(&dir) => Ok(Ok(dir)),
            Ok(dir) => Ok(Err(format!("lacks weight files in {}", dir.display()))),
            Err(HfError::NotInCache { reason, .. }) => Ok(Err(reason)),
            Err(e) => Err(e),
        };
        if let Ok(dir) = what_cache_has()? {
            return Ok(dir);
        }
        let lock = self.lock(cache, repo_id)?;
        // Another process may have finished while this one waited.
        let in_cache = match what_cache_has()? {
            Ok(dir) => return Ok(dir),
            Err(reason) => reason,
        };
        let fail = |reason: String| {
            HfError::Download(Box::new(DownloadFailure {
                repo_id: repo_id.to_owned(),
                revision: revision.to_owned(),
                endpoint: self.endpoint.clone(),
                cache: cache.root().to_owned(),
                in_cache: in_cache.clone(),
                reason,
            }))
        };
        let api = ApiBuilder::from_cache(Cache::new(cache.root().to_owned()))
            .with_endpoint(self.endpoint.clone())
            .with_token(self.token.clone())
            .with_progress(self.progress)
            .with_retries(2)
            .build()
            .map_err(|e| fail(format!("could not start the HTTP client: {e}")))?;
        let repo = api.repo(Repo::with_revision(
            repo_id.to_owned(),
            RepoType::Model,
            revision.to_owned(),
        ));
        let info = repo
            .info()
            .map_err(|e| fail(self.explain(&e, "its file list")))?;
        if !is_commit(&info.sha) {
            return Err(fail(format!(
                "the Hub answered commit {:?}, not a commit hash",
                info.sha
            )));
        }
        log::info!(
            "downloading Hub model {repo_id} at {revision} (commit {}) from {} into {}",
            info.sha,
            self.endpoint,
            cache.root().display()
        );
        // hf-hub names a ref after the revision asked for, even a commit;
        // `huggingface_hub` keeps refs for branches and tags only, so one this
        // download adds for a commit is removed after it.
        let commit_ref = cache.repo_dir(repo_id).join("refs").join(revision);
        let added_ref = is_commit(revision) && !commit_ref.exists();
        let listed: BTreeSet<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
        let snapshot = cache.repo_dir(repo_id).join("snapshots").join(&info.sha);
        let fetch = |name: &str| -> Result<PathBuf> {
            // A file of this commit that an interrupted download left complete.
            if snapshot.join(name).is_file() {
                return Ok(snapshot.join(name));
            }
            let path = repo
                .download(name)
                .map_err(|e| fail(self.explain(&e, name)))?;
            self.check_file(&path, &info.sha, name).map_err(fail)?;
            Ok(path)
        };
        let wanted = wanted_files(&listed, fetch).map_err(|e| match e {
            HfError::Download(_) => e,
            other => fail(other.to_string()),
        })?;
        log::info!("downloaded Hub model {repo_id}: {}", wanted.join(", "));
        if added_ref {
            let _ = std::fs::remove_file(&commit_ref);
        }
        drop(lock);
        let dir = snapshot;
        if !complete(&dir) {
            return Err(fail(format!(
                "snapshot {} lacks some of {} after the download",
                dir.display(),
                wanted.join(", ")
            )));
        }
        Ok(dir)
    }

    /// Holds the repository's download lock in the cache's `.locks/`, as
    /// `huggingface_hub` keeps its own per-file locks there.
    fn lock(&self, cache: &HubCache, repo_id: &str) -> Result<std::fs::File> {
        let dir = cache
            .root()
            .join(".locks")
            .join(format!("models--{}", repo_id.replace('/', "--")));
        let path = dir.join("kiln-download.lock");
        let open = || -> std::io::Result<std::fs::File> {
            std::fs::create_dir_all(&dir)?;
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)?;
            file.lock()?;
            Ok(file)
        };
        open().map_err(|e| HfError::Core(kiln_core::Error::io(&path, e)))
    }

    /// Checks that `path` is in snapshot `commit`, and that a blob named by a
    /// sha256 holds bytes with that sha256 (it is removed if not).
    fn check_file(&self, path: &Path, commit: &str, name: &str) -> Result<(), String> {
        let in_commit = path
            .parent()
            .and_then(|p| {
                p.ancestors()
                    .find(|a| a.file_name().is_some_and(|n| n == commit))
            })
            .is_some();
        if !in_commit {
            return Err(format!(
                "{name} came from another commit than {commit} ({}): the revision moved during \
                 the download; run again",
                path.display()
            ));
        }
        let blob = std::fs::canonicalize(path).map_err(|e| format!("{name}: {e}"))?;
        let Some(expected) = blob.file_name().and_then(|n| n.to_str()).map(str::to_owned) else {
            return Ok(());
        };
        if expected.len() != 64 || !expected.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(());
        }
        let actual = sha256(&blob).map_err(|e| format!("{name}: {e}"))?;
        if actual != expected.to_ascii_lowercase() {
            let _ = std::fs::remove_file(path);
            let _ = std::fs::remove_file(&blob);
            return Err(format!(
                "{name} arrived damaged: its sha256 is {actual}, the Hub's is {expected} \
                 (the file was removed; run again)"
            ));
        }
        Ok(())
    }

    /// What went wrong asking the Hub for `what`, with what to do about it.
    fn explain(&self, error: &ApiError, what: &str) -> String {
        if let ApiError::RequestError(e) = error {
            return match e.as_ref() {
                ureq::Error::Status(code, _) => status_reason(*code, what, self.token.is_some()),
                ureq::Error::Transport(t) => format!("{what}: could not reach the Hub: {t}"),
            };
        }
        format!("{what}: {error}")
    }
}

/// The files of a repository listing `listed` that Kiln reads, fetched with
/// `fetch`: `config.json`, the optional files present, and the safetensors
/// weights (`model.safetensors`, as `from_pretrained` prefers it, else the
/// index and each shard it names).
fn wanted_files(
    listed: &BTreeSet<&str>,
    fetch: impl Fn(&str) -> Result<PathBuf>,
) -> Result<Vec<String>> {
    let missing = |what: String| HfError::Core(kiln_core::Error::invalid_argument("model", what));
    if !listed.contains(CONFIG) {
        return Err(missing(format!(
            "the repository has no {CONFIG}: it is not a transformers model ({} files: {})",
            listed.len(),
            listed
                .iter()
                .take(8)
                .copied()
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let mut files = vec![CONFIG.to_owned()];
    files.extend(
        OPTIONAL
            .iter()
            .filter(|f| listed.contains(**f))
            .map(|f| (*f).to_owned()),
    );
    if listed.contains(WEIGHTS) {
        files.push(WEIGHTS.to_owned());
    } else if listed.contains(INDEX) {
        let index = fetch(INDEX)?;
        let shards = shard_names(&index)?;
        if let Some(absent) = shards.iter().find(|s| !listed.contains(s.as_str())) {
            return Err(missing(format!(
                "{INDEX} names shard {absent}, which the repository does not have"
            )));
        }
        files.push(INDEX.to_owned());
        files.extend(shards);
    } else {
        let others: Vec<&str> = listed
            .iter()
            .copied()
            .filter(|f| OTHER_WEIGHTS.iter().any(|ext| f.ends_with(ext)))
            .collect();
        return Err(missing(format!(
            "the repository has no {WEIGHTS} nor {INDEX}: Kiln reads safetensors weights only{}",
            if others.is_empty() {
                String::new()
            } else {
                format!(" (it has {})", others.join(", "))
            }
        )));
    }
    for name in files.iter().filter(|f| f.as_str() != INDEX) {
        fetch(name)?;
    }
    Ok(files)
}

/// The shard files a safetensors index names, in order, once each.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let bad = |reason: String| HfError::Config {
        path: index.to_owned(),
        key: "weight_map".into(),
        reason,
    };
    let text = std::fs::read_to_string(index).map_err(|e| bad(e.to_string()))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = value["weight_map"]
        .as_object()
        .ok_or_else(|| bad("expected an object of tensor names to shard files".into()))?;
    let mut shards = BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .filter(|f| f.ends_with(".safetensors") && !f.contains("..") && !f.starts_with('/'))
            .ok_or_else(|| {
                bad(format!(
                    "{tensor}: expected a .safetensors file name, got {file}"
                ))
            })?;
        shards.insert(file.to_owned());
    }
    Ok(shards.into_iter().collect())
}

/// Whether snapshot `dir` holds `config.json` and every weight file.
pub(crate) fn complete(dir: &Path) -> bool {
    if !dir.join(CONFIG).is_file() {
        return false;
    }
    if dir.join(WEIGHTS).is_file() {
        return true;
    }
    let index = dir.join(INDEX);
    index.is_file()
        && shard_names(&index).is_ok_and(|shards| shards.iter().all(|s| dir.join(s).is_file()))
}

/// What a Hub answer with HTTP status `code` means for `what`.
fn status_reason(code: u16, what: &str, token: bool) -> String {
    match code {
        401 | 403 if !token => format!(
            "{what}: the Hub answered {code}: the model is gated or private; accept its licence \
             on the Hub, then set HF_TOKEN (or run `hf auth login`)"
        ),
        401 | 403 => format!(
            "{what}: the Hub answered {code}: the token (HF_TOKEN, or HF_HOME/token) has no \
             access to this model; accept its licence on the Hub, or use another token"
        ),
        404 => format!("{what}: the Hub answered 404: no such model, revision or file"),
        429 => format!("{what}: the Hub answered 429: too many requests; wait and run again"),
        _ => format!("{what}: the Hub answered HTTP {code}"),
    }
}

/// The sha256 of file `path`, in lowercase hex.
fn sha256(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// `HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`.
pub(crate) fn hf_home() -> PathBuf {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
        var("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from(".cache"))
            .join("huggingface")
    })
}

/// Whether the boolean environment variable `name` is set as
/// `huggingface_hub` reads one: `1`, `ON`, `YES` or `TRUE`, in any case.
pub(crate) fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_uppercase().as_str(),
            "1" | "ON" | "YES" | "TRUE"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_files_kiln_reads_are_chosen_from_a_listing() {
        let listed: BTreeSet<&str> = [
            "config.json",
            "model.safetensors",
            "pytorch_model.bin",
            "tokenizer.json",
            "README.md",
        ]
        .into();
        let fetched = std::cell::RefCell::new(Vec::new());
        let files = wanted_files(&listed, |name| {
            fetched.borrow_mut().push(name.to_owned());
            Ok(PathBuf::from(name))
        })
        .unwrap();
        assert_eq!(
            files,
            ["config.json", "tokenizer.json", "model.safetensors"]
        );
        assert_eq!(*fetched.borrow(), files);

        let bin_only: BTreeSet<&str> = ["config.json", "pytorch_model.bin"].into();
        let err = wanted_files(&bin_only, |n| Ok(PathBuf::from(n))).unwrap_err();
        assert!(
            err.to_string().contains("(it has pytorch_model.bin)"),
            "{err}"
        );
        let no_config: BTreeSet<&str> = ["model.safetensors"].into();
        let err = wanted_files(&no_config, |n| Ok(PathBuf::from(n))).unwrap_err();
        assert!(err.to_string().contains("no config.json"), "{err}");
    }

    #[test]
    fn hub_statuses_say_what_to_do() {
        assert!(status_reason(401, "config.json", false).contains("set HF_TOKEN"));
        assert!(status_reason(403, "x", true).contains("no access"));
        assert!(status_reason(404, "x", false).contains("no such model"));
    }
}
