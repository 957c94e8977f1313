//! The rows of a text file, by index: JSON Lines (one object per line) and
//! CSV (a header naming the columns) without holding the file in memory
//! (opening reads the file once, checks every row has the columns asked for,
//! and keeps each row's byte offset; [`TextRecords::get`] reads one row
//! back), and Parquet (as `datasets`' `to_parquet` writes it), whose columns
//! asked for are read into memory.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use kiln_core::error::{Error, Result};

/// How a text file's rows are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextFormat {
    /// One JSON object per line (`.jsonl`, `.json`), as `datasets`' `to_json` writes.
    JsonLines,
    /// Comma-separated values with a header line (`.csv`), quoted as RFC 4180 says.
    Csv,
    /// Apache Parquet (`.parquet`), as `datasets`' `to_parquet` and pandas write it
    /// (uncompressed, Snappy or gzip pages).
    Parquet,
}

impl TextFormat {
    /// The format a file name's extension says: `.jsonl`/`.json`/`.ndjson`, `.csv`.
    pub fn from_path(path: &Path) -> Result<Self> {
        match path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("jsonl" | "json" | "ndjson") => Ok(TextFormat::JsonLines),
            Some("csv") => Ok(TextFormat::Csv),
            Some("parquet") => Ok(TextFormat::Parquet),
            other => Err(Error::invalid_argument(
                "path",
                format!(
                    "{}: text data is read from JSON Lines (.jsonl), CSV (.csv) or Parquet \
                     (.parquet) files, not {}",
                    path.display(),
                    other.map_or("a file without an extension".to_owned(), |e| format!(
                        ".{e}"
                    ))
                ),
            )),
        }
    }
}

/// The rows of a JSON Lines or CSV file, read one at a time: each row's
/// values of the columns asked for, as text (a JSON number or boolean as
/// written).
#[derive(Debug)]
pub struct TextRecords {
    path: PathBuf,
    format: TextFormat,
    columns: Vec<String>,
    /// Byte offset and length of each row (CSV: of each record, quotes included).
    rows: Vec<(u64, u32)>,
    /// Line number (1-based) of each row, for messages.
    lines: Vec<u32>,
    /// CSV: the index of each wanted column in a record.
    csv_index: Vec<usize>,
    /// Parquet: the wanted columns of every row.
    values: Vec<Vec<String>>,
    file: Mutex<File>,
    /// The most bytes a row may have.
    max_row_bytes: u64,
    /// For each column, whether it holds a list of messages (given as its
    /// JSON text) rather than text.
    lists: Vec<bool>,
}

/// The UTF-8 byte-order mark, skipped at the start of a file.
const UTF8_BOM: &[u8] = b"\xef\xbb\xbf";

/// The most bytes a row may have when no limit is given (64 MiB: about 16
/// million tokens of English): a row is read into memory whole.
pub const MAX_ROW_BYTES: u64 = 64 << 20;

impl TextRecords {
    /// Reads `path` (format from its extension) and checks that every row has
    /// every one of `columns`. An empty file, a row that is not a JSON object,
    /// a missing column (named with the row's line and the columns there are)
    /// or a value that is not text, a number or a boolean is an error; blank
    /// lines are skipped.
    pub fn open(path: impl AsRef<Path>, columns: &[&str]) -> Result<Self> {
        Self::open_bounded(path, columns, MAX_ROW_BYTES)
    }

    /// [`open`](Self::open), refusing any row (JSON Lines line, CSV record) of
    /// more than `max_row_bytes` bytes while reading it: a row is never held
    /// whole beyond that, so a one-line file of gigabytes costs its limit in
    /// memory and is refused naming its line.
    pub fn open_bounded(
        path: impl AsRef<Path>,
        columns: &[&str],
        max_row_bytes: u64,
    ) -> Result<Self> {
        Self::open_with_lists(path, columns, &[], max_row_bytes)
    }

