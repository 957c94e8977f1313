//! Tokenized examples from text rows, padded or packed into batches.

use std::sync::Arc;

use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

use crate::{PromptTemplate, TextRecords};
use kiln_data::{Batch, Collate, Dataset};

/// The label of a position without a target (PyTorch's and `transformers`'
/// `ignore_index`): a prompt token, padding, the last position of a sequence.
pub const IGNORE_INDEX: i64 = -100;

/// Text to token ids: what [`TextDataset`] needs of a tokenizer
/// (`kiln_hf::TextTokenizer` implements it with `tokenizer.json`).
pub trait TokenizeText: Send + Sync {
    /// The ids of `text`, with the special tokens the tokenizer adds (a BOS)
    /// when `add_special_tokens`, as `tokenizer(text, add_special_tokens=...)`.
    fn encode_text(&self, text: &str, add_special_tokens: bool) -> Result<Vec<i64>>;
}

/// Conversations to token ids through a chat template: what the
/// conversational tasks of [`TextDataset`] need (`kiln_hf::ChatTokenizer`
/// implements it with the model's template and `tokenizer.json`).
pub trait TokenizeChat: Send + Sync {
    /// The ids of `messages` rendered by the template (ending with the
    /// assistant's header when `add_generation_prompt`), as
    /// `apply_chat_template(messages, tokenize=True)` gives them, and for each
    /// whether the template's `{% generation %}` blocks rendered it.
    /// `tools` are the row's tool schemas, for templates that take them.
    fn tokenize_chat(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<(Vec<i64>, Vec<bool>)>;

    /// Whether the template marks the assistant's turns with `{% generation
    /// %}` blocks (what assistant-only loss reads).
    fn marks_assistant_turns(&self) -> bool;

    /// Where the template comes from, for messages.
    fn origin(&self) -> String;
}

/// What a row becomes.
#[derive(Clone, Debug, PartialEq)]
pub enum TextTask {
    /// Causal language modelling on one column: every token is a target.
    LanguageModel {
        /// The text column.
        text: String,
    },
    /// Instruction tuning: the prompt (a template over the row's columns,
    /// tokenized with the special tokens) then the response (without them,
    /// EOS appended), the loss on the response tokens only, as TRL's
    /// prompt-completion `completion_only_loss` computes it.
    Instruction {
        /// The prompt's template.
        prompt: PromptTemplate,
        /// The response's template.
        response: PromptTemplate,
    },
    /// A conversation (TRL's conversational language modelling): a column of
    /// messages (`[{"role", "content"}, ...]`) rendered by the chat template;
    /// the loss on every token, or with `assistant_only` on the tokens of the
    /// template's `{% generation %}` blocks (TRL's `assistant_only_loss`).
    Conversation {
        /// The messages column.
        messages: String,
        /// A column of tool schemas (a list, its JSON text, or null) the
        /// template is given as `tools`, as TRL reads a row's `tools`.
        tools: Option<String>,
        /// Train on the assistant's turns only.
        assistant_only: bool,
    },
    /// A conversational prompt and completion (TRL's conversational
    /// prompt-completion): two columns of messages, the prompt's rendered with
    /// the generation prompt; the completion starts where the prompt's ids and
    /// the whole conversation's part (TRL's `common_prefix_length`).
    ChatCompletion {
        /// The prompt's messages column.
        prompt: String,
        /// The completion's messages column.
        completion: String,
        /// A column of tool schemas, as [`TextTask::Conversation`]'s.
        tools: Option<String>,
        /// The loss on the completion only (TRL's `completion_only_loss`,
        /// its default).
        completion_only: bool,
        /// The loss on the template's `{% generation %}` blocks only.
        assistant_only: bool,
    },
    /// Sequence classification: a text column and an integer label column.
    Classification {
        /// The text column.
        text: String,
        /// The label column (whole numbers).
        label: String,
    },
}

impl TextTask {
    /// The columns the task reads, in the order [`TextRecords`] is opened with.
    pub fn columns(&self) -> Vec<String> {
        match self {
            TextTask::LanguageModel { text } => vec![text.clone()],
            TextTask::Instruction { prompt, response } => {
                let mut cols: Vec<String> = prompt.fields().to_vec();
                for f in response.fields() {
                    if !cols.contains(f) {
                        cols.push(f.clone());
                    }
                }
                cols
            }
            TextTask::Conversation {
                messages, tools, ..
            } => std::iter::once(messages.clone())
                .chain(tools.clone())
                .collect(),
            TextTask::ChatCompletion {
                prompt,
                completion,
                tools,
                ..
            } => [prompt.clone(), completion.clone()]
                .into_iter()
                .chain(tools.clone())
                .collect(),
            TextTask::Classification { text, label } => vec![text.clone(), label.clone()],
        }
    }

