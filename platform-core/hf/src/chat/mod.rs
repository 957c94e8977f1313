//! Chat templates: a model directory's Jinja `chat_template`, rendered as
//! `transformers`' `apply_chat_template` renders it, with `minijinja` (the
//! engine Hugging Face's Rust servers use) set up as `transformers` sets up
//! Jinja2: `trim_blocks` and `lstrip_blocks`, `break` and `continue`, Python's
//! string and dict methods (`.strip()`, `.split()`, `.items()`, ...), Python's
//! printing of `None`, `True` and `False`, and its globals and filters:
//! `raise_exception`, `strftime_now`, and a `tojson` that writes what
//! Python's `json.dumps` writes (`", "` and `": "` separators, nothing
//! escaped for HTML, `indent`, `separators`, `sort_keys`, `ensure_ascii`).
//!
//! A template's `{% generation %}` ... `{% endgeneration %}` blocks (TRL's
//! assistant-only loss) are kept as spans of the rendered text
//! ([`RenderedChat::generation`]), as `transformers`' `AssistantTracker`
//! records them.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use minijinja::value::Value as JValue;
use minijinja::{Environment, Error as JError, ErrorKind};
use serde_json::Value;

use crate::error::{HfError, Result};

mod python;
use python::{python_formatter, python_value, raise_exception, strftime_now, tojson};

/// The template's name inside its environment.
const NAME: &str = "chat_template";
/// The context variable holding [`ChatOptions::now`].
const NOW: &str = "__kiln_now";
/// Marks where a `{% generation %}` block starts and ends in the rendered
/// text (private-use characters, removed before the text is returned).
const GENERATION_START: char = '\u{F8F0}';
const GENERATION_END: char = '\u{F8F1}';
/// `tokenizer_config.json`'s named special tokens, which `transformers`
/// passes to every template (`special_tokens_map`).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A chat template with the tokenizer its text goes through and the options
/// every conversation renders with: what `kiln_text`'s conversational tasks
/// tokenize rows with ([`kiln_text::TokenizeChat`]).
///
/// ```no_run
/// use std::sync::Arc;
/// use kiln_hf::{ChatOptions, ChatTemplate, ChatTokenizer, TextTokenizer};
/// use kiln_text::{TextDataset, TextOptions, TextTask};
///
/// let dir = "models/tiny-chat";
/// let template = ChatTemplate::open(dir)?.expect("a chat template");
/// let tokenizer = Arc::new(TextTokenizer::open(dir)?);
/// let chat = ChatTokenizer::new(template, tokenizer.clone(), ChatOptions::default());
/// let task = TextTask::Conversation {
///     messages: "messages".into(),
///     tools: None,
///     assistant_only: true,
/// };
/// let options = TextOptions { max_length: Some(1024), truncation: true, eos_token: None };
/// let data = TextDataset::open("chats.jsonl", task, options, tokenizer)?
///     .with_chat(Arc::new(chat))?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct ChatTokenizer {
    template: ChatTemplate,
    tokenizer: Arc<crate::TextTokenizer>,
    options: ChatOptions,
    system_prompt: Option<String>,
}

impl ChatTokenizer {
    /// Conversations rendered by `template` with `options` (its
    /// `add_generation_prompt` set per call) and tokenized by `tokenizer`.
    pub fn new(
        template: ChatTemplate,
        tokenizer: Arc<crate::TextTokenizer>,
        options: ChatOptions,
    ) -> Self {
        ChatTokenizer {
            template,
            tokenizer,
            options,
            system_prompt: None,
        }
    }

    /// Puts a system message with `text` first in every conversation that
    /// does not start with one.
    pub fn with_system_prompt(mut self, text: impl Into<String>) -> Self {
        self.system_prompt = Some(text.into());
        self
    }

    /// The template.
    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }
}

impl kiln_text::TokenizeChat for ChatTokenizer {
    fn tokenize_chat(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
    ) -> kiln_core::Result<(Vec<i64>, Vec<bool>)> {
        let mut options = self.options.clone();
        options.add_generation_prompt = add_generation_prompt;
        if let Some(tools) = tools {
            options.tools = Some(tools.to_vec());
        }
        let starts_with_system = messages
            .first()
            .and_then(|m| m.get("role"))
            .and_then(Value::as_str)
            == Some("system");
        let rendered = match &self.system_prompt {
            Some(system) if !starts_with_system => {
                let mut with_system = Vec::with_capacity(messages.len() + 1);
                with_system.push(serde_json::json!({"role": "system", "content": system}));
                with_system.extend(messages.iter().cloned());
                self.template.render(&with_system, &options)?
            }
            _ => self.template.render(messages, &options)?,
        };
        let tokens = rendered.tokenize(&self.tokenizer)?;
        Ok((tokens.ids, tokens.assistant_mask))
    }

