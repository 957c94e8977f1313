//! What a layer's rules work with: where the layer sits in the tree (its path
//! and type name, for error messages and parameter names), and the helpers
//! that build its errors and parameter specs from there.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::model::init::{fan_in_and_fan_out, Init, InitDistribution};
use crate::model::{ParamKind, ParamSpec};
use crate::shape::Shape;

/// `prefix.name`, or `name` at the root.
pub(crate) fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}.{name}")
    }
}

/// The layer path and type as errors show them: `2.block.0 (Linear)`.
pub(crate) fn context(path: &str, kind: &str) -> String {
    if path.is_empty() {
        kind.to_owned()
    } else {
        format!("{path} ({kind})")
    }
}

pub(crate) fn dims(shape: &[usize]) -> String {
    Shape::from(shape).to_string()
}

/// Builds invalid-argument errors for one layer's fields.
pub(crate) struct FieldCheck<'a> {
    pub(crate) path: &'a str,
    pub(crate) kind: &'static str,
}

impl FieldCheck<'_> {
    pub(crate) fn invalid(&self, field: &str, reason: impl std::fmt::Display) -> Error {
        Error::invalid_argument(join(self.path, field), format!("{}: {reason}", self.kind))
    }

    pub(crate) fn positive(&self, field: &str, v: usize) -> Result<()> {
        if v == 0 {
            return Err(self.invalid(field, "must be at least 1, got 0"));
        }
        Ok(())
    }

    pub(crate) fn positive_all(&self, field: &str, v: &[usize]) -> Result<()> {
        if v.contains(&0) {
            return Err(self.invalid(field, format!("every size must be at least 1, got {v:?}")));
        }
        Ok(())
    }

    pub(crate) fn probability(&self, field: &str, p: f64) -> Result<()> {
        if !(0.0..1.0).contains(&p) {
            return Err(self.invalid(field, format!("must be in [0, 1), got {p}")));
        }
        Ok(())
    }

    pub(crate) fn non_negative(&self, field: &str, v: f64) -> Result<()> {
        if !(v.is_finite() && v >= 0.0) {
            return Err(self.invalid(field, format!("must be finite and >= 0, got {v}")));
        }
        Ok(())
    }

    pub(crate) fn divisible(
        &self,
        field: &str,
        what: &str,
        value: usize,
        groups: usize,
    ) -> Result<()> {
        if groups != 0 && !value.is_multiple_of(groups) {
            return Err(self.invalid(
                field,
                format!("{what} ({value}) must be divisible by {field} ({groups})"),
            ));
        }
        Ok(())
    }
}

/// Builds shape-mismatch errors for one layer's input.
pub(crate) struct ShapeCheck<'a> {
    pub(crate) path: &'a str,
    pub(crate) kind: &'static str,
    pub(crate) input: &'a [usize],
}

impl ShapeCheck<'_> {
    /// `[batch, recorded...]` for a layer whose per-example output shape a
    /// backend recorded (TorchScript and SavedModel layers); `unknown()` before.
    pub(crate) fn recorded(
        &self,
        recorded: Option<&[usize]>,
        unknown: impl FnOnce(&str) -> Error,
    ) -> Result<Vec<usize>> {
        match (recorded, self.input.first()) {
            (Some(shape), Some(&batch)) => {
                let mut out = vec![batch];
                out.extend_from_slice(shape);
                Ok(out)
            }
            (Some(_), None) => Err(self.mismatch("[batch, ...]".to_owned())),
            (None, _) => Err(unknown(if self.path.is_empty() {
                "(root)"
            } else {
                self.path
            })),
        }
    }

    /// The input itself when its last dimension is `dim` (a layer over the
    /// features of `[*, dim]`: RMSNorm, the gated MLP, the experts).
    pub(crate) fn same_with_last(&self, input: &[usize], dim: usize) -> Result<Vec<usize>> {
        match input.last() {
            Some(&d) if d == dim => Ok(input.to_vec()),
            _ => Err(self.mismatch(format!("[*, {dim}]"))),
        }
    }

    /// The layer expected an input like `expected` and got this one.
    pub(crate) fn mismatch(&self, expected: String) -> Error {
        Error::ShapeMismatch {
            context: context(self.path, self.kind),
            expected,
            actual: dims(self.input),
        }
    }
}

/// Appends one layer's parameters to the spec list.
pub(crate) struct Params<'a> {
    pub(crate) path: &'a str,
    pub(crate) kind: &'static str,
    pub(crate) out: &'a mut Vec<ParamSpec>,
}

impl Params<'_> {
    pub(crate) fn push(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        dtype: DType,
        kind: ParamKind,
        init: InitDistribution,
    ) {
        self.out.push(ParamSpec {
            name: join(self.path, name),
            shape,
            dtype,
            kind,
            init,
            zero_row: None,
        });
    }

    pub(crate) fn constant(&mut self, name: &str, shape: Vec<usize>, value: f64, kind: ParamKind) {
        self.push(
            name,
            shape,
            DType::F32,
            kind,
            InitDistribution::Constant { value },
        );
    }

    /// Resolves `init` for the parameter configured by `field`, naming the field on error.
    pub(crate) fn resolve(
        &self,
        field: &str,
        init: &Init,
        shape: &[usize],
    ) -> Result<InitDistribution> {
        init.resolve(shape).map_err(|e| match e {
            Error::InvalidArgument { name, reason } => Error::invalid_argument(
                join(self.path, field),
                format!("{}: {name}: {reason}", self.kind),
            ),
            other => other,
        })
    }

    /// A `Linear`/convolution weight and optional bias with PyTorch's defaults.
    pub(crate) fn weight_and_bias(
        &mut self,
        weight_shape: Vec<usize>,
        bias_len: Option<usize>,
        weight_init: Option<&Init>,
        bias_init: Option<&Init>,
    ) -> Result<()> {
        let weight = self.resolve(
            "weight_init",
            weight_init.unwrap_or(&Init::torch_default_weight()),
            &weight_shape,
        )?;
        let bias = match bias_len {
            None => None,
            Some(len) => {
                let init = match bias_init {
                    Some(init) => self.resolve("bias_init", init, &[len])?,
                    None => {
                        let (fan_in, _) = fan_in_and_fan_out(&weight_shape)?;
                        let bound = if fan_in > 0 {
                            1.0 / (fan_in as f64).sqrt()
                        } else {
                            0.0
                        };
                        InitDistribution::Uniform {
                            low: -bound,
                            high: bound,
                        }
                    }
                };
                Some((len, init))
            }
        };
        self.push(
            "weight",
            weight_shape,
            DType::F32,
            ParamKind::Parameter,
            weight,
        );
        if let Some((len, init)) = bias {
            self.push("bias", vec![len], DType::F32, ParamKind::Parameter, init);
        }
        Ok(())
    }
}
