//! Metric values as CSV files.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::{check_names, MetricSink};
use kiln_core::error::{Error, Result};

/// Name of the per-step file in a [`CsvSink`]'s directory.
pub(crate) const STEPS_FILE: &str = "steps.csv";
/// Name of the per-epoch file in a [`CsvSink`]'s directory.
pub(crate) const EPOCHS_FILE: &str = "epochs.csv";

/// Writes per-step values to `steps.csv` and per-epoch values to
/// `epochs.csv` in a directory.
///
/// `steps.csv` has a `step` column, `epochs.csv` an `epoch` and a `step`
/// column (the last step given to [`log_step`](MetricSink::log_step) before
/// the epoch ended), then one column per metric name in the order the names
/// first appeared. The header is written with the first row. A name seen for
/// the first time later adds a column: the file is rewritten with the wider
/// header and the earlier rows get an empty cell, as does any row that lacks
/// a value. Values are written so that they parse back to the same `f64`
/// (`0.1`, `1e-7`, `NaN`, `inf`). Metric names must not contain commas,
/// quotes or line breaks.
///
/// Rows are buffered; [`flush`](MetricSink::flush) writes them out (every
/// epoch does too).
///
/// ```
/// use kiln_train::{CsvSink, MetricSink};
///
/// let dir = std::env::temp_dir().join(format!("kiln-csv-doc-{}", std::process::id()));
/// let mut sink = CsvSink::new(&dir)?;
/// sink.log_step(1, &[("loss".into(), 0.5)])?;
/// sink.log_step(2, &[("loss".into(), 0.25), ("lr".into(), 0.1)])?;
/// sink.log_epoch(1, &[("loss".into(), 0.4)])?;
/// sink.finish()?;
/// let steps = std::fs::read_to_string(dir.join("steps.csv")).map_err(|e| kiln_core::Error::io(&dir, e))?;
/// assert_eq!(steps, "step,loss,lr\n1,0.5,\n2,0.25,0.1\n");
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Debug)]
pub struct CsvSink {
    dir: PathBuf,
    steps: CsvFile,
    epochs: CsvFile,
    last_step: u64,
}

impl CsvSink {
    /// Starts fresh files in `dir` (created if missing); existing
    /// `steps.csv` and `epochs.csv` there are replaced.
    pub fn new(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        Ok(CsvSink {
            steps: CsvFile::create(dir.join(STEPS_FILE), &["step"])?,
            epochs: CsvFile::create(dir.join(EPOCHS_FILE), &["epoch", "step"])?,
            dir,
            last_step: 0,
        })
    }

    /// Continues the files in `dir` for a run resumed from a checkpoint taken
    /// at step `from_step`: rows of `steps.csv` with a step after `from_step`,
    /// and rows of `epochs.csv` whose `step` column is after it, are removed
    /// (they will be logged again), then new rows are appended. A row cut
    /// short by a crash (the file's last line without a line break) is
    /// dropped. Missing files are started fresh, as by [`CsvSink::new`].
    ///
    /// Epoch rows are cut exactly when the trainer logs a step row at the
    /// last step of every epoch (so that the epoch's `step` is where it
    /// ended).
    pub fn resume(dir: impl AsRef<Path>, from_step: u64) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        Ok(CsvSink {
            steps: CsvFile::resume(dir.join(STEPS_FILE), &["step"], 0, from_step)?,
            epochs: CsvFile::resume(dir.join(EPOCHS_FILE), &["epoch", "step"], 1, from_step)?,
            dir,
            last_step: from_step,
        })
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl MetricSink for CsvSink {
    fn log_step(&mut self, step: u64, values: &[(String, f64)]) -> Result<()> {
        self.steps.append(&[step], values)?;
        self.last_step = step;
        Ok(())
    }

    fn end_step(&mut self, step: u64) -> Result<()> {
        self.last_step = step;
        Ok(())
    }

    fn log_epoch(&mut self, epoch: u64, values: &[(String, f64)]) -> Result<()> {
        self.epochs.append(&[epoch, self.last_step], values)?;
        self.flush()
    }

    fn flush(&mut self) -> Result<()> {
        self.steps.flush()?;
        self.epochs.flush()
    }

    fn finish(&mut self) -> Result<()> {
        self.steps.finish()?;
        self.epochs.finish()
    }
}

/// One CSV file: integer key columns, then metric columns.
#[derive(Debug)]
struct CsvFile {
    path: PathBuf,
    keys: &'static [&'static str],
    /// Metric column names; meaningful once `has_header`.
    columns: Vec<String>,
    has_header: bool,
    writer: BufWriter<File>,
}

