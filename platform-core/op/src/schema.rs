//! An op's schema: what both engines are told about it.

use crate::attrs::{AttrDef, AttrKind, AttrValue};
use crate::OpError;

/// What the gradient op receives besides the gradients of the outputs.
///
/// The gradient op of an op with inputs `x1..xn` and outputs `y1..ym` takes,
/// in this order, `grad_y1..grad_ym`, then `x1..xn`, then (with
/// [`Saved::InputsAndOutputs`]) `y1..ym`, and the same attributes; it returns
/// `grad_x1..grad_xn`, each of its input's shape. A gradient an engine does not
/// have (an output nobody used) arrives as zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saved {
    /// The forward inputs are kept for the backward pass.
    Inputs,
    /// The forward inputs and outputs are kept (saves recomputing an output
    /// the gradient needs, at the cost of keeping it alive).
    InputsAndOutputs,
}

/// The op that computes an op's gradient, in the same namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gradient {
    /// Its name, without the namespace.
    pub op: String,
    /// What it receives besides the output gradients.
    pub saves: Saved,
}

/// An op's name, tensor arguments, attributes and gradient.
///
/// ```
/// use kiln_custom_op::{AttrValue, OpSchema, Saved};
///
/// let schema = OpSchema::new("my_ops", "rms_norm")
///     .input("x")
///     .input("weight")
///     .output("y")
///     .attr("eps", AttrValue::Float(1e-6))
///     .gradient("rms_norm_backward", Saved::Inputs);
/// assert_eq!(schema.torch_schema(), "rms_norm(Tensor x, Tensor weight, float eps=1e-06) -> Tensor");
/// assert_eq!(schema.tf_op_name(), "MyOpsRmsNorm");
/// schema.validate()?;
/// # Ok::<(), kiln_custom_op::OpError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct OpSchema {
    /// The namespace, as in `torch.ops.<namespace>.<name>`.
    pub namespace: String,
    /// The op's name in its namespace.
    pub name: String,
    /// The tensor inputs' names, in order.
    pub inputs: Vec<String>,
    /// The tensor outputs' names, in order.
    pub outputs: Vec<String>,
    /// The scalar attributes, in order (after the inputs in libtorch's schema).
    pub attrs: Vec<AttrDef>,
    /// The op computing the gradient, or `None` for an op that is not differentiated.
    pub gradient: Option<Gradient>,
}