    fn marks_assistant_turns(&self) -> bool {
        self.template.has_generation_blocks()
    }

    fn origin(&self) -> String {
        self.template.origin().to_owned()
    }
}

/// A chat template, ready to render conversations.
///
/// ```
/// use kiln_hf::{ChatOptions, ChatTemplate};
/// use serde_json::json;
///
/// let template = ChatTemplate::new(
///     "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}\
///      {% if add_generation_prompt %}<|assistant|>{% endif %}",
///     [("eos_token", "</s>")],
///     "example",
/// )?;
/// let chat = [json!({"role": "user", "content": "Hi"})];
/// let rendered = template.render(&chat, &ChatOptions::generation_prompt())?;
/// assert_eq!(rendered.text, "<|user|>Hi</s><|assistant|>");
/// # Ok::<(), kiln_hf::HfError>(())
/// ```
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    origin: String,
    special_tokens: Vec<(String, String)>,
}

/// What a render takes besides the messages, as `apply_chat_template`'s
/// arguments.
#[derive(Clone, Debug, Default)]
pub struct ChatOptions {
    /// Ends the text with the header of an assistant turn, for generation.
    pub add_generation_prompt: bool,
    /// Tool schemas (JSON Schema objects), for templates that take `tools`.
    pub tools: Option<Vec<Value>>,
    /// Documents (`{"title", "text"}` objects), for templates that take them.
    pub documents: Option<Vec<Value>>,
    /// Further variables the template reads (`enable_thinking`,
    /// `date_string`, ...); they replace special tokens of the same name.
    pub variables: serde_json::Map<String, Value>,
    /// The time `strftime_now` gives (default: the local time now), so that
    /// a data set renders the same text on any day.
    pub now: Option<chrono::NaiveDateTime>,
}

impl ChatOptions {
    /// Options that end the text with an assistant turn's header.
    pub fn generation_prompt() -> Self {
        ChatOptions {
            add_generation_prompt: true,
            ..ChatOptions::default()
        }
    }

    /// These options with the template variable `name` set to `value`.
    pub fn with_variable(mut self, name: impl Into<String>, value: impl Into<Value>) -> Self {
        self.variables.insert(name.into(), value.into());
        self
    }
}

/// A rendered conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderedChat {
    /// The text, as `apply_chat_template(..., tokenize=False)` returns it.
    pub text: String,
    /// The byte ranges of `text` that the template's `{% generation %}`
    /// blocks rendered (the assistant's tokens, for assistant-only loss).
    pub generation: Vec<Range<usize>>,
}

/// A rendered conversation's tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizedChat {
    /// The ids, as `apply_chat_template(..., tokenize=True)` gives them (the
    /// tokenizer's own special tokens not added: the template writes them).
    pub ids: Vec<i64>,
    /// For each id, whether a `{% generation %}` block rendered it
    /// (`return_assistant_tokens_mask`): the tokens assistant-only loss trains.
    pub assistant_mask: Vec<bool>,
}

impl RenderedChat {
    /// The text's tokens, and which of them the generation blocks rendered,
    /// as `transformers` finds them: from the token holding a block's first
    /// character to the one holding its last.
    pub fn tokenize(&self, tokenizer: &crate::TextTokenizer) -> Result<TokenizedChat> {
        let (ids, offsets) = tokenizer.encode_with_offsets(&self.text, false)?;
        let token_at = |pos: usize| offsets.iter().position(|r| r.start <= pos && pos < r.end);
        let mut assistant_mask = vec![false; ids.len()];
        for span in self.generation.iter().filter(|s| !s.is_empty()) {
            let Some(first) = token_at(span.start) else {
                break;
            };
            // transformers' `range(start, end + 1 if end else len)`.
            let end = match token_at(span.end - 1) {
                Some(last) if last > 0 => last + 1,
                _ => ids.len(),
            };
            for m in &mut assistant_mask[first..end] {
                *m = true;
            }
        }
        Ok(TokenizedChat {
            ids,
            assistant_mask,
        })
    }
}