    /// The columns that hold messages (JSON lists) rather than text.
    pub fn message_columns(&self) -> Vec<String> {
        match self {
            TextTask::Conversation { .. } | TextTask::ChatCompletion { .. } => self.columns(),
            _ => Vec::new(),
        }
    }

    /// Whether the task renders conversations through a chat template.
    pub fn is_conversational(&self) -> bool {
        !self.message_columns().is_empty()
    }

    /// Whether the loss is on the template's `{% generation %}` blocks only.
    pub fn assistant_only(&self) -> bool {
        matches!(
            self,
            TextTask::Conversation {
                assistant_only: true,
                ..
            } | TextTask::ChatCompletion {
                assistant_only: true,
                ..
            }
        )
    }

    /// Whether the targets are next tokens (a language model's).
    pub fn is_causal(&self) -> bool {
        !matches!(self, TextTask::Classification { .. })
    }
}

/// How examples are cut to length.
#[derive(Clone, Debug, PartialEq)]
pub struct TextOptions {
    /// Tokens per example at most (with packing: per block); `None` for no limit.
    pub max_length: Option<usize>,
    /// Cut longer examples to `max_length` (their end is lost) instead of
    /// refusing them.
    pub truncation: bool,
    /// Appended to every language-model text and response (the tokenizer's EOS).
    pub eos_token: Option<i64>,
}

/// The most bytes of a row a token may take, bounding a row's bytes by
/// `max_length`: far above any tokenizer's longest token, with JSON's
/// escapes (`\uXXXX` is 6 bytes a character).
const MAX_BYTES_PER_TOKEN: u64 = 4096;

/// The most bytes a row may have for `options`: what `max_length` tokens can
/// use, at least 1 MiB, at most [`super::records::MAX_ROW_BYTES`] (also the
/// limit without `max_length`).
fn max_row_bytes(options: &TextOptions) -> u64 {
    let most = super::records::MAX_ROW_BYTES;
    options.max_length.map_or(most, |m| {
        (m as u64)
            .saturating_mul(MAX_BYTES_PER_TOKEN)
            .clamp(1 << 20, most)
    })
}

/// Tokenized examples of text rows: `(ids [len], targets [len])`, the
/// targets the next token's label ([`IGNORE_INDEX`] where there is none) for
/// a causal task, or `(ids [len], label)` for classification. Rows are read
/// and tokenized when an example is asked for, on the loader's workers.
pub struct TextDataset {
    records: TextRecords,
    task: TextTask,
    options: TextOptions,
    tokenizer: Arc<dyn TokenizeText>,
    chat: Option<Arc<dyn TokenizeChat>>,
}

impl std::fmt::Debug for TextDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextDataset")
            .field("path", &self.records.path())
            .field("rows", &self.records.len())
            .field("task", &self.task)
            .field("options", &self.options)
            .finish()
    }
}

impl TextDataset {
    /// The examples of `path` (JSON Lines or CSV) for `task`, checked: every
    /// row has the task's columns. Rows longer than `max_length` are found
    /// when tokenized (see [`check_lengths`](TextDataset::check_lengths)).
    pub fn open(
        path: impl AsRef<std::path::Path>,
        task: TextTask,
        options: TextOptions,
        tokenizer: Arc<dyn TokenizeText>,
    ) -> Result<Self> {
        if options.max_length == Some(0) {
            return Err(Error::invalid_argument(
                "max_length",
                "must be at least 1, got 0",
            ));
        }
        let columns = task.columns();
        let names: Vec<&str> = columns.iter().map(String::as_str).collect();
        let lists = task.message_columns();
        let lists: Vec<&str> = lists.iter().map(String::as_str).collect();
        let records = TextRecords::open_with_lists(path, &names, &lists, max_row_bytes(&options))?;
        Ok(TextDataset {
            records,
            task,
            options,
            tokenizer,
            chat: None,
        })
    }

