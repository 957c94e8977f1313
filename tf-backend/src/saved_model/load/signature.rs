//! What a SavedModel signature takes and returns, in Kiln's terms.

use std::fmt;

use kiln_core::DType;
use tensorflow::DataType;

/// The element type of a signature's tensor: a Kiln [`DType`] when Kiln has one,
/// otherwise TensorFlow's name for it (such tensors can be listed but not fed or
/// fetched).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TensorDType {
    /// A dtype a [`HostTensor`](kiln_core::HostTensor) can hold.
    Kiln(DType),
    /// A TensorFlow dtype Kiln has no host type for: `string`, `bool`, `f16`, ...
    Other(String),
}

impl TensorDType {
    /// The Kiln dtype, or `None` for a TensorFlow-only dtype.
    pub fn kiln(&self) -> Option<DType> {
        match self {
            Self::Kiln(dtype) => Some(*dtype),
            Self::Other(_) => None,
        }
    }

    pub(crate) fn from_tf(data_type: DataType) -> Self {
        let other = match data_type {
            DataType::Float => return Self::Kiln(DType::F32),
            DataType::Double => return Self::Kiln(DType::F64),
            DataType::Int32 => return Self::Kiln(DType::I32),
            DataType::Int64 => return Self::Kiln(DType::I64),
            DataType::UInt8 => return Self::Kiln(DType::U8),
            DataType::Int8 => "i8",
            DataType::Int16 => "i16",
            DataType::UInt16 => "u16",
            DataType::UInt32 => "u32",
            DataType::UInt64 => "u64",
            DataType::Half => "f16",
            DataType::BFloat16 => "bf16",
            DataType::Bool => "bool",
            DataType::String => "string",
            DataType::Complex64 => "c64",
            DataType::Complex128 => "c128",
            DataType::Resource => "resource",
            DataType::Variant => "variant",
            other => return Self::Other(other.to_string().to_ascii_lowercase()),
        };
        Self::Other(other.to_owned())
    }
}

/// Short Rust-style names (`f32`, `i64`), as in `f32[?, 8]`.
impl fmt::Display for TensorDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Kiln(DType::U8) => f.write_str("u8"),
            Self::Kiln(DType::I32) => f.write_str("i32"),
            Self::Kiln(DType::I64) => f.write_str("i64"),
            Self::Kiln(DType::F32) => f.write_str("f32"),
            Self::Kiln(DType::F64) => f.write_str("f64"),
            Self::Kiln(other) => write!(f, "{other}"),
            Self::Other(name) => f.write_str(name),
        }
    }
}

impl From<DType> for TensorDType {
    fn from(dtype: DType) -> Self {
        Self::Kiln(dtype)
    }
}

/// One named input or output of a signature.
///
/// Displays as `x: f32[?, 8]`: `?` is a dimension of unknown size, `[...]` a shape
/// of unknown rank and `[]` a scalar.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TensorSpec {
    /// The signature's name for it (`x`, `output_0`, `loss`).
    pub name: String,
    /// The element type.
    pub dtype: TensorDType,
    /// The shape: `None` when even the rank is unknown; a `None` dimension has an
    /// unknown (any) size, usually the batch dimension.
    pub shape: Option<Vec<Option<usize>>>,
    /// The graph tensor it is bound to (`serving_default_x:0`,
    /// `StatefulPartitionedCall_1:0`).
    pub tensor: String,
}

impl TensorSpec {
    /// Whether a tensor of `dims` fits the shape (known dimensions equal, rank equal
    /// when known).
    pub fn accepts(&self, dims: &[usize]) -> bool {
        match &self.shape {
            None => true,
            Some(shape) => {
                shape.len() == dims.len()
                    && shape.iter().zip(dims).all(|(want, &got)| match want {
                        Some(size) => *size == got,
                        None => true,
                    })
            }
        }
    }

    /// The shape as text: `[?, 8]`, `[]`, or `[...]` for an unknown rank.
    pub fn shape_string(&self) -> String {
        ShapeText(&self.shape).to_string()
    }
}

