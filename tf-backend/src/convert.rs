//! [`HostTensor`] to and from TensorFlow tensors: one copy each way, shape and dtype kept.

use kiln_core::{dtype::Element, DType, Error, HostTensor, Result, Shape};
use tensorflow::{DataType, Tensor, TensorType};

use crate::error::tf_error;

/// A TensorFlow tensor of any dtype Kiln has a host type for.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum TfTensor {
    /// `uint8`.
    U8(Tensor<u8>),
    /// `int32`.
    I32(Tensor<i32>),
    /// `int64`.
    I64(Tensor<i64>),
    /// `float32`.
    F32(Tensor<f32>),
    /// `float64`.
    F64(Tensor<f64>),
}

impl TfTensor {
    /// Copies a host tensor into a TensorFlow tensor of the same dtype and shape.
    pub fn from_host(host: &HostTensor) -> Result<Self> {
        Ok(match host.dtype() {
            DType::U8 => Self::U8(to_tf(host)?),
            DType::I32 => Self::I32(to_tf(host)?),
            DType::I64 => Self::I64(to_tf(host)?),
            DType::F32 => Self::F32(to_tf(host)?),
            DType::F64 => Self::F64(to_tf(host)?),
            other => return Err(Error::unsupported(format!("{other} tensors in TensorFlow"))),
        })
    }

    /// Copies this tensor back into host memory.
    pub fn to_host(&self) -> Result<HostTensor> {
        match self {
            Self::U8(t) => from_tf(t),
            Self::I32(t) => from_tf(t),
            Self::I64(t) => from_tf(t),
            Self::F32(t) => from_tf(t),
            Self::F64(t) => from_tf(t),
        }
    }

    /// The Kiln dtype.
    pub fn dtype(&self) -> DType {
        match self {
            Self::U8(_) => DType::U8,
            Self::I32(_) => DType::I32,
            Self::I64(_) => DType::I64,
            Self::F32(_) => DType::F32,
            Self::F64(_) => DType::F64,
        }
    }

    /// The TensorFlow dtype.
    pub fn data_type(&self) -> DataType {
        match self {
            Self::U8(_) => DataType::UInt8,
            Self::I32(_) => DataType::Int32,
            Self::I64(_) => DataType::Int64,
            Self::F32(_) => DataType::Float,
            Self::F64(_) => DataType::Double,
        }
    }

    /// The shape.
    pub fn shape(&self) -> Shape {
        let dims = match self {
            Self::U8(t) => t.dims(),
            Self::I32(t) => t.dims(),
            Self::I64(t) => t.dims(),
            Self::F32(t) => t.dims(),
            Self::F64(t) => t.dims(),
        };
        Shape::new(dims.iter().map(|&d| d as usize).collect())
    }
}

/// Copies a host tensor into a `tensorflow::Tensor<T>`; the host dtype must be `T`'s.
pub fn to_tf<T: Element + TensorType>(host: &HostTensor) -> Result<Tensor<T>> {
    let values = host.as_slice::<T>().map_err(|_| Error::DTypeMismatch {
        context: "converting a host tensor to TensorFlow".to_owned(),
        expected: T::DTYPE,
        actual: host.dtype(),
    })?;
    let dims: Vec<u64> = host.dims().iter().map(|&d| d as u64).collect();
    Tensor::new(&dims)
        .with_values(values)
        .map_err(|status| tf_error("creating a TensorFlow tensor from host data", status))
}

/// Copies a `tensorflow::Tensor<T>` into a host tensor of the same shape.
pub fn from_tf<T: Element + TensorType>(tensor: &Tensor<T>) -> Result<HostTensor> {
    let shape = Shape::new(tensor.dims().iter().map(|&d| d as usize).collect());
    HostTensor::from_slice(tensor, shape)
}