    /// [`open_bounded`](Self::open_bounded), where the columns `lists` hold
    /// lists (a conversation's messages: a JSON list in JSON Lines, its JSON
    /// text in CSV, a list of structs in Parquet), each given by
    /// [`get`](Self::get) as its JSON text.
    pub fn open_with_lists(
        path: impl AsRef<Path>,
        columns: &[&str],
        lists: &[&str],
        max_row_bytes: u64,
    ) -> Result<Self> {
        let path = path.as_ref().to_owned();
        let format = TextFormat::from_path(&path)?;
        let file = kiln_core::fs::open_regular_file(&path)?;
        let list_flags: Vec<bool> = columns.iter().map(|c| lists.contains(c)).collect();
        let columns: Vec<String> = columns.iter().map(|c| (*c).to_owned()).collect();
        let mut records = TextRecords {
            path,
            format,
            columns,
            rows: Vec::new(),
            lines: Vec::new(),
            csv_index: Vec::new(),
            values: Vec::new(),
            file: Mutex::new(file.try_clone().map_err(|e| Error::io("text file", e))?),
            max_row_bytes,
            lists: list_flags,
        };
        match format {
            TextFormat::JsonLines => records.index_json_lines(file)?,
            TextFormat::Csv => records.index_csv(file)?,
            TextFormat::Parquet => records.read_parquet(file)?,
        }
        if records.rows.is_empty() {
            return Err(records.bad(0, "the file holds no rows".into()));
        }
        Ok(records)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format.
    pub fn format(&self) -> TextFormat {
        self.format
    }

    /// The columns each row gives, in [`get`](TextRecords::get)'s order.
    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether there are no rows (never, once opened).
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The line (1-based) row `index` starts on (Parquet: its 1-based row number).
    pub fn line(&self, index: usize) -> usize {
        self.lines.get(index).map_or(0, |&l| l as usize)
    }

    /// Where row `index` is, for messages: `file, line N` (Parquet: `file, row N`).
    pub fn place(&self, index: usize) -> String {
        let what = if self.format == TextFormat::Parquet {
            "row"
        } else {
            "line"
        };
        format!("{}, {what} {}", self.path.display(), self.line(index))
    }

    /// `path:line: reason` as a data error.
    fn bad(&self, line: usize, reason: String) -> Error {
        let place = if line == 0 {
            self.path.display().to_string()
        } else {
            format!("{}, line {line}", self.path.display())
        };
        Error::invalid_argument("data", format!("{place}: {reason}"))
    }

    /// The values of the columns of row `index`.
    pub fn get(&self, index: usize) -> Result<Vec<String>> {
        if self.format == TextFormat::Parquet {
            return self.values.get(index).cloned().ok_or_else(|| {
                Error::invalid_argument(
                    "index",
                    format!("row {index} is out of range for {} rows", self.values.len()),
                )
            });
        }
        let &(offset, len) = self.rows.get(index).ok_or_else(|| {
            Error::invalid_argument(
                "index",
                format!("row {index} is out of range for {} rows", self.rows.len()),
            )
        })?;
        let mut bytes = vec![0u8; len as usize];
        {
            let mut file = self
                .file
                .lock()
                .map_err(|_| Error::invalid_argument("data", "a reader thread panicked"))?;
            file.seek(SeekFrom::Start(offset))
                .and_then(|_| file.read_exact(&mut bytes))
                .map_err(|e| Error::io(&self.path, e))?;
        }
        let line = self.line(index);
        match self.format {
            TextFormat::JsonLines | TextFormat::Parquet => self.json_values(&bytes, line),
            TextFormat::Csv => {
                let record = parse_csv_record(&bytes)
                    .map_err(|reason| self.bad(line, reason))?
                    .0;
                Ok(self
                    .csv_index
                    .iter()
                    .map(|&i| record.get(i).cloned().unwrap_or_default())
                    .collect())
            }
        }
    }

    /// The wanted columns of a JSON object line.
    fn json_values(&self, bytes: &[u8], line: usize) -> Result<Vec<String>> {
        let value: serde_json::Value = serde_json::from_slice(bytes)
            .map_err(|e| self.bad(line, format!("not a JSON object: {e}")))?;
        let Some(object) = value.as_object() else {
            return Err(self.bad(line, "a row must be a JSON object".into()));
        };
        self.columns
            .iter()
            .zip(&self.lists)
            .map(|(c, &list)| match object.get(c) {
                Some(v @ (serde_json::Value::Array(_) | serde_json::Value::Null)) if list => {
                    Ok(v.to_string())
                }
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                Some(other) if list => Err(self.bad(
                    line,
                    format!("column `{c}` holds {other}, not a list of messages"),
                )),
                Some(v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_))) => {
                    Ok(v.to_string())
                }
                Some(other) => Err(self.bad(line, format!("column `{c}` holds {other}, not text"))),
                None => {
                    let mut have: Vec<&str> = object.keys().map(String::as_str).collect();
                    have.truncate(12);
                    Err(self.bad(
                        line,
                        format!(
                            "no column `{c}` (the row has: {})",
                            if have.is_empty() {
                                "none".to_owned()
                            } else {
                                have.join(", ")
                            }
                        ),
                    ))
                }
            })
            .collect()
    }

    fn index_json_lines(&mut self, file: File) -> Result<()> {
        let mut reader = BufReader::new(file);
        let mut offset = 0u64;
        let mut buf = Vec::new();
        let mut line = 0usize;
        loop {
            buf.clear();
            // At most one byte past the limit is read: enough to know the row
            // is over it, without holding the rest.
            let n = (&mut reader)
                .take(self.max_row_bytes + 1)
                .read_until(b'\n', &mut buf)
                .map_err(|e| Error::io(&self.path, e))?;
            if n == 0 {
                break;
            }
            line += 1;
            if n as u64 > self.max_row_bytes {
                return Err(self.too_long(line));
            }
            let mut start = offset;
            offset += n as u64;
            let mut n = n;
            // A UTF-8 byte-order mark (as Windows editors write) is not part
            // of the first row.
            if line == 1 && buf.starts_with(UTF8_BOM) {
                buf.drain(..UTF8_BOM.len());
                start += UTF8_BOM.len() as u64;
                n -= UTF8_BOM.len();
            }
            if buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            self.json_values(&buf, line)?;
            let len =
                u32::try_from(n).map_err(|_| self.bad(line, "a row longer than 4 GiB".into()))?;
            self.rows.push((start, len));
            self.lines.push(line as u32);
        }
        Ok(())
    }

    /// A row over [`max_row_bytes`](Self::open_bounded), at `line`.
    fn too_long(&self, line: usize) -> Error {
        self.bad(
            line,
            format!(
                "the row is longer than {} bytes, more than the examples can use (the limit \
                 follows from data.max_length, or is {} MiB without one); split or cut such rows",
                self.max_row_bytes,
                MAX_ROW_BYTES >> 20
            ),
        )
    }

    fn index_csv(&mut self, file: File) -> Result<()> {
        let mut bytes = Vec::new();
        BufReader::new(file)
            .read_to_end(&mut bytes)
            .map_err(|e| Error::io(&self.path, e))?;
        let mut pos = 0usize;
        let mut line = 1usize;
        if bytes.starts_with(UTF8_BOM) {
            pos = UTF8_BOM.len();
        }
        // The header.
        let (header, used) = parse_csv_record(&bytes[pos..]).map_err(|r| self.bad(1, r))?;
        if used == 0 {
            return Ok(());
        }
        let header: Vec<String> = header.iter().map(|h| h.trim().to_owned()).collect();
        self.csv_index = self
            .columns
            .iter()
            .map(|c| {
                header.iter().position(|h| h == c).ok_or_else(|| {
                    self.bad(
                        1,
                        format!(
                            "no column `{c}` in the header (it has: {})",
                            header.join(", ")
                        ),
                    )
                })
            })
            .collect::<Result<_>>()?;
        line += count_newlines(&bytes[pos..pos + used]);
        pos += used;
        while pos < bytes.len() {
            let (record, used) = parse_csv_record(&bytes[pos..]).map_err(|r| self.bad(line, r))?;
            if used as u64 > self.max_row_bytes {
                return Err(self.too_long(line));
            }
            let blank = record.len() == 1 && record[0].trim().is_empty();
            if !blank {
                if record.len() != header.len() {
                    return Err(self.bad(
                        line,
                        format!(
                            "{} fields, the header names {} columns",
                            record.len(),
                            header.len()
                        ),
                    ));
                }
                let len = u32::try_from(used)
                    .map_err(|_| self.bad(line, "a row longer than 4 GiB".into()))?;
                self.rows.push((pos as u64, len));
                self.lines.push(line as u32);
            }
            line += count_newlines(&bytes[pos..pos + used]);
            pos += used;
        }
        Ok(())
    }
}

