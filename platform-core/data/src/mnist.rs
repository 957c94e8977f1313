//! Reader for IDX files, the format of MNIST and Fashion-MNIST.
//!
//! An IDX file is a 4-byte magic number `00 00 TT DD` (`TT` the element
//! type, `DD` the number of dimensions), `DD` big-endian `u32` sizes, then
//! the elements in row-major order, big-endian.

use std::path::{Path, PathBuf};

use crate::source::{read_error, Source};
use kiln_core::dtype::DType;
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// Magic number of an MNIST image file: unsigned bytes, 3 dimensions.
const MAGIC_IMAGES: u32 = 0x0000_0803;
/// Magic number of an MNIST label file: unsigned bytes, 1 dimension.
const MAGIC_LABELS: u32 = 0x0000_0801;
/// Bytes reserved up front for a payload; larger ones grow as they are read,
/// so a corrupt header cannot make the reader allocate gigabytes.
const MAX_RESERVE: usize = 1 << 26;

/// An IDX element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IdxType {
    U8,
    I8,
    I16,
    I32,
    F32,
    F64,
}

impl IdxType {
    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0x08 => IdxType::U8,
            0x09 => IdxType::I8,
            0x0B => IdxType::I16,
            0x0C => IdxType::I32,
            0x0D => IdxType::F32,
            0x0E => IdxType::F64,
            _ => return None,
        })
    }

    fn size(self) -> usize {
        match self {
            IdxType::U8 | IdxType::I8 => 1,
            IdxType::I16 => 2,
            IdxType::I32 | IdxType::F32 => 4,
            IdxType::F64 => 8,
        }
    }

    /// The element type as written in messages.
    fn name(self) -> &'static str {
        match self {
            IdxType::U8 => "unsigned byte",
            IdxType::I8 => "signed byte",
            IdxType::I16 => "16-bit integer",
            IdxType::I32 => "32-bit integer",
            IdxType::F32 => "32-bit float",
            IdxType::F64 => "64-bit float",
        }
    }
}

/// The parsed content of an IDX file.
struct Idx {
    ty: IdxType,
    dims: Vec<usize>,
    /// The elements, still big-endian.
    payload: Vec<u8>,
}

