//! Scalar attributes: an op's non-tensor arguments (an epsilon, a slope).

use crate::{OpError, OpSchema};

/// The type of an attribute: `float` (f64), `int` (i64) or `bool`, as in both
/// engines' schemas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttrKind {
    /// A 64-bit float: `float` in PyTorch's schemas, `float` in TensorFlow's
    /// (which stores it as f32).
    Float,
    /// A 64-bit integer: `int` in both.
    Int,
    /// `bool` in both.
    Bool,
}

/// The value of an attribute.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttrValue {
    /// A float.
    Float(f64),
    /// An integer.
    Int(i64),
    /// A boolean.
    Bool(bool),
}

impl AttrValue {
    /// Its type.
    pub fn kind(self) -> AttrKind {
        match self {
            AttrValue::Float(_) => AttrKind::Float,
            AttrValue::Int(_) => AttrKind::Int,
            AttrValue::Bool(_) => AttrKind::Bool,
        }
    }

    /// A number from a config file (where every attribute is a number) as a
    /// value of `kind`: an `int` must be integral, a `bool` 0 or 1.
    pub fn from_number(kind: AttrKind, v: f64) -> Option<AttrValue> {
        match kind {
            AttrKind::Float => Some(AttrValue::Float(v)),
            AttrKind::Int => {
                (v.fract() == 0.0 && v.abs() < 9.0e15).then_some(AttrValue::Int(v as i64))
            }
            AttrKind::Bool => match v {
                0.0 => Some(AttrValue::Bool(false)),
                1.0 => Some(AttrValue::Bool(true)),
                _ => None,
            },
        }
    }
}

impl AttrKind {
    /// The type's name in schemas (`float`, `int`, `bool`).
    pub fn name(self) -> &'static str {
        match self {
            AttrKind::Float => "float",
            AttrKind::Int => "int",
            AttrKind::Bool => "bool",
        }
    }
}

/// An attribute of an op's schema: its name and default value (which gives its type).
#[derive(Debug, Clone, PartialEq)]
pub struct AttrDef {
    /// The name, an identifier.
    pub name: String,
    /// The value when the caller gives none.
    pub default: AttrValue,
}

/// The attribute values one call of an op sees, in schema order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Attrs {
    values: Vec<(String, AttrValue)>,
}

impl Attrs {
    /// Every attribute of `schema` at its default.
    pub fn defaults(schema: &OpSchema) -> Self {
        Attrs {
            values: schema
                .attrs
                .iter()
                .map(|a| (a.name.clone(), a.default))
                .collect(),
        }
    }

    /// The schema's attributes with some set from numbers, as a model file
    /// gives them (every attribute a number): a float as is, an int when
    /// integral, a bool as 0 or 1. The others keep their defaults.
    ///
    /// An unknown name, or a number its type cannot hold, is an error returned
    /// with the attribute's name.
    ///
    /// ```
    /// use kiln_custom_op::{AttrValue, Attrs, OpSchema};
    ///
    /// let schema = OpSchema::new("ns", "op").input("x").output("y").attr("k", AttrValue::Int(3));
    /// let attrs = Attrs::from_numbers(&schema, [("k", 5.0)]).unwrap();
    /// assert_eq!(attrs.int("k").unwrap(), 5);
    /// let (name, err) = Attrs::from_numbers(&schema, [("k", 1.5)]).unwrap_err();
    /// assert_eq!(name, "k");
    /// assert!(err.to_string().contains("not a valid int"));
    /// ```
    pub fn from_numbers<'a>(
        schema: &OpSchema,
        numbers: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> Result<Attrs, (String, OpError)> {
        let mut attrs = Attrs::defaults(schema);
        for (name, number) in numbers {
            let fail = |message: String| (name.to_owned(), OpError::new(message));
            let def = schema
                .attrs
                .iter()
                .find(|a| a.name == name)
                .ok_or_else(|| {
                    let names: Vec<&str> = schema.attrs.iter().map(|a| a.name.as_str()).collect();
                    fail(format!(
                        "`{}` has no attribute `{name}`; it has {names:?}",
                        schema.qualified_name()
                    ))
                })?;
            let kind = def.default.kind();
            let value = AttrValue::from_number(kind, number).ok_or_else(|| {
                fail(format!(
                    "expected a value of kind {kind}, got {number}: not a valid {kind} (an int \
                     must be integral, a bool 0 or 1)",
                    kind = kind.name()
                ))
            })?;
            attrs.set(name, value).map_err(|e| (name.to_owned(), e))?;
        }
        Ok(attrs)
    }

    /// Sets `name`, which must exist with `value`'s type.
    pub fn set(&mut self, name: &str, value: AttrValue) -> Result<(), OpError> {
        let names = self.names();
        let slot = self
            .values
            .iter_mut()
            .find(|(n, _)| n == name)
            .ok_or_else(|| OpError::new(format!("no attribute `{name}`; the op has [{names}]")))?;
        if slot.1.kind() != value.kind() {
            return Err(OpError::new(format!(
                "attribute `{name}` is {}, got a {} value",
                slot.1.kind().name(),
                value.kind().name()
            )));
        }
        slot.1 = value;
        Ok(())
    }

    /// The attributes in schema order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, AttrValue)> + '_ {
        self.values.iter().map(|(n, v)| (n.as_str(), *v))
    }

    /// The value of `name`.
    pub fn get(&self, name: &str) -> Result<AttrValue, OpError> {
        self.values
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
            .ok_or_else(|| {
                OpError::new(format!(
                    "no attribute `{name}`; the op has [{}]",
                    self.names()
                ))
            })
    }

    /// The float attribute `name`.
    pub fn float(&self, name: &str) -> Result<f64, OpError> {
        match self.get(name)? {
            AttrValue::Float(v) => Ok(v),
            other => Err(self.wrong_kind(name, AttrKind::Float, other)),
        }
    }

    /// The int attribute `name`.
    pub fn int(&self, name: &str) -> Result<i64, OpError> {
        match self.get(name)? {
            AttrValue::Int(v) => Ok(v),
            other => Err(self.wrong_kind(name, AttrKind::Int, other)),
        }
    }

    /// The bool attribute `name`.
    pub fn bool(&self, name: &str) -> Result<bool, OpError> {
        match self.get(name)? {
            AttrValue::Bool(v) => Ok(v),
            other => Err(self.wrong_kind(name, AttrKind::Bool, other)),
        }
    }

    fn wrong_kind(&self, name: &str, asked: AttrKind, got: AttrValue) -> OpError {
        OpError::new(format!(
            "attribute `{name}` is {}, read as {}",
            got.kind().name(),
            asked.name()
        ))
    }

    fn names(&self) -> String {
        self.values
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}