impl TextRecords {
    /// Reads the wanted columns of a Parquet file; a row's "line" is its
    /// 1-based row number.
    fn read_parquet(&mut self, file: File) -> Result<()> {
        use parquet::file::reader::{FileReader, SerializedFileReader};
        use parquet::record::Field;
        let path = self.path.clone();
        let bad = |reason: String| {
            Error::invalid_argument("data", format!("{}: {reason}", path.display()))
        };
        let reader = SerializedFileReader::new(file)
            .map_err(|e| bad(format!("not a Parquet file Kiln reads: {e}")))?;
        // The top-level fields are the columns a row has (a list column's
        // leaf is `name.list.element`, which no user writes).
        let schema = reader.metadata().file_metadata().schema_descr();
        let fields = schema.root_schema().get_fields();
        let names: Vec<&str> = fields.iter().map(|f| f.name()).collect();
        for c in &self.columns {
            let Some(field) = fields.iter().find(|f| f.name() == c) else {
                return Err(bad(format!(
                    "no column `{c}` (the file has: {})",
                    names.join(", ")
                )));
            };
            let list = self.lists[self.columns.iter().position(|x| x == c).unwrap_or(0)];
            if field.is_group() && !list {
                let info = field.get_basic_info();
                let what = match (info.logical_type_ref(), info.converted_type()) {
                    (Some(parquet::basic::LogicalType::List), _)
                    | (_, parquet::basic::ConvertedType::LIST) => "a list",
                    (Some(parquet::basic::LogicalType::Map), _)
                    | (
                        _,
                        parquet::basic::ConvertedType::MAP
                        | parquet::basic::ConvertedType::MAP_KEY_VALUE,
                    ) => "a map",
                    _ => "a struct",
                };
                return Err(bad(format!(
                    "column `{c}` holds {what} in each row, not text: Kiln reads string and \
                     number columns (flatten it to one string first, or name another column)"
                )));
            }
        }
        let rows = reader
            .get_row_iter(None)
            .map_err(|e| bad(format!("reading its rows: {e}")))?;
        for (i, row) in rows.enumerate() {
            let row = row.map_err(|e| bad(format!("row {}: {e}", i + 1)))?;
            let mut values = vec![None; self.columns.len()];
            for (name, field) in row.get_column_iter() {
                let Some(k) = self.columns.iter().position(|c| c == name) else {
                    continue;
                };
                values[k] = Some(match field {
                    Field::ListInternal(_) | Field::Null if self.lists[k] => {
                        field.to_json_value().to_string()
                    }
                    Field::Str(s) => s.clone(),
                    Field::Null => {
                        return Err(bad(format!("row {}: column `{name}` is null", i + 1)))
                    }
                    Field::Bool(_)
                    | Field::Byte(_)
                    | Field::Short(_)
                    | Field::Int(_)
                    | Field::Long(_)
                    | Field::UByte(_)
                    | Field::UShort(_)
                    | Field::UInt(_)
                    | Field::ULong(_)
                    | Field::Float(_)
                    | Field::Double(_) => field.to_string(),
                    other => {
                        return Err(bad(format!(
                            "row {}: column `{name}` holds {other}, not text",
                            i + 1
                        )))
                    }
                });
            }
            let values: Vec<String> = values
                .into_iter()
                .zip(&self.columns)
                .map(|(v, c)| v.ok_or_else(|| bad(format!("row {}: no column `{c}`", i + 1))))
                .collect::<Result<_>>()?;
            self.values.push(values);
            self.rows.push((0, 0));
            self.lines.push(u32::try_from(i + 1).unwrap_or(u32::MAX));
        }
        Ok(())
    }
}