impl OpSchema {
    /// An op `namespace::name` with no arguments yet.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        OpSchema {
            namespace: namespace.into(),
            name: name.into(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            attrs: Vec::new(),
            gradient: None,
        }
    }

    /// Adds a tensor input.
    pub fn input(mut self, name: impl Into<String>) -> Self {
        self.inputs.push(name.into());
        self
    }

    /// Adds a tensor output.
    pub fn output(mut self, name: impl Into<String>) -> Self {
        self.outputs.push(name.into());
        self
    }

    /// Adds an attribute with its default (whose variant is its type).
    pub fn attr(mut self, name: impl Into<String>, default: AttrValue) -> Self {
        self.attrs.push(AttrDef {
            name: name.into(),
            default,
        });
        self
    }

    /// Names the op (in this namespace) that computes the gradient.
    pub fn gradient(mut self, op: impl Into<String>, saves: Saved) -> Self {
        self.gradient = Some(Gradient {
            op: op.into(),
            saves,
        });
        self
    }

    /// `namespace::name`, as Kiln's layers and libtorch's dispatcher name it.
    pub fn qualified_name(&self) -> String {
        format!("{}::{}", self.namespace, self.name)
    }

    /// The gradient op's `namespace::name`.
    pub fn gradient_qualified_name(&self) -> Option<String> {
        self.gradient
            .as_ref()
            .map(|g| format!("{}::{}", self.namespace, g.op))
    }

    /// The schema string libtorch parses: `name(Tensor x, float eps=1e-06) -> Tensor`.
    pub fn torch_schema(&self) -> String {
        let mut args: Vec<String> = self.inputs.iter().map(|i| format!("Tensor {i}")).collect();
        args.extend(self.attrs.iter().map(|a| {
            let default = match a.default {
                AttrValue::Float(v) => format_float(v),
                AttrValue::Int(v) => v.to_string(),
                AttrValue::Bool(true) => "True".to_owned(),
                AttrValue::Bool(false) => "False".to_owned(),
            };
            format!("{} {}={default}", a.default.kind().name(), a.name)
        }));
        let returns = if self.outputs.len() == 1 {
            "Tensor".to_owned()
        } else {
            format!("({})", vec!["Tensor"; self.outputs.len()].join(", "))
        };
        format!("{}({}) -> {returns}", self.name, args.join(", "))
    }

    /// The TensorFlow op type: the namespace and name in CamelCase
    /// (`my_ops::rms_norm` is `MyOpsRmsNorm`), as TensorFlow requires.
    pub fn tf_op_name(&self) -> String {
        camel(&self.namespace) + &camel(&self.name)
    }

    /// The gradient op's TensorFlow op type.
    pub fn tf_gradient_op_name(&self) -> Option<String> {
        self.gradient
            .as_ref()
            .map(|g| camel(&self.namespace) + &camel(&g.op))
    }

    /// Checks the names (lowercase identifiers, as TensorFlow requires, and no
    /// name used twice), that there is at least one input and one output, and
    /// that float defaults are finite.
    pub fn validate(&self) -> Result<(), OpError> {
        let op = self.qualified_name();
        let fail = |what: String| Err(OpError::new(format!("op schema `{op}`: {what}")));
        for (what, name) in [("namespace", &self.namespace), ("name", &self.name)] {
            if !is_identifier(name) {
                return fail(format!(
                    "the {what} `{name}` is not a lowercase identifier ([a-z][a-z0-9_]*)"
                ));
            }
        }
        if self.inputs.is_empty() || self.outputs.is_empty() {
            return fail("an op needs at least one input and one output".to_owned());
        }
        let mut seen: Vec<&str> = Vec::new();
        let names = self
            .inputs
            .iter()
            .chain(&self.outputs)
            .chain(self.attrs.iter().map(|a| &a.name));
        for name in names {
            if !is_identifier(name) {
                return fail(format!(
                    "the argument `{name}` is not a lowercase identifier ([a-z][a-z0-9_]*)"
                ));
            }
            if seen.contains(&name.as_str()) {
                return fail(format!("the name `{name}` is used twice"));
            }
            seen.push(name);
        }
        for a in &self.attrs {
            if matches!(a.default, AttrValue::Float(v) if !v.is_finite()) {
                return fail(format!("the default of `{}` is not finite", a.name));
            }
        }
        if let Some(g) = &self.gradient {
            if !is_identifier(&g.op) || g.op == self.name {
                return fail(format!(
                    "the gradient op `{}` is not a lowercase identifier other than the op's name",
                    g.op
                ));
            }
        }
        Ok(())
    }

    /// Checks that `grad` has the arguments this op's gradient op must have
    /// (see [`Saved`]) and the same attributes.
    pub fn check_gradient_op(&self, grad: &OpSchema) -> Result<(), OpError> {
        let Some(g) = &self.gradient else {
            return Ok(());
        };
        let (n_in, n_out) = (self.inputs.len(), self.outputs.len());
        let expected_inputs = match g.saves {
            Saved::Inputs => n_out + n_in,
            Saved::InputsAndOutputs => 2 * n_out + n_in,
        };
        let fail = |what: String| {
            Err(OpError::new(format!(
                "`{}` is the gradient of `{}`, so {what}",
                grad.qualified_name(),
                self.qualified_name()
            )))
        };
        if grad.namespace != self.namespace || grad.name != g.op {
            return fail(format!("it must be named `{}::{}`", self.namespace, g.op));
        }
        if grad.inputs.len() != expected_inputs {
            return fail(format!(
                "it takes {expected_inputs} inputs (the {n_out} output gradients, the {n_in} inputs{}), not {}",
                if g.saves == Saved::InputsAndOutputs { ", the outputs" } else { "" },
                grad.inputs.len()
            ));
        }
        if grad.outputs.len() != n_in {
            return fail(format!(
                "it returns {n_in} gradients (one per input), not {}",
                grad.outputs.len()
            ));
        }
        let kinds = |s: &OpSchema| -> Vec<(String, AttrKind)> {
            s.attrs
                .iter()
                .map(|a| (a.name.clone(), a.default.kind()))
                .collect()
        };
        if kinds(grad) != kinds(self) {
            return fail(format!(
                "it takes the same attributes, {:?}, not {:?}",
                kinds(self),
                kinds(grad)
            ));
        }
        Ok(())
    }
}