/// Reads an IDX file; `expected_magic` (if any) is checked against the
/// file's magic number before anything else, described as `what`.
fn read_idx_raw(path: &Path, expected_magic: Option<(u32, &str)>) -> Result<Idx> {
    let data_error = |offset: u64, reason: String| Error::data(path, Some(offset), reason);
    let mut src = Source::open(path)?;
    let gzip = src.gzip;

    let mut header = Vec::with_capacity(4);
    src.read_up_to(4, &mut header)
        .map_err(|e| read_error(path, header.len() as u64, gzip, e))?;
    let Ok(magic_bytes) = <[u8; 4]>::try_from(header.as_slice()) else {
        return Err(data_error(
            header.len() as u64,
            format!(
                "truncated header: the file ends after {} bytes, before the 4-byte magic number",
                header.len()
            ),
        ));
    };
    let magic = u32::from_be_bytes(magic_bytes);
    if let Some((expected, what)) = expected_magic {
        if magic != expected {
            return Err(data_error(
                0,
                format!(
                    "magic number 0x{magic:08x}, expected 0x{expected:08x} for {what} \
                     (is this the right file?)"
                ),
            ));
        }
    }
    if magic_bytes[0] != 0 || magic_bytes[1] != 0 {
        return Err(data_error(
            0,
            format!(
                "magic number 0x{magic:08x} does not start with two zero bytes; not an IDX file"
            ),
        ));
    }
    let ty = IdxType::from_code(magic_bytes[2]).ok_or_else(|| {
        data_error(
            2,
            format!(
                "unknown element type code 0x{:02x}; expected 0x08, 0x09, 0x0b, 0x0c, 0x0d or 0x0e",
                magic_bytes[2]
            ),
        )
    })?;
    let rank = usize::from(magic_bytes[3]);
    if rank == 0 {
        return Err(data_error(3, "the header declares 0 dimensions".into()));
    }

    let header_len = 4 + 4 * rank;
    let mut dims_bytes = Vec::with_capacity(4 * rank);
    src.read_up_to(4 * rank as u64, &mut dims_bytes)
        .map_err(|e| read_error(path, 4 + dims_bytes.len() as u64, gzip, e))?;
    if dims_bytes.len() < 4 * rank {
        return Err(data_error(
            4 + dims_bytes.len() as u64,
            format!(
                "truncated header: {rank} dimension sizes need {} bytes, the file ends after {}",
                header_len,
                4 + dims_bytes.len()
            ),
        ));
    }
    let mut dims = Vec::with_capacity(rank);
    for (axis, chunk) in dims_bytes.chunks_exact(4).enumerate() {
        let size = u32::from_be_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        if size == 0 && axis > 0 {
            return Err(data_error(
                4 + 4 * axis as u64,
                format!("dimension {axis} has size 0"),
            ));
        }
        dims.push(size as usize);
    }

    let expected = dims
        .iter()
        .try_fold(ty.size(), |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            data_error(
                4,
                format!("the payload size of dimensions {dims:?} overflows usize"),
            )
        })?;
    let truncated = |have: usize| {
        let item_bytes = expected / dims[0].max(1);
        data_error(
            (header_len + have) as u64,
            format!(
                "truncated payload: dimensions {dims:?} of {} need {expected} bytes after the \
                 {header_len}-byte header, the file has {have} (it ends inside item {})",
                ty.name(),
                have / item_bytes.max(1)
            ),
        )
    };
    // Refuse a header that declares more than the file can hold before
    // reserving or inflating anything for it.
    if let (Some(max), Some(file_len)) = (src.max_stream_len(), src.file_len) {
        let declared = (header_len as u64).saturating_add(expected as u64);
        if declared > max {
            if !gzip {
                // `max` is the file's length, at least the header's
                return Err(truncated(max.saturating_sub(header_len as u64) as usize));
            }
            return Err(data_error(
                4,
                format!(
                    "the header declares dimensions {dims:?} of {}, a {expected}-byte payload \
                     after the {header_len}-byte header, but this {file_len}-byte gzip file \
                     can decompress to at most {max} bytes (deflate expands at most about \
                     1032:1); the header is corrupt",
                    ty.name()
                ),
            ));
        }
    }
    let mut payload = Vec::with_capacity(expected.min(MAX_RESERVE));
    src.read_up_to(expected as u64, &mut payload)
        .map_err(|e| read_error(path, (header_len + payload.len()) as u64, gzip, e))?;
    if payload.len() < expected {
        return Err(truncated(payload.len()));
    }
    let mut extra = Vec::new();
    src.read_up_to(1, &mut extra)
        .map_err(|e| read_error(path, (header_len + expected) as u64, gzip, e))?;
    if !extra.is_empty() {
        return Err(data_error(
            (header_len + expected) as u64,
            format!("unexpected data after the {expected}-byte payload of dimensions {dims:?}"),
        ));
    }
    Ok(Idx { ty, dims, payload })
}

/// Reads an IDX file of any element type and rank, raw or gzip-compressed
/// (recognised by its first bytes, not its name).
///
/// The tensor has the header's dimensions. Unsigned bytes give `uint8`,
/// signed bytes, 16- and 32-bit integers give `int32`, and floats give
/// `float32` or `float64`.
///
/// # Errors
///
/// [`Error::Io`] if the file cannot be opened; [`Error::Data`] naming the
/// file and the byte offset (in the decompressed stream) of the problem for
/// a bad magic number, a truncated header or payload, data after the
/// payload, or corrupt gzip data. A header that declares more data than the
/// file can hold (its length if raw; about 1032 times it, deflate's largest
/// ratio, if gzip) is refused before the payload is read, and no more than
/// the declared payload and one byte is ever decompressed.
///
/// ```no_run
/// let t = kiln_data::read_idx(std::path::Path::new("train-images-idx3-ubyte.gz"))?;
/// assert_eq!(t.dims(), &[60000, 28, 28]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn read_idx(path: &Path) -> Result<HostTensor> {
    let idx = read_idx_raw(path, None)?;
    decode(idx)
}

