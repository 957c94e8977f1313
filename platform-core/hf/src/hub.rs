//! Models named as on the Hub (`"Qwen/Qwen3-0.6B"`), found in the local
//! Hugging Face cache as `huggingface_hub` lays it out:
//! `<cache>/models--<org>--<name>/refs/<revision>` holds a commit, whose
//! files are under `snapshots/<commit>/`. The cache is `HF_HUB_CACHE`, else
//! `HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
//! `~/.cache/huggingface/hub`. A model the cache lacks is downloaded into it
//! ([`HubClient`](crate::HubClient)) unless `HF_HUB_OFFLINE` is set.

use std::path::{Path, PathBuf};

use crate::error::{HfError, Result};
use crate::HubClient;

/// The local Hugging Face cache of Hub repositories.
///
/// ```no_run
/// use kiln_hf::HubCache;
///
/// let dir = HubCache::from_env().snapshot("Qwen/Qwen3-0.6B", "main")?;
/// assert!(dir.join("config.json").is_file());
/// # Ok::<(), kiln_hf::HfError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubCache {
    root: PathBuf,
}

impl HubCache {
    /// The cache at `root` (a `hub` directory).
    pub fn at(root: impl Into<PathBuf>) -> Self {
        HubCache { root: root.into() }
    }

    /// The cache `huggingface_hub` uses, from the environment.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        if let Some(cache) = var("HF_HUB_CACHE").or_else(|| var("HUGGINGFACE_HUB_CACHE")) {
            return HubCache::at(cache);
        }
        HubCache::at(crate::download::hf_home().join("hub"))
    }

    /// The cache's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The snapshot directory of model `repo_id` at `revision` (a branch or
    /// tag that `refs/` records, or a commit hash), holding its `config.json`.
    pub fn snapshot(&self, repo_id: &str, revision: &str) -> Result<PathBuf> {
        self.check_names(repo_id, revision)?;
        let repo = self.repo_dir(repo_id);
        if !repo.is_dir() {
            return Err(self.missing(repo_id, revision, "is not in the cache"));
        }
        let commit = match std::fs::read_to_string(repo.join("refs").join(revision)) {
            Ok(text) => text.trim().to_owned(),
            Err(_) if is_commit(revision) => revision.to_owned(),
            Err(_) => {
                let known = refs(&repo.join("refs"));
                return Err(self.missing(
                    repo_id,
                    revision,
                    &format!(
                        "has no revision {revision:?} in the cache (refs: {})",
                        if known.is_empty() {
                            "none".to_owned()
                        } else {
                            known.join(", ")
                        }
                    ),
                ));
            }
        };
        if !is_commit(&commit) {
            return Err(self.missing(
                repo_id,
                revision,
                &format!("has a damaged ref {revision:?} (not a commit hash: {commit:?})"),
            ));
        }
        let snapshot = repo.join("snapshots").join(&commit);
        if !snapshot.join("config.json").is_file() {
            return Err(self.missing(
                repo_id,
                revision,
                &format!(
                    "has no config.json in snapshot {commit} (a partial download: fetch it again)"
                ),
            ));
        }
        Ok(snapshot)
    }

    /// Refuses a `repo_id` that is not a Hub model id and a `revision` that
    /// could name a path outside the cache.
    pub(crate) fn check_names(&self, repo_id: &str, revision: &str) -> Result<()> {
        if !is_repo_id(repo_id) {
            return Err(self.missing(repo_id, revision, "is not a Hub model id (`org/name`)"));
        }
        if revision.is_empty()
            || revision.contains("..")
            || revision.starts_with('/')
            || revision.contains('\\')
        {
            return Err(self.missing(repo_id, revision, "is not a revision name"));
        }
        Ok(())
    }

    /// The directory of model `repo_id` in the cache (`models--org--name`).
    pub(crate) fn repo_dir(&self, repo_id: &str) -> PathBuf {
        self.root
            .join(format!("models--{}", repo_id.replace('/', "--")))
    }

    fn missing(&self, repo_id: &str, revision: &str, reason: &str) -> HfError {
        HfError::NotInCache {
            repo_id: repo_id.to_owned(),
            revision: revision.to_owned(),
            cache: self.root.clone(),
            reason: reason.to_owned(),
        }
    }
}

/// The model directory `name` means: an existing path as it is, else a Hub
/// model id (`"Qwen/Qwen3-0.6B"`) at `revision` (default `"main"`) in the
/// cache of [`HubCache::from_env`], downloaded into it first by
/// [`HubClient::from_env`] when the cache lacks any file Kiln reads, unless
/// `HF_HUB_OFFLINE` is set (then [`HfError::Offline`]). A revision the cache
/// has whole is used as it is, without asking the Hub.
pub fn resolve_model(name: &str, revision: Option<&str>) -> Result<PathBuf> {
    let path = Path::new(name);
    if path.exists() {
        if let Some(revision) = revision {
            return Err(HfError::Core(kiln_core::Error::invalid_argument(
                "revision",
                format!("{revision:?} names a revision of a Hub model, but {name} is a local path"),
            )));
        }
        return Ok(path.to_owned());
    }
    if !is_repo_id(name) {
        return Err(HfError::Core(kiln_core::Error::io(
            path,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no such directory (nor a Hub model id, `org/name`)",
            ),
        )));
    }
    let cache = HubCache::from_env();
    let revision = revision.unwrap_or("main");
    let cached = cache.snapshot(name, revision);
    match &cached {
        Ok(dir) if crate::download::complete(dir) => return cached,
        Err(HfError::NotInCache { .. }) | Ok(_) => {}
        Err(_) => return cached,
    }
    cache.check_names(name, revision)?;
    if crate::download::flag("HF_HUB_OFFLINE") {
        return match cached {
            // Whatever it lacks is named when it is read.
            Ok(dir) => Ok(dir),
            Err(e) => Err(HfError::Offline {
                not_in_cache: Box::new(e),
                repo_id: name.to_owned(),
            }),
        };
    }
    HubClient::from_env().download(&cache, name, revision)
}

/// Whether `id` is a Hub repository id: `name` or `org/name`, of letters,
/// digits, `-`, `_` and `.`, without `--` or `..`, at most 96 characters.
pub fn is_repo_id(id: &str) -> bool {
    let parts: Vec<&str> = id.split('/').collect();
    id.len() <= 96
        && (1..=2).contains(&parts.len())
        && parts.iter().all(|p| {
            !p.is_empty()
                && !p.starts_with(['-', '.'])
                && !p.ends_with(['-', '.'])
                && !p.contains("--")
                && !p.contains("..")
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
}

/// Whether `s` is a full commit hash (40 lowercase hex digits).
pub(crate) fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f'))
}

/// The revisions `refs` records (branches and tags, `refs/pr/1` as `pr/1`).
fn refs(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![(dir.to_owned(), String::new())];
    while let Some((d, prefix)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let name = format!("{prefix}{}", e.file_name().to_string_lossy());
            if e.path().is_dir() {
                stack.push((e.path(), format!("{name}/")));
            } else {
                out.push(name);
            }
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_are_told_from_paths() {
        for id in [
            "Qwen/Qwen3-0.6B",
            "gpt2",
            "meta-llama/Llama-3.2-1B",
            "a.b/c_d",
        ] {
            assert!(is_repo_id(id), "{id}");
        }
        for id in [
            "", "a/b/c", "../x", "a/..", "org--x/y", "/abs", "a/", "x y", "a/b..",
        ] {
            assert!(!is_repo_id(id), "{id}");
        }
    }
}