/// Formats a value so that it parses back to the same `f64`.
fn format_value(v: f64) -> String {
    format!("{v:?}")
}

impl CsvFile {
    fn create(path: PathBuf, keys: &'static [&'static str]) -> Result<Self> {
        let file = File::create(&path).map_err(|e| Error::io(&path, e))?;
        Ok(CsvFile {
            path,
            keys,
            columns: Vec::new(),
            has_header: false,
            writer: BufWriter::new(file),
        })
    }

    /// Keeps the header and the rows whose key column `key` is at most
    /// `max_key`, then opens the file for appending.
    fn resume(
        path: PathBuf,
        keys: &'static [&'static str],
        key: usize,
        max_key: u64,
    ) -> Result<Self> {
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Self::create(path, keys),
            Err(e) => return Err(Error::io(&path, e)),
        };
        // Only complete lines count: a crash can leave half a row at the end.
        let complete = match text.rfind('\n') {
            Some(end) => &text[..=end],
            None => "",
        };
        let mut lines = complete.lines();
        let Some(header) = lines.next() else {
            return Self::create(path, keys);
        };
        let names: Vec<&str> = header.split(',').collect();
        if names.len() < keys.len() || names[..keys.len()] != *keys {
            return Err(Error::Data {
                path,
                offset: None,
                reason: format!(
                    "line 1: expected a header starting with `{}`, got `{header}`",
                    keys.join(",")
                ),
                source: None,
            });
        }
        let mut kept = String::with_capacity(complete.len());
        kept.push_str(header);
        kept.push('\n');
        for (i, line) in lines.enumerate() {
            let value = line.split(',').nth(key).and_then(|v| v.parse::<u64>().ok());
            match value {
                Some(v) if v <= max_key => {
                    kept.push_str(line);
                    kept.push('\n');
                }
                Some(_) => {}
                None => {
                    return Err(Error::Data {
                        path,
                        offset: None,
                        reason: format!(
                            "line {}: expected an integer `{}` in column {}, got `{line}`",
                            i + 2,
                            keys[key],
                            key + 1
                        ),
                        source: None,
                    })
                }
            }
        }
        replace_file(&path, kept.as_bytes())?;
        let file = OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        Ok(CsvFile {
            columns: names[keys.len()..].iter().map(|s| s.to_string()).collect(),
            path,
            keys,
            has_header: true,
            writer: BufWriter::new(file),
        })
    }

    fn append(&mut self, keys: &[u64], values: &[(String, f64)]) -> Result<()> {
        check_names(values)?;
        for (name, _) in values {
            if name.contains([',', '"', '\n', '\r']) || self.keys.contains(&name.as_str()) {
                return Err(Error::invalid_argument(
                    "values",
                    format!(
                        "metric name `{name}` cannot be a CSV column of {}: names must not \
                         contain commas, quotes or line breaks, nor be `{}`",
                        self.path.display(),
                        self.keys.join("` or `")
                    ),
                ));
            }
        }
        let new: Vec<String> = values
            .iter()
            .filter(|(name, _)| !self.columns.contains(name))
            .map(|(name, _)| name.clone())
            .collect();
        if !self.has_header {
            self.columns = new;
            let header = self.header();
            self.write(header.as_bytes())?;
            self.has_header = true;
        } else if !new.is_empty() {
            self.widen(new)?;
        }
        let mut row = keys
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(",");
        for column in &self.columns {
            row.push(',');
            if let Some((_, v)) = values.iter().find(|(name, _)| name == column) {
                row.push_str(&format_value(*v));
            }
        }
        row.push('\n');
        self.write(row.as_bytes())
    }

    fn header(&self) -> String {
        let mut header = self.keys.join(",");
        for c in &self.columns {
            header.push(',');
            header.push_str(c);
        }
        header.push('\n');
        header
    }

    /// Adds columns: rewrites the file with the wider header and an empty
    /// cell for each new column in every row.
    fn widen(&mut self, new: Vec<String>) -> Result<()> {
        self.flush()?;
        let text = fs::read_to_string(&self.path).map_err(|e| Error::io(&self.path, e))?;
        let padding = ",".repeat(new.len());
        self.columns.extend(new);
        let mut out = self.header();
        for line in text.lines().skip(1) {
            out.push_str(line);
            out.push_str(&padding);
            out.push('\n');
        }
        replace_file(&self.path, out.as_bytes())?;
        let file = OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(|e| Error::io(&self.path, e))?;
        self.writer = BufWriter::new(file);
        Ok(())
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.writer
            .write_all(bytes)
            .map_err(|e| Error::io(&self.path, e))
    }

    fn flush(&mut self) -> Result<()> {
        self.writer.flush().map_err(|e| Error::io(&self.path, e))
    }

    fn finish(&mut self) -> Result<()> {
        self.flush()?;
        self.writer
            .get_ref()
            .sync_all()
            .map_err(|e| Error::io(&self.path, e))
    }
}