fn count_newlines(bytes: &[u8]) -> usize {
    bytes.iter().filter(|&&b| b == b'\n').count()
}

/// One CSV record from the start of `bytes` (RFC 4180: fields in double
/// quotes may hold commas, newlines and `""`), and the bytes it took with its
/// line end.
fn parse_csv_record(bytes: &[u8]) -> std::result::Result<(Vec<String>, usize), String> {
    let mut fields = Vec::new();
    let mut field: Vec<u8> = Vec::new();
    let mut i = 0;
    let mut quoted = false;
    let mut was_quoted = false;
    let text = |f: &[u8]| {
        String::from_utf8(f.to_vec()).map_err(|_| "a field is not UTF-8 text".to_owned())
    };
    while i < bytes.len() {
        let b = bytes[i];
        if quoted {
            if b == b'"' {
                if bytes.get(i + 1) == Some(&b'"') {
                    field.push(b'"');
                    i += 2;
                    continue;
                }
                quoted = false;
            } else {
                field.push(b);
            }
            i += 1;
            continue;
        }
        match b {
            b'"' if field.is_empty() && !was_quoted => {
                quoted = true;
                was_quoted = true;
            }
            b',' => {
                fields.push(text(&field)?);
                field.clear();
                was_quoted = false;
            }
            b'\n' => {
                if field.last() == Some(&b'\r') && !was_quoted {
                    field.pop();
                }
                fields.push(text(&field)?);
                return Ok((fields, i + 1));
            }
            b'\r' if was_quoted => {}
            _ => field.push(b),
        }
        i += 1;
    }
    if quoted {
        return Err("a quoted field is not closed".into());
    }
    if i > 0 {
        fields.push(text(&field)?);
    }
    Ok((fields, i))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-text-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_default();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap_or_default();
        path
    }

    #[test]
    fn json_lines_rows_come_back_by_index() -> Result<()> {
        let path = write(
            "a.jsonl",
            "{\"q\": \"héllo\", \"a\": \"x\\ny\", \"n\": 3}\n\n{\"q\": \"two\", \"a\": \"z\", \"n\": 4}\n",
        );
        let r = TextRecords::open(&path, &["a", "q", "n"])?;
        assert_eq!(r.len(), 2);
        assert_eq!(r.get(0)?, ["x\ny", "héllo", "3"]);
        assert_eq!(r.get(1)?, ["z", "two", "4"]);
        assert_eq!(r.line(1), 3);
        let err = TextRecords::open(&path, &["answer"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("line 1: no column `answer` (the row has: "),
            "{err}"
        );
        let empty = write("e.jsonl", "\n\n");
        let err = TextRecords::open(&empty, &["q"]).unwrap_err().to_string();
        assert!(err.contains("holds no rows"), "{err}");
        Ok(())
    }

    #[test]
    fn csv_quotes_commas_and_newlines() -> Result<()> {
        let path = write(
            "b.csv",
            "text,label\r\n\"a, \"\"quoted\"\"\nline\",1\r\nplain,0\n",
        );
        let r = TextRecords::open(&path, &["label", "text"])?;
        assert_eq!(r.len(), 2);
        assert_eq!(r.get(0)?, ["1", "a, \"quoted\"\nline"]);
        assert_eq!(r.get(1)?, ["0", "plain"]);
        assert_eq!(r.line(1), 4);
        let err = TextRecords::open(&path, &["txt"]).unwrap_err().to_string();
        assert!(
            err.contains("no column `txt` in the header (it has: text, label)"),
            "{err}"
        );
        Ok(())
    }
}
