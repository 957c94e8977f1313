//! Owned tensors in host memory.

use std::fmt;

use half::{bf16, f16};

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::shape::Shape;

/// Number of values [`HostTensor`]'s `Debug` output shows.
const DEBUG_VALUES: usize = 8;

/// Typed element buffer of a [`HostTensor`].
#[derive(Clone, PartialEq)]
enum Storage {
    U8(Vec<u8>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

/// Evaluates `$body` with `$v` bound to the buffer of every variant.
macro_rules! dispatch {
    ($storage:expr, $v:ident => $body:expr) => {
        match $storage {
            Storage::U8($v) => $body,
            Storage::I32($v) => $body,
            Storage::I64($v) => $body,
            Storage::F32($v) => $body,
            Storage::F64($v) => $body,
            Storage::BF16($v) => $body,
            Storage::F16($v) => $body,
        }
    };
}

/// Evaluates `$body` with the type alias `$t` set to the Rust type of `$dtype`.
macro_rules! with_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::U8 => {
                type $t = u8;
                $body
            }
            DType::I32 => {
                type $t = i32;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::BF16 => {
                type $t = bf16;
                $body
            }
            DType::F16 => {
                type $t = f16;
                $body
            }
        }
    };
}

/// Converts every element of `$storage` to the primitive `$t` with `as`
/// (half-precision elements through their exact `f64` value).
macro_rules! cast_all {
    ($storage:expr, $t:ty) => {
        match $storage {
            Storage::U8(v) => v.iter().map(|&x| x as $t).collect::<Vec<$t>>(),
            Storage::I32(v) => v.iter().map(|&x| x as $t).collect(),
            Storage::I64(v) => v.iter().map(|&x| x as $t).collect(),
            Storage::F32(v) => v.iter().map(|&x| x as $t).collect(),
            Storage::F64(v) => v.iter().map(|&x| x as $t).collect(),
            Storage::BF16(v) => v.iter().map(|&x| x.to_f64() as $t).collect(),
            Storage::F16(v) => v.iter().map(|&x| x.to_f64() as $t).collect(),
        }
    };
}

/// Reinterprets a vector of one element type as another of the same layout,
/// copying only if the allocation cannot be reused.
fn retype_vec<A: Element, B: Element>(v: Vec<A>) -> Vec<B> {
    bytemuck::allocation::try_cast_vec(v).unwrap_or_else(|(_, v)| bytemuck::pod_collect_to_vec(&v))
}

impl Storage {
    fn dtype(&self) -> DType {
        match self {
            Storage::U8(_) => DType::U8,
            Storage::I32(_) => DType::I32,
            Storage::I64(_) => DType::I64,
            Storage::F32(_) => DType::F32,
            Storage::F64(_) => DType::F64,
            Storage::BF16(_) => DType::BF16,
            Storage::F16(_) => DType::F16,
        }
    }

    fn len(&self) -> usize {
        dispatch!(self, v => v.len())
    }

    fn from_vec<T: Element>(data: Vec<T>) -> Self {
        match T::DTYPE {
            DType::U8 => Storage::U8(retype_vec(data)),
            DType::I32 => Storage::I32(retype_vec(data)),
            DType::I64 => Storage::I64(retype_vec(data)),
            DType::F32 => Storage::F32(retype_vec(data)),
            DType::F64 => Storage::F64(retype_vec(data)),
            DType::BF16 => Storage::BF16(retype_vec(data)),
            DType::F16 => Storage::F16(retype_vec(data)),
        }
    }

    fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::U8 => Storage::U8(vec![0; n]),
            DType::I32 => Storage::I32(vec![0; n]),
            DType::I64 => Storage::I64(vec![0; n]),
            DType::F32 => Storage::F32(vec![0.0; n]),
            DType::F64 => Storage::F64(vec![0.0; n]),
            DType::BF16 => Storage::BF16(vec![bf16::ZERO; n]),
            DType::F16 => Storage::F16(vec![f16::ZERO; n]),
        }
    }

    /// Decodes native-endian bytes; `bytes.len()` must be a multiple of the element size.
    fn from_bytes(dtype: DType, bytes: &[u8]) -> Self {
        match dtype {
            DType::U8 => Storage::U8(bytes.to_vec()),
            DType::I32 => Storage::I32(bytemuck::pod_collect_to_vec(bytes)),
            DType::I64 => Storage::I64(bytemuck::pod_collect_to_vec(bytes)),
            DType::F32 => Storage::F32(bytemuck::pod_collect_to_vec(bytes)),
            DType::F64 => Storage::F64(bytemuck::pod_collect_to_vec(bytes)),
            DType::BF16 => Storage::BF16(bytemuck::pod_collect_to_vec(bytes)),
            DType::F16 => Storage::F16(bytemuck::pod_collect_to_vec(bytes)),
        }
    }

    fn as_bytes(&self) -> &[u8] {
        dispatch!(self, v => bytemuck::cast_slice(v.as_slice()))
    }

    fn cast(&self, dtype: DType) -> Self {
        match dtype {
            DType::U8 => Storage::U8(cast_all!(self, u8)),
            DType::I32 => Storage::I32(cast_all!(self, i32)),
            DType::I64 => Storage::I64(cast_all!(self, i64)),
            DType::F32 => Storage::F32(cast_all!(self, f32)),
            DType::F64 => Storage::F64(cast_all!(self, f64)),
            // One rounding: every other element type converts to f64 exactly
            // (i64 beyond 2^53 aside, which bf16 cannot tell apart anyway).
            DType::BF16 => Storage::BF16(
                cast_all!(self, f64)
                    .into_iter()
                    .map(bf16::from_f64)
                    .collect(),
            ),
            DType::F16 => Storage::F16(
                cast_all!(self, f64)
                    .into_iter()
                    .map(f16::from_f64)
                    .collect(),
            ),
        }
    }

    fn to_f64_vec(&self) -> Vec<f64> {
        cast_all!(self, f64)
    }
}

/// An owned, contiguous, row-major tensor in host memory.
///
/// This is the exchange format between Kiln and the backends: data loaders
/// produce it, [`Backend::from_host`](crate::backend::Backend::from_host) uploads it and
/// checkpoints store it.
///
/// ```
/// use kiln_core::{DType, HostTensor};
///
/// let t = HostTensor::new(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3])?;
/// assert_eq!(t.dims(), &[2, 3]);
/// assert_eq!(t.dtype(), DType::F32);
/// assert_eq!(t.as_slice::<f32>()?[4], 5.0);
/// assert!(t.as_slice::<i64>().is_err());
///
/// let t = t.reshape([3, 2])?.to_dtype(DType::I64);
/// assert_eq!(t.into_vec::<i64>()?, vec![1, 2, 3, 4, 5, 6]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, PartialEq)]
pub struct HostTensor {
    shape: Shape,
    storage: Storage,
}

/// Checks that `shape` has a representable element count and returns it.
fn numel_of(shape: &Shape) -> Result<usize> {
    shape.checked_numel().ok_or_else(|| {
        Error::invalid_argument(
            "shape",
            format!("the element count of {shape} overflows usize"),
        )
    })
}

impl HostTensor {
    /// A tensor owning `data`, laid out row-major in `shape`.
    ///
    /// Fails with [`Error::ElementCount`] if `data.len()` differs from the shape's element count.
    pub fn new<T: Element>(data: Vec<T>, shape: impl Into<Shape>) -> Result<Self> {
        let shape = shape.into();
        let expected = numel_of(&shape)?;
        if data.len() != expected {
            return Err(Error::ElementCount {
                shape,
                expected,
                actual: data.len(),
            });
        }
        Ok(HostTensor {
            shape,
            storage: Storage::from_vec(data),
        })
    }

