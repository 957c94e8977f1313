//! Reader for numeric CSV files.

use std::borrow::Cow;
use std::path::Path;

use crate::source::{read_error, Source};
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// Which column of a CSV file holds the labels.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum LabelColumn {
    /// The last column (the default).
    #[default]
    Last,
    /// The column at this 0-based index.
    Index(usize),
    /// The column with this name in the header.
    Name(String),
}

/// How labels are parsed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LabelKind {
    /// Integer class indices, as `int64` `[N]` (the default). `"3"` and
    /// `"3.0"` are both class 3; `"2.5"` is an error.
    #[default]
    Class,
    /// Real-valued regression targets, as `float32` `[N]`.
    Regression,
}

/// How [`load_csv`] reads a file.
///
/// ```
/// use kiln_data::{CsvOptions, LabelColumn, LabelKind};
///
/// let opts = CsvOptions {
///     label_column: LabelColumn::Name("price".into()),
///     labels: LabelKind::Regression,
///     ..CsvOptions::default()
/// };
/// assert!(opts.has_header);
/// assert_eq!(opts.delimiter, b',');
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CsvOptions {
    /// Whether the first (non-blank) line holds column names. Default `true`.
    pub has_header: bool,
    /// The field separator, one ASCII byte such as `b','`, `b';'` or
    /// `b'\t'`. Default `b','`.
    pub delimiter: u8,
    /// The label column; every other column is a feature. Default: the last.
    pub label_column: LabelColumn,
    /// How labels are parsed. Default: class indices.
    pub labels: LabelKind,
    /// Whether features (and [`LabelKind::Regression`] labels) may be NaN
    /// or infinite: `nan`, `inf`, `-infinity` and the like, or a number too
    /// large for `float32`. Default `false`: [`load_csv`] refuses them,
    /// naming the line and the column, since one such value otherwise
    /// surfaces steps later as a NaN loss.
    pub allow_non_finite: bool,
}

impl Default for CsvOptions {
    fn default() -> Self {
        CsvOptions {
            has_header: true,
            delimiter: b',',
            label_column: LabelColumn::Last,
            labels: LabelKind::Class,
            allow_non_finite: false,
        }
    }
}

