//! `Custom`: a layer computed by an op a backend extension registered, with
//! the parameters the layer declares.

use serde::{Deserialize, Serialize};

use super::builder::config_builder;
use super::{FieldCheck, LayerSpec, Params, ShapeCheck};
use crate::dtype::DType;
use crate::error::Result;
use crate::model::init::Init;
use crate::model::ParamKind;

/// A layer computed by an op a backend extension registered under `op`
/// (Kiln's fused ops in kiln-fused-ops, or a user's own): the backend creates the
/// declared parameters and calls the op with the input, the parameters in
/// declaration order, and the attributes.
///
/// Custom layers keep their input's shape (activations, fused bias and
/// activation, normalisations); the backends check the op's output against it.
/// The op must be registered with the backend that builds the model
/// (`kiln_torch::register_custom_layer`, `kiln_tf::register_custom_layer`,
/// or `kiln_fused_ops::register_layers()` for `kiln::bias_gelu` and `kiln::swish`).
///
/// ```
/// use kiln_core::model::{CustomConfig, Init, Layer};
///
/// // Swish-β with one learned β starting at 1, as kiln-fused-ops declares it.
/// let layer: Layer = CustomConfig::new("kiln::swish")
///     .with_param("beta", [1], Init::Ones)
///     .into();
/// assert_eq!(layer.output_shape(&[8, 16])?, vec![8, 16]);
/// assert_eq!(layer.parameter_specs("act")?[0].name, "act.beta");
///
/// // The same layer in a config file.
/// let toml = r#"
///     type = "custom"
///     op = "kiln::swish"
///     params = [{ name = "beta", shape = [1], init = { type = "ones" } }]
/// "#;
/// assert_eq!(toml::from_str::<Layer>(toml).expect("valid"), layer);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CustomConfig {
    /// The registered op, `namespace::name` as in `torch.ops` (`"kiln::swish"`).
    pub op: String,
    /// The learned parameters, passed to the op after the input in this order.
    #[serde(default)]
    pub params: Vec<CustomParam>,
    /// Scalar attributes passed to the op (a slope, an epsilon), by name.
    #[serde(default)]
    pub attrs: std::collections::BTreeMap<String, f64>,
}

/// One learned parameter of a [`CustomConfig`] layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CustomParam {
    /// The name in the state dict, under the layer's path (`"bias"`).
    pub name: String,
    /// Its dimensions (`[]` for a scalar).
    pub shape: Vec<usize>,
    /// Its initialiser.
    pub init: Init,
}

config_builder! {
    CustomConfig {
        /// A layer calling `op`, without parameters or attributes.
        new(op: impl Into<String>) {
            op: op.into(),
            params: Vec::new(),
            attrs: Default::default(),
        }
    }
}

impl CustomConfig {
    /// Declares the next learned parameter.
    pub fn with_param(
        mut self,
        name: impl Into<String>,
        shape: impl Into<Vec<usize>>,
        init: Init,
    ) -> Self {
        self.params.push(CustomParam {
            name: name.into(),
            shape: shape.into(),
            init,
        });
        self
    }

    /// Sets a scalar attribute.
    pub fn with_attr(mut self, name: impl Into<String>, value: f64) -> Self {
        self.attrs.insert(name.into(), value);
        self
    }

    /// The value of attribute `name`, or `default` when the layer does not set it.
    pub fn attr_or(&self, name: &str, default: f64) -> f64 {
        self.attrs.get(name).copied().unwrap_or(default)
    }
}

impl LayerSpec for CustomConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        let c = self;
        let valid_op =
            c.op.split_once("::")
                .is_some_and(|(ns, name)| !ns.is_empty() && !name.is_empty());
        if !valid_op {
            return Err(check.invalid("op", format!("expected `namespace::name`, got {:?}", c.op)));
        }
        let mut seen = std::collections::HashSet::new();
        for param in &c.params {
            if param.name.is_empty() || param.name.contains('.') {
                return Err(check.invalid(
                    "params",
                    format!(
                        "parameter name {:?} must be non-empty without dots",
                        param.name
                    ),
                ));
            }
            if !seen.insert(param.name.as_str()) {
                return Err(check.invalid(
                    "params",
                    format!("parameter {:?} declared twice", param.name),
                ));
            }
        }
        match c.attrs.iter().find(|(_, v)| !v.is_finite()) {
            Some((name, v)) => {
                Err(check.invalid(&format!("attrs.{name}"), format!("must be finite, got {v}")))
            }
            None => Ok(()),
        }
    }

    /// Custom layers keep their input's shape; the backends check the op's output.
    fn output_shape(&self, input: &[usize], _at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        Ok(input.to_vec())
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        for param in &self.params {
            let init =
                params.resolve(&format!("params.{}", param.name), &param.init, &param.shape)?;
            params.push(
                &param.name,
                param.shape.clone(),
                DType::F32,
                ParamKind::Parameter,
                init,
            );
        }
        Ok(())
    }
}
