//! Prompt templates: text with `{column}` fields filled from a row.

use kiln_core::error::{Error, Result};

/// A template such as `"### Question:\n{question}\n\n### Answer:\n"`: literal
/// text and `{field}` placeholders, each a column of the data (`{{` and `}}`
/// write a brace).
///
/// ```
/// use kiln_text::PromptTemplate;
///
/// let t = PromptTemplate::parse("Q: {question}\nA: {{ok}}")?;
/// assert_eq!(t.fields(), ["question"]);
/// assert_eq!(t.render(&["2 + 2?".to_owned()])?, "Q: 2 + 2?\nA: {ok}");
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptTemplate {
    source: String,
    parts: Vec<Part>,
    fields: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Text(String),
    /// Index into `fields`.
    Field(usize),
}

impl PromptTemplate {
    /// Parses `source`; an unclosed `{`, a stray `}` or an empty `{}` is an error.
    pub fn parse(source: &str) -> Result<Self> {
        let bad =
            |reason: String| Error::invalid_argument("template", format!("{source:?}: {reason}"));
        let mut parts = Vec::new();
        let mut fields: Vec<String> = Vec::new();
        let mut text = String::new();
        let mut chars = source.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    text.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    text.push('}');
                }
                '{' => {
                    let mut name = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some(c) => name.push(c),
                            None => return Err(bad("a `{` is not closed".into())),
                        }
                    }
                    let name = name.trim().to_owned();
                    if name.is_empty() {
                        return Err(bad("`{}` names no column".into()));
                    }
                    if !text.is_empty() {
                        parts.push(Part::Text(std::mem::take(&mut text)));
                    }
                    let index = match fields.iter().position(|f| *f == name) {
                        Some(i) => i,
                        None => {
                            fields.push(name);
                            fields.len() - 1
                        }
                    };
                    parts.push(Part::Field(index));
                }
                '}' => return Err(bad("a `}` without its `{` (write `}}` for a brace)".into())),
                c => text.push(c),
            }
        }
        if !text.is_empty() {
            parts.push(Part::Text(text));
        }
        Ok(PromptTemplate {
            source: source.to_owned(),
            parts,
            fields,
        })
    }

    /// The template as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The columns the template reads, in order of first use.
    pub fn fields(&self) -> &[String] {
        &self.fields
    }

    /// The text with `values[i]` in place of field `i` of [`fields`](PromptTemplate::fields).
    pub fn render(&self, values: &[String]) -> Result<String> {
        if values.len() != self.fields.len() {
            return Err(Error::invalid_argument(
                "values",
                format!(
                    "the template {:?} has {} fields, got {} values",
                    self.source,
                    self.fields.len(),
                    values.len()
                ),
            ));
        }
        let mut out = String::new();
        for part in &self.parts {
            match part {
                Part::Text(t) => out.push_str(t),
                Part::Field(i) => out.push_str(&values[*i]),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_repeat_and_bad_braces_are_refused() -> Result<()> {
        let t = PromptTemplate::parse("{a}-{ b }-{a}")?;
        assert_eq!(t.fields(), ["a", "b"]);
        assert_eq!(t.render(&["1".into(), "2".into()])?, "1-2-1");
        for bad in ["{a", "a}", "{}"] {
            assert!(PromptTemplate::parse(bad).is_err(), "{bad}");
        }
        Ok(())
    }
}