/// Reads a CSV file of numbers into features `float32` `[N, F]` and labels
/// `[N]` (`int64` class indices, or `float32` with
/// [`LabelKind::Regression`]); `F` is the number of columns but the label's.
///
/// The file may be gzip-compressed (recognised by its first bytes). Fields
/// are separated by [`CsvOptions::delimiter`] and may be quoted with `"`
/// (a quoted field may contain the delimiter, line breaks and `""` for a
/// quote); spaces around a number are ignored; lines end with `\n` or
/// `\r\n`; blank lines are skipped. Every record must have as many fields
/// as the first.
///
/// # Errors
///
/// [`Error::Io`] if the file cannot be opened; [`Error::Data`] naming the
/// file, the byte offset (in the decompressed stream) and the 1-based line
/// for a field that is not a number (also naming the 1-based column and its
/// header name), a NaN or infinite feature or regression label unless
/// [`CsvOptions::allow_non_finite`] (naming the column by header name and
/// 0-based index), a record with the wrong number of fields, an
/// unterminated quote, a label column that does not exist, or a file
/// without data rows;
/// [`Error::InvalidArgument`] for a [`LabelColumn::Name`] without a header.
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("kiln-csv-doc-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).map_err(|e| kiln_core::Error::io(&dir, e))?;
/// let path = dir.join("iris.csv");
/// std::fs::write(&path, "sepal,petal,\"species, id\"\n5.1,1.4,0\n6.3,4.9,1\n")
///     .map_err(|e| kiln_core::Error::io(&path, e))?;
/// let (x, y) = kiln_data::load_csv(&path, &kiln_data::CsvOptions::default())?;
/// assert_eq!(x.dims(), &[2, 2]);
/// assert_eq!(x.as_slice::<f32>()?, &[5.1, 1.4, 6.3, 4.9]);
/// assert_eq!(y.as_slice::<i64>()?, &[0, 1]);
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn load_csv(path: &Path, options: &CsvOptions) -> Result<(HostTensor, HostTensor)> {
    let data_error = |offset: usize, reason: String| Error::data(path, Some(offset as u64), reason);
    if matches!(options.label_column, LabelColumn::Name(_)) && !options.has_header {
        return Err(Error::invalid_argument(
            "label_column",
            "a label column given by name needs a header (has_header: true)",
        ));
    }
    if matches!(options.delimiter, b'"' | b'\n' | b'\r') {
        return Err(Error::invalid_argument(
            "delimiter",
            format!("{:?} cannot separate fields", char::from(options.delimiter)),
        ));
    }

    let mut src = Source::open(path)?;
    let mut text = Vec::new();
    src.read_rest(&mut text)
        .map_err(|e| read_error(path, text.len() as u64, src.gzip, e))?;

    let mut parser = Parser {
        text: &text,
        pos: 0,
        line: 1,
        delimiter: options.delimiter,
    };
    let mut names: Option<Vec<String>> = None;
    let mut columns: Option<usize> = None;
    let mut label_index = 0usize;
    let mut features: Vec<f32> = Vec::new();
    let mut class_labels: Vec<i64> = Vec::new();
    let mut real_labels: Vec<f32> = Vec::new();
    let mut rows = 0usize;

    while let Some(record) = parser
        .next_record()
        .map_err(|(offset, reason)| data_error(offset, reason))?
    {
        let ncols = match columns {
            Some(n) => n,
            None => {
                let n = record.fields.len();
                label_index = resolve_label(&options.label_column, n, options.has_header, &record)
                    .map_err(|reason| {
                        data_error(record.offset, format!("line {}: {reason}", record.line))
                    })?;
                columns = Some(n);
                if options.has_header {
                    names = Some(
                        record
                            .fields
                            .iter()
                            .map(|f| f.text.trim().to_string())
                            .collect(),
                    );
                    continue;
                }
                n
            }
        };
        if record.fields.len() != ncols {
            return Err(data_error(
                record.offset,
                format!(
                    "line {}: expected {ncols} fields, found {}",
                    record.line,
                    record.fields.len()
                ),
            ));
        }
        for (column, field) in record.fields.iter().enumerate() {
            let describe = || match names.as_ref().and_then(|n| n.get(column)) {
                Some(name) => format!("line {}, column {} (`{name}`)", field.line, column + 1),
                None => format!("line {}, column {}", field.line, column + 1),
            };
            let value = field.text.trim();
            if value.is_empty() {
                return Err(data_error(
                    field.offset,
                    format!("{}: empty field", describe()),
                ));
            }
            if column == label_index {
                match options.labels {
                    LabelKind::Class => {
                        class_labels.push(parse_class(value).map_err(|reason| {
                            data_error(field.offset, format!("{}: {reason}", describe()))
                        })?)
                    }
                    LabelKind::Regression => {
                        let label = value.parse::<f32>().map_err(|_| {
                            data_error(
                                field.offset,
                                format!("{}: `{value}` is not a number", describe()),
                            )
                        })?;
                        if !label.is_finite() && !options.allow_non_finite {
                            return Err(data_error(
                                field.offset,
                                non_finite_reason(
                                    field.line,
                                    column,
                                    names.as_deref(),
                                    value,
                                    "regression labels",
                                ),
                            ));
                        }
                        real_labels.push(label)
                    }
                }
            } else {
                let feature = value.parse::<f32>().map_err(|_| {
                    data_error(
                        field.offset,
                        format!("{}: `{value}` is not a number", describe()),
                    )
                })?;
                if !feature.is_finite() && !options.allow_non_finite {
                    return Err(data_error(
                        field.offset,
                        non_finite_reason(field.line, column, names.as_deref(), value, "features"),
                    ));
                }
                features.push(feature);
            }
        }
        rows += 1;
    }
    if rows == 0 {
        return Err(data_error(
            text.len(),
            if columns.is_some() {
                "no data rows after the header".into()
            } else {
                "no data rows: the file is empty".into()
            },
        ));
    }
    let width = columns.unwrap_or(1) - 1;
    log::debug!(
        "load_csv: {rows} rows of {width} features from {}",
        path.display()
    );
    let labels = match options.labels {
        LabelKind::Class => HostTensor::new(class_labels, [rows])?,
        LabelKind::Regression => HostTensor::new(real_labels, [rows])?,
    };
    Ok((HostTensor::new(features, [rows, width])?, labels))
}

/// The index of the label column in records of `ncols` fields; `first` is
/// the first record (the header when `has_header`).
fn resolve_label(
    column: &LabelColumn,
    ncols: usize,
    has_header: bool,
    first: &Record<'_>,
) -> std::result::Result<usize, String> {
    match column {
        LabelColumn::Last => Ok(ncols - 1),
        LabelColumn::Index(i) if *i < ncols => Ok(*i),
        LabelColumn::Index(i) => Err(format!(
            "label column index {i} is out of range: the {} has {ncols} columns",
            if has_header { "header" } else { "first row" }
        )),
        LabelColumn::Name(name) => first
            .fields
            .iter()
            .position(|f| f.text.trim() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = first.fields.iter().map(|f| f.text.trim()).collect();
                format!(
                    "no column named `{name}` in the header (columns: {})",
                    names.join(", ")
                )
            }),
    }
}

