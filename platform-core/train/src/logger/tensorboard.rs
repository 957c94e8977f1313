//! Metric values as a TensorBoard event file.
//!
//! An event file is a sequence of TFRecords, each holding one `Event`
//! protocol buffer (tensorflow/core/util/event.proto). The few fields Kiln
//! writes are encoded here by hand.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::{check_names, LoggedImage, MetricSink};
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// Buckets of a histogram summary (TensorBoard's dashboard rebins them).
const HISTOGRAM_BUCKETS: usize = 30;

/// CRC-32C (Castagnoli), the checksum of TFRecord framing.
const CRC32C: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);

/// Writes values as scalar summaries to a TensorBoard event file
/// `events.out.tfevents.<unix time>.<hostname>` in a directory (the "log
/// dir" given to `tensorboard --logdir`).
///
/// Step values are written under their own names at their step; epoch values
/// under `epoch/<name>` with the epoch number as the step, so TensorBoard
/// shows them as a separate group with epochs on the x axis. Values are
/// stored as `f32`, as TensorBoard's scalar summaries do.
///
/// Events are buffered; [`flush`](MetricSink::flush) writes them out (every
/// epoch does too), so that a running TensorBoard sees them.
///
/// ```
/// use kiln_train::{MetricSink, TensorBoardSink};
///
/// let dir = std::env::temp_dir().join(format!("kiln-tb-doc-{}", std::process::id()));
/// let mut tb = TensorBoardSink::new(&dir)?;
/// tb.log_step(1, &[("loss".into(), 0.69)])?;
/// tb.log_epoch(1, &[("val_accuracy".into(), 0.9)])?;
/// tb.finish()?;
/// assert!(tb.path().file_name().is_some_and(|n| n.to_string_lossy().starts_with("events.out.tfevents.")));
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Debug)]
pub struct TensorBoardSink {
    path: PathBuf,
    writer: BufWriter<File>,
}

