//! Normalisation: `BatchNorm1d` and `BatchNorm2d` (one config), `LayerNorm`
//! and `GroupNorm`.

use serde::{Deserialize, Serialize};

use super::builder::config_builder;
use super::defaults::{default_bn_momentum, default_eps, yes};
use super::{FieldCheck, LayerSpec, Params, ShapeCheck};
use crate::dtype::DType;
use crate::error::Result;
use crate::model::init::InitDistribution;
use crate::model::ParamKind;

/// `nn.BatchNorm1d` / `nn.BatchNorm2d`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchNormConfig {
    /// Number of channels (`C` of `[N, C, ...]`).
    pub num_features: usize,
    /// Added to the variance for stability (default 1e-5).
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Weight of the newest batch in the running statistics (default 0.1).
    #[serde(default = "default_bn_momentum")]
    pub momentum: f64,
    /// Whether to learn a per-channel scale and shift (default `true`).
    #[serde(default = "yes")]
    pub affine: bool,
    /// Whether to keep running statistics for evaluation (default `true`).
    #[serde(default = "yes")]
    pub track_running_stats: bool,
}

config_builder! {
    BatchNormConfig {
        /// Batch normalisation with PyTorch's defaults.
        new(num_features: usize) {
            num_features,
            eps: 1e-5,
            momentum: 0.1,
            affine: true,
            track_running_stats: true,
        }
        /// Sets `eps`.
        with_eps(eps: f64);
        /// Sets the running-statistics momentum.
        with_momentum(momentum: f64);
        /// Sets whether the layer has a learnable scale and shift.
        with_affine(affine: bool);
        /// Sets whether running statistics are kept.
        with_track_running_stats(track_running_stats: bool);
    }
}

// What `BatchNorm1d` and `BatchNorm2d` share: their fields' checks and parameters.
impl BatchNormConfig {
    fn validate_fields(&self, check: &FieldCheck<'_>) -> Result<()> {
        let c = self;
        check.positive("num_features", c.num_features)?;
        check.non_negative("eps", c.eps)?;
        if !(0.0..=1.0).contains(&c.momentum) {
            return Err(check.invalid("momentum", format!("must be in [0, 1], got {}", c.momentum)));
        }
        Ok(())
    }

    fn push_params(&self, params: &mut Params<'_>) {
        let c = self;
        let n = c.num_features;
        if c.affine {
            params.constant("weight", vec![n], 1.0, ParamKind::Parameter);
            params.constant("bias", vec![n], 0.0, ParamKind::Parameter);
        }
        if c.track_running_stats {
            params.constant("running_mean", vec![n], 0.0, ParamKind::Buffer);
            params.constant("running_var", vec![n], 1.0, ParamKind::Buffer);
            params.push(
                "num_batches_tracked",
                Vec::new(),
                DType::I64,
                ParamKind::Buffer,
                InitDistribution::Constant { value: 0.0 },
            );
        }
    }
}

/// [`Layer::BatchNorm1d`](crate::model::Layer::BatchNorm1d): on `[N, C]` or `[N, C, L]`.
pub(crate) struct BatchNorm1d<'a>(pub(crate) &'a BatchNormConfig);

impl LayerSpec for BatchNorm1d<'_> {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        self.0.validate_fields(check)
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let c = self.0;
        match *input {
            [_, ch] | [_, ch, _] if ch == c.num_features => Ok(input.to_vec()),
            _ => Err(at.mismatch(format!("[N, {0}] or [N, {0}, L]", c.num_features))),
        }
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        self.0.push_params(params);
        Ok(())
    }
}

/// [`Layer::BatchNorm2d`](crate::model::Layer::BatchNorm2d): on `[N, C, H, W]`.
pub(crate) struct BatchNorm2d<'a>(pub(crate) &'a BatchNormConfig);

impl LayerSpec for BatchNorm2d<'_> {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        self.0.validate_fields(check)
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let c = self.0;
        match *input {
            [_, ch, _, _] if ch == c.num_features => Ok(input.to_vec()),
            _ => Err(at.mismatch(format!("[N, {}, H, W]", c.num_features))),
        }
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        self.0.push_params(params);
        Ok(())
    }
}

/// `nn.LayerNorm` over the trailing `normalized_shape` dimensions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerNormConfig {
    /// The trailing dimensions to normalise over.
    pub normalized_shape: Vec<usize>,
    /// Added to the variance for stability (default 1e-5).
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Whether to learn an element-wise scale (and shift, see `bias`) (default `true`).
    #[serde(default = "yes")]
    pub elementwise_affine: bool,
    /// Whether the affine transform has a shift (default `true`; PyTorch's `bias`).
    #[serde(default = "yes")]
    pub bias: bool,
}

config_builder! {
    LayerNormConfig {
        /// Layer normalisation over `normalized_shape` with PyTorch's defaults.
        new(normalized_shape: impl Into<Vec<usize>>) {
            normalized_shape: normalized_shape.into(),
            eps: 1e-5,
            elementwise_affine: true,
            bias: true,
        }
        /// Sets `eps`.
        with_eps(eps: f64);
        /// Sets whether the layer has a learnable scale and shift.
        with_elementwise_affine(elementwise_affine: bool);
        /// Sets whether the affine transform has a shift.
        with_bias(bias: bool);
    }
}