/// Converts big-endian elements into a tensor.
fn decode(idx: Idx) -> Result<HostTensor> {
    let Idx { ty, dims, payload } = idx;
    match ty {
        IdxType::U8 => HostTensor::new(payload, dims),
        IdxType::I8 => HostTensor::new(
            payload
                .iter()
                .map(|&b| i32::from(b as i8))
                .collect::<Vec<_>>(),
            dims,
        ),
        IdxType::I16 => HostTensor::new(
            payload
                .chunks_exact(2)
                .map(|c| i32::from(i16::from_be_bytes([c[0], c[1]])))
                .collect::<Vec<_>>(),
            dims,
        ),
        IdxType::I32 => HostTensor::new(
            payload
                .chunks_exact(4)
                .map(|c| i32::from_be_bytes([c[0], c[1], c[2], c[3]]))
                .collect::<Vec<_>>(),
            dims,
        ),
        IdxType::F32 => HostTensor::new(
            payload
                .chunks_exact(4)
                .map(|c| f32::from_be_bytes([c[0], c[1], c[2], c[3]]))
                .collect::<Vec<_>>(),
            dims,
        ),
        IdxType::F64 => HostTensor::new(
            payload
                .chunks_exact(8)
                .map(|c| f64::from_be_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect::<Vec<_>>(),
            dims,
        ),
    }
}

/// Reads an MNIST image file (`train-images-idx3-ubyte`, raw or gzip):
/// `uint8` `[N, rows, cols]` with the sizes its header gives (`[60000, 28,
/// 28]` for MNIST's training set).
///
/// # Errors
///
/// As [`read_idx`], and [`Error::Data`] at offset 0 if the magic number is
/// not `0x00000803`.
pub fn load_mnist_images(path: &Path) -> Result<HostTensor> {
    let idx = read_idx_raw(
        path,
        Some((
            MAGIC_IMAGES,
            "an MNIST image file (unsigned bytes, 3 dimensions)",
        )),
    )?;
    debug_assert_eq!(idx.ty, IdxType::U8);
    let t = decode(idx)?;
    log::debug!("load_mnist_images: {} from {}", t.shape(), path.display());
    Ok(t)
}

/// Reads an MNIST label file (`train-labels-idx1-ubyte`, raw or gzip):
/// `int64` `[N]`.
///
/// # Errors
///
/// As [`read_idx`], and [`Error::Data`] at offset 0 if the magic number is
/// not `0x00000801`.
pub fn load_mnist_labels(path: &Path) -> Result<HostTensor> {
    let idx = read_idx_raw(
        path,
        Some((
            MAGIC_LABELS,
            "an MNIST label file (unsigned bytes, 1 dimension)",
        )),
    )?;
    let t = decode(idx)?.to_dtype(DType::I64);
    log::debug!(
        "load_mnist_labels: {} labels from {}",
        t.numel(),
        path.display()
    );
    Ok(t)
}

/// The four parts of MNIST (or of any data set in its layout, such as
/// Fashion-MNIST).
#[derive(Clone, Debug, PartialEq)]
pub struct Mnist {
    /// Training images, `uint8` `[60000, 28, 28]` for MNIST.
    pub train_images: HostTensor,
    /// Training labels, `int64` `[60000]`.
    pub train_labels: HostTensor,
    /// Test images, `uint8` `[10000, 28, 28]`.
    pub test_images: HostTensor,
    /// Test labels, `int64` `[10000]`.
    pub test_labels: HostTensor,
}

/// The standard file names of the four parts, without `.gz`.
const MNIST_FILES: [&str; 4] = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
];

