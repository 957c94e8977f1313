//! Tensor shapes.

use std::fmt;

use crate::error::{Error, Result};

/// The dimensions of a tensor, outermost first (row-major).
///
/// A scalar has the empty shape `[]` and holds one element.
///
/// ```
/// use kiln_core::Shape;
///
/// let s = Shape::from([2, 3, 4]);
/// assert_eq!(s.rank(), 3);
/// assert_eq!(s.numel(), 24);
/// assert_eq!(s.strides(), vec![12, 4, 1]);
/// assert_eq!(s.dim(-1)?, 4);
/// assert_eq!(s.to_string(), "[2, 3, 4]");
/// assert_eq!(Shape::from(()).numel(), 1);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Shape(Vec<usize>);

impl Shape {
    /// A shape with the given dimensions.
    pub fn new(dims: Vec<usize>) -> Self {
        Shape(dims)
    }

    /// The scalar shape `[]`.
    pub fn scalar() -> Self {
        Shape(Vec::new())
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Number of dimensions (0 for a scalar).
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements: the product of the dimensions (1 for a scalar).
    ///
    /// Saturates at `usize::MAX` on overflow; use [`Shape::checked_numel`] where
    /// the shape comes from untrusted input. Shapes of existing tensors never overflow.
    pub fn numel(&self) -> usize {
        self.checked_numel().unwrap_or(usize::MAX)
    }

    /// Number of elements, or `None` if the product overflows `usize`.
    pub fn checked_numel(&self) -> Option<usize> {
        self.0.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }

    /// Size of axis `axis`; negative values count from the end (`-1` is the last axis).
    pub fn dim(&self, axis: isize) -> Result<usize> {
        let rank = self.rank();
        let index = if axis < 0 {
            rank.checked_sub(axis.unsigned_abs())
        } else {
            Some(axis.unsigned_abs()).filter(|&i| i < rank)
        };
        match index {
            Some(i) => Ok(self.0[i]),
            None => Err(Error::invalid_argument(
                "axis",
                format!(
                    "axis {axis} is out of range for shape {self} of rank {rank}; \
                     expected -{rank}..{rank}"
                ),
            )),
        }
    }

    /// Row-major (C-contiguous) strides, in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut strides = vec![1usize; self.rank()];
        let mut acc = 1usize;
        for (stride, &d) in strides.iter_mut().zip(&self.0).rev() {
            *stride = acc;
            acc = acc.saturating_mul(d);
        }
        strides
    }

    /// The dimensions as `i64`, as native libraries expect them.
    ///
    /// Fails only for a dimension above `i64::MAX`.
    pub fn to_i64_vec(&self) -> Result<Vec<i64>> {
        self.0
            .iter()
            .map(|&d| {
                i64::try_from(d).map_err(|_| {
                    Error::invalid_argument(
                        "shape",
                        format!("dimension {d} of {self} does not fit in i64"),
                    )
                })
            })
            .collect()
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

impl From<Vec<usize>> for Shape {
    fn from(dims: Vec<usize>) -> Self {
        Shape(dims)
    }
}

impl From<&[usize]> for Shape {
    fn from(dims: &[usize]) -> Self {
        Shape(dims.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(dims: [usize; N]) -> Self {
        Shape(dims.to_vec())
    }
}

impl From<()> for Shape {
    fn from((): ()) -> Self {
        Shape::scalar()
    }
}

impl From<&Shape> for Shape {
    fn from(shape: &Shape) -> Self {
        shape.clone()
    }
}

impl TryFrom<&[i64]> for Shape {
    type Error = Error;

    /// Converts dimensions from a native library; negative dimensions are rejected.
    fn try_from(dims: &[i64]) -> Result<Self> {
        dims.iter()
            .map(|&d| {
                usize::try_from(d).map_err(|_| {
                    Error::invalid_argument(
                        "shape",
                        format!("dimension {d} in {dims:?} is negative or too large; expected sizes >= 0"),
                    )
                })
            })
            .collect::<Result<Vec<usize>>>()
            .map(Shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numel_and_rank() {
        assert_eq!(Shape::from([2, 3, 4]).numel(), 24);
        assert_eq!(Shape::from([5, 0, 7]).numel(), 0);
        assert_eq!(Shape::from(()).numel(), 1);
        assert_eq!(Shape::from(()).rank(), 0);
        assert_eq!(Shape::default(), Shape::scalar());
        assert_eq!(Shape::from(vec![7]).rank(), 1);
    }

    #[test]
    fn checked_numel_detects_overflow() {
        let huge = Shape::from([usize::MAX, 2]);
        assert_eq!(huge.checked_numel(), None);
        assert_eq!(huge.numel(), usize::MAX);
        // A zero anywhere makes the product 0, even with a huge dimension.
        assert_eq!(Shape::from([0, usize::MAX]).checked_numel(), Some(0));
        assert_eq!(Shape::from([3, 5]).checked_numel(), Some(15));
    }

    #[test]
    fn dim_with_positive_and_negative_axes() -> Result<()> {
        let s = Shape::from([2, 3, 4]);
        assert_eq!(s.dim(0)?, 2);
        assert_eq!(s.dim(2)?, 4);
        assert_eq!(s.dim(-1)?, 4);
        assert_eq!(s.dim(-3)?, 2);
        for bad in [3, -4, isize::MIN, isize::MAX] {
            let err = s.dim(bad).expect_err("axis out of range");
            let msg = err.to_string();
            assert!(msg.contains(&format!("axis {bad}")), "{msg}");
            assert!(msg.contains("[2, 3, 4]") && msg.contains("-3..3"), "{msg}");
        }
        assert!(Shape::scalar().dim(0).is_err());
        assert!(Shape::scalar().dim(-1).is_err());
        Ok(())
    }

    #[test]
    fn strides_are_row_major() {
        assert_eq!(Shape::from([2, 3, 4]).strides(), vec![12, 4, 1]);
        assert_eq!(Shape::from([5]).strides(), vec![1]);
        assert_eq!(Shape::scalar().strides(), Vec::<usize>::new());
        assert_eq!(Shape::from([3, 0, 2]).strides(), vec![0, 2, 1]);
    }

    #[test]
    fn i64_round_trip() -> Result<()> {
        let s = Shape::from([2, 3]);
        let v = s.to_i64_vec()?;
        assert_eq!(v, vec![2i64, 3]);
        assert_eq!(Shape::try_from(v.as_slice())?, s);
        assert_eq!(Shape::try_from(&[] as &[i64])?, Shape::scalar());
        Ok(())
    }

    #[test]
    fn negative_i64_dims_are_rejected() {
        let err = Shape::try_from(&[2i64, -1][..]).expect_err("negative dim");
        assert!(matches!(err, Error::InvalidArgument { .. }));
        assert!(err.to_string().contains("dimension -1 in [2, -1]"), "{err}");
    }

    #[test]
    fn conversions_and_display() {
        let dims: &[usize] = &[4, 1];
        assert_eq!(Shape::from(dims).dims(), &[4, 1]);
        assert_eq!(Shape::from(vec![4, 1]), Shape::new(vec![4, 1]));
        assert_eq!(Shape::from(&Shape::from([9])), Shape::from([9]));
        assert_eq!(Shape::from([2, 3]).to_string(), "[2, 3]");
        assert_eq!(Shape::from([10]).to_string(), "[10]");
        assert_eq!(Shape::scalar().to_string(), "[]");
    }
}