    /// These examples rendering their conversations through `chat` (a
    /// conversational task needs it). Fails when the task trains on the
    /// assistant's turns only and the template does not mark them.
    pub fn with_chat(mut self, chat: Arc<dyn TokenizeChat>) -> Result<Self> {
        if self.task.assistant_only() && !chat.marks_assistant_turns() {
            return Err(Error::invalid_argument(
                "assistant_only_loss",
                format!(
                    "the chat template ({}) has no {{% generation %}} blocks, which mark the \
                     assistant's tokens: use a template that has them (TRL ships training \
                     templates with them), or train on every token",
                    chat.origin()
                ),
            ));
        }
        self.chat = Some(chat);
        Ok(self)
    }

    /// The messages of row `index`'s column `k` (JSON text of a list).
    fn messages(&self, index: usize, k: usize, text: &str) -> Result<Vec<serde_json::Value>> {
        match serde_json::from_str(text) {
            Ok(serde_json::Value::Array(list)) => Ok(list),
            // The column's name is looked up only for the message.
            _ => Err(Error::invalid_argument(
                "data",
                format!(
                    "{}: column `{}` is not a list of messages ([{{\"role\": ..., \
                     \"content\": ...}}, ...])",
                    self.records.place(index),
                    self.task.columns().get(k).map_or("?", String::as_str)
                ),
            )),
        }
    }

    /// Ids and labels of a conversational row.
    fn chat_tokens(&self, index: usize, values: &[String]) -> Result<(Vec<i64>, Vec<i64>)> {
        let chat = self.chat.as_ref().ok_or_else(|| {
            Error::invalid_argument(
                "data",
                "a conversational task renders its rows through a chat template: give the \
                 examples one (TextDataset::with_chat)",
            )
        })?;
        let place = || self.records.place(index);
        // The row's tools: the column after the messages, a list or null.
        let tools_at = match &self.task {
            TextTask::Conversation { tools: Some(_), .. } => Some(1),
            TextTask::ChatCompletion { tools: Some(_), .. } => Some(2),
            _ => None,
        };
        let tools = match tools_at {
            Some(k) => match serde_json::from_str(&values[k]) {
                Ok(serde_json::Value::Array(list)) => Some(list),
                Ok(serde_json::Value::Null) => None,
                _ => {
                    return Err(Error::invalid_argument(
                        "data",
                        format!(
                            "{}: column `{}` is not a list of tool schemas (or null)",
                            place(),
                            self.task.columns()[k]
                        ),
                    ))
                }
            },
            None => None,
        };
        let render = |messages: &[serde_json::Value], prompt: bool| {
            chat.tokenize_chat(messages, tools.as_deref(), prompt)
                .map_err(|e| Error::invalid_argument("data", format!("{}: {e}", place())))
        };
        match &self.task {
            TextTask::Conversation { assistant_only, .. } => {
                let (ids, mask) = render(&self.messages(index, 0, &values[0])?, false)?;
                let labels = ids
                    .iter()
                    .zip(&mask)
                    .map(|(&id, &m)| {
                        if m || !assistant_only {
                            id
                        } else {
                            IGNORE_INDEX
                        }
                    })
                    .collect();
                Ok((ids, labels))
            }
            TextTask::ChatCompletion {
                completion_only,
                assistant_only,
                ..
            } => {
                let prompt = self.messages(index, 0, &values[0])?;
                let mut whole = prompt.clone();
                whole.extend(self.messages(index, 1, &values[1])?);
                let (prompt_ids, _) = render(&prompt, true)?;
                let (ids, mask) = render(&whole, false)?;
                let start = prompt_ids
                    .iter()
                    .zip(&ids)
                    .take_while(|(a, b)| a == b)
                    .count();
                let labels = ids
                    .iter()
                    .zip(&mask)
                    .enumerate()
                    .map(|(i, (&id, &m))| {
                        let completion = i >= start || !completion_only;
                        let assistant = m || !assistant_only;
                        if completion && assistant {
                            id
                        } else {
                            IGNORE_INDEX
                        }
                    })
                    .collect();
                Ok((ids, labels))
            }
            _ => Err(Error::invalid_argument("data", "not a conversational task")),
        }
    }

    /// The rows.
    pub fn records(&self) -> &TextRecords {
        &self.records
    }

    /// The task.
    pub fn task(&self) -> &TextTask {
        &self.task
    }