/// The file of one part in `dir`: `name`, `name.gz`, or the same with the
/// last `-` written as `.` (`train-images.idx3-ubyte`, as some mirrors do).
fn find_part(dir: &Path, name: &str) -> Result<PathBuf> {
    let dotted = match name.rsplit_once("-idx") {
        Some((stem, rest)) => format!("{stem}.idx{rest}"),
        None => name.to_string(),
    };
    let candidates = [
        name.to_string(),
        format!("{name}.gz"),
        dotted.clone(),
        format!("{dotted}.gz"),
    ];
    for candidate in &candidates {
        let path = dir.join(candidate);
        if path.is_file() {
            return Ok(path);
        }
    }
    Err(Error::io(
        dir.join(name),
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!(
                "no MNIST file {} in {}",
                candidates.join(", "),
                dir.display()
            ),
        ),
    ))
}

/// Reads MNIST from `dir`, which holds the four standard files
/// (`train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
/// `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`), each raw or
/// gzip-compressed, with or without `.gz` in its name.
///
/// # Errors
///
/// [`Error::Io`] (not found) naming the first missing file; the errors of
/// [`load_mnist_images`] and [`load_mnist_labels`]; and [`Error::Data`]
/// naming the label file if it holds a different number of labels than its
/// image file holds images.
///
/// ```no_run
/// let mnist = kiln_data::load_mnist(std::path::Path::new("data/mnist"))?;
/// assert_eq!(mnist.train_images.dims(), &[60000, 28, 28]);
/// assert_eq!(mnist.test_labels.dims(), &[10000]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn load_mnist(dir: &Path) -> Result<Mnist> {
    let [train_x, train_y, test_x, test_y] = MNIST_FILES.map(|name| find_part(dir, name));
    let (train_x, train_y, test_x, test_y) = (train_x?, train_y?, test_x?, test_y?);
    let (train_images, train_labels) = load_pair(&train_x, &train_y)?;
    let (test_images, test_labels) = load_pair(&test_x, &test_y)?;
    log::info!(
        "load_mnist: {} training and {} test images of {:?} from {}",
        train_labels.numel(),
        test_labels.numel(),
        train_images.dims().get(1..).unwrap_or_default(),
        dir.display()
    );
    Ok(Mnist {
        train_images,
        train_labels,
        test_images,
        test_labels,
    })
}