/// Why a NaN or infinite `value` at `line` and 0-based `column` is refused;
/// `what` is `"features"` or `"regression labels"`.
fn non_finite_reason(
    line: usize,
    column: usize,
    names: Option<&[String]>,
    value: &str,
    what: &str,
) -> String {
    let column = match names.and_then(|n| n.get(column)).filter(|n| !n.is_empty()) {
        Some(name) => format!("column `{name}` (index {column})"),
        None => format!("column index {column}"),
    };
    let unsigned = value.trim_start_matches(['+', '-']);
    let overflow = if ["nan", "inf", "infinity"]
        .iter()
        .any(|word| unsigned.eq_ignore_ascii_case(word))
    {
        ""
    } else {
        " (too large for float32)"
    };
    format!(
        "line {line}, {column}: non-finite value `{value}`{overflow}; Kiln refuses NaN and \
         infinite {what} (set CsvOptions::allow_non_finite to accept them)"
    )
}

/// A class label: an integer, or a float with an integral value.
fn parse_class(value: &str) -> std::result::Result<i64, String> {
    if let Ok(v) = value.parse::<i64>() {
        return Ok(v);
    }
    match value.parse::<f64>() {
        // integral and in [-2^63, 2^63): the conversion is exact.
        Ok(v) if v.fract() == 0.0 && (i64::MIN as f64..i64::MAX as f64).contains(&v) => {
            Ok(v as i64)
        }
        Ok(_) => Err(format!("`{value}` is not an integer class label")),
        Err(_) => Err(format!("`{value}` is not a number")),
    }
}

/// One field of a record.
struct Field<'a> {
    text: Cow<'a, str>,
    /// Byte offset of the field's first byte (its opening quote if quoted).
    offset: usize,
    /// 1-based line the field starts on.
    line: usize,
}

/// One record (usually one line).
struct Record<'a> {
    fields: Vec<Field<'a>>,
    offset: usize,
    line: usize,
}

/// Splits CSV text into records. Errors are `(byte offset, reason)`.
struct Parser<'a> {
    text: &'a [u8],
    pos: usize,
    /// 1-based line at `pos`.
    line: usize,
    delimiter: u8,
}