impl ChatTemplate {
    /// The template `source`, given the special tokens it reads
    /// (`bos_token`, `eos_token`, ...) as `(name, text)` pairs; `origin`
    /// names it in errors. Fails on a syntax error, naming its line.
    pub fn new<K: Into<String>, V: Into<String>>(
        source: impl Into<String>,
        special_tokens: impl IntoIterator<Item = (K, V)>,
        origin: impl Into<String>,
    ) -> Result<Self> {
        let source = source.into();
        let origin = origin.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_global(NOW, JValue::UNDEFINED);
        env.add_function("__kiln_generation", |start: bool| {
            JValue::from(if start {
                GENERATION_START
            } else {
                GENERATION_END
            })
        });
        env.add_template_owned(NAME, with_generation_markers(&source))
            .map_err(|e| engine_error(&origin, &e))?;
        Ok(ChatTemplate {
            env,
            source,
            origin,
            special_tokens: special_tokens
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        })
    }

    /// The chat template of the model directory `dir`, as `transformers`
    /// finds it: `chat_template.jinja`, else `tokenizer_config.json`'s
    /// `chat_template` (a string, or named templates of which the one named
    /// `default`), else `chat_template.json`; with the special tokens of
    /// `tokenizer_config.json`. `None` when the directory has no template.
    pub fn open(dir: impl AsRef<Path>) -> Result<Option<Self>> {
        let dir = dir.as_ref();
        let config_path = dir.join("tokenizer_config.json");
        let config = match read_json(&config_path)? {
            Some(Value::Object(map)) => map,
            Some(other) => {
                return Err(HfError::Config {
                    path: config_path,
                    key: "<root>".into(),
                    reason: format!("expected a JSON object, got {other}"),
                })
            }
            None => serde_json::Map::new(),
        };
        let special_tokens: Vec<(String, String)> = SPECIAL_TOKENS
            .iter()
            .filter_map(|name| {
                let text = match config.get(*name)? {
                    Value::String(s) => s.clone(),
                    Value::Object(token) => token.get("content")?.as_str()?.to_owned(),
                    _ => return None,
                };
                Some(((*name).to_owned(), text))
            })
            .collect();
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja)
                .map_err(|e| HfError::Core(kiln_core::Error::io(&jinja, e)))?;
            return Self::new(source, special_tokens, jinja.display().to_string()).map(Some);
        }
        if let Some(template) = config.get("chat_template") {
            let source = named_default(template).map_err(|reason| HfError::Config {
                path: config_path.clone(),
                key: "chat_template".into(),
                reason,
            })?;
            return Self::new(source, special_tokens, config_path.display().to_string()).map(Some);
        }
        let json_path = dir.join("chat_template.json");
        if let Some(Value::Object(map)) = read_json(&json_path)? {
            if let Some(template) = map.get("chat_template") {
                let source = named_default(template).map_err(|reason| HfError::Config {
                    path: json_path.clone(),
                    key: "chat_template".into(),
                    reason,
                })?;
                return Self::new(source, special_tokens, json_path.display().to_string())
                    .map(Some);
            }
        }
        Ok(None)
    }

    /// Another template, `source` (from `origin`), given the same special
    /// tokens as this one: a template file that replaces a model's own.
    pub fn with_source(
        &self,
        source: impl Into<String>,
        origin: impl Into<String>,
    ) -> Result<Self> {
        Self::new(source, self.special_tokens.iter().cloned(), origin)
    }

    /// The template's text, as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Where the template comes from (its file), as errors name it.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Whether the template marks the assistant's text with `{% generation %}`
    /// blocks (what assistant-only loss needs).
    pub fn has_generation_blocks(&self) -> bool {
        generation_tag().is_match(&self.source)
    }

    /// The special token `name` (`eos_token`) the template is given, if any.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Renders `messages` (objects with `role` and `content`, and whatever
    /// else the template reads: `tool_calls`, `reasoning_content`, ...) as
    /// `apply_chat_template(messages, tokenize=False, ...)` does: keys whose
    /// value is `null` are dropped, a message's reasoning under any of
    /// `reasoning_content`, `thinking` or `reasoning` is given under the
    /// first two, and the special tokens and `options` are the template's
    /// variables.
    ///
    /// Fails with [`HfError::ChatTemplate`] naming the template line where
    /// rendering failed, or the message the template raised.
    pub fn render(&self, messages: &[Value], options: &ChatOptions) -> Result<RenderedChat> {
        let fail = |reason: String| HfError::ChatTemplate {
            origin: self.origin.clone(),
            line: None,
            reason,
        };
        let mut chat = Vec::with_capacity(messages.len());
        for (i, message) in messages.iter().enumerate() {
            let Value::Object(fields) = message else {
                return Err(fail(format!(
                    "message {i} is {message}; each message is an object with a `role` and its \
                     `content`"
                )));
            };
            let mut fields: serde_json::Map<String, Value> = fields
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let reasoning = ["reasoning_content", "thinking", "reasoning"]
                .iter()
                .find_map(|k| fields.get(*k).cloned());
            if let Some(reasoning) = reasoning {
                let mut aliased = serde_json::Map::new();
                aliased.insert("thinking".into(), reasoning.clone());
                for (k, v) in fields {
                    aliased.insert(k, v);
                }
                aliased.insert("reasoning_content".into(), reasoning);
                fields = aliased;
            }
            for text in fields.values().filter_map(Value::as_str) {
                if text.contains([GENERATION_START, GENERATION_END]) {
                    return Err(fail(format!(
                        "message {i} holds the private-use character U+F8F0 or U+F8F1, which \
                         Kiln uses to find the template's generation blocks"
                    )));
                }
            }
            chat.push(Value::Object(fields));
        }
        // The data as Python values: lists and dicts print as Python's repr.
        let mut context = std::collections::BTreeMap::new();
        for (name, text) in &self.special_tokens {
            context.insert(name.clone(), JValue::from(text.as_str()));
        }
        for (name, value) in &options.variables {
            context.insert(name.clone(), python_value(value));
        }
        context.insert("messages".into(), python_value(&Value::Array(chat)));
        let list = |items: &Option<Vec<Value>>| match items {
            Some(items) => python_value(&Value::Array(items.clone())),
            None => JValue::from(()),
        };
        context.insert("tools".into(), list(&options.tools));
        context.insert("documents".into(), list(&options.documents));
        context.insert(
            "add_generation_prompt".into(),
            JValue::from(options.add_generation_prompt),
        );
        if let Some(now) = options.now {
            context.insert(
                NOW.into(),
                JValue::from(now.format("%Y-%m-%dT%H:%M:%S%.f").to_string()),
            );
        }
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| engine_error(&self.origin, &e))?;
        let marked = template
            .render(JValue::from(context))
            .map_err(|e| engine_error(&self.origin, &e))?;
        let mut text = String::with_capacity(marked.len());
        let mut generation = Vec::new();
        let mut open: Option<usize> = None;
        for c in marked.chars() {
            match c {
                GENERATION_START => open = Some(text.len()),
                GENERATION_END => {
                    if let Some(start) = open.take() {
                        generation.push(start..text.len());
                    }
                }
                c => text.push(c),
            }
        }
        Ok(RenderedChat { text, generation })
    }
}