/// A float as a schema default that parses back to the same value.
fn format_float(v: f64) -> String {
    let text = format!("{v:e}");
    // `1e-6` → `1e-06`, `1.5e0` → `1.5`: the forms both schema parsers read.
    match text.split_once('e') {
        Some((mantissa, "0")) if mantissa.contains('.') => mantissa.to_owned(),
        Some((mantissa, "0")) => format!("{mantissa}.0"),
        Some((mantissa, exp)) => {
            let (sign, digits) = exp.strip_prefix('-').map_or(("", exp), |d| ("-", d));
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => text,
    }
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

fn camel(s: &str) -> String {
    s.split('_')
        .map(|part| {
            let mut chars = part.chars();
            chars.next().map_or_else(String::new, |c| {
                c.to_ascii_uppercase().to_string() + chars.as_str()
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_both_parsers_read_them() {
        for (v, text) in [
            (1e-6, "1e-06"),
            (1.0, "1.0"),
            (0.5, "5e-01"),
            (-2.5, "-2.5"),
            (1e10, "1e10"),
        ] {
            assert_eq!(format_float(v), text);
            assert_eq!(format_float(v).parse::<f64>().unwrap(), v);
        }
    }

    #[test]
    fn schemas_for_both_engines() {
        let s = OpSchema::new("ns", "two_out")
            .input("x")
            .output("a")
            .output("b")
            .attr("k", AttrValue::Int(3))
            .attr("flag", AttrValue::Bool(true));
        assert_eq!(
            s.torch_schema(),
            "two_out(Tensor x, int k=3, bool flag=True) -> (Tensor, Tensor)"
        );
        assert_eq!(s.tf_op_name(), "NsTwoOut");
        s.validate().unwrap();
    }

    #[test]
    fn validation_names_the_problem() {
        let bad = OpSchema::new("ns", "Op").input("x").output("y");
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("the name `Op`"));
        let dup = OpSchema::new("ns", "op").input("x").output("x");
        assert!(dup
            .validate()
            .unwrap_err()
            .to_string()
            .contains("`x` is used twice"));
        let none = OpSchema::new("ns", "op").output("y");
        assert!(none.validate().is_err());
    }

    #[test]
    fn gradient_op_arity_is_checked() {
        let fwd = OpSchema::new("ns", "f")
            .input("x")
            .input("w")
            .output("y")
            .attr("eps", AttrValue::Float(0.1))
            .gradient("f_backward", Saved::InputsAndOutputs);
        let good = OpSchema::new("ns", "f_backward")
            .input("grad")
            .input("x")
            .input("w")
            .input("y")
            .output("dx")
            .output("dw")
            .attr("eps", AttrValue::Float(0.1));
        fwd.check_gradient_op(&good).unwrap();
        let mut short = good.clone();
        short.inputs.pop();
        let err = fwd.check_gradient_op(&short).unwrap_err().to_string();
        assert!(err.contains("takes 4 inputs"), "{err}");
        let mut no_attr = good;
        no_attr.attrs.clear();
        assert!(fwd.check_gradient_op(&no_attr).is_err());
    }
}