    /// Token ids and labels of row `index` before the shift: `(ids, labels)`
    /// with `labels[i]` the label of `ids[i]` ([`IGNORE_INDEX`] in a prompt),
    /// or the class label in `labels[0]` for classification.
    pub fn tokens(&self, index: usize) -> Result<(Vec<i64>, Vec<i64>)> {
        let values = self.records.get(index)?;
        let place = || self.records.place(index);
        let tok = &self.tokenizer;
        let (mut ids, mut labels) = match &self.task {
            TextTask::Conversation { .. } | TextTask::ChatCompletion { .. } => {
                self.chat_tokens(index, &values)?
            }
            TextTask::LanguageModel { .. } => {
                let mut ids = tok.encode_text(&values[0], true)?;
                ids.extend(self.options.eos_token);
                (ids.clone(), ids)
            }
            TextTask::Instruction { prompt, response } => {
                let columns = self.task.columns();
                let pick = |t: &PromptTemplate| -> Vec<String> {
                    t.fields()
                        .iter()
                        .map(|f| {
                            let i = columns.iter().position(|c| c == f).unwrap_or(0);
                            values[i].clone()
                        })
                        .collect()
                };
                let p = tok.encode_text(&prompt.render(&pick(prompt))?, true)?;
                let mut r = tok.encode_text(&response.render(&pick(response))?, false)?;
                r.extend(self.options.eos_token);
                let mut labels = vec![IGNORE_INDEX; p.len()];
                labels.extend(&r);
                let mut ids = p;
                ids.extend(r);
                (ids, labels)
            }
            TextTask::Classification { .. } => {
                let ids = tok.encode_text(&values[0], true)?;
                let label = parse_label(&values[1]).ok_or_else(|| {
                    Error::invalid_argument(
                        "data",
                        format!("{}: label {:?} is not a whole number", place(), values[1]),
                    )
                })?;
                (ids, vec![label])
            }
        };
        if ids.is_empty() {
            return Err(Error::invalid_argument(
                "data",
                format!("{}: the text gives no tokens", place()),
            ));
        }
        if let Some(max) = self.options.max_length {
            if ids.len() > max {
                if !self.options.truncation {
                    return Err(Error::invalid_argument(
                        "data",
                        format!(
                            "{}: {} tokens, longer than max_length = {max} (set truncation = \
                             true to cut such rows)",
                            place(),
                            ids.len()
                        ),
                    ));
                }
                ids.truncate(max);
                if self.task.is_causal() {
                    labels.truncate(max);
                }
            }
        }
        Ok((ids, labels))
    }

    /// Tokenizes every row on `threads` threads and returns each one's
    /// length in tokens; the first row that fails (too long without
    /// truncation, a bad label) is the error, so a run can refuse its data
    /// before it starts.
    ///
    /// For a causal task each row must also keep a target after the shift: a
    /// row whose prompt fills `max_length` (cut by truncation) or a single
    /// token has nothing to learn from, and would make a batch's loss NaN.
    pub fn check_lengths(&self, threads: usize) -> Result<Vec<usize>> {
        self.tokenize_all(threads, self.task.is_causal())
    }

    /// [`check_lengths`](Self::check_lengths), the targets checked only when
    /// `need_targets` (a packed document's targets are its block's).
    fn tokenize_all(&self, threads: usize, need_targets: bool) -> Result<Vec<usize>> {
        let n = self.len();
        let threads = threads.clamp(1, n.max(1));
        let chunk = n.div_ceil(threads);
        let results: Vec<Result<Vec<usize>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    s.spawn(move || {
                        (t * chunk..((t + 1) * chunk).min(n))
                            .map(|i| {
                                let (ids, labels) = self.tokens(i)?;
                                if need_targets {
                                    self.check_has_target(i, ids.len(), &labels)?;
                                }
                                Ok(ids.len())
                            })
                            .collect::<Result<Vec<usize>>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::invalid_argument(
                            "data",
                            "a tokenizer thread panicked",
                        ))
                    })
                })
                .collect()
        });
        let mut lengths = Vec::with_capacity(n);
        for r in results {
            lengths.extend(r?);
        }
        Ok(lengths)
    }
}