/// Replaces `path` with `bytes` atomically, through an exclusive temporary
/// ([`kiln_core::fs::replace_file`]).
fn replace_file(path: &Path, bytes: &[u8]) -> Result<()> {
    kiln_core::fs::replace_file(path, bytes)
}

/// A CSV file read back: the header's names and, per row, one optional
/// value per column (`None` for an empty cell).
pub(crate) struct Table {
    pub(crate) header: Vec<String>,
    pub(crate) rows: Vec<Vec<Option<f64>>>,
}

/// Parses a CSV file written by [`CsvSink`].
pub(crate) fn read_table(path: &Path) -> Result<Table> {
    let text = fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut lines = text.lines();
    let header: Vec<String> = lines
        .next()
        .unwrap_or_default()
        .split(',')
        .map(str::to_string)
        .collect();
    let mut rows = Vec::new();
    for (i, line) in lines.enumerate() {
        if line.is_empty() {
            continue;
        }
        let cells: Vec<&str> = line.split(',').collect();
        if cells.len() != header.len() {
            return Err(Error::Data {
                path: path.to_path_buf(),
                offset: None,
                reason: format!(
                    "line {}: expected {} cells like the header, got {}",
                    i + 2,
                    header.len(),
                    cells.len()
                ),
                source: None,
            });
        }
        let row = cells
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                if cell.is_empty() {
                    return Ok(None);
                }
                cell.parse::<f64>().map(Some).map_err(|_| Error::Data {
                    path: path.to_path_buf(),
                    offset: None,
                    reason: format!(
                        "line {}: column `{}` holds `{cell}`, not a number",
                        i + 2,
                        header[c]
                    ),
                    source: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        rows.push(row);
    }
    Ok(Table { header, rows })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_through_their_text() {
        for v in [
            0.1,
            1e-7,
            1e300,
            -0.0,
            1.0 / 3.0,
            f64::MAX,
            f64::MIN_POSITIVE,
        ] {
            assert_eq!(format_value(v).parse::<f64>().ok(), Some(v), "{v}");
        }
        assert!(format_value(f64::NAN).parse::<f64>().is_ok_and(f64::is_nan));
        assert_eq!(
            format_value(f64::INFINITY).parse::<f64>().ok(),
            Some(f64::INFINITY)
        );
        assert_eq!(format_value(2.0), "2.0");
    }
}
