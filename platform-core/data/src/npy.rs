//! Reader for NumPy's `.npy` files, as `numpy.save` writes them.

use std::io::Read;
use std::path::Path;

use kiln_core::dtype::DType;
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// The magic string every `.npy` file starts with.
const MAGIC: &[u8] = b"\x93NUMPY";

/// The longest header read; `numpy.load` refuses headers over 10,000 bytes
/// by default, so this only bounds what a corrupt file can make Kiln read.
const MAX_HEADER: usize = 1 << 16;

/// An element type of a `.npy` file and the tensor dtype it becomes.
#[derive(Clone, Copy, Debug)]
struct Element {
    /// Bytes per element in the file.
    size: usize,
    /// Whether the file's bytes are big-endian.
    big_endian: bool,
    kind: Kind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Bool,
    U8,
    I8,
    I16,
    U16,
    I32,
    U32,
    I64,
    F16,
    F32,
    F64,
}

impl Kind {
    /// The tensor dtype the kind is read as: the same where Kiln has it,
    /// else the narrowest that holds every value (`bool` as 0/1 `uint8`,
    /// `int8`/`int16`/`uint16` as `int32`, `uint32` as `int64`).
    fn dtype(self) -> DType {
        match self {
            Kind::Bool | Kind::U8 => DType::U8,
            Kind::I8 | Kind::I16 | Kind::U16 | Kind::I32 => DType::I32,
            Kind::U32 | Kind::I64 => DType::I64,
            Kind::F16 => DType::F16,
            Kind::F32 => DType::F32,
            Kind::F64 => DType::F64,
        }
    }
}

/// The `descr` of a header (`'<f4'`, `'|u1'`, `'>i8'`...) as an element type.
fn element(descr: &str) -> Option<Element> {
    let (order, code) = descr.split_at_checked(1)?;
    let big_endian = match order {
        "<" | "|" => false,
        ">" => true,
        "=" => cfg!(target_endian = "big"),
        _ => return None,
    };
    let (kind, size) = match code {
        "b1" => (Kind::Bool, 1),
        "u1" => (Kind::U8, 1),
        "i1" => (Kind::I8, 1),
        "i2" => (Kind::I16, 2),
        "u2" => (Kind::U16, 2),
        "i4" => (Kind::I32, 4),
        "u4" => (Kind::U32, 4),
        "i8" => (Kind::I64, 8),
        "f2" => (Kind::F16, 2),
        "f4" => (Kind::F32, 4),
        "f8" => (Kind::F64, 8),
        _ => return None,
    };
    Some(Element {
        size,
        big_endian,
        kind,
    })
}

/// What a header says: the element type, the memory order and the shape.
#[derive(Debug)]
struct Header {
    descr: String,
    fortran_order: bool,
    shape: Vec<usize>,
}