impl TextDataset {
    /// Fails when row `index` (`len` tokens, `labels` before the shift) has
    /// no target once shifted.
    fn check_has_target(&self, index: usize, len: usize, labels: &[i64]) -> Result<()> {
        if labels.iter().skip(1).any(|&l| l != IGNORE_INDEX) {
            return Ok(());
        }
        let why = match (&self.task, self.options.max_length) {
            (TextTask::Instruction { .. }, Some(max)) if self.options.truncation && len == max => {
                format!(
                    "after truncation to max_length = {max}, no response token is left (the \
                     prompt fills the example); raise data.max_length or shorten the prompt"
                )
            }
            (TextTask::Instruction { .. }, _) => {
                "the response gives no token to learn from".to_owned()
            }
            (TextTask::Conversation { .. } | TextTask::ChatCompletion { .. }, Some(max))
                if self.options.truncation && len == max =>
            {
                format!(
                    "after truncation to max_length = {max}, no trained token is left; raise \
                     data.max_length"
                )
            }
            (
                TextTask::Conversation {
                    assistant_only: true,
                    ..
                },
                _,
            ) => "the template's {% generation %} blocks mark none of its tokens (no assistant \
                  turn, or one without content?)"
                .to_owned(),
            (TextTask::ChatCompletion { .. }, _) => {
                "the completion gives no token to learn from".to_owned()
            }
            _ => format!(
                "{len} token{}: a language model needs at least 2 to predict one",
                if len == 1 { "" } else { "s" }
            ),
        };
        Err(Error::invalid_argument(
            "data",
            format!(
                "{}: the row has no target: {why} (its loss would be NaN, or add nothing)",
                self.records.place(index)
            ),
        ))
    }
}

/// A class label written as a whole number: `1`, or `1.0` as pandas writes an
/// integer column that held a missing value.
fn parse_label(text: &str) -> Option<i64> {
    let text = text.trim();
    text.parse::<i64>().ok().or_else(|| {
        let value: f64 = text.parse().ok()?;
        (value.is_finite() && value.fract() == 0.0 && value.abs() < 9.0e15).then_some(value as i64)
    })
}

/// `labels` shifted one to the left (position `i` predicts token `i + 1`),
/// [`IGNORE_INDEX`] at the end: the targets `transformers`' causal-LM loss
/// compares logits with.
pub fn shift_labels(labels: &[i64]) -> Vec<i64> {
    let mut out: Vec<i64> = labels.iter().skip(1).copied().collect();
    out.push(IGNORE_INDEX);
    out
}

impl Dataset for TextDataset {
    type Item = (HostTensor, HostTensor);

    fn len(&self) -> usize {
        self.records.len()
    }

    fn get(&self, index: usize) -> Result<Self::Item> {
        let (ids, labels) = self.tokens(index)?;
        let n = ids.len();
        let target = if self.task.is_causal() {
            HostTensor::new(shift_labels(&labels), [n])?
        } else {
            HostTensor::scalar(labels[0])
        };
        Ok((HostTensor::new(ids, [n])?, target))
    }
}

/// A causal [`TextDataset`] packed into blocks of `block` tokens: the
/// examples one after another (each ending with EOS), cut into blocks as
/// `transformers`' `group_texts` does (the tail that does not fill a block is
/// dropped). Each block's targets are its labels shifted within the block, so
/// a block predicts across the documents it holds (they attend to each
/// other, as in `group_texts`).
///
/// Only each example's length is kept: a block reads and tokenizes the rows
/// it covers when asked for.
#[derive(Debug)]
pub struct PackedText {
    inner: TextDataset,
    block: usize,
    /// Token offset of each example's start, and the total at the end.
    starts: Vec<usize>,
}

impl PackedText {
    /// Packs `inner` (tokenized once here on `threads` threads to find the
    /// lengths) into blocks of `block` tokens. Fails for a classification
    /// task, or when the data does not fill one block.
    pub fn new(inner: TextDataset, block: usize, threads: usize) -> Result<Self> {
        if !inner.task.is_causal() {
            return Err(Error::invalid_argument(
                "packing",
                "packing joins language-model or instruction examples, not classification ones",
            ));
        }
        if block < 2 {
            return Err(Error::invalid_argument(
                "max_length",
                format!("a packed block needs at least 2 tokens, got {block}"),
            ));
        }
        let mut inner = inner;
        // A document is never cut to the block: the stream of documents (one
        // after another, each with its EOS) is, so a long one spans blocks.
        inner.options.max_length = None;
        inner.options.truncation = false;
        let lengths = inner.tokenize_all(threads, false)?;
        let mut starts = Vec::with_capacity(lengths.len() + 1);
        let mut total = 0usize;
        for l in lengths {
            starts.push(total);
            total += l;
        }
        starts.push(total);
        if total < block {
            return Err(Error::invalid_argument(
                "data",
                format!(
                    "{}: {total} tokens in all, fewer than one block of {block}",
                    inner.records.path().display()
                ),
            ));
        }
        Ok(PackedText {
            inner,
            block,
            starts,
        })
    }

