//! Python's side of Jinja2, as `transformers` sets it up for chat
//! templates: lists and dicts that print as Python's `repr`, `None`, `True`
//! and `False` printed as Python prints them, `raise_exception`,
//! `strftime_now`, and a `tojson` that writes what `json.dumps` writes.

use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value as JValue, ValueKind};
use minijinja::{Error as JError, ErrorKind};
use serde_json::Value;

use super::NOW;

/// A JSON value as the template sees it: lists and dicts as Python's, which
/// print (and `| string` and `~` convert) as Python's `repr`.
pub(super) fn python_value(value: &Value) -> JValue {
    match value {
        Value::Array(items) => {
            JValue::from_object(PyList(items.iter().map(python_value).collect()))
        }
        Value::Object(map) => JValue::from_object(PyDict(
            map.iter()
                .map(|(k, v)| (JValue::from(k.as_str()), python_value(v)))
                .collect(),
        )),
        scalar => JValue::from_serialize(scalar),
    }
}

/// A Python list.
#[derive(Debug)]
struct PyList(Vec<JValue>);

impl Object for PyList {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Seq
    }

    fn get_value(self: &Arc<Self>, key: &JValue) -> Option<JValue> {
        self.0.get(key.as_usize()?).cloned()
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Seq(self.0.len())
    }

    fn render(self: &Arc<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut text = String::new();
        python_repr(&JValue::from_dyn_object(self.clone()), &mut text)
            .map_err(|_| std::fmt::Error)?;
        f.write_str(&text)
    }
}

/// A Python dict, in its keys' order.
#[derive(Debug)]
struct PyDict(Vec<(JValue, JValue)>);

impl Object for PyDict {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &JValue) -> Option<JValue> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.0.iter().map(|(k, _)| k.clone()).collect())
    }

    fn render(self: &Arc<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut text = String::new();
        python_repr(&JValue::from_dyn_object(self.clone()), &mut text)
            .map_err(|_| std::fmt::Error)?;
        f.write_str(&text)
    }
}

/// `raise_exception(message)`: fails the render with the template's message.
pub(super) fn raise_exception(message: String) -> std::result::Result<JValue, JError> {
    Err(JError::new(
        ErrorKind::InvalidOperation,
        format!("raised: {message}"),
    ))
}

/// `strftime_now(format)`: the local time (or [`ChatOptions::now`]) in
/// `format` (Python's `strftime`).
pub(super) fn strftime_now(
    state: &minijinja::State<'_, '_>,
    format: String,
) -> std::result::Result<JValue, JError> {
    use chrono::format::{Item, StrftimeItems};
    use std::fmt::Write as _;
    let items: Vec<Item<'_>> = StrftimeItems::new(&format).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(JError::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: {format:?} is not a strftime format"),
        ));
    }
    let now = state
        .lookup(NOW)
        .and_then(|v| v.as_str().map(str::to_owned))
        .and_then(|s| chrono::NaiveDateTime::parse_from_str(&s, "%Y-%m-%dT%H:%M:%S%.f").ok())
        .unwrap_or_else(|| chrono::Local::now().naive_local());
    let mut out = String::new();
    write!(out, "{}", now.format_with_items(items.into_iter())).map_err(|_| {
        JError::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: cannot format {format:?}"),
        )
    })?;
    Ok(JValue::from(out))
}

/// Prints values as Python's Jinja2 does (`str()`): `None`, `True`,
/// `False`, and lists and dicts as Python's `repr` writes them.
pub(super) fn python_formatter(
    out: &mut minijinja::Output<'_>,
    state: &minijinja::State<'_, '_>,
    value: &JValue,
) -> std::result::Result<(), JError> {
    let text = match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            python_repr(value, &mut text)?;
            text
        }
        ValueKind::Number if !value.is_integer() => {
            python_float(f64::try_from(value.clone()).unwrap_or(f64::NAN))
        }
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(&text)
        .map_err(|_| JError::new(ErrorKind::WriteFailure, "writing the template's output"))
}

