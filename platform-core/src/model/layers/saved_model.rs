//! `SavedModel`: one signature of a TensorFlow SavedModel (a Keras 3 or
//! `tf.saved_model.save` export) as a frozen feature extractor inside a model.
//! Its variables come from the SavedModel's own checkpoint and never train;
//! the TensorFlow backend builds it (libtorch cannot run a TensorFlow graph).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{FieldCheck, LayerSpec, ShapeCheck};
use crate::error::{Error, Result};

fn serving_default() -> String {
    SavedModelLayerConfig::DEFAULT_SIGNATURE.to_owned()
}

/// A SavedModel signature as a frozen layer:
/// `{ type = "saved_model", path = "exported/", signature = "serve" }`.
///
/// The layer feeds the tensor reaching it to the signature's input and passes
/// the signature's output on. The signature runs as it was exported (a Keras
/// `serve` endpoint calls the model with `training=False`): Kiln's train and
/// eval modes do not change it. It has no parameters in Kiln's sense: its
/// variables are read from `<path>/variables/` when the model is built, get no
/// gradient and are not in the optimizer nor in the state dict.
///
/// Its output shape is read from the signature (or found by running it once):
/// the TensorFlow backend fills `output_shape` in
/// (`kiln_tf::resolve_saved_model_shapes`). Until then, shape inference through
/// this layer is [`Error::Unsupported`](crate::Error::Unsupported) saying so.
///
/// ```
/// use kiln_core::model::{Layer, LinearConfig, SavedModelLayerConfig};
///
/// let toml = r#"
///     type = "sequential"
///     layers = [
///       { type = "saved_model", path = "exported/", signature = "features" },
///       { type = "linear", in_features = 16, out_features = 2 },
///     ]
/// "#;
/// let net: Layer = toml::from_str(toml).expect("valid");
/// assert!(net.output_shape(&[4, 8]).is_err()); // not resolved yet
/// let features = SavedModelLayerConfig::new("exported/")
///     .with_signature("features")
///     .with_output_shape([16]);
/// let resolved = Layer::sequential([features.into(), LinearConfig::new(16, 2).into()]);
/// assert_eq!(resolved.output_shape(&[4, 8])?, vec![4, 2]);
/// assert!(resolved.parameter_specs("")?.iter().all(|p| p.name.starts_with("1.")));
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedModelLayerConfig {
    /// The SavedModel directory (holding `saved_model.pb` and `variables/`;
    /// relative paths are relative to the working directory).
    pub path: PathBuf,
    /// The signature to run (default `serving_default`).
    #[serde(default = "serving_default")]
    pub signature: String,
    /// The signature input the layer's input is fed to, checked when given; a
    /// layer feeds one tensor, so the signature must have exactly one input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// The signature output the layer passes on; may be left out when the
    /// signature has exactly one output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    /// The shape of one example's output (without the batch dimension), read
    /// from the signature; filled in by the TensorFlow backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_shape: Option<Vec<usize>>,
}

impl SavedModelLayerConfig {
    /// The signature TensorFlow exports name their main function by.
    pub const DEFAULT_SIGNATURE: &'static str = "serving_default";

    /// The SavedModel at `path`, its `serving_default` signature, its only
    /// input and output, the output shape unknown.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            signature: serving_default(),
            input: None,
            output: None,
            output_shape: None,
        }
    }

    /// Runs the signature `name` instead of `serving_default`.
    pub fn with_signature(mut self, name: impl Into<String>) -> Self {
        self.signature = name.into();
        self
    }

    /// Feeds the signature input `name` (needed when it has several inputs).
    pub fn with_input(mut self, name: impl Into<String>) -> Self {
        self.input = Some(name.into());
        self
    }

    /// Passes on the signature output `name` (needed when it has several).
    pub fn with_output(mut self, name: impl Into<String>) -> Self {
        self.output = Some(name.into());
        self
    }

    /// Records the shape of one example's output (batch dimension excluded).
    pub fn with_output_shape(mut self, shape: impl Into<Vec<usize>>) -> Self {
        self.output_shape = Some(shape.into());
        self
    }
}

impl LayerSpec for SavedModelLayerConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        if self.path.as_os_str().is_empty() {
            return Err(check.invalid("path", "must name a SavedModel directory"));
        }
        if self.signature.is_empty() {
            return Err(check.invalid(
                "signature",
                "must name a signature of the SavedModel (`serving_default` when left out)",
            ));
        }
        for (field, name) in [("input", &self.input), ("output", &self.output)] {
            if name.as_deref() == Some("") {
                return Err(
                    check.invalid(field, "must name a tensor of the signature, or be left out")
                );
            }
        }
        if let Some(shape) = &self.output_shape {
            check.positive_all("output_shape", shape)?;
        }
        Ok(())
    }

    fn output_shape(&self, _input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        at.recorded(self.output_shape.as_deref(), |path| {
            Error::unsupported(format!(
                "shape inference through the saved_model layer `{}` ({}, signature `{}`) \
                 before its signature was read: its output shape is found on the \
                 TensorFlow backend (kiln_tf::resolve_saved_model_shapes), or give it as \
                 `output_shape`",
                path,
                self.path.display(),
                self.signature
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::SavedModelLayerConfig;
    use crate::error::Error;
    use crate::model::Layer;

    #[test]
    fn toml_defaults_round_trip_and_no_parameters() {
        let layer: Layer = toml::from_str(
            r#"type = "saved_model"
path = "exported/""#,
        )
        .expect("valid");
        assert_eq!(layer, Layer::from(SavedModelLayerConfig::new("exported/")));
        assert_eq!(layer.kind(), "SavedModel");
        let Layer::SavedModel(config) = &layer else {
            panic!("{layer:?}");
        };
        assert_eq!(config.signature, "serving_default");

        let full = SavedModelLayerConfig::new("m")
            .with_signature("serve")
            .with_input("x")
            .with_output("output_0")
            .with_output_shape([16]);
        let layer = Layer::from(full);
        let text = toml::to_string(&layer).expect("serializable");
        assert_eq!(toml::from_str::<Layer>(&text).expect("round trip"), layer);
        assert!(layer.parameter_specs("").expect("valid").is_empty());
        assert_eq!(layer.output_shape(&[3, 8]).expect("known"), vec![3, 16]);
    }

    #[test]
    fn invalid_fields_are_refused() {
        for bad in [
            SavedModelLayerConfig::new(""),
            SavedModelLayerConfig::new("m").with_signature(""),
            SavedModelLayerConfig::new("m").with_output(""),
            SavedModelLayerConfig::new("m").with_output_shape([0]),
        ] {
            let err = Layer::from(bad).validate().expect_err("invalid");
            assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
        }
        let unknown = toml::from_str::<Layer>(
            r#"type = "saved_model"
path = "m"
trainable = true"#,
        );
        assert!(unknown.is_err(), "a frozen layer has no `trainable`");
    }
}
