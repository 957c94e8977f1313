//! Reading `config.json`: typed values by key, with errors that name the file,
//! the key and what was expected.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{HfError, Result};

/// A model's `config.json`, read.
#[derive(Clone, Debug)]
pub struct HfConfig {
    path: PathBuf,
    map: Map<String, Value>,
}

impl HfConfig {
    /// `json` as a `config.json` (the unit tests' configs).
    #[cfg(test)]
    pub(crate) fn test(json: &str) -> Self {
        HfConfig::parse(Path::new("config.json"), json).expect("a test config")
    }

    /// Reads and parses `path`.
    pub fn read(path: &Path) -> Result<Self> {
        let text = kiln_core::fs::read_regular_to_string(path)?;
        Self::parse(path, &text)
    }

    /// Parses `text`, the contents of `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| HfError::Config {
            path: path.to_owned(),
            key: "(file)".to_owned(),
            reason: format!("not JSON: {e}"),
        })?;
        match value {
            Value::Object(map) => Ok(HfConfig {
                path: path.to_owned(),
                map,
            }),
            _ => Err(HfError::Config {
                path: path.to_owned(),
                key: "(file)".to_owned(),
                reason: "a config is a JSON object".to_owned(),
            }),
        }
    }

    /// The file it came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The whole object.
    pub fn as_map(&self) -> &Map<String, Value> {
        &self.map
    }

    /// The value of `key`, `None` when absent or `null`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn wrong(&self, key: &str, expected: &str) -> HfError {
        HfError::Config {
            path: self.path.clone(),
            key: key.to_owned(),
            reason: match self.map.get(key) {
                Some(v) => format!("expected {expected}, got {v}"),
                None => format!("missing; expected {expected}"),
            },
        }
    }

    /// A required non-negative integer.
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.wrong(key, "a non-negative integer"))
    }

    /// An optional non-negative integer.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| self.wrong(key, "a non-negative integer")),
        }
    }

    /// A number, `default` when absent.
    pub fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| self.wrong(key, "a number")),
        }
    }

    /// A boolean, `default` when absent.
    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.wrong(key, "true or false")),
        }
    }

    /// A string, `default` when absent.
    pub fn str_or<'a>(&'a self, key: &str, default: &'a str) -> Result<&'a str> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_str().ok_or_else(|| self.wrong(key, "a string")),
        }
    }

    /// The token ids of `key`: one integer or a list (`eos_token_id`).
    pub fn token_ids(&self, key: &str) -> Result<Vec<i64>> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_i64()
                        .ok_or_else(|| self.wrong(key, "a token id or a list of them"))
                })
                .collect(),
            Some(v) => v
                .as_i64()
                .map(|id| vec![id])
                .ok_or_else(|| self.wrong(key, "a token id or a list of them")),
        }
    }

    /// Refuses `key` when present with a value other than those `ok` accepts.
    pub fn refuse_unless(
        &self,
        key: &str,
        ok: impl Fn(&Value) -> bool,
        reason: &str,
    ) -> Result<()> {
        match self.get(key) {
            Some(v) if !ok(v) => Err(HfError::UnsupportedKey {
                path: self.path.clone(),
                key: key.to_owned(),
                value: v.to_string(),
                reason: reason.to_owned(),
            }),
            _ => Ok(()),
        }
    }

    /// Checks the attention sizes every family derives its heads from:
    /// `heads` (the value of `heads_key`) at least 1 and, when the config gives
    /// no `head_dim`, dividing `hidden` (of `hidden_key`); an error names the
    /// config's keys, not the layers built from them.
    pub fn check_heads(
        &self,
        hidden_key: &str,
        hidden: usize,
        heads_key: &str,
        heads: usize,
    ) -> Result<()> {
        if heads == 0 {
            return Err(HfError::Config {
                path: self.path.clone(),
                key: heads_key.to_owned(),
                reason: "is 0; attention needs at least one head".to_owned(),
            });
        }
        if self.get("head_dim").is_none() && !hidden.is_multiple_of(heads) {
            return Err(HfError::Config {
                path: self.path.clone(),
                key: hidden_key.to_owned(),
                reason: format!(
                    "is {hidden}, which {heads_key} = {heads} does not divide: each head takes \
                     {hidden_key} / {heads_key} features (or give head_dim)"
                ),
            });
        }
        Ok(())
    }

    /// An [`HfError::UnsupportedKey`] for `key`.
    pub fn unsupported(&self, key: &str, reason: impl Into<String>) -> HfError {
        HfError::UnsupportedKey {
            path: self.path.clone(),
            key: key.to_owned(),
            value: self
                .map
                .get(key)
                .map_or_else(|| "(absent)".to_owned(), Value::to_string),
            reason: reason.into(),
        }
    }

    /// Sets `key` (when a saved copy records what changed).
    pub fn set(&mut self, key: &str, value: Value) {
        self.map.insert(key.to_owned(), value);
    }

    /// The config as pretty JSON.
    pub fn to_json(&self) -> String {
        let mut text = serde_json::to_string_pretty(&Value::Object(self.map.clone()))
            .unwrap_or_else(|_| "{}".to_owned());
        text.push('\n');
        text
    }
}