    /// Tokens per block.
    pub fn block(&self) -> usize {
        self.block
    }

    /// Tokens in all the examples.
    pub fn total_tokens(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }
}

impl Dataset for PackedText {
    type Item = (HostTensor, HostTensor);

    fn len(&self) -> usize {
        self.total_tokens() / self.block
    }

    fn get(&self, index: usize) -> Result<Self::Item> {
        if index >= self.len() {
            return Err(Error::invalid_argument(
                "index",
                format!("block {index} is out of range for {} blocks", self.len()),
            ));
        }
        let (from, to) = (index * self.block, (index + 1) * self.block);
        // The example holding token `from`.
        let mut row = self.starts.partition_point(|&s| s <= from) - 1;
        let mut ids = Vec::with_capacity(self.block);
        let mut labels = Vec::with_capacity(self.block);
        while ids.len() < self.block && row + 1 < self.starts.len() {
            let (i, l) = self.inner.tokens(row)?;
            let start = self.starts[row];
            let lo = from.saturating_sub(start);
            let hi = (to - start).min(i.len());
            if lo < hi {
                ids.extend_from_slice(&i[lo..hi]);
                labels.extend_from_slice(&l[lo..hi]);
            }
            row += 1;
        }
        let n = ids.len();
        Ok((
            HostTensor::new(ids, [n])?,
            HostTensor::new(shift_labels(&labels), [n])?,
        ))
    }
}

/// Pads the examples of a batch to the longest (on the right, as causal
/// models are trained): inputs with `pad_id`, targets with
/// [`IGNORE_INDEX`], so padding adds nothing to the loss and, the attention
/// being causal, changes no real position's output. Classification labels
/// (scalars) are stacked.
///
/// ```
/// use kiln_data::Collate;
/// use kiln_text::PadCollate;
/// use kiln_core::HostTensor;
///
/// let ex = |ids: Vec<i64>| {
///     let n = ids.len();
///     (HostTensor::new(ids.clone(), [n]).unwrap(), HostTensor::new(ids, [n]).unwrap())
/// };
/// let batch = PadCollate::new(0).collate(vec![ex(vec![5, 6, 7]), ex(vec![8])])?;
/// assert_eq!(batch.inputs.as_slice::<i64>()?, &[5, 6, 7, 8, 0, 0]);
/// assert_eq!(batch.targets.as_slice::<i64>()?, &[5, 6, 7, 8, -100, -100]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PadCollate {
    pad_id: i64,
    flatten_targets: bool,
    attention_mask: bool,
}

impl PadCollate {
    /// Pads inputs with `pad_id`.
    pub fn new(pad_id: i64) -> Self {
        PadCollate {
            pad_id,
            flatten_targets: false,
            attention_mask: false,
        }
    }

    /// Gives inputs as `[batch, 2, len]`: the padded ids and their attention
    /// mask (1 on the tokens, 0 on the padding) stacked, as
    /// [`stack_attention_mask`](kiln_core::model::stack_attention_mask) makes
    /// them, for a model that reads the mask (a classifier over padded rows).
    ///
    /// ```
    /// use kiln_text::PadCollate;
    /// use kiln_data::Collate;
    /// use kiln_core::HostTensor;
    ///
    /// let ex = |ids: Vec<i64>| (HostTensor::new(ids.clone(), [ids.len()]).unwrap(), HostTensor::scalar(0i64));
    /// let batch = PadCollate::new(0).with_attention_mask(true).collate(vec![ex(vec![5, 6]), ex(vec![8])])?;
    /// assert_eq!(batch.inputs.dims(), [2, 2, 2]);
    /// assert_eq!(batch.inputs.as_slice::<i64>()?, &[5, 6, 1, 1, 8, 0, 1, 0]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn with_attention_mask(mut self, attention_mask: bool) -> Self {
        self.attention_mask = attention_mask;
        self
    }

    /// Gives sequence targets as one `[batch * len]` row, for a model whose
    /// logits are flattened to `[batch * len, vocab]` for the loss.
    pub fn flatten_targets(mut self, flatten: bool) -> Self {
        self.flatten_targets = flatten;
        self
    }
}