impl TensorBoardSink {
    /// Creates `dir` if needed and a new event file in it, starting with the
    /// file-version event TensorBoard expects. If a file of the same name
    /// exists (two sinks started in the same second), the process id and a
    /// counter are appended to the name.
    pub fn new(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let now = wall_time();
        let base = format!("events.out.tfevents.{}.{}", now as u64, hostname());
        let mut attempt = 0u32;
        let (path, file) = loop {
            let name = if attempt == 0 {
                base.clone()
            } else {
                format!("{base}.{}.{attempt}", std::process::id())
            };
            let path = dir.join(name);
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => break (path, file),
                Err(e) if e.kind() == ErrorKind::AlreadyExists && attempt < 1000 => {
                    attempt += 1;
                }
                Err(e) => return Err(Error::io(&path, e)),
            }
        };
        let mut sink = TensorBoardSink {
            path,
            writer: BufWriter::new(file),
        };
        let mut event = Vec::new();
        encode_event_header(&mut event, now, 0);
        encode_bytes_field(&mut event, 3, b"brain.Event:2");
        sink.write_record(&event)?;
        sink.flush()?;
        Ok(sink)
    }

    /// Like [`new`](Self::new), for a run resumed after step `from_step`: the new
    /// file starts with a `SessionLog.START` event at `from_step + 1`, which makes
    /// TensorBoard drop what the interrupted run logged after its checkpoint
    /// (its "purge orphaned data"), so no step shows twice.
    pub fn resume(dir: impl AsRef<Path>, from_step: u64) -> Result<Self> {
        let mut sink = Self::new(dir)?;
        let step = i64::try_from(from_step.saturating_add(1)).map_err(|_| {
            Error::invalid_argument(
                "from_step",
                format!("{from_step} does not fit an int64 step"),
            )
        })?;
        let mut event = Vec::new();
        encode_event_header(&mut event, wall_time(), step);
        // Event.session_log (field 7) = SessionLog { status (field 1) = START (1) }.
        encode_bytes_field(&mut event, 7, &[0x08, 0x01]);
        sink.write_record(&event)?;
        sink.flush()?;
        Ok(sink)
    }

    /// The event file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one event at `step` holding a scalar summary per value, tagged
    /// `prefix` + name.
    fn write_scalars(&mut self, prefix: &str, step: u64, values: &[(String, f64)]) -> Result<()> {
        check_names(values)?;
        let step = event_step(step)?;
        let mut summary = Vec::new();
        for (name, value) in values {
            let mut v = Vec::new();
            encode_bytes_field(&mut v, 1, format!("{prefix}{name}").as_bytes());
            // simple_value: field 2, wire type 5 (32-bit).
            v.push((2 << 3) | 5);
            v.extend_from_slice(&(*value as f32).to_le_bytes());
            encode_bytes_field(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        encode_event_header(&mut event, wall_time(), step);
        encode_bytes_field(&mut event, 5, &summary);
        self.write_record(&event)
    }

    /// Writes one event at `step` holding a histogram summary per tensor.
    fn write_histograms(&mut self, step: u64, tensors: &[(String, HostTensor)]) -> Result<()> {
        let step = event_step(step)?;
        let mut summary = Vec::new();
        for (name, tensor) in tensors {
            let mut v = Vec::new();
            encode_bytes_field(&mut v, 1, name.as_bytes());
            // Summary.Value.histo: field 5.
            encode_bytes_field(&mut v, 5, &histogram_proto(&tensor.to_f64_vec()));
            encode_bytes_field(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        encode_event_header(&mut event, wall_time(), step);
        encode_bytes_field(&mut event, 5, &summary);
        self.write_record(&event)
    }

    /// Writes one event at `step` holding a summary `value` (an encoded
    /// `Summary.Value`) per entry.
    fn write_values(&mut self, step: u64, values: &[Vec<u8>]) -> Result<()> {
        let step = event_step(step)?;
        let mut summary = Vec::new();
        for v in values {
            encode_bytes_field(&mut summary, 1, v);
        }
        let mut event = Vec::new();
        encode_event_header(&mut event, wall_time(), step);
        encode_bytes_field(&mut event, 5, &summary);
        self.write_record(&event)
    }

    fn write_record(&mut self, data: &[u8]) -> Result<()> {
        let record = tf_record(data);
        self.writer
            .write_all(&record)
            .map_err(|e| Error::io(&self.path, e))
    }
}

impl MetricSink for TensorBoardSink {
    fn log_step(&mut self, step: u64, values: &[(String, f64)]) -> Result<()> {
        self.write_scalars("", step, values)
    }

    fn log_epoch(&mut self, epoch: u64, values: &[(String, f64)]) -> Result<()> {
        self.write_scalars("epoch/", epoch, values)?;
        self.flush()
    }

    fn flush(&mut self) -> Result<()> {
        self.writer.flush().map_err(|e| Error::io(&self.path, e))
    }

    /// One event per call, a histogram per tensor under its name; non-finite
    /// values are left out of the buckets and the sums.
    fn log_histograms(&mut self, step: u64, tensors: &[(String, HostTensor)]) -> Result<()> {
        self.write_histograms(step, tensors)
    }

    /// One event holding the graph (`Event.graph_def`, field 4), as
    /// `SummaryWriter.add_graph` writes it.
    fn log_graph(&mut self, graph_def: &[u8]) -> Result<()> {
        let mut event = Vec::new();
        encode_event_header(&mut event, wall_time(), 0);
        encode_bytes_field(&mut event, 4, graph_def);
        self.write_record(&event)?;
        self.flush()
    }

    /// One event holding an image summary per image (`Summary.Value.image`,
    /// as `SummaryWriter.add_image` writes it), flushed.
    fn log_images(&mut self, step: u64, images: &[LoggedImage]) -> Result<()> {
        let values: Vec<Vec<u8>> = images
            .iter()
            .map(|image| {
                let mut proto = Vec::new();
                for (field, n) in [
                    (1u8, image.height),
                    (2, image.width),
                    (3, u32::from(image.channels)),
                ] {
                    proto.push(field << 3);
                    encode_varint(&mut proto, u64::from(n));
                }
                encode_bytes_field(&mut proto, 4, &image.png);
                let mut v = Vec::new();
                encode_bytes_field(&mut v, 1, image.tag.as_bytes());
                encode_bytes_field(&mut v, 4, &proto);
                v
            })
            .collect();
        self.write_values(step, &values)?;
        self.flush()
    }

    /// One event holding a text summary: a scalar string tensor with the
    /// `text` plugin's metadata, as `SummaryWriter.add_text` writes it.
    fn log_text(&mut self, step: u64, tag: &str, markdown: &str) -> Result<()> {
        let mut plugin = Vec::new();
        encode_bytes_field(&mut plugin, 1, b"text");
        let mut metadata = Vec::new();
        encode_bytes_field(&mut metadata, 1, &plugin);
        // TensorProto: dtype DT_STRING (7), a scalar shape, one string_val.
        let mut tensor = vec![1 << 3, 7];
        encode_bytes_field(&mut tensor, 2, &[]);
        encode_bytes_field(&mut tensor, 8, markdown.as_bytes());
        let mut v = Vec::new();
        encode_bytes_field(&mut v, 1, tag.as_bytes());
        encode_bytes_field(&mut v, 9, &metadata);
        encode_bytes_field(&mut v, 8, &tensor);
        self.write_values(step, &[v])?;
        self.flush()
    }

    fn finish(&mut self) -> Result<()> {
        self.flush()?;
        self.writer
            .get_ref()
            .sync_all()
            .map_err(|e| Error::io(&self.path, e))
    }
}

/// A `HistogramProto` of `values` (finite ones): min, max, count, sum, sum of
/// squares, and [`HISTOGRAM_BUCKETS`] equal-width buckets from min to max,
/// each given by its right edge, as TensorBoard reads them.
fn histogram_proto(values: &[f64]) -> Vec<u8> {
    let finite: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    let (min, max) = finite
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    let (min, max) = if finite.is_empty() {
        (0.0, 0.0)
    } else {
        (min, max)
    };
    let buckets = if max > min { HISTOGRAM_BUCKETS } else { 1 };
    let width = (max - min) / buckets as f64;
    let limits: Vec<f64> = (1..=buckets)
        .map(|i| {
            if i == buckets {
                max
            } else {
                min + width * i as f64
            }
        })
        .collect();
    let mut counts = vec![0.0f64; buckets];
    for &v in &finite {
        let i = if width > 0.0 {
            (((v - min) / width) as usize).min(buckets - 1)
        } else {
            0
        };
        counts[i] += 1.0;
    }
    let mut out = Vec::new();
    let double = |out: &mut Vec<u8>, field: u8, v: f64| {
        out.push((field << 3) | 1);
        out.extend_from_slice(&v.to_le_bytes());
    };
    double(&mut out, 1, min);
    double(&mut out, 2, max);
    double(&mut out, 3, finite.len() as f64);
    double(&mut out, 4, finite.iter().sum());
    double(&mut out, 5, finite.iter().map(|v| v * v).sum());
    for (field, list) in [(6u8, &limits), (7u8, &counts)] {
        let packed: Vec<u8> = list.iter().flat_map(|v| v.to_le_bytes()).collect();
        encode_bytes_field(&mut out, field, &packed);
    }
    out
}

/// `step` as an event's int64 step.
fn event_step(step: u64) -> Result<i64> {
    i64::try_from(step).map_err(|_| {
        Error::invalid_argument(
            "step",
            format!("{step} does not fit in the int64 step of a TensorBoard event"),
        )
    })
}

/// Seconds since the Unix epoch, as TensorBoard's `wall_time`.
fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The machine's host name for the event file name, like Python's
/// `socket.gethostname()`, with characters other than letters, digits, `-`,
/// `_` and `.` replaced by `_`; `localhost` when it cannot be found.
fn hostname() -> String {
    let found = ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .filter_map(|p| fs::read_to_string(p).ok())
        .chain(
            ["HOSTNAME", "COMPUTERNAME"]
                .iter()
                .filter_map(|v| std::env::var(v).ok()),
        )
        .map(|s| s.trim().to_string())
        .find(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_string());
    found
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// TFRecord framing: length (u64 LE), masked CRC-32C of the length, the
/// data, masked CRC-32C of the data.
fn tf_record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// TFRecord's masked CRC-32C.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = CRC32C.checksum(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Protobuf base-128 varint.
fn encode_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2): strings, bytes, sub-messages.
fn encode_bytes_field(out: &mut Vec<u8>, field: u8, bytes: &[u8]) {
    out.push((field << 3) | 2);
    encode_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// `Event.wall_time` (field 1, double) and `Event.step` (field 2, int64).
fn encode_event_header(out: &mut Vec<u8>, wall_time: f64, step: i64) {
    out.push((1 << 3) | 1);
    out.extend_from_slice(&wall_time.to_le_bytes());
    out.push(2 << 3);
    // int64 is encoded as the two's complement u64 (10 bytes when negative).
    encode_varint(out, step as u64);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_and_mask_match_known_values() {
        // The CRC-32C check value from the catalogue of parametrised CRCs.
        assert_eq!(CRC32C.checksum(b"123456789"), 0xe306_9283);
        assert_eq!(CRC32C.checksum(b""), 0);
        // Masked CRCs computed by a bitwise CRC-32C written in Python.
        assert_eq!(masked_crc(&[0u8; 8]), 0x0798_0329);
        assert_eq!(masked_crc(b"abc"), 0x21f1_576e);
        assert_eq!(masked_crc(&24u64.to_le_bytes()), 0x224b_7fa3);
    }

    #[test]
    fn varints_and_fields_encode_like_protobuf() {
        let mut out = Vec::new();
        encode_varint(&mut out, 300);
        assert_eq!(out, [0xac, 0x02]);
        out.clear();
        encode_varint(&mut out, (-1i64) as u64);
        assert_eq!(out.len(), 10);
        out.clear();
        encode_bytes_field(&mut out, 3, b"brain.Event:2");
        assert_eq!(&out[..2], &[0x1a, 13]);
        out.clear();
        encode_event_header(&mut out, 1.5, 7);
        assert_eq!(out[0], 0x09);
        assert_eq!(&out[1..9], &1.5f64.to_le_bytes());
        assert_eq!(&out[9..], &[0x10, 7]);
    }

    #[test]
    fn records_are_framed() {
        let rec = tf_record(b"abc");
        assert_eq!(rec.len(), 8 + 4 + 3 + 4);
        assert_eq!(&rec[..8], &3u64.to_le_bytes());
        assert_eq!(&rec[8..12], &masked_crc(&3u64.to_le_bytes()).to_le_bytes());
        assert_eq!(&rec[12..15], b"abc");
        assert_eq!(&rec[15..], &masked_crc(b"abc").to_le_bytes());
    }

    #[test]
    fn hostname_is_safe_in_a_file_name() {
        let h = hostname();
        assert!(!h.is_empty());
        assert!(h
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')));
    }
}