type ParseResult<T> = std::result::Result<T, (usize, String)>;

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.get(self.pos).copied()
    }

    /// Skips blank lines (only spaces, tabs and line ends); `true` if data follows.
    fn skip_blank_lines(&mut self) -> bool {
        loop {
            let start = self.pos;
            let mut p = self.pos;
            while p < self.text.len()
                && matches!(self.text[p], b' ' | b'\t' | b'\r')
                && self.text[p] != self.delimiter
            {
                p += 1;
            }
            match self.text.get(p) {
                None => {
                    self.pos = p;
                    return false;
                }
                Some(b'\n') => {
                    self.pos = p + 1;
                    self.line += 1;
                }
                Some(_) => {
                    self.pos = start;
                    return true;
                }
            }
        }
    }

    fn next_record(&mut self) -> ParseResult<Option<Record<'a>>> {
        if !self.skip_blank_lines() {
            return Ok(None);
        }
        let record_offset = self.pos;
        let record_line = self.line;
        let mut fields = Vec::new();
        loop {
            let field = self.next_field()?;
            fields.push(field);
            match self.peek() {
                Some(b) if b == self.delimiter => self.pos += 1,
                Some(b'\n') => {
                    self.pos += 1;
                    self.line += 1;
                    break;
                }
                None => break,
                // next_field stops only at a delimiter, a line end or the end
                Some(_) => break,
            }
        }
        Ok(Some(Record {
            fields,
            offset: record_offset,
            line: record_line,
        }))
    }

    /// Reads one field, leaving `pos` at the delimiter, `\n` or the end.
    fn next_field(&mut self) -> ParseResult<Field<'a>> {
        let offset = self.pos;
        let line = self.line;
        // spaces before an opening quote are allowed
        let mut p = self.pos;
        while p < self.text.len() && self.text[p] == b' ' && self.delimiter != b' ' {
            p += 1;
        }
        if self.text.get(p) == Some(&b'"') {
            return self.quoted_field(p, offset, line);
        }
        let start = self.pos;
        while let Some(b) = self.peek() {
            if b == self.delimiter || b == b'\n' {
                break;
            }
            self.pos += 1;
        }
        let mut raw = &self.text[start..self.pos];
        if raw.last() == Some(&b'\r') && self.peek() != Some(self.delimiter) {
            raw = &raw[..raw.len() - 1];
        }
        let text = std::str::from_utf8(raw).map_err(|e| {
            (
                offset,
                format!("line {line}: field is not valid UTF-8: {e}"),
            )
        })?;
        Ok(Field {
            text: Cow::Borrowed(text),
            offset,
            line,
        })
    }

    /// A field whose opening quote is at `quote`.
    fn quoted_field(&mut self, quote: usize, offset: usize, line: usize) -> ParseResult<Field<'a>> {
        let mut value = Vec::new();
        self.pos = quote + 1;
        loop {
            match self.peek() {
                None => {
                    return Err((
                        quote,
                        format!("line {line}: the quoted field opened here is never closed"),
                    ))
                }
                Some(b'"') if self.text.get(self.pos + 1) == Some(&b'"') => {
                    value.push(b'"');
                    self.pos += 2;
                }
                Some(b'"') => {
                    self.pos += 1;
                    break;
                }
                Some(b) => {
                    if b == b'\n' {
                        self.line += 1;
                    }
                    value.push(b);
                    self.pos += 1;
                }
            }
        }
        // only spaces (and a '\r' before '\n') may follow the closing quote
        while matches!(self.peek(), Some(b' ' | b'\r')) && self.peek() != Some(self.delimiter) {
            self.pos += 1;
        }
        match self.peek() {
            None | Some(b'\n') => {}
            Some(b) if b == self.delimiter => {}
            Some(b) => {
                return Err((
                    self.pos,
                    format!(
                        "line {}: unexpected {:?} after the closing quote of a field",
                        self.line,
                        char::from(b)
                    ),
                ))
            }
        }
        let text = String::from_utf8(value).map_err(|e| {
            (
                offset,
                format!("line {line}: field is not valid UTF-8: {}", e.utf8_error()),
            )
        })?;
        Ok(Field {
            text: Cow::Owned(text),
            offset,
            line,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(text: &str, delimiter: u8) -> ParseResult<Vec<Vec<(String, usize, usize)>>> {
        let mut p = Parser {
            text: text.as_bytes(),
            pos: 0,
            line: 1,
            delimiter,
        };
        let mut out = Vec::new();
        while let Some(r) = p.next_record()? {
            out.push(
                r.fields
                    .into_iter()
                    .map(|f| (f.text.into_owned(), f.offset, f.line))
                    .collect(),
            );
        }
        Ok(out)
    }

    fn texts(text: &str, delimiter: u8) -> Vec<Vec<String>> {
        records(text, delimiter)
            .expect("parses")
            .into_iter()
            .map(|r| r.into_iter().map(|f| f.0).collect())
            .collect()
    }

    #[test]
    fn splits_quoted_fields_and_line_ends() {
        assert_eq!(
            texts("a,\"b,c\",d\r\n\n1, \"say \"\"hi\"\"\" ,3\n", b','),
            vec![vec!["a", "b,c", "d"], vec!["1", "say \"hi\"", "3"],]
        );
        // a quoted line break stays in the field, and the next record's line counts it
        let r = records("\"x\ny\",1\n2,3", b',').expect("parses");
        assert_eq!(r[0][0], ("x\ny".to_string(), 0, 1));
        assert_eq!(r[1][0], ("2".to_string(), 8, 3));
        assert_eq!(r[1][1], ("3".to_string(), 10, 3));
        // empty fields and a trailing delimiter
        assert_eq!(texts("1,,3,\n", b','), vec![vec!["1", "", "3", ""]]);
        assert_eq!(texts("1\t2\n", b'\t'), vec![vec!["1", "2"]]);
        assert!(texts("\n \r\n", b',').is_empty());
    }

    #[test]
    fn reports_quote_errors_with_offsets() {
        let err = records("1,2\n3,\"4\n", b',').expect_err("unterminated");
        assert_eq!(err.0, 6);
        assert_eq!(
            err.1,
            "line 2: the quoted field opened here is never closed"
        );
        let err = records("\"a\"b,1\n", b',').expect_err("junk after quote");
        assert_eq!(
            err,
            (
                3,
                "line 1: unexpected 'b' after the closing quote of a field".to_string()
            )
        );
    }

    /// Loads `text` from a temp file with `options`.
    fn load_text(name: &str, text: &str, options: &CsvOptions) -> Result<(HostTensor, HostTensor)> {
        let path =
            std::env::temp_dir().join(format!("kiln-core-csv-{}-{name}.csv", std::process::id()));
        std::fs::write(&path, text).map_err(|e| Error::io(&path, e))?;
        let loaded = load_csv(&path, options);
        // Best effort: a leftover file in the temp dir is harmless.
        let _ = std::fs::remove_file(&path);
        loaded
    }

    fn data_reason(err: Error) -> (Option<u64>, String) {
        match err {
            Error::Data { offset, reason, .. } => (offset, reason),
            other => panic!("expected Error::Data, got {other:?}"),
        }
    }

    #[test]
    fn non_finite_features_are_refused_naming_line_and_column() -> Result<()> {
        let hint = "(set CsvOptions::allow_non_finite to accept them)";
        let text = "pixel0,pixel1,pixel2,pixel3,label\n\
                    0,1,2,3,0\n\
                    \n\
                    4,5,6,nan,1\n";
        let err = load_text("nan", text, &CsvOptions::default()).expect_err("nan");
        let (offset, reason) = data_reason(err);
        assert_eq!(offset, Some(text.find("nan").unwrap_or(0) as u64));
        assert_eq!(
            reason,
            format!(
                "line 4, column `pixel3` (index 3): non-finite value `nan`; Kiln refuses NaN \
                 and infinite features {hint}"
            )
        );
        // every spelling f32 parses as non-finite, and an overflow, without a header
        let no_header = CsvOptions {
            has_header: false,
            ..CsvOptions::default()
        };
        for (value, note) in [
            ("NaN", ""),
            ("inf", ""),
            ("-inf", ""),
            ("+Infinity", ""),
            ("-INFINITY", ""),
            ("1e39", " (too large for float32)"),
        ] {
            let text = format!("1,2,0\n3, {value} ,1\n");
            let err = load_text("spellings", &text, &no_header).expect_err(value);
            let (_, reason) = data_reason(err);
            assert_eq!(
                reason,
                format!(
                    "line 2, column index 1: non-finite value `{value}`{note}; Kiln refuses \
                     NaN and infinite features {hint}"
                )
            );
        }
        // regression labels likewise
        let regression = CsvOptions {
            labels: LabelKind::Regression,
            ..CsvOptions::default()
        };
        let err = load_text("label", "x,y\n1,inf\n", &regression).expect_err("inf label");
        assert_eq!(
            data_reason(err).1,
            format!(
                "line 2, column `y` (index 1): non-finite value `inf`; Kiln refuses NaN and \
                 infinite regression labels {hint}"
            )
        );
        // a class label is refused as before: it is not an integer
        let err = load_text("class", "x,y\n1,nan\n", &CsvOptions::default()).expect_err("class");
        assert_eq!(
            data_reason(err).1,
            "line 2, column 2 (`y`): `nan` is not an integer class label"
        );
        Ok(())
    }

    #[test]
    fn allow_non_finite_keeps_them() -> Result<()> {
        let options = CsvOptions {
            allow_non_finite: true,
            labels: LabelKind::Regression,
            ..CsvOptions::default()
        };
        let (x, y) = load_text("allowed", "a,b,y\nnan,-inf,inf\n1e39,2,NaN\n", &options)?;
        let x = x.as_slice::<f32>()?;
        assert!(x[0].is_nan());
        assert_eq!(&x[1..], &[f32::NEG_INFINITY, f32::INFINITY, 2.0]);
        let y = y.as_slice::<f32>()?;
        assert_eq!(y[0], f32::INFINITY);
        assert!(y[1].is_nan());
        assert!(!CsvOptions::default().allow_non_finite);
        Ok(())
    }

    #[test]
    fn class_labels_accept_integral_floats() {
        assert_eq!(parse_class("7"), Ok(7));
        assert_eq!(parse_class("-2"), Ok(-2));
        assert_eq!(parse_class("3.0"), Ok(3));
        assert_eq!(parse_class("1e2"), Ok(100));
        assert_eq!(
            parse_class("2.5"),
            Err("`2.5` is not an integer class label".to_string())
        );
        assert_eq!(
            parse_class("nan"),
            Err("`nan` is not an integer class label".to_string())
        );
        assert_eq!(parse_class("x"), Err("`x` is not a number".to_string()));
    }
}
