//! Reader for scikit-learn's handwritten digits data set.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use flate2::read::GzDecoder;

use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// Pixels per image (8 x 8).
const PIXELS: usize = 64;
/// Values per line: the pixels, then the label.
const COLUMNS: usize = PIXELS + 1;
/// Rows of the scikit-learn file, used as a capacity hint only.
const EXPECTED_ROWS: usize = 1797;
/// Largest pixel value (pixels count set bits in a 4 x 4 block).
const MAX_PIXEL: f64 = 16.0;
/// Number of classes.
const CLASSES: f64 = 10.0;
/// The most decompressed text read: scikit-learn's file is 265 KB (1797
/// lines), and even written as `0.000000000000000000e+00` it stays under
/// 3 MB. Reading stops here so that a gzip bomb cannot fill memory.
const MAX_TEXT_BYTES: u64 = 16 << 20;

/// Reads scikit-learn's `sklearn/datasets/data/digits.csv.gz`.
///
/// The file is a gzip-compressed CSV without header: each line holds 64 pixel
/// values in `0..=16`, then the class label in `0..=9`; values may be written
/// as integers or floats (`"3"`, `"3.0"`). Blank lines are skipped.
///
/// Returns features `[N, 64]` as `f32` (raw values, not normalised) and labels
/// `[N]` as `i64`; the scikit-learn file has N = 1797.
///
/// # Errors
///
/// * [`Error::Io`] naming `path` if the file cannot be opened.
/// * [`Error::Data`] naming `path`, the 1-based line, and the byte offset of
///   that line's start in the decompressed stream, for invalid gzip data, a
///   wrong number of columns, a value that is not a number, or a value out of
///   range; also for a file without rows, and for one whose decompressed
///   text exceeds 16 MiB (reading stops there).
///
/// ```no_run
/// use std::path::Path;
///
/// let (x, y) = kiln_data::load_digits(Path::new("digits.csv.gz"))?;
/// assert_eq!(x.dims(), &[1797, 64]);
/// assert_eq!(y.dims(), &[1797]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn load_digits(path: &Path) -> Result<(HostTensor, HostTensor)> {
    read_digits(path, MAX_TEXT_BYTES)
}

/// [`load_digits`], reading at most `max_text` bytes of decompressed text.
fn read_digits(path: &Path, max_text: u64) -> Result<(HostTensor, HostTensor)> {
    let file = kiln_core::fs::open_regular_file(path)?;
    // one byte past the limit tells a file of exactly `max_text` bytes from a longer one
    let mut reader =
        BufReader::new(GzDecoder::new(BufReader::new(file))).take(max_text.saturating_add(1));
    let data_error = |offset: u64, reason: String| Error::data(path, Some(offset), reason);

    let mut features: Vec<f32> = Vec::with_capacity(EXPECTED_ROWS * PIXELS);
    let mut labels: Vec<i64> = Vec::with_capacity(EXPECTED_ROWS);
    let mut line = Vec::new();
    let mut offset = 0u64;
    for line_no in 1usize.. {
        line.clear();
        let read = reader.read_until(b'\n', &mut line).map_err(|e| {
            Error::data_caused_by(
                path,
                Some(offset),
                format!("line {line_no}: cannot decompress gzip data"),
                e,
            )
        })?;
        if read == 0 {
            break;
        }
        if offset + read as u64 > max_text {
            return Err(data_error(
                offset,
                format!(
                    "line {line_no}: the decompressed text exceeds {max_text} bytes, far more \
                     than scikit-learn's digits file (1797 lines, about 265 KB); reading \
                     stopped there"
                ),
            ));
        }
        parse_line(&line, &mut features, &mut labels)
            .map_err(|reason| data_error(offset, format!("line {line_no}: {reason}")))?;
        offset += read as u64;
    }
    if labels.is_empty() {
        return Err(data_error(
            offset,
            "no rows; expected lines of 65 values".into(),
        ));
    }
    let n = labels.len();
    log::debug!("load_digits: read {n} images from {}", path.display());
    Ok((
        HostTensor::new(features, [n, PIXELS])?,
        HostTensor::new(labels, [n])?,
    ))
}