/// Reads the header's Python dict literal (`{'descr': '<f4', 'fortran_order':
/// False, 'shape': (3, 4), }`), in any key order; `Err` says what is wrong.
fn parse_header(text: &str) -> std::result::Result<Header, String> {
    let body = text
        .trim()
        .strip_prefix('{')
        .and_then(|t| t.strip_suffix('}'))
        .ok_or("the header is not a Python dict")?;
    let value_of = |key: &str| -> std::result::Result<&str, String> {
        let at = body
            .find(&format!("'{key}'"))
            .ok_or_else(|| format!("the header has no '{key}'"))?;
        let rest = body[at + key.len() + 2..].trim_start();
        rest.strip_prefix(':')
            .map(str::trim_start)
            .ok_or_else(|| format!("the header's '{key}' has no value"))
    };
    let descr = value_of("descr")?;
    let descr = descr
        .strip_prefix('\'')
        .and_then(|d| d.split_once('\''))
        .map(|(d, _)| d.to_owned())
        .ok_or("the header's 'descr' is not a string (a structured dtype?)")?;
    let fortran = value_of("fortran_order")?;
    let fortran_order = if fortran.starts_with("True") {
        true
    } else if fortran.starts_with("False") {
        false
    } else {
        return Err("the header's 'fortran_order' is neither True nor False".into());
    };
    let shape = value_of("shape")?;
    let inner = shape
        .strip_prefix('(')
        .and_then(|s| s.split_once(')'))
        .map(|(s, _)| s)
        .ok_or("the header's 'shape' is not a tuple")?;
    let shape = inner
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| {
            d.parse::<usize>()
                .map_err(|_| format!("the header's shape ({inner}) holds {d:?}, not a size"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(Header {
        descr,
        fortran_order,
        shape,
    })
}

/// Reads the array in the `.npy` file `path` as a tensor of its shape and
/// values, equal to `numpy.load(path)`.
///
/// * Formats 1.0, 2.0 and 3.0 (`numpy.save` writes the first that fits).
/// * Element types: `float16`, `float32`, `float64`, `int32`, `int64` and
///   `uint8` as themselves; `bool` as `uint8` 0/1; `int8`, `int16` and
///   `uint16` as `int32`; `uint32` as `int64`; little- or big-endian.
///   Others (`uint64`, complex, strings, objects, structured arrays) are an
///   [`Error::Data`] naming the `descr`.
/// * A Fortran-ordered array (`np.asfortranarray`) is given in C order, the
///   same values at the same indices, as `numpy.load` gives them.
///
/// The file's size is checked against its header before the data is read,
/// so a header that lies allocates nothing; a named pipe or a device is
/// refused ([`kiln_core::fs::open_regular_file`]).
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("kiln-npy-doc-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).map_err(|e| kiln_core::Error::io(&dir, e))?;
/// // numpy.save("x.npy", np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float32))
/// let header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
/// let mut file = b"\x93NUMPY\x01\x00".to_vec();
/// let padded = format!("{header:<117}\n");
/// file.extend((padded.len() as u16).to_le_bytes());
/// file.extend(padded.as_bytes());
/// for v in [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0] {
///     file.extend(v.to_le_bytes());
/// }
/// let path = dir.join("x.npy");
/// std::fs::write(&path, &file).map_err(|e| kiln_core::Error::io(&path, e))?;
/// let x = kiln_data::read_npy(&path)?;
/// assert_eq!(x.dims(), &[2, 3]);
/// assert_eq!(x.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn read_npy(path: impl AsRef<Path>) -> Result<HostTensor> {
    let path = path.as_ref();
    let bad = |offset: u64, reason: String| Error::data(path, Some(offset), reason);
    let mut file = kiln_core::fs::open_regular_file(path)?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut read = |buf: &mut [u8], offset: u64, what: &str| {
        file.read_exact(buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                bad(offset, format!("the file ends inside its {what}"))
            } else {
                Error::data_caused_by(path, Some(offset), "cannot read", e)
            }
        })
    };
    let mut prelude = [0u8; 8];
    read(&mut prelude, 0, "magic string")?;
    if &prelude[..6] != MAGIC {
        return Err(bad(
            0,
            "not a .npy file (it does not start with \\x93NUMPY; an .npz is a zip of them)".into(),
        ));
    }
    let (major, minor) = (prelude[6], prelude[7]);
    let header_len = match major {
        1 => {
            let mut n = [0u8; 2];
            read(&mut n, 8, "header length")?;
            u16::from_le_bytes(n) as usize
        }
        2 | 3 => {
            let mut n = [0u8; 4];
            read(&mut n, 8, "header length")?;
            u32::from_le_bytes(n) as usize
        }
        _ => {
            return Err(bad(
                6,
                format!("format version {major}.{minor}; Kiln reads 1.0, 2.0 and 3.0"),
            ))
        }
    };
    let header_at: u64 = if major == 1 { 10 } else { 12 };
    if header_len > MAX_HEADER {
        return Err(bad(
            8,
            format!("a header of {header_len} bytes (at most {MAX_HEADER} are read)"),
        ));
    }
    let mut header = vec![0u8; header_len];
    read(&mut header, header_at, "header")?;
    let text = std::str::from_utf8(&header)
        .map_err(|_| bad(header_at, "the header is not text".into()))?;
    let header = parse_header(text).map_err(|reason| bad(header_at, reason))?;
    let element = element(&header.descr).ok_or_else(|| {
        bad(
            header_at,
            format!(
                "elements of type {:?}; Kiln reads bool, uint8, int8, int16, uint16, int32, \
                 uint32, int64, float16, float32 and float64",
                header.descr
            ),
        )
    })?;
    let data_at = header_at + header_len as u64;
    let count = header
        .shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|n| n.checked_mul(element.size).is_some())
        .ok_or_else(|| bad(header_at, format!("shape {:?} is too large", header.shape)))?;
    let bytes = (count * element.size) as u64;
    if len.checked_sub(data_at) != Some(bytes) {
        return Err(bad(
            data_at,
            format!(
                "shape {:?} of {:?} needs {bytes} bytes of data, the file has {}",
                header.shape,
                header.descr,
                len.saturating_sub(data_at)
            ),
        ));
    }
    let mut raw = vec![0u8; bytes as usize];
    read(&mut raw, data_at, "data")?;
    if element.big_endian && element.size > 1 {
        for item in raw.chunks_exact_mut(element.size) {
            item.reverse();
        }
    }
    if header.fortran_order && header.shape.len() > 1 {
        raw = c_order(&raw, &header.shape, element.size);
    }
    to_tensor(&raw, element.kind, &header.shape)
        .map_err(|e| bad(data_at, format!("the data does not fit its header: {e}")))
}

