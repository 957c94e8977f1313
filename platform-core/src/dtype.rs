//! Element types of tensors.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The element type of a tensor.
///
/// ```
/// use kiln_core::DType;
///
/// let dt: DType = "float".parse()?;
/// assert_eq!(dt, DType::F32);
/// assert_eq!(dt.to_string(), "float32");
/// assert_eq!(dt.size_in_bytes(), 4);
/// assert_eq!(dt.safetensors_name(), "F32");
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// Unsigned 8-bit integer (`u8`).
    U8,
    /// Signed 32-bit integer (`i32`).
    I32,
    /// Signed 64-bit integer (`i64`), the usual index and label type.
    I64,
    /// 32-bit float (`f32`), the usual parameter type.
    F32,
    /// 64-bit float (`f64`).
    F64,
    /// Brain floating point (`half::bf16`): f32's range with 8 bits of mantissa,
    /// the usual mixed-precision type on recent GPUs and CPUs.
    BF16,
    /// IEEE half precision (`half::f16`).
    F16,
}

/// Every dtype, in declaration order.
const ALL: [DType; 7] = [
    DType::U8,
    DType::I32,
    DType::I64,
    DType::F32,
    DType::F64,
    DType::BF16,
    DType::F16,
];

impl DType {
    /// Size of one element in bytes.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::BF16 | DType::F16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }

    /// PyTorch-style lowercase name: `"uint8"`, `"int32"`, `"int64"`, `"float32"`,
    /// `"float64"`, `"bfloat16"`, `"float16"`.
    pub const fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
        }
    }

    /// Name used in safetensors headers: `"U8"`, `"I32"`, `"I64"`, `"F32"`, `"F64"`,
    /// `"BF16"`, `"F16"`.
    pub const fn safetensors_name(self) -> &'static str {
        match self {
            DType::U8 => "U8",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::BF16 => "BF16",
            DType::F16 => "F16",
        }
    }

    /// The dtype whose [`safetensors_name`](DType::safetensors_name) is exactly
    /// `name` (a file's header is not parsed as leniently as [`str::parse`]).
    ///
    /// ```
    /// use kiln_core::DType;
    ///
    /// assert_eq!(DType::from_safetensors_name("I64"), Some(DType::I64));
    /// assert_eq!(DType::from_safetensors_name("BF16"), Some(DType::BF16));
    /// assert_eq!(DType::from_safetensors_name("F8_E4M3"), None);
    /// ```
    pub fn from_safetensors_name(name: &str) -> Option<Self> {
        ALL.into_iter().find(|d| d.safetensors_name() == name)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;

    /// Parses a PyTorch name (`"float32"`), a Rust name (`"f32"`), a C-style alias
    /// (`"float"`, `"double"`, `"int"`, `"long"`) or a safetensors name (`"F32"`);
    /// matching ignores ASCII case.
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        let dtype = match lower.as_str() {
            "uint8" | "u8" => DType::U8,
            "int32" | "i32" | "int" => DType::I32,
            "int64" | "i64" | "long" => DType::I64,
            "float32" | "f32" | "float" => DType::F32,
            "float64" | "f64" | "double" => DType::F64,
            "bfloat16" | "bf16" => DType::BF16,
            "float16" | "f16" | "half" => DType::F16,
            _ => {
                let names: Vec<&str> = ALL.iter().map(|d| d.name()).collect();
                return Err(Error::invalid_argument(
                    "dtype",
                    format!(
                        "unknown dtype `{s}`; expected one of {} \
                         (or u8, i32, i64, f32, f64, bf16, f16, int, long, float, double, half)",
                        names.join(", ")
                    ),
                ));
            }
        };
        Ok(dtype)
    }
}