    /// A tensor holding a copy of `data`.
    pub fn from_slice<T: Element>(data: &[T], shape: impl Into<Shape>) -> Result<Self> {
        Self::new(data.to_vec(), shape)
    }

    /// A scalar (shape `[]`) tensor.
    ///
    /// ```
    /// use kiln_core::HostTensor;
    ///
    /// let t = HostTensor::scalar(2.5f64);
    /// assert_eq!(t.rank(), 0);
    /// assert_eq!(t.item::<f64>()?, 2.5);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn scalar<T: Element>(value: T) -> Self {
        HostTensor {
            shape: Shape::scalar(),
            storage: Storage::from_vec(vec![value]),
        }
    }

    /// A tensor of zeros.
    pub fn zeros(dtype: DType, shape: impl Into<Shape>) -> Result<Self> {
        let shape = shape.into();
        let n = numel_of(&shape)?;
        Ok(HostTensor {
            shape,
            storage: Storage::zeros(dtype, n),
        })
    }

    /// Decodes a tensor from raw bytes in native byte order (little-endian on
    /// every supported target), the layout of [`HostTensor::as_bytes`].
    ///
    /// `bytes` need not be aligned. Fails if its length is not
    /// `numel * dtype.size_in_bytes()`.
    ///
    /// ```
    /// use kiln_core::{DType, HostTensor};
    ///
    /// let t = HostTensor::from_bytes(DType::I32, [2], &[1, 0, 0, 0, 2, 0, 0, 0])?;
    /// assert_eq!(t.as_slice::<i32>()?, &[1, 2]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn from_bytes(dtype: DType, shape: impl Into<Shape>, bytes: &[u8]) -> Result<Self> {
        let shape = shape.into();
        let n = numel_of(&shape)?;
        let expected = n.checked_mul(dtype.size_in_bytes()).ok_or_else(|| {
            Error::invalid_argument(
                "shape",
                format!("the byte size of {shape} {dtype} overflows usize"),
            )
        })?;
        if bytes.len() != expected {
            return Err(Error::invalid_argument(
                "bytes",
                format!(
                    "shape {shape} of {dtype} needs {expected} bytes \
                     ({n} elements x {} bytes), got {}",
                    dtype.size_in_bytes(),
                    bytes.len()
                ),
            ));
        }
        Ok(HostTensor {
            shape,
            storage: Storage::from_bytes(dtype, bytes),
        })
    }

    /// Stacks equally shaped tensors of one dtype along a new leading axis.
    ///
    /// ```
    /// use kiln_core::HostTensor;
    ///
    /// let a = HostTensor::new(vec![1i64, 2], [2])?;
    /// let b = HostTensor::new(vec![3i64, 4], [2])?;
    /// let s = HostTensor::stack(&[a, b])?;
    /// assert_eq!(s.dims(), &[2, 2]);
    /// assert_eq!(s.as_slice::<i64>()?, &[1, 2, 3, 4]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn stack(tensors: &[HostTensor]) -> Result<Self> {
        let first = tensors.first().ok_or_else(|| {
            Error::invalid_argument("tensors", "cannot stack an empty list of tensors")
        })?;
        for (i, t) in tensors.iter().enumerate().skip(1) {
            if t.dtype() != first.dtype() {
                return Err(Error::DTypeMismatch {
                    context: format!("HostTensor::stack: tensor {i}"),
                    expected: first.dtype(),
                    actual: t.dtype(),
                });
            }
            if t.shape != first.shape {
                return Err(Error::ShapeMismatch {
                    context: format!("HostTensor::stack: tensor {i}"),
                    expected: first.shape.to_string(),
                    actual: t.shape.to_string(),
                });
            }
        }
        let mut dims = Vec::with_capacity(first.rank() + 1);
        dims.push(tensors.len());
        dims.extend_from_slice(first.dims());
        let shape = Shape::new(dims);
        with_dtype!(first.dtype(), T => {
            let mut data: Vec<T> = Vec::with_capacity(numel_of(&shape)?);
            for t in tensors {
                data.extend_from_slice(t.as_slice::<T>()?);
            }
            HostTensor::new(data, shape)
        })
    }

    /// The rows at `indices` along the first axis, in that order (like `index_select(0, ..)`).
    ///
    /// ```
    /// use kiln_core::HostTensor;
    ///
    /// let t = HostTensor::new(vec![0u8, 1, 10, 11, 20, 21], [3, 2])?;
    /// let picked = t.select_rows(&[2, 0])?;
    /// assert_eq!(picked.dims(), &[2, 2]);
    /// assert_eq!(picked.as_slice::<u8>()?, &[20, 21, 0, 1]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn select_rows(&self, indices: &[usize]) -> Result<Self> {
        let (&rows, rest) = self.shape.dims().split_first().ok_or_else(|| {
            Error::invalid_argument("self", "cannot select rows of a scalar tensor")
        })?;
        let row_shape = Shape::from(rest);
        let row_len = numel_of(&row_shape)?;
        if let Some(&bad) = indices.iter().find(|&&i| i >= rows) {
            return Err(Error::invalid_argument(
                "indices",
                format!(
                    "row {bad} is out of range for shape {}; expected 0..{rows}",
                    self.shape
                ),
            ));
        }
        let mut dims = Vec::with_capacity(self.rank());
        dims.push(indices.len());
        dims.extend_from_slice(rest);
        let shape = Shape::new(dims);
        with_dtype!(self.dtype(), T => {
            let src = self.as_slice::<T>()?;
            let mut data: Vec<T> = Vec::with_capacity(numel_of(&shape)?);
            for &i in indices {
                let start = i * row_len;
                data.extend_from_slice(&src[start..start + row_len]);
            }
            HostTensor::new(data, shape)
        })
    }

    /// Row `index` along the first axis, with that axis removed (`t[index]`).
    pub fn row(&self, index: usize) -> Result<Self> {
        let rest = Shape::from(self.dims().get(1..).unwrap_or_default());
        self.select_rows(&[index])?.reshape(rest)
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The dimensions, shorthand for `shape().dims()`.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.rank()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.storage.len()
    }

    /// Size of the data in bytes.
    pub fn size_in_bytes(&self) -> usize {
        self.as_bytes().len()
    }

    fn mismatch<T: Element>(&self, op: &str) -> Error {
        Error::DTypeMismatch {
            context: format!("HostTensor::{op}::<{}>", T::DTYPE),
            expected: T::DTYPE,
            actual: self.dtype(),
        }
    }

    /// The elements as a slice of `T`; fails unless `T` matches the dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        if T::DTYPE != self.dtype() {
            return Err(self.mismatch::<T>("as_slice"));
        }
        dispatch!(&self.storage, v => bytemuck::try_cast_slice::<_, T>(v.as_slice()))
            .map_err(|_| self.mismatch::<T>("as_slice"))
    }

    /// The elements as a mutable slice of `T`; fails unless `T` matches the dtype.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        let actual = self.dtype();
        let err = || Error::DTypeMismatch {
            context: format!("HostTensor::as_mut_slice::<{}>", T::DTYPE),
            expected: T::DTYPE,
            actual,
        };
        if T::DTYPE != actual {
            return Err(err());
        }
        dispatch!(&mut self.storage, v => bytemuck::try_cast_slice_mut::<_, T>(v.as_mut_slice()))
            .map_err(|_| err())
    }

    /// Takes the elements out as a `Vec<T>`; fails unless `T` matches the dtype.
    pub fn into_vec<T: Element>(self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            return Err(self.mismatch::<T>("into_vec"));
        }
        Ok(dispatch!(self.storage, v => retype_vec::<_, T>(v)))
    }

    /// The single value of a one-element tensor (any shape); fails unless `T` matches the dtype.
    pub fn item<T: Element>(&self) -> Result<T> {
        match self.as_slice::<T>()? {
            [value] => Ok(*value),
            values => Err(Error::ShapeMismatch {
                context: "HostTensor::item".into(),
                expected: "with exactly 1 element".into(),
                actual: format!("{} ({} elements)", self.shape, values.len()),
            }),
        }
    }

    /// The raw data in native byte order (little-endian on every supported target).
    pub fn as_bytes(&self) -> &[u8] {
        self.storage.as_bytes()
    }

    /// The raw data in native byte order, writable (e.g. to read a file straight
    /// into a tensor made with [`HostTensor::zeros`]).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        dispatch!(&mut self.storage, v => bytemuck::cast_slice_mut(v.as_mut_slice()))
    }

    /// The same data viewed with another shape of the same element count.
    pub fn reshape(self, shape: impl Into<Shape>) -> Result<Self> {
        let shape = shape.into();
        let n = self.numel();
        if shape.checked_numel() != Some(n) {
            return Err(Error::ShapeMismatch {
                context: format!("HostTensor::reshape of {}", self.shape),
                expected: format!("with {n} elements"),
                actual: match shape.checked_numel() {
                    Some(m) => format!("{shape} ({m} elements)"),
                    None => format!("{shape} (element count overflows)"),
                },
            });
        }
        Ok(HostTensor {
            shape,
            storage: self.storage,
        })
    }

    /// A copy converted to `dtype` with Rust `as` semantics: float to integer
    /// truncates toward zero (like PyTorch) and saturates at the target's
    /// range (NaN becomes 0); integer to narrower integer wraps.
    ///
    /// ```
    /// use kiln_core::{DType, HostTensor};
    ///
    /// let t = HostTensor::new(vec![-1.7f32, 2.9], [2])?.to_dtype(DType::I64);
    /// assert_eq!(t.as_slice::<i64>()?, &[-1, 2]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn to_dtype(&self, dtype: DType) -> HostTensor {
        if dtype == self.dtype() {
            return self.clone();
        }
        HostTensor {
            shape: self.shape.clone(),
            storage: self.storage.cast(dtype),
        }
    }

    /// The elements converted to `f64` (exact except for `i64` beyond 2^53).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        self.storage.to_f64_vec()
    }

    /// Whether both tensors have the same shape and dtype and every pair of
    /// elements satisfies `|a - b| <= atol + rtol * |b|` (as `torch.allclose`).
    ///
    /// Equal infinities are close; NaN is never close to anything.
    ///
    /// ```
    /// use kiln_core::HostTensor;
    ///
    /// let a = HostTensor::new(vec![1.0f32, 2.0], [2])?;
    /// let b = HostTensor::new(vec![1.0f32, 2.000_1], [2])?;
    /// assert!(a.allclose(&b, 1e-3, 0.0));
    /// assert!(!a.allclose(&b, 1e-6, 1e-6));
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn allclose(&self, other: &HostTensor, rtol: f64, atol: f64) -> bool {
        if self.shape != other.shape || self.dtype() != other.dtype() {
            return false;
        }
        self.to_f64_vec()
            .iter()
            .zip(other.to_f64_vec())
            .all(|(&a, b)| a == b || (a - b).abs() <= atol + rtol * b.abs())
    }
}

/// Writes up to [`DEBUG_VALUES`] values, then the total count if there are more.
struct Head<'a, T>(&'a [T]);

impl<T: fmt::Debug> fmt::Debug for Head<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, x) in self.0.iter().take(DEBUG_VALUES).enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            x.fmt(f)?;
        }
        if self.0.len() > DEBUG_VALUES {
            write!(f, ", ... ({} values)", self.0.len())?;
        }
        f.write_str("]")
    }
}

impl fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("HostTensor");
        s.field("shape", &format_args!("{}", self.shape));
        s.field("dtype", &format_args!("{}", self.dtype()));
        dispatch!(&self.storage, v => s.field("data", &Head(v.as_slice())));
        s.finish()
    }
}

#[cfg(test)]
mod tests;