/// The elements of a column-major array of `shape` (`size` bytes each),
/// reordered row-major.
fn c_order(raw: &[u8], shape: &[usize], size: usize) -> Vec<u8> {
    let count = raw.len() / size.max(1);
    // The column-major stride of each axis, in elements.
    let mut strides = vec![1usize; shape.len()];
    for axis in 1..shape.len() {
        strides[axis] = strides[axis - 1] * shape[axis - 1];
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut index = vec![0usize; shape.len()];
    for _ in 0..count {
        let at: usize = index.iter().zip(&strides).map(|(i, s)| i * s).sum();
        out.extend_from_slice(&raw[at * size..(at + 1) * size]);
        // The next row-major index: the last axis fastest.
        for axis in (0..shape.len()).rev() {
            index[axis] += 1;
            if index[axis] < shape[axis] {
                break;
            }
            index[axis] = 0;
        }
    }
    out
}

/// Little-endian, row-major elements of `kind` as a tensor of its dtype.
fn to_tensor(raw: &[u8], kind: Kind, shape: &[usize]) -> Result<HostTensor> {
    fn widened<const N: usize, T>(raw: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        raw.chunks_exact(N)
            .map(|c| {
                let mut b = [0u8; N];
                b.copy_from_slice(c);
                f(b)
            })
            .collect()
    }
    let shape = shape.to_vec();
    match kind {
        Kind::Bool => HostTensor::new(raw.iter().map(|&b| u8::from(b != 0)).collect(), shape),
        Kind::I8 => HostTensor::new(
            widened(raw, |b: [u8; 1]| i8::from_le_bytes(b) as i32),
            shape,
        ),
        Kind::I16 => HostTensor::new(
            widened(raw, |b: [u8; 2]| i16::from_le_bytes(b) as i32),
            shape,
        ),
        Kind::U16 => HostTensor::new(
            widened(raw, |b: [u8; 2]| u16::from_le_bytes(b) as i32),
            shape,
        ),
        Kind::U32 => HostTensor::new(
            widened(raw, |b: [u8; 4]| u32::from_le_bytes(b) as i64),
            shape,
        ),
        Kind::U8 | Kind::I32 | Kind::I64 | Kind::F16 | Kind::F32 | Kind::F64 => {
            HostTensor::from_bytes(kind.dtype(), shape, raw)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_in_any_order_and_their_faults() {
        let h = parse_header("{'shape': (), 'fortran_order': True, 'descr': '>i8'}").unwrap();
        assert_eq!((h.descr.as_str(), h.fortran_order), (">i8", true));
        assert!(h.shape.is_empty());
        let h =
            parse_header("{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }  \n").unwrap();
        assert_eq!(h.shape, [5]);
        let err = parse_header("{'descr': '<f4', 'fortran_order': False}").unwrap_err();
        assert_eq!(err, "the header has no 'shape'");
        let err = parse_header("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,)}")
            .unwrap_err();
        assert!(err.contains("structured"), "{err}");
        let err =
            parse_header("{'descr': '<f4', 'fortran_order': False, 'shape': (2, x)}").unwrap_err();
        assert!(err.contains("holds \"x\""), "{err}");
        assert!(element("<c8").is_none() && element("<u8").is_none() && element("|O").is_none());
        assert_eq!(
            element(">f8").map(|e| (e.size, e.big_endian)),
            Some((8, true))
        );
    }

    #[test]
    fn fortran_order_is_reordered() {
        // [[0, 1, 2], [3, 4, 5]] stored column-major: 0 3 1 4 2 5.
        let raw: Vec<u8> = vec![0, 3, 1, 4, 2, 5];
        assert_eq!(c_order(&raw, &[2, 3], 1), [0, 1, 2, 3, 4, 5]);
        // 2x2x2: element (i, j, k) at i + 2j + 4k.
        let raw: Vec<u8> = (0..8).collect();
        assert_eq!(c_order(&raw, &[2, 2, 2], 1), [0, 4, 2, 6, 1, 5, 3, 7]);
    }
}
