//! Opening data files that may be gzip-compressed.

use std::io::{self, BufReader, Cursor, Read};
use std::path::Path;

use flate2::read::MultiGzDecoder;

use kiln_core::error::{Error, Result};

/// The first two bytes of every gzip stream.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
/// Deflate expands at most about 1032:1; this rounds it up so that any
/// gzip file (one member or several) stays below the bound.
const GZIP_MAX_RATIO: u64 = 1100;
/// Slack on top of the ratio, so that tiny files are never refused on it.
const GZIP_SLACK: u64 = 1 << 20;

/// A readable data file, decompressed on the fly if it is gzip.
pub(crate) struct Source {
    reader: Box<dyn Read>,
    /// Whether the file is gzip-compressed.
    pub(crate) gzip: bool,
    /// The file's length on disk, when it is a regular file (a pipe or a
    /// device has no length to trust).
    pub(crate) file_len: Option<u64>,
}

impl Source {
    /// Opens `path`; a file starting with the gzip magic bytes `1f 8b` is
    /// decompressed, whatever its name.
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let mut file = kiln_core::fs::open_regular_file(path)?;
        let mut head = [0u8; 2];
        let mut got = 0;
        while got < head.len() {
            match file.read(&mut head[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(path, e)),
            }
        }
        let gzip = got == 2 && head == GZIP_MAGIC;
        let file_len = file
            .metadata()
            .ok()
            .filter(|m| m.is_file())
            .map(|m| m.len());
        let replay = Cursor::new(head[..got].to_vec()).chain(file);
        let reader: Box<dyn Read> = if gzip {
            Box::new(BufReader::new(MultiGzDecoder::new(BufReader::new(replay))))
        } else {
            Box::new(BufReader::new(replay))
        };
        Ok(Source {
            reader,
            gzip,
            file_len,
        })
    }

    /// The most bytes the whole (decompressed) stream can hold: the file's
    /// length if raw, [`GZIP_MAX_RATIO`] times it plus [`GZIP_SLACK`] if
    /// gzip; `None` when the length is unknown. A header that declares more
    /// is corrupt, and is refused before anything is allocated for it.
    pub(crate) fn max_stream_len(&self) -> Option<u64> {
        let len = self.file_len?;
        Some(if self.gzip {
            len.saturating_mul(GZIP_MAX_RATIO)
                .saturating_add(GZIP_SLACK)
        } else {
            len
        })
    }

    /// Reads up to `limit` bytes into `buf`, stopping early at the end of
    /// the data. On failure (e.g. corrupt gzip data) returns the error and
    /// leaves the bytes read before it in `buf`.
    pub(crate) fn read_up_to(&mut self, limit: u64, buf: &mut Vec<u8>) -> io::Result<()> {
        (&mut self.reader).take(limit).read_to_end(buf).map(|_| ())
    }

    /// Reads everything that is left into `buf` (with the same failure rule).
    pub(crate) fn read_rest(&mut self, buf: &mut Vec<u8>) -> io::Result<()> {
        self.reader.read_to_end(buf).map(|_| ())
    }
}

/// A read error at byte `offset` of the (possibly compressed) file `path`, as
/// [`Error::Data`] with the I/O error as its source.
pub(crate) fn read_error(path: &Path, offset: u64, gzip: bool, e: io::Error) -> Error {
    let reason = if gzip {
        "cannot decompress gzip data"
    } else {
        "cannot read"
    };
    Error::data_caused_by(path, Some(offset), reason, e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::write::GzEncoder;
    use flate2::Compression;
    use std::io::Write;

    fn temp_file(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let path =
            std::env::temp_dir().join(format!("kiln-core-source-{}-{name}", std::process::id()));
        std::fs::write(&path, bytes).expect("write temp file");
        path
    }

    #[test]
    fn detects_gzip_by_content_not_name() -> Result<()> {
        let mut enc = GzEncoder::new(Vec::new(), Compression::default());
        enc.write_all(b"hello gzip").expect("compress");
        let gz = enc.finish().expect("compress");
        // a compressed file without .gz and a plain one with .gz
        let a = temp_file("plain-name", &gz);
        let b = temp_file("raw.gz", b"hello raw");
        let c = temp_file("one-byte", b"x");
        let d = temp_file("empty", b"");
        for (path, gzip, text) in [
            (&a, true, &b"hello gzip"[..]),
            (&b, false, &b"hello raw"[..]),
            (&c, false, &b"x"[..]),
            (&d, false, &b""[..]),
        ] {
            let mut src = Source::open(path)?;
            assert_eq!(src.gzip, gzip, "{}", path.display());
            let len = std::fs::metadata(path).expect("metadata").len();
            assert_eq!(src.file_len, Some(len));
            let max = if gzip { len * 1100 + (1 << 20) } else { len };
            assert_eq!(src.max_stream_len(), Some(max));
            let mut buf = Vec::new();
            src.read_up_to(3, &mut buf).expect("read");
            src.read_rest(&mut buf).expect("read");
            assert_eq!(buf, text);
        }
        for p in [a, b, c, d] {
            let _ = std::fs::remove_file(p);
        }
        let err = Source::open(Path::new("/nonexistent/kiln/x"))
            .err()
            .expect("missing");
        assert!(matches!(err, Error::Io { .. }), "{err}");
        Ok(())
    }
}