/// `{% generation %}` and `{% endgeneration %}` with either whitespace control.
/// Compiled once: every template and every data set asks it.
fn generation_tag() -> &'static regex::Regex {
    static TAG: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"\{%(-?)\s*(end)?generation\s*(-?)%\}").expect("a valid pattern")
    });
    &TAG
}

/// `source` with each `{% generation %}` block made plain Jinja that emits
/// the markers around the block's output: `{%L if true %}{{ start }}{% if
/// true R%}` ... `{%L endif %}{{ end }}{% endif R%}`, so that the tags' own
/// whitespace control, `lstrip_blocks` and `trim_blocks` act as on the
/// original tags, and the lines stay where they were.
fn with_generation_markers(source: &str) -> String {
    generation_tag()
        .replace_all(source, |c: &regex::Captures<'_>| {
            let (left, right) = (&c[1], &c[3]);
            if c.get(2).is_some() {
                format!("{{%{left} endif %}}{{{{ __kiln_generation(false) }}}}{{% endif {right}%}}")
            } else {
                format!(
                    "{{%{left} if true %}}{{{{ __kiln_generation(true) }}}}{{% if true {right}%}}"
                )
            }
        })
        .into_owned()
}

/// A template of `tokenizer_config.json`: a string, or named templates
/// (`[{"name", "template"}]`) of which the `default` one.
fn named_default(template: &Value) -> std::result::Result<String, String> {
    match template {
        Value::String(s) => Ok(s.clone()),
        Value::Array(named) => {
            let mut names = Vec::new();
            for entry in named {
                let name = entry.get("name").and_then(Value::as_str);
                let source = entry.get("template").and_then(Value::as_str);
                match (name, source) {
                    (Some("default"), Some(source)) => return Ok(source.to_owned()),
                    (Some(name), Some(_)) => names.push(name.to_owned()),
                    _ => {
                        return Err(format!(
                        "has an entry {entry}; each named template is {{\"name\", \"template\"}}"
                    ))
                    }
                }
            }
            Err(format!(
                "names templates {names:?} but none `default`, which Kiln renders"
            ))
        }
        other => Err(format!(
            "is {other}; expected a template string or a list of named templates"
        )),
    }
}

