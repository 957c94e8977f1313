//! Borrowed, contiguous, row-major tensor views: what a kernel reads and writes.

use crate::OpError;

/// Number of elements of `shape`, or an error for a negative size or overflow.
fn element_count(shape: &[i64]) -> Result<usize, OpError> {
    shape.iter().try_fold(1usize, |n, &d| {
        let d = usize::try_from(d)
            .map_err(|_| OpError::new(format!("shape {shape:?} has a negative size")))?;
        n.checked_mul(d)
            .ok_or_else(|| OpError::new(format!("shape {shape:?} overflows usize")))
    })
}

/// Checks that `len` elements fill `shape`.
fn check_len(len: usize, shape: &[i64]) -> Result<(), OpError> {
    let n = element_count(shape)?;
    if n == len {
        Ok(())
    } else {
        Err(OpError::new(format!(
            "a view of shape {shape:?} needs {n} elements, got {len}"
        )))
    }
}

/// An input of a kernel: contiguous elements in row-major order and the shape.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a, T> {
    data: &'a [T],
    shape: &'a [i64],
}

impl<'a, T> TensorRef<'a, T> {
    /// A view of `data` with `shape`; their element counts must agree.
    pub fn new(data: &'a [T], shape: &'a [i64]) -> Result<Self, OpError> {
        check_len(data.len(), shape)?;
        Ok(TensorRef { data, shape })
    }
    /// The elements, row-major.
    pub fn data(&self) -> &'a [T] {
        self.data
    }
    /// The sizes of the dimensions.
    pub fn shape(&self) -> &'a [i64] {
        self.shape
    }
    /// Number of dimensions.
    pub fn dim(&self) -> usize {
        self.shape.len()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }
    /// The size of the last dimension (1 for a scalar).
    pub fn last_dim(&self) -> usize {
        self.shape.last().map_or(1, |&d| d as usize)
    }
}

/// An output of a kernel, allocated by the engine: the kernel writes every element.
#[derive(Debug)]
pub struct TensorMut<'a, T> {
    data: &'a mut [T],
    shape: &'a [i64],
}

impl<'a, T> TensorMut<'a, T> {
    /// A view of `data` with `shape`; their element counts must agree.
    pub fn new(data: &'a mut [T], shape: &'a [i64]) -> Result<Self, OpError> {
        check_len(data.len(), shape)?;
        Ok(TensorMut { data, shape })
    }
    /// The elements, row-major.
    pub fn data_mut(&mut self) -> &mut [T] {
        self.data
    }
    /// The elements, read-only.
    pub fn data(&self) -> &[T] {
        self.data
    }
    /// The sizes of the dimensions.
    pub fn shape(&self) -> &'a [i64] {
        self.shape
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }
}