/// Parses one line, appending its pixels and label; blank lines append nothing.
fn parse_line(
    line: &[u8],
    features: &mut Vec<f32>,
    labels: &mut Vec<i64>,
) -> std::result::Result<(), String> {
    let text = std::str::from_utf8(line).map_err(|e| format!("not valid UTF-8: {e}"))?;
    let text = text.trim();
    if text.is_empty() {
        return Ok(());
    }
    let fields: Vec<&str> = text.split(',').map(str::trim).collect();
    if fields.len() != COLUMNS {
        return Err(format!(
            "expected {COLUMNS} comma-separated values (64 pixels and a label), found {}",
            fields.len()
        ));
    }
    let mut values = [0f64; COLUMNS];
    for (column, (value, field)) in values.iter_mut().zip(&fields).enumerate() {
        *value = field
            .parse()
            .map_err(|_| format!("column {}: `{field}` is not a number", column + 1))?;
    }
    let (pixels, label) = values.split_at(PIXELS);
    if let Some((column, value)) = pixels
        .iter()
        .enumerate()
        .find(|(_, v)| !(0.0..=MAX_PIXEL).contains(*v))
    {
        return Err(format!(
            "column {}: pixel value {value} is outside 0..=16",
            column + 1
        ));
    }
    let label = label[0];
    if !(label.fract() == 0.0 && (0.0..CLASSES).contains(&label)) {
        return Err(format!(
            "column {COLUMNS}: label {label} is not a class in 0..=9"
        ));
    }
    features.extend(pixels.iter().map(|&v| v as f32));
    labels.push(label as i64);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::data_error;
    use kiln_core::dtype::DType;
    use std::fs::File;
    use std::io::Write;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fresh path in the system temp directory, removed on drop.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(name: &str) -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let unique = format!(
                "kiln-core-{}-{}-{name}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            );
            TempFile(std::env::temp_dir().join(unique))
        }

        fn gz(name: &str, text: &str) -> std::io::Result<Self> {
            let file = TempFile::new(name);
            let mut enc = flate2::write::GzEncoder::new(
                File::create(&file.0)?,
                flate2::Compression::default(),
            );
            enc.write_all(text.as_bytes())?;
            enc.finish()?;
            Ok(file)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            // Best effort: a leftover file in the temp dir is harmless.
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// A line whose pixel `i` is `(i + shift) % 17`, written as `int` or `int.0`.
    fn line(shift: usize, label: &str, floats: bool) -> String {
        let mut fields: Vec<String> = (0..PIXELS)
            .map(|i| {
                let v = (i + shift) % 17;
                if floats {
                    format!("{v}.0")
                } else {
                    v.to_string()
                }
            })
            .collect();
        fields.push(label.to_string());
        fields.join(",")
    }

    #[test]
    fn reads_valid_file() -> Result<()> {
        let text = format!(
            "{}\n{}\r\n\n{}",
            line(0, "0.0", true),
            line(1, "7", false),
            line(16, "9", false)
        );
        let file = TempFile::gz("ok.csv.gz", &text).map_err(|e| Error::io("tmp", e))?;
        let (x, y) = load_digits(&file.0)?;
        assert_eq!(x.dims(), &[3, 64]);
        assert_eq!(x.dtype(), DType::F32);
        assert_eq!(y.dims(), &[3]);
        assert_eq!(y.as_slice::<i64>()?, &[0, 7, 9]);
        let px = x.as_slice::<f32>()?;
        // row 0: pixel i = i % 17
        assert_eq!(&px[..3], &[0.0, 1.0, 2.0]);
        assert_eq!(px[16], 16.0);
        assert_eq!(px[17], 0.0);
        // row 1: pixel i = (i + 1) % 17; row 2: (i + 16) % 17
        assert_eq!(&px[64..66], &[1.0, 2.0]);
        assert_eq!(&px[128..130], &[16.0, 0.0]);
        assert_eq!(px[191], ((63 + 16) % 17) as f32);
        Ok(())
    }

    #[test]
    fn missing_file_is_io_error_naming_path() {
        let file = TempFile::new("absent.csv.gz");
        let err = load_digits(&file.0).expect_err("no file");
        match &err {
            Error::Io { path, source } => {
                assert_eq!(path, &file.0);
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
            }
            other => panic!("expected Error::Io, got {other:?}"),
        }
        assert!(err.to_string().starts_with(&file.0.display().to_string()));
    }

    #[test]
    fn wrong_column_count_names_line_and_offset() -> std::io::Result<()> {
        let first = line(0, "1", false);
        let short = first
            .rsplit_once(',')
            .map_or("", |(head, _)| head)
            .to_string();
        let file = TempFile::gz("short.csv.gz", &format!("{first}\n{short}\n"))?;
        let (path, offset, reason) = data_error(load_digits(&file.0).expect_err("64 columns"));
        assert_eq!(path, file.0);
        assert_eq!(offset, Some(first.len() as u64 + 1));
        assert_eq!(
            reason,
            "line 2: expected 65 comma-separated values (64 pixels and a label), found 64"
        );
        Ok(())
    }

    #[test]
    fn bad_number_names_line_column_and_offset() -> std::io::Result<()> {
        let good = line(0, "1", false);
        let bad = line(0, "1", true).replacen("2.0", "2.x", 1);
        let text = format!("{good}\n\n{bad}\n");
        let file = TempFile::gz("nan.csv.gz", &text)?;
        let err = load_digits(&file.0).expect_err("bad number");
        let msg = err.to_string();
        let (_, offset, reason) = data_error(err);
        // line 3 starts after the first line, its newline and the blank line
        assert_eq!(offset, Some(good.len() as u64 + 2));
        assert_eq!(reason, "line 3: column 3: `2.x` is not a number");
        assert!(
            msg.contains(&format!("at byte {}", good.len() + 2)),
            "{msg}"
        );
        assert!(msg.contains("nan.csv.gz"), "{msg}");
        Ok(())
    }

    #[test]
    fn out_of_range_values_are_rejected() -> std::io::Result<()> {
        let cases = [
            (
                line(0, "10", false),
                "column 65: label 10 is not a class in 0..=9",
            ),
            (
                line(0, "2.5", false),
                "column 65: label 2.5 is not a class in 0..=9",
            ),
            (
                line(0, "1", false).replacen("0,", "17,", 1),
                "column 1: pixel value 17 is outside 0..=16",
            ),
            (
                line(0, "1", false).replacen("3,", "NaN,", 1),
                "column 4: pixel value NaN is outside 0..=16",
            ),
        ];
        for (text, want) in cases {
            let file = TempFile::gz("range.csv.gz", &text)?;
            let (_, offset, reason) = data_error(load_digits(&file.0).expect_err(want));
            assert_eq!(offset, Some(0));
            assert_eq!(reason, format!("line 1: {want}"));
        }
        Ok(())
    }

    #[test]
    fn corrupt_gzip_is_data_error() -> std::io::Result<()> {
        // Plain text instead of gzip.
        let plain = TempFile::new("plain.csv.gz");
        std::fs::write(&plain.0, line(0, "1", false))?;
        let (path, offset, reason) = data_error(load_digits(&plain.0).expect_err("not gzip"));
        assert_eq!(path, plain.0);
        assert_eq!(offset, Some(0));
        assert!(
            reason.starts_with("line 1: cannot decompress gzip data"),
            "{reason}"
        );

        // A valid stream cut short after its first two lines were written.
        let text: String = (0..40).map(|i| line(i, "3", false) + "\n").collect();
        let whole = TempFile::gz("whole.csv.gz", &text)?;
        let bytes = std::fs::read(&whole.0)?;
        let cut = TempFile::new("cut.csv.gz");
        std::fs::write(&cut.0, &bytes[..bytes.len() / 2])?;
        let (_, offset, reason) = data_error(load_digits(&cut.0).expect_err("truncated"));
        assert!(reason.contains("cannot decompress gzip data"), "{reason}");
        // Errors are reported at the start of the line being read.
        let offset = offset.map_or(usize::MAX, |o| o as usize);
        assert!(offset > 0 && offset < text.len(), "{offset}");
        assert_eq!(text.as_bytes()[offset - 1], b'\n');
        let line_no = text[..offset].matches('\n').count() + 1;
        assert!(reason.starts_with(&format!("line {line_no}:")), "{reason}");
        Ok(())
    }

    #[test]
    fn decompressed_text_is_bounded() -> std::io::Result<()> {
        let row = line(0, "1", false) + "\n";
        let text = row.repeat(3);
        let file = TempFile::gz("bounded.csv.gz", &text)?;
        // a limit of exactly the text's length reads it all
        let limit = text.len() as u64;
        let (_, y) = read_digits(&file.0, limit).map_err(std::io::Error::other)?;
        assert_eq!(y.dims(), &[3]);
        // one byte less stops inside line 3, reported at its start
        let (path, offset, reason) =
            data_error(read_digits(&file.0, limit - 1).expect_err("over the limit"));
        assert_eq!(path, file.0);
        assert_eq!(offset, Some(2 * row.len() as u64));
        assert_eq!(
            reason,
            format!(
                "line 3: the decompressed text exceeds {} bytes, far more than scikit-learn's \
                 digits file (1797 lines, about 265 KB); reading stopped there",
                limit - 1
            )
        );
        // a single line longer than the limit is not read past it
        let file = TempFile::gz("one-line.csv.gz", &"0,".repeat(1 << 16))?;
        let (_, offset, reason) = data_error(read_digits(&file.0, 1000).expect_err("a long line"));
        assert_eq!(offset, Some(0));
        assert!(reason.starts_with("line 1: the decompressed text exceeds 1000 bytes"));
        Ok(())
    }

    #[test]
    fn load_digits_stops_after_16_mib_of_text() -> std::io::Result<()> {
        // valid rows, but 16 MiB and a bit of them: what a gzip bomb inflates to
        let row = line(5, "4", false) + "\n";
        let rows = (MAX_TEXT_BYTES as usize) / row.len() + 1;
        let file = TempFile::new("bomb.csv.gz");
        let mut enc =
            flate2::write::GzEncoder::new(File::create(&file.0)?, flate2::Compression::fast());
        for _ in 0..rows {
            enc.write_all(row.as_bytes())?;
        }
        enc.finish()?;
        let (_, offset, reason) = data_error(load_digits(&file.0).expect_err("too long"));
        let full_rows = (MAX_TEXT_BYTES as usize) / row.len();
        assert_eq!(offset, Some((full_rows * row.len()) as u64));
        assert_eq!(
            reason,
            format!(
                "line {}: the decompressed text exceeds 16777216 bytes, far more than \
                 scikit-learn's digits file (1797 lines, about 265 KB); reading stopped there",
                full_rows + 1
            )
        );
        Ok(())
    }

    #[test]
    fn file_without_rows_is_data_error() -> std::io::Result<()> {
        let file = TempFile::gz("empty.csv.gz", "\n\n")?;
        let (_, offset, reason) = data_error(load_digits(&file.0).expect_err("no rows"));
        assert_eq!(offset, Some(2));
        assert_eq!(reason, "no rows; expected lines of 65 values");
        Ok(())
    }
}