impl LayerSpec for LayerNormConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        let c = self;
        if c.normalized_shape.is_empty() {
            return Err(check.invalid("normalized_shape", "must not be empty"));
        }
        check.positive_all("normalized_shape", &c.normalized_shape)?;
        check.non_negative("eps", c.eps)
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let c = self;
        if input.ends_with(&c.normalized_shape) {
            Ok(input.to_vec())
        } else {
            let trailing: Vec<String> =
                c.normalized_shape.iter().map(ToString::to_string).collect();
            Err(at.mismatch(format!("[*, {}]", trailing.join(", "))))
        }
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        let c = self;
        if c.elementwise_affine {
            let shape = c.normalized_shape.clone();
            params.constant("weight", shape.clone(), 1.0, ParamKind::Parameter);
            if c.bias {
                params.constant("bias", shape, 0.0, ParamKind::Parameter);
            }
        }
        Ok(())
    }
}

/// `nn.GroupNorm` on `[N, C, ...]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupNormConfig {
    /// Number of groups the channels are split into; must divide `num_channels`.
    pub num_groups: usize,
    /// Number of channels.
    pub num_channels: usize,
    /// Added to the variance for stability (default 1e-5).
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Whether to learn a per-channel scale and shift (default `true`).
    #[serde(default = "yes")]
    pub affine: bool,
}

config_builder! {
    GroupNormConfig {
        /// Group normalisation with PyTorch's defaults.
        new(num_groups: usize, num_channels: usize) {
            num_groups,
            num_channels,
            eps: 1e-5,
            affine: true,
        }
        /// Sets `eps`.
        with_eps(eps: f64);
        /// Sets whether the layer has a learnable scale and shift.
        with_affine(affine: bool);
    }
}

impl LayerSpec for GroupNormConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        let c = self;
        check.positive("num_groups", c.num_groups)?;
        check.positive("num_channels", c.num_channels)?;
        check.divisible("num_groups", "num_channels", c.num_channels, c.num_groups)?;
        check.non_negative("eps", c.eps)
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let c = self;
        match input {
            [_, ch, ..] if *ch == c.num_channels => Ok(input.to_vec()),
            _ => Err(at.mismatch(format!("[N, {}, *]", c.num_channels))),
        }
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        let c = self;
        if c.affine {
            params.constant("weight", vec![c.num_channels], 1.0, ParamKind::Parameter);
            params.constant("bias", vec![c.num_channels], 0.0, ParamKind::Parameter);
        }
        Ok(())
    }
}

/// RMSNorm over the last dimension, as the LLaMA, Mistral, Qwen and Gemma
/// families use it (`torch.nn.RMSNorm` when `weight_offset` is 0):
///
/// ```text
/// y = x / sqrt(mean(x², last axis) + eps) * (weight_offset + weight)
/// ```
///
/// The mean is taken in float32 whatever the input's dtype (as the Hugging Face
/// modules do). Gemma stores `weight` as an offset from one: `weight_offset = 1`
/// (its weight then starts at 0).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RmsNormConfig {
    /// Size of the last dimension.
    pub dim: usize,
    /// Added to the mean square for stability (default 1e-6, LLaMA's `rms_norm_eps`).
    #[serde(default = "default_rms_eps")]
    pub eps: f64,
    /// Added to `weight` before it scales (default 0; Gemma: 1).
    #[serde(default)]
    pub weight_offset: f64,
    /// Whether the weight scales the float32 normalised values before the
    /// cast back to the input's dtype (OLMo 2's order, and Gemma's, which a
    /// `weight_offset` implies) rather than after it (default `false`:
    /// LLaMA's). The two differ in bfloat16 only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub scale_in_float32: bool,
}

fn default_rms_eps() -> f64 {
    1e-6
}

config_builder! {
    RmsNormConfig {
        /// RMSNorm with `eps = 1e-6` and no weight offset.
        new(dim: usize) {
            dim,
            eps: 1e-6,
            weight_offset: 0.0,
            scale_in_float32: false,
        }
        /// Sets `eps`.
        with_eps(eps: f64);
        /// Sets the weight offset (1 for Gemma's `1 + weight`).
        with_weight_offset(weight_offset: f64);
        /// Sets whether the weight scales before the cast back (OLMo 2).
        with_scale_in_float32(scale_in_float32: bool);
    }
}

impl LayerSpec for RmsNormConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        check.positive("dim", self.dim)?;
        check.non_negative("eps", self.eps)?;
        if !self.weight_offset.is_finite() {
            return Err(check.invalid("weight_offset", "must be finite"));
        }
        Ok(())
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        at.same_with_last(input, self.dim)
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        // The scale starts at 1 in effect: `weight_offset + weight == 1`.
        params.constant(
            "weight",
            vec![self.dim],
            1.0 - self.weight_offset,
            ParamKind::Parameter,
        );
        Ok(())
    }
}