/// Serialized as the PyTorch-style name (`"float32"`).
impl serde::Serialize for DType {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

/// Accepts every spelling [`DType::from_str`] accepts.
impl<'de> serde::Deserialize<'de> for DType {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

mod sealed {
    /// Prevents implementations of [`Element`](super::Element) outside this crate.
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// A Rust type that can be stored in a [`HostTensor`](crate::HostTensor).
///
/// Implemented for `u8`, `i32`, `i64`, `f32`, `f64`, [`half::bf16`] and
/// [`half::f16`]; sealed.
///
/// ```
/// use kiln_core::{dtype::Element, DType};
///
/// assert_eq!(<f32 as Element>::DTYPE, DType::F32);
/// assert_eq!(<i64 as Element>::DTYPE, DType::I64);
/// ```
pub trait Element:
    sealed::Sealed + bytemuck::Pod + Copy + Send + Sync + fmt::Debug + PartialEq + 'static
{
    /// The dtype corresponding to this Rust type.
    const DTYPE: DType;
}

impl Element for u8 {
    const DTYPE: DType = DType::U8;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_float_flags() {
        let sizes: Vec<usize> = ALL.iter().map(|d| d.size_in_bytes()).collect();
        assert_eq!(sizes, vec![1, 4, 8, 4, 8, 2, 2]);
        let floats: Vec<bool> = ALL.iter().map(|d| d.is_float()).collect();
        assert_eq!(floats, vec![false, false, false, true, true, true, true]);
        assert_eq!(std::mem::size_of::<i64>(), DType::I64.size_in_bytes());
    }

    #[test]
    fn names_and_display() {
        let names: Vec<String> = ALL.iter().map(ToString::to_string).collect();
        assert_eq!(
            names,
            ["uint8", "int32", "int64", "float32", "float64", "bfloat16", "float16"]
        );
        let st: Vec<&str> = ALL.iter().map(|d| d.safetensors_name()).collect();
        assert_eq!(st, ["U8", "I32", "I64", "F32", "F64", "BF16", "F16"]);
    }

    #[test]
    fn parse_accepts_names_and_aliases() -> Result<()> {
        for d in ALL {
            assert_eq!(d.name().parse::<DType>()?, d);
            assert_eq!(d.safetensors_name().parse::<DType>()?, d);
        }
        let cases = [
            ("u8", DType::U8),
            ("i32", DType::I32),
            ("int", DType::I32),
            ("i64", DType::I64),
            ("long", DType::I64),
            ("f32", DType::F32),
            ("float", DType::F32),
            ("f64", DType::F64),
            ("double", DType::F64),
            ("bf16", DType::BF16),
            ("half", DType::F16),
            (" Float32 ", DType::F32),
        ];
        for (s, d) in cases {
            assert_eq!(s.parse::<DType>()?, d, "parsing {s:?}");
        }
        Ok(())
    }

    #[test]
    fn parse_rejects_unknown_and_lists_allowed() {
        let err = "float8"
            .parse::<DType>()
            .expect_err("float8 is not supported");
        let msg = err.to_string();
        assert!(matches!(err, Error::InvalidArgument { ref name, .. } if name == "dtype"));
        assert!(msg.contains("`float8`"), "{msg}");
        assert!(
            msg.contains("uint8, int32, int64, float32, float64, bfloat16, float16"),
            "{msg}"
        );
    }

    #[test]
    fn serde_uses_torch_names() -> Result<()> {
        let json = serde_json::to_string(&[DType::F32, DType::I64])
            .map_err(|e| Error::invalid_argument("json", e.to_string()))?;
        assert_eq!(json, r#"["float32","int64"]"#);
        let back: Vec<DType> = serde_json::from_str(r#"["float32", "long", "U8"]"#)
            .map_err(|e| Error::invalid_argument("json", e.to_string()))?;
        assert_eq!(back, [DType::F32, DType::I64, DType::U8]);
        let err = serde_json::from_str::<DType>(r#""fp8""#).expect_err("unknown");
        assert!(err.to_string().contains("unknown dtype `fp8`"), "{err}");
        Ok(())
    }

    #[test]
    fn element_dtypes() {
        assert_eq!(<u8 as Element>::DTYPE, DType::U8);
        assert_eq!(<i32 as Element>::DTYPE, DType::I32);
        assert_eq!(<i64 as Element>::DTYPE, DType::I64);
        assert_eq!(<f32 as Element>::DTYPE, DType::F32);
        assert_eq!(<f64 as Element>::DTYPE, DType::F64);
    }
}