/// Reads an image file and its label file and checks that the counts agree.
fn load_pair(images_path: &Path, labels_path: &Path) -> Result<(HostTensor, HostTensor)> {
    let images = load_mnist_images(images_path)?;
    let labels = load_mnist_labels(labels_path)?;
    let n_images = images.dims().first().copied().unwrap_or(0);
    if labels.numel() != n_images {
        return Err(Error::data(
            labels_path,
            // the count is the first dimension, right after the magic number
            Some(4),
            format!(
                "{} labels, but {} holds {n_images} images",
                labels.numel(),
                images_path.display()
            ),
        ));
    }
    Ok((images, labels))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::data_error;
    use flate2::write::GzEncoder;
    use flate2::Compression;
    use std::io::Write;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fresh file in the system temp directory, removed on drop.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(name: &str, bytes: &[u8]) -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let path = std::env::temp_dir().join(format!(
                "kiln-core-idx-{}-{}-{name}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::write(&path, bytes).expect("write temp file");
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            // Best effort: a leftover file in the temp dir is harmless.
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn header(dims: &[u32]) -> Vec<u8> {
        let mut bytes = vec![0, 0, 0x08, dims.len() as u8];
        for d in dims {
            bytes.extend(d.to_be_bytes());
        }
        bytes
    }

    fn gzip(parts: &[&[u8]]) -> Vec<u8> {
        let mut enc = GzEncoder::new(Vec::new(), Compression::default());
        for part in parts {
            enc.write_all(part).expect("compress");
        }
        enc.finish().expect("compress")
    }

    #[test]
    fn absurd_declared_sizes_are_refused_before_reading() {
        // 4 GB declared, 10 zero bytes stored
        let gz = gzip(&[&header(&[4_000_000_000]), &[0; 10]]);
        let file = TempFile::new("absurd.gz", &gz);
        let err = read_idx(&file.0).expect_err("4 GB declared");
        assert!(
            err.to_string()
                .contains(&format!("{} at byte 4", file.0.display())),
            "{err}"
        );
        let (path, offset, reason) = data_error(err);
        assert_eq!(path, file.0);
        assert_eq!(offset, Some(4));
        let max = gz.len() as u64 * 1100 + (1 << 20);
        assert_eq!(
            reason,
            format!(
                "the header declares dimensions [4000000000] of unsigned byte, a \
                 4000000000-byte payload after the 8-byte header, but this {}-byte gzip file \
                 can decompress to at most {max} bytes (deflate expands at most about \
                 1032:1); the header is corrupt",
                gz.len()
            )
        );

        // MNIST's training images declared, a few hundred bytes stored
        let file = TempFile::new(
            "mnist-header.gz",
            &gzip(&[&header(&[60000, 28, 28]), &[0; 784]]),
        );
        let (_, offset, reason) =
            data_error(load_mnist_images(&file.0).expect_err("47 MB declared"));
        assert_eq!(offset, Some(4));
        assert!(
            reason.starts_with(
                "the header declares dimensions [60000, 28, 28] of unsigned byte, a \
                 47040000-byte payload after the 16-byte header, but this"
            ),
            "{reason}"
        );

        // a raw file: it holds exactly its length
        let mut raw = header(&[4_000_000_000]);
        raw.extend([0; 10]);
        let file = TempFile::new("absurd-raw", &raw);
        let (_, offset, reason) = data_error(read_idx(&file.0).expect_err("raw"));
        assert_eq!(offset, Some(18));
        assert_eq!(
            reason,
            "truncated payload: dimensions [4000000000] of unsigned byte need 4000000000 bytes \
             after the 8-byte header, the file has 10 (it ends inside item 10)"
        );
    }

    #[test]
    fn payload_inflating_past_its_declared_size_is_refused() -> Result<()> {
        // 16 bytes declared; 4 MiB of zeros (a few KB compressed) follow them
        let zeros = vec![0u8; 4 << 20];
        let file = TempFile::new("bomb.gz", &gzip(&[&header(&[16]), &zeros]));
        let (path, offset, reason) = data_error(read_idx(&file.0).expect_err("trailing data"));
        assert_eq!(path, file.0);
        assert_eq!(offset, Some(8 + 16));
        assert_eq!(
            reason,
            "unexpected data after the 16-byte payload of dimensions [16]"
        );

        // the same header with exactly its payload reads, gzip or raw
        for bytes in [
            gzip(&[&header(&[16]), &[7; 16]]),
            [header(&[16]), vec![7; 16]].concat(),
        ] {
            let file = TempFile::new("exact", &bytes);
            assert_eq!(read_idx(&file.0)?, HostTensor::new(vec![7u8; 16], [16])?);
        }
        Ok(())
    }

    #[test]
    fn decodes_every_element_type_big_endian() -> Result<()> {
        let t = decode(Idx {
            ty: IdxType::I16,
            dims: vec![2],
            payload: vec![0xff, 0xfe, 0x01, 0x00],
        })?;
        assert_eq!(t.as_slice::<i32>()?, &[-2, 256]);
        let t = decode(Idx {
            ty: IdxType::I8,
            dims: vec![2],
            payload: vec![0x80, 0x7f],
        })?;
        assert_eq!(t.as_slice::<i32>()?, &[-128, 127]);
        let t = decode(Idx {
            ty: IdxType::I32,
            dims: vec![1],
            payload: vec![0xff, 0xff, 0xff, 0x9c],
        })?;
        assert_eq!(t.as_slice::<i32>()?, &[-100]);
        let t = decode(Idx {
            ty: IdxType::F32,
            dims: vec![1, 1],
            payload: 1.5f32.to_be_bytes().to_vec(),
        })?;
        assert_eq!(t.as_slice::<f32>()?, &[1.5]);
        let t = decode(Idx {
            ty: IdxType::F64,
            dims: vec![1],
            payload: (-0.25f64).to_be_bytes().to_vec(),
        })?;
        assert_eq!(t.as_slice::<f64>()?, &[-0.25]);
        Ok(())
    }
}