/// The JSON file at `path`, `None` when there is none.
fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(path).map_err(|e| HfError::Core(kiln_core::Error::io(path, e)))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| HfError::Config {
            path: path.to_owned(),
            key: "<root>".into(),
            reason: format!("not valid JSON: {e}"),
        })
}

/// The engine's error as an [`HfError::ChatTemplate`] with its line.
fn engine_error(origin: &str, e: &JError) -> HfError {
    let reason = match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(message)) if message.starts_with("raised: ") => {
            format!(
                "the template raised an exception: {}",
                &message["raised: ".len()..]
            )
        }
        (_, Some(detail)) => format!("{}: {detail}", e.kind()),
        (_, None) => e.kind().to_string(),
    };
    HfError::ChatTemplate {
        origin: origin.to_owned(),
        line: e.line(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, messages: &[Value], options: &ChatOptions) -> RenderedChat {
        ChatTemplate::new(source, [("bos_token", "<s>")], "test")
            .unwrap()
            .render(messages, options)
            .unwrap()
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let tools =
            vec![json!({"name": "f", "b": [1, 2.5, 1e20], "a": "é<>&\"\n", "z": null, "t": true})];
        let options = ChatOptions {
            tools: Some(tools),
            ..ChatOptions::default()
        };
        let out = render("{{ tools[0] | tojson }}", &[], &options);
        assert_eq!(
            out.text,
            r#"{"name": "f", "b": [1, 2.5, 1e+20], "a": "é<>&\"\n", "z": null, "t": true}"#
        );
        let out = render(
            "{{ tools[0].b | tojson(indent=2) }}|{{ tools[0] | tojson(sort_keys=true, separators=[',', ':']) }}",
            &[],
            &options,
        );
        assert_eq!(
            out.text,
            "[\n  1,\n  2.5,\n  1e+20\n]|{\"a\":\"é<>&\\\"\\n\",\"b\":[1,2.5,1e+20],\"name\":\"f\",\"t\":true,\"z\":null}"
        );
    }

    #[test]
    fn python_printing_methods_and_trimming_apply() {
        let messages = [json!({"role": "user", "content": "  hi there  ", "x": null})];
        let out = render(
            "{% for m in messages %}\n  {{ m.content.strip().split(' ')[-1] }}|{{ m.x is defined }}|{{ none }}\n{% endfor %}",
            &messages,
            &ChatOptions::default(),
        );
        assert_eq!(out.text, "  there|False|None\n");
    }

    #[test]
    fn generation_blocks_become_spans_and_keep_the_tags_whitespace_rules() {
        let source = "{% for m in messages %}{% if m.role == 'assistant' %}A: \n    {%- generation %}\n{{ m.content }}!{% endgeneration %}\n{% else %}U: {{ m.content }}\n{% endif %}{% endfor %}";
        let messages = [
            json!({"role": "user", "content": "q"}),
            json!({"role": "assistant", "content": "a"}),
        ];
        let out = render(source, &messages, &ChatOptions::default());
        assert_eq!(out.text, "U: q\nA:a!");
        assert_eq!(&out.text[out.generation[0].clone()], "a!");
        let template = ChatTemplate::new(source, [("eos_token", "</s>")], "test").unwrap();
        assert!(template.has_generation_blocks());
    }

    #[test]
    fn failures_name_the_template_line_and_the_raised_message() {
        let template = ChatTemplate::new(
            "line one\n{% if messages[0].role != 'user' %}{{ raise_exception('Conversations start with the user') }}{% endif %}",
            Vec::<(String, String)>::new(),
            "tokenizer_config.json",
        )
        .unwrap();
        let err = template
            .render(
                &[json!({"role": "system", "content": "x"})],
                &ChatOptions::default(),
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains("template line 2"), "{err}");
        assert!(err.contains("Conversations start with the user"), "{err}");
        let err = ChatTemplate::new("{% for %}", Vec::<(String, String)>::new(), "t.jinja")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("t.jinja, template line 1: syntax error"),
            "{err}"
        );
    }
}
