//! A registered op as a [`Layer::Custom`](kiln_core::model::Layer::Custom) layer
//! of a [`TfModel`](kiln_tf::TfModel).

use kiln_core::{model::CustomConfig, Error, Result};
use kiln_custom_op::{Attrs, CustomOp, OpSchema};

use crate::{add_op, registry};

/// Registers `O` with TensorFlow (unless [`register`](crate::register) already
/// did, for `O` itself) and makes it the TensorFlow function of
/// [`Layer::Custom`](kiln_core::model::Layer::Custom) layers whose op is `O`'s
/// `namespace::name` (`kiln_tf::register_custom_layer`).
///
/// The layer's input `x` and then its parameters, in declaration order, are
/// the op's inputs; the layer's output is the op's first output. The layer's
/// `attrs` set the op's attributes by name (a float as is, an int when
/// integral, a bool as 0 or 1); attributes it does not set keep their
/// defaults. Training differentiates through the op's gradient op, which must be
/// registered too.
///
/// # Errors
///
/// Those of [`register`](crate::register), other than `O` being registered
/// already. Building a model fails with [`Error::InvalidArgument`] when a
/// layer declares a number of parameters other than the op's inputs after
/// `x`, or sets an attribute the op does not have (or a value its type
/// cannot hold).
pub fn register_layer<O: CustomOp>() -> Result<()> {
    registry::register_inner::<O>(true)?;
    let op = O::schema().qualified_name();
    kiln_tf::register_custom_layer(&op, |graph, name, x, params, config| {
        let schema = O::schema();
        check_params(&schema, config)?;
        let attrs = layer_attrs(&schema, config)?;
        let mut inputs = Vec::with_capacity(1 + params.len());
        inputs.push(x);
        inputs.extend(params.iter().cloned());
        let outputs = add_op::<O>(graph, name, &inputs, &attrs)?;
        outputs
            .into_iter()
            .next()
            .ok_or_else(|| Error::invalid_argument(schema.qualified_name(), "the op has no output"))
    });
    Ok(())
}

fn check_params(schema: &OpSchema, config: &CustomConfig) -> Result<()> {
    let expected = schema.inputs.get(1..).unwrap_or_default();
    if config.params.len() == expected.len() {
        return Ok(());
    }
    let declared: Vec<&str> = config.params.iter().map(|p| p.name.as_str()).collect();
    Err(Error::invalid_argument(
        format!("{}.params", config.op),
        format!(
            "the op takes the layer input `{}` and then {} parameters {expected:?}; the layer \
             declares {} {declared:?}",
            schema.inputs.first().map_or("x", String::as_str),
            expected.len(),
            declared.len()
        ),
    ))
}

/// The layer's attributes over the op's defaults.
pub(crate) fn layer_attrs(schema: &OpSchema, config: &CustomConfig) -> Result<Attrs> {
    Attrs::from_numbers(schema, config.attrs.iter().map(|(k, &v)| (k.as_str(), v))).map_err(
        |(key, e)| Error::invalid_argument(format!("{}.attrs.{key}", config.op), e.to_string()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_custom_op::AttrValue;

    fn schema() -> OpSchema {
        OpSchema::new("t", "op")
            .input("x")
            .input("w")
            .output("y")
            .attr("eps", AttrValue::Float(0.5))
            .attr("k", AttrValue::Int(3))
            .attr("on", AttrValue::Bool(true))
    }

    #[test]
    fn layer_attributes_map_by_name_and_kind() {
        let config = CustomConfig::new("t::op")
            .with_attr("k", 5.0)
            .with_attr("on", 0.0);
        let attrs = layer_attrs(&schema(), &config).expect("valid attributes");
        assert_eq!(attrs.get("eps").ok(), Some(AttrValue::Float(0.5)));
        assert_eq!(attrs.get("k").ok(), Some(AttrValue::Int(5)));
        assert_eq!(attrs.get("on").ok(), Some(AttrValue::Bool(false)));

        let unknown = CustomConfig::new("t::op").with_attr("alpha", 1.0);
        let err = layer_attrs(&schema(), &unknown)
            .expect_err("unknown")
            .to_string();
        assert!(
            err.contains("t::op.attrs.alpha") && err.contains("\"eps\""),
            "{err}"
        );
        let fractional = CustomConfig::new("t::op").with_attr("k", 1.5);
        let err = layer_attrs(&schema(), &fractional)
            .expect_err("fraction")
            .to_string();
        assert!(err.contains("not a valid int"), "{err}");
    }

    #[test]
    fn parameter_count_is_checked() {
        use kiln_core::model::Init;
        let none = CustomConfig::new("t::op");
        let err = check_params(&schema(), &none)
            .expect_err("no params")
            .to_string();
        assert!(
            err.contains("t::op.params") && err.contains("[\"w\"]"),
            "{err}"
        );
        let one = CustomConfig::new("t::op").with_param("weight", [4], Init::Ones);
        check_params(&schema(), &one).expect("one parameter");
    }
}