impl fmt::Display for TensorSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}{}", self.name, self.dtype, ShapeText(&self.shape))
    }
}

struct ShapeText<'a>(&'a Option<Vec<Option<usize>>>);

impl fmt::Display for ShapeText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(dims) = self.0 else {
            return f.write_str("[...]");
        };
        f.write_str("[")?;
        for (i, dim) in dims.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            match dim {
                Some(size) => write!(f, "{size}")?,
                None => f.write_str("?")?,
            }
        }
        f.write_str("]")
    }
}

/// A signature of a SavedModel: a named function from input tensors to output
/// tensors (Keras's export endpoints, `serving_default`, ...).
///
/// Displays on one line as
/// `serving_default: inputs x: f32[?, 8] -> outputs output_0: f32[?, 3]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SignatureInfo {
    /// The signature key (`serving_default`, `serve`, `train`).
    pub name: String,
    /// The method name recorded with it (`tensorflow/serving/predict` for TF2
    /// exports).
    pub method_name: String,
    /// The inputs, sorted by name.
    pub inputs: Vec<TensorSpec>,
    /// The outputs, sorted by name.
    pub outputs: Vec<TensorSpec>,
}

impl SignatureInfo {
    /// The input called `name`.
    pub fn input(&self, name: &str) -> Option<&TensorSpec> {
        self.inputs.iter().find(|spec| spec.name == name)
    }

    /// The output called `name`.
    pub fn output(&self, name: &str) -> Option<&TensorSpec> {
        self.outputs.iter().find(|spec| spec.name == name)
    }

    /// The output names, comma-separated, for messages.
    pub(crate) fn output_names(&self) -> String {
        names(&self.outputs)
    }
}

fn names(specs: &[TensorSpec]) -> String {
    if specs.is_empty() {
        return "(none)".to_owned();
    }
    specs
        .iter()
        .map(|spec| spec.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

impl fmt::Display for SignatureInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: inputs ", self.name)?;
        write_specs(f, &self.inputs)?;
        f.write_str(" -> outputs ")?;
        write_specs(f, &self.outputs)
    }
}

fn write_specs(f: &mut fmt::Formatter<'_>, specs: &[TensorSpec]) -> fmt::Result {
    if specs.is_empty() {
        return f.write_str("(none)");
    }
    for (i, spec) in specs.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{spec}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, dtype: TensorDType, shape: Option<Vec<Option<usize>>>) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            shape,
            tensor: format!("sig_{name}:0"),
        }
    }

    #[test]
    fn display_uses_question_marks_for_unknown_sizes() {
        let info = SignatureInfo {
            name: "train".into(),
            method_name: "tensorflow/serving/predict".into(),
            inputs: vec![
                spec("x", DType::F32.into(), Some(vec![None, Some(8)])),
                spec("y", DType::I32.into(), Some(vec![None])),
            ],
            outputs: vec![spec("loss", DType::F32.into(), Some(vec![]))],
        };
        assert_eq!(
            info.to_string(),
            "train: inputs x: f32[?, 8], y: i32[?] -> outputs loss: f32[]"
        );
        let any = spec("s", TensorDType::from_tf(DataType::String), None);
        assert_eq!(any.to_string(), "s: string[...]");
    }

    #[test]
    fn accepts_checks_rank_and_known_sizes() {
        let x = spec("x", DType::F32.into(), Some(vec![None, Some(8)]));
        assert!(x.accepts(&[4, 8]));
        assert!(x.accepts(&[0, 8]));
        assert!(!x.accepts(&[4, 7]));
        assert!(!x.accepts(&[8]));
        assert!(spec("x", DType::F32.into(), None).accepts(&[1, 2, 3]));
    }

    #[test]
    fn tf_dtypes_map_to_kiln_where_possible() {
        assert_eq!(
            TensorDType::from_tf(DataType::Float).kiln(),
            Some(DType::F32)
        );
        assert_eq!(
            TensorDType::from_tf(DataType::Int64).kiln(),
            Some(DType::I64)
        );
        assert_eq!(
            TensorDType::from_tf(DataType::Bool),
            TensorDType::Other("bool".into())
        );
    }
}
