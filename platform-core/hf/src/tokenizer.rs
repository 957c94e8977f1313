//! `tokenizer.json` through the `tokenizers` crate: text to token ids and back.

use std::path::{Path, PathBuf};

use crate::error::{HfError, Result};

/// A model directory's tokenizer.
///
/// ```no_run
/// use kiln_hf::TextTokenizer;
///
/// let tok = TextTokenizer::open("models/tiny-llama")?;
/// let ids = tok.encode("Hello there")?;
/// assert_eq!(tok.decode(&ids)?, "Hello there");
/// # Ok::<(), kiln_hf::HfError>(())
/// ```
pub struct TextTokenizer {
    path: PathBuf,
    inner: tokenizers::Tokenizer,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl TextTokenizer {
    /// Reads `dir/tokenizer.json`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let path = dir.as_ref().join("tokenizer.json");
        if !path.is_file() {
            return Err(HfError::NotAModel {
                dir: dir.as_ref().to_owned(),
                what: "no tokenizer.json (generation from text needs the model's tokenizer; \
                       pass token ids instead)"
                    .to_owned(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| HfError::Tokenizer {
            path: path.clone(),
            reason: format!("not a tokenizer the tokenizers crate reads: {e}"),
        })?;
        Ok(TextTokenizer { path, inner })
    }

    /// The ids of `text`, with the special tokens the tokenizer adds (a BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<i64>> {
        self.encode_with(text, true)
    }

    /// The ids of `text`, with the tokenizer's special tokens when
    /// `add_special_tokens` (Python's `tokenizer(text, add_special_tokens=...)`).
    pub fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<i64>> {
        Ok(self.encode_with_offsets(text, add_special_tokens)?.0)
    }

    /// The ids of `text` and, for each, the byte range of `text` it covers
    /// (Python's `return_offsets_mapping`, in bytes), with the tokenizer's
    /// special tokens when `add_special_tokens`.
    pub fn encode_with_offsets(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<(Vec<i64>, Vec<std::ops::Range<usize>>)> {
        let encoding =
            self.inner
                .encode(text, add_special_tokens)
                .map_err(|e| HfError::Tokenizer {
                    path: self.path.clone(),
                    reason: format!("encoding {text:?}: {e}"),
                })?;
        Ok((
            encoding.get_ids().iter().map(|&id| i64::from(id)).collect(),
            encoding.get_offsets().iter().map(|&(a, b)| a..b).collect(),
        ))
    }

    /// The special token (an added token marked special, such as
    /// `<|im_end|>`) that `text` starts with, the longest if several do,
    /// with its id.
    pub fn special_token_at_start(&self, text: &str) -> Option<(String, i64)> {
        self.inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !t.content.is_empty() && text.starts_with(&t.content))
            .max_by_key(|(_, t)| t.content.len())
            .map(|(id, t)| (t.content, i64::from(id)))
    }

    /// The text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[i64]) -> Result<String> {
        let ids: Vec<u32> = ids
            .iter()
            .map(|&id| {
                u32::try_from(id).map_err(|_| HfError::Tokenizer {
                    path: self.path.clone(),
                    reason: format!("token id {id} is outside the vocabulary"),
                })
            })
            .collect::<Result<_>>()?;
        self.inner
            .decode(&ids, true)
            .map_err(|e| HfError::Tokenizer {
                path: self.path.clone(),
                reason: format!("decoding: {e}"),
            })
    }

    /// The number of ids the tokenizer can give (its vocabulary with the
    /// added tokens): every id is below it.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of token `token` (`"</s>"`), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<i64> {
        self.inner.token_to_id(token).map(i64::from)
    }
}

impl kiln_text::TokenizeText for TextTokenizer {
    fn encode_text(&self, text: &str, add_special_tokens: bool) -> kiln_core::Result<Vec<i64>> {
        Ok(self.encode_with(text, add_special_tokens)?)
    }
}
