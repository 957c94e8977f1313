//! The element types a kernel is generic over.

use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, DivAssign, Mul, MulAssign, Neg, Sub, SubAssign};

/// An element type of the tensors an op reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FloatType {
    /// `f32`, PyTorch's `torch.float32`, TensorFlow's `DT_FLOAT`.
    F32,
    /// `f64`, PyTorch's `torch.float64`, TensorFlow's `DT_DOUBLE`.
    F64,
}

impl FloatType {
    /// PyTorch's name for it (`float32`, `float64`).
    pub fn name(self) -> &'static str {
        match self {
            FloatType::F32 => "float32",
            FloatType::F64 => "float64",
        }
    }
}

/// `f32` or `f64`: the arithmetic a kernel needs, with the same meaning as the
/// inherent methods of the primitive types.
pub trait Float:
    Copy
    + Send
    + Sync
    + Default
    + Debug
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
    + 'static
{
    /// Which type this is.
    const TYPE: FloatType;
    /// `0`.
    const ZERO: Self;
    /// `1`.
    const ONE: Self;
    /// The nearest value of this type.
    fn from_f64(v: f64) -> Self;
    /// This value as `f64` (exact).
    fn to_f64(self) -> f64;
    /// Square root.
    fn sqrt(self) -> Self;
    /// `e^self`.
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// Hyperbolic tangent.
    fn tanh(self) -> Self;
    /// Absolute value.
    fn abs(self) -> Self;
    /// The larger of the two (the other one when one is NaN).
    fn max(self, other: Self) -> Self;
    /// The smaller of the two (the other one when one is NaN).
    fn min(self, other: Self) -> Self;
    /// `self * a + b` with one rounding.
    fn mul_add(self, a: Self, b: Self) -> Self;
}

macro_rules! impl_float {
    ($t:ty, $kind:ident) => {
        impl Float for $t {
            const TYPE: FloatType = FloatType::$kind;
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn to_f64(self) -> f64 {
                f64::from(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
            fn min(self, other: Self) -> Self {
                <$t>::min(self, other)
            }
            fn mul_add(self, a: Self, b: Self) -> Self {
                <$t>::mul_add(self, a, b)
            }
        }
    };
}

impl_float!(f32, F32);
impl_float!(f64, F64);