/// Python's `repr` of a value: `None`, `True`, `'text'`, `[1, 2.0]`,
/// `{'key': 'value'}`.
fn python_repr(v: &JValue, out: &mut String) -> std::result::Result<(), JError> {
    match v.kind() {
        ValueKind::None | ValueKind::Undefined => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => {
            out.push_str(&python_float(f64::try_from(v.clone()).unwrap_or(f64::NAN)))
        }
        ValueKind::String => python_str_repr(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&key, out)?;
                out.push_str(": ");
                python_repr(&v.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        _ => out.push_str(&v.to_string()),
    }
    Ok(())
}

/// Python's `repr` of a string: single quotes, or double quotes when it
/// holds a single quote and no double one.
fn python_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// `tojson`: Python's `json.dumps(value, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, its arguments as keywords.
pub(super) fn tojson(value: &JValue, kwargs: Kwargs) -> std::result::Result<JValue, JError> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let indent: Option<JValue> = kwargs.get("indent")?;
    let separators: Option<JValue> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => match v.as_str() {
                Some(s) => Some(s.to_owned()),
                None => {
                    return Err(JError::new(
                        ErrorKind::InvalidOperation,
                        format!("tojson: indent is {v}; expected a number or a string"),
                    ))
                }
            },
        },
    };
    let (item, key) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .unwrap_or_default();
            match parts.as_slice() {
                [item, key] => (item.clone(), key.clone()),
                _ => {
                    return Err(JError::new(
                        ErrorKind::InvalidOperation,
                        format!("tojson: separators is {v}; expected two strings"),
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let mut out = String::new();
    let dumper = PyJson {
        ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
        indent,
        item,
        key,
    };
    dumper.dump(value, 0, &mut out)?;
    Ok(JValue::from_safe_string(out))
}

/// Python's `json.dumps` settings.
struct PyJson {
    ascii: bool,
    sort_keys: bool,
    indent: Option<String>,
    item: String,
    key: String,
}

impl PyJson {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    }

    fn dump(&self, v: &JValue, level: usize, out: &mut String) -> std::result::Result<(), JError> {
        match v.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Undefined => {
                return Err(JError::new(
                    ErrorKind::UndefinedError,
                    "tojson: an undefined value is not JSON serializable",
                ))
            }
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => match v.as_i64() {
                Some(i) if v.is_integer() => out.push_str(&i.to_string()),
                _ if v.is_integer() => out.push_str(&v.to_string()),
                _ => {
                    let f = f64::try_from(v.clone()).map_err(|_| {
                        JError::new(ErrorKind::InvalidOperation, format!("tojson: {v}"))
                    })?;
                    out.push_str(&python_float(f));
                }
            },
            ValueKind::String => self.string(v.as_str().unwrap_or_default(), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<JValue> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(level + 1, out);
                    self.dump(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push(']');
            }
            ValueKind::Map => {
                let mut keys: Vec<JValue> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                out.push('{');
                for (i, key) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(level + 1, out);
                    let name = match key.as_str() {
                        Some(s) => s.to_owned(),
                        None => key.to_string(),
                    };
                    self.string(&name, out);
                    out.push_str(&self.key);
                    self.dump(&v.get_item(key)?, level + 1, out)?;
                }
                self.newline(level, out);
                out.push('}');
            }
            _ => {
                return Err(JError::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a {} value is not JSON serializable", v.kind()),
                ))
            }
        }
        Ok(())
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ascii && (c as u32) > 0x7e) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A float as Python's `repr` writes it (`1.0`, `0.1`, `1e+20`, `NaN`).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // Python: the shortest digits in exponent form, a sign and two digits at least.
        let shown = format!("{f:e}");
        let (mantissa, exponent) = shown.split_once('e').unwrap_or((&shown, "0"));
        let exponent: i32 = exponent.parse().unwrap_or(0);
        let sign = if exponent < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exponent.abs());
    }
    let shown = format!("{f}");
    if shown.contains('.') {
        shown
    } else {
        format!("{shown}.0")
    }
}