impl Collate<(HostTensor, HostTensor)> for PadCollate {
    type Output = Result<Batch>;

    fn collate(&self, batch: Vec<(HostTensor, HostTensor)>) -> Result<Batch> {
        let n = batch.len();
        let longest = batch
            .iter()
            .map(|(x, _)| x.numel())
            .max()
            .ok_or_else(|| Error::invalid_argument("batch", "an empty batch"))?;
        let mut inputs = Vec::with_capacity(n * longest);
        let mut targets = Vec::with_capacity(n * longest);
        let sequences = batch.iter().all(|(_, t)| !t.dims().is_empty());
        for (x, t) in &batch {
            let ids = x.as_slice::<i64>()?;
            inputs.extend_from_slice(ids);
            inputs.extend(std::iter::repeat_n(self.pad_id, longest - ids.len()));
            let t = t.as_slice::<i64>()?;
            targets.extend_from_slice(t);
            if sequences {
                targets.extend(std::iter::repeat_n(IGNORE_INDEX, longest - t.len()));
            }
        }
        let targets = match (sequences, self.flatten_targets) {
            (false, _) => HostTensor::new(targets, [n])?,
            (true, false) => HostTensor::new(targets, [n, longest])?,
            (true, true) => HostTensor::new(targets, [n * longest])?,
        };
        let ids = HostTensor::new(inputs, [n, longest])?;
        let inputs = if self.attention_mask {
            let mut mask = Vec::with_capacity(n * longest);
            for (x, _) in &batch {
                let len = x.numel();
                mask.extend(std::iter::repeat_n(1i64, len));
                mask.extend(std::iter::repeat_n(0i64, longest - len));
            }
            kiln_core::model::stack_attention_mask(&ids, &HostTensor::new(mask, [n, longest])?)?
        } else {
            ids
        };
        Ok(Batch { inputs, targets })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One token per character (its code point); BOS = 1 with special tokens.
    struct Chars;
    impl TokenizeText for Chars {
        fn encode_text(&self, text: &str, special: bool) -> Result<Vec<i64>> {
            let mut ids: Vec<i64> = if special { vec![1] } else { Vec::new() };
            ids.extend(text.chars().map(|c| c as i64));
            Ok(ids)
        }
    }

    fn file(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-textds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_default();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap_or_default();
        path
    }

    fn options(max: Option<usize>, truncation: bool) -> TextOptions {
        TextOptions {
            max_length: max,
            truncation,
            eos_token: Some(2),
        }
    }

    #[test]
    fn instruction_rows_mask_the_prompt() -> Result<()> {
        let path = file("i.jsonl", "{\"q\": \"ab\", \"a\": \"c\"}\n");
        let task = TextTask::Instruction {
            prompt: PromptTemplate::parse("{q}:")?,
            response: PromptTemplate::parse("{a}")?,
        };
        let ds = TextDataset::open(&path, task, options(None, false), Arc::new(Chars))?;
        let (ids, labels) = ds.tokens(0)?;
        assert_eq!(ids, [1, 97, 98, 58, 99, 2]);
        assert_eq!(labels, [-100, -100, -100, -100, 99, 2]);
        let (x, t) = ds.get(0)?;
        assert_eq!(x.as_slice::<i64>()?, &[1, 97, 98, 58, 99, 2]);
        assert_eq!(t.as_slice::<i64>()?, &[-100, -100, -100, 99, 2, -100]);
        Ok(())
    }

    #[test]
    fn long_rows_are_refused_or_truncated() -> Result<()> {
        let path = file("l.jsonl", "{\"t\": \"abcdef\"}\n");
        let task = TextTask::LanguageModel { text: "t".into() };
        let ds = TextDataset::open(
            &path,
            task.clone(),
            options(Some(4), false),
            Arc::new(Chars),
        )?;
        let err = ds.check_lengths(2).unwrap_err().to_string();
        assert!(
            err.contains("line 1: 8 tokens, longer than max_length = 4"),
            "{err}"
        );
        let ds = TextDataset::open(&path, task, options(Some(4), true), Arc::new(Chars))?;
        assert_eq!(ds.tokens(0)?.0, [1, 97, 98, 99]);
        Ok(())
    }

    #[test]
    fn packing_cuts_the_stream_into_blocks() -> Result<()> {
        // Rows of 3 + 2 = 5 tokens (with BOS and EOS): "a" -> [1, 97, 2], "" -> [1, 2].
        let path = file(
            "p.jsonl",
            "{\"t\": \"a\"}\n{\"t\": \"\"}\n{\"t\": \"bc\"}\n",
        );
        let task = TextTask::LanguageModel { text: "t".into() };
        let ds = TextDataset::open(&path, task, options(None, false), Arc::new(Chars))?;
        let packed = PackedText::new(ds, 4, 2)?;
        assert_eq!(packed.total_tokens(), 9);
        assert_eq!(packed.len(), 2);
        let (x, t) = packed.get(1)?;
        assert_eq!(x.as_slice::<i64>()?, &[2, 1, 98, 99]);
        assert_eq!(t.as_slice::<i64>()?, &[1, 98, 99, -100]);
        assert!(packed.get(2).is_err());
        Ok(())
    }

    #[test]
    fn labels_are_whole_numbers_written_either_way() {
        assert_eq!(parse_label(" 2 "), Some(2));
        assert_eq!(parse_label("1.0"), Some(1));
        assert_eq!(parse_label("1.5"), None);
        assert_eq!(parse_label("NaN"), None);
        assert_eq!(parse_label("cat"), None);
    }

    #[test]
    fn a_document_longer_than_a_block_spans_blocks() -> Result<()> {
        // 26 letters + BOS + EOS = 28 tokens; blocks of 8 (the options' 8 is
        // the block, not a cut): 3 whole blocks, the document continuing
        // from one to the next.
        let letters: String = ('a'..='z').collect();
        let path = file("long.jsonl", &format!("{{\"t\": \"{letters}\"}}\n"));
        let task = TextTask::LanguageModel { text: "t".into() };
        let ds = TextDataset::open(&path, task, options(Some(8), false), Arc::new(Chars))?;
        let packed = PackedText::new(ds, 8, 2)?;
        assert_eq!(packed.total_tokens(), 28);
        assert_eq!(packed.len(), 3);
        let (x, _) = packed.get(1)?;
        let expected: Vec<i64> = ('h'..='o').map(|c| c as i64).collect();
        assert_eq!(x.as_slice::<i64>()?, expected.as_slice());
        Ok(())
    }

    #[test]
    fn a_row_with_no_target_is_refused_naming_its_line() -> Result<()> {
        let path = file(
            "nt.jsonl",
            "{\"q\": \"a\", \"a\": \"b\"}\n{\"q\": \"abcdefgh\", \"a\": \"b\"}\n",
        );
        let task = TextTask::Instruction {
            prompt: PromptTemplate::parse("{q}")?,
            response: PromptTemplate::parse("{a}")?,
        };
        let ds = TextDataset::open(&path, task, options(Some(4), true), Arc::new(Chars))?;
        let err = ds.check_lengths(2).unwrap_err().to_string();
        assert!(
            err.contains("nt.jsonl, line 2: the row has no target"),
            "{err}"
        );
        assert!(err.contains("no response token is left"), "{err}");
        Ok(())
    }

    #[test]
    fn rows_are_read_within_their_byte_bound() -> Result<()> {
        // max_length 1 allows 1 MiB a row: a 2 MiB row is refused while read.
        let big = "x".repeat(2 << 20);
        let path = file(
            "big.jsonl",
            &format!("{{\"t\": \"a\"}}\n{{\"t\": \"{big}\"}}\n"),
        );
        let task = TextTask::LanguageModel { text: "t".into() };
        let err = TextDataset::open(&path, task.clone(), options(Some(1), true), Arc::new(Chars))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("line 2: the row is longer than 1048576 bytes"),
            "{err}"
        );
        // A byte-order mark before the first row is not part of it.
        let path = file("bom.jsonl", "\u{feff}{\"t\": \"a\"}\n");
        let ds = TextDataset::open(&path, task, options(None, false), Arc::new(Chars))?;
        assert_eq!(ds.tokens(0)?.0, [1, 97, 2]);
        Ok(())
    }
}
