//! Convolutions: `Conv1d`, `Conv2d` and `ConvTranspose2d`, and the window
//! arithmetic they share with pooling.

use serde::{Deserialize, Serialize};

use super::builder::config_builder;
use super::defaults::{one_usize, ones2, pair, yes};
use super::{FieldCheck, LayerSpec, Params, ShapeCheck};
use crate::error::Result;
use crate::model::init::Init;

/// Output length of a convolution or pooling window along one dimension
/// (PyTorch's formula with `ceil_mode=False`), or `None` when the padded
/// input is shorter than the dilated kernel.
pub(super) fn window_out(
    len: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
) -> Option<usize> {
    let effective = dilation
        .checked_mul(kernel.checked_sub(1)?)?
        .checked_add(1)?;
    let padded = len.checked_add(padding.checked_mul(2)?)?;
    let span = padded.checked_sub(effective)?;
    Some(span.checked_div(stride)? + 1)
}

/// Output length of a transposed convolution along one dimension:
/// `(len - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1`,
/// or `None` when that is below 1.
fn transposed_out(
    len: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    output_padding: usize,
    dilation: usize,
) -> Option<usize> {
    let [len, kernel, stride, padding, output_padding, dilation] =
        [len, kernel, stride, padding, output_padding, dilation].map(|v| v as i128);
    let out = (len - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1;
    usize::try_from(out).ok().filter(|&o| o >= 1)
}

/// The checks every convolution's channels, kernel, stride, dilation and groups pass.
fn validate_conv(
    check: &FieldCheck<'_>,
    in_channels: usize,
    out_channels: usize,
    groups: usize,
) -> Result<()> {
    check.positive("groups", groups)?;
    check.divisible("groups", "in_channels", in_channels, groups)?;
    check.divisible("groups", "out_channels", out_channels, groups)
}

/// `nn.Conv1d` on `[batch, channels, length]` (zero padding).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conv1dConfig {
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel length.
    pub kernel_size: usize,
    /// Stride (default 1).
    #[serde(default = "one_usize")]
    pub stride: usize,
    /// Zero padding on both sides (default 0).
    #[serde(default)]
    pub padding: usize,
    /// Spacing between kernel elements (default 1).
    #[serde(default = "one_usize")]
    pub dilation: usize,
    /// Number of blocked connections from input to output channels (default 1).
    #[serde(default = "one_usize")]
    pub groups: usize,
    /// Whether to add a learnable bias (default `true`).
    #[serde(default = "yes")]
    pub bias: bool,
    /// Initialiser of `weight`; `None` is PyTorch's default.
    #[serde(default)]
    pub weight_init: Option<Init>,
    /// Initialiser of `bias`; `None` is PyTorch's default.
    #[serde(default)]
    pub bias_init: Option<Init>,
}

config_builder! {
    Conv1dConfig {
        /// A convolution with stride 1, no padding, dilation 1, one group and a bias.
        new(in_channels: usize, out_channels: usize, kernel_size: usize) {
            in_channels,
            out_channels,
            kernel_size,
            stride: 1,
            padding: 0,
            dilation: 1,
            groups: 1,
            bias: true,
            weight_init: None,
            bias_init: None,
        }
        /// Sets the stride.
        with_stride(stride: usize);
        /// Sets the zero padding.
        with_padding(padding: usize);
        /// Sets the dilation.
        with_dilation(dilation: usize);
        /// Sets the number of groups.
        with_groups(groups: usize);
        /// Sets whether the layer has a bias.
        with_bias(bias: bool);
        /// Sets the initialiser of `weight`.
        with_weight_init(weight_init: Some(Init));
        /// Sets the initialiser of `bias`.
        with_bias_init(bias_init: Some(Init));
    }
}

impl LayerSpec for Conv1dConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        let c = self;
        check.positive("in_channels", c.in_channels)?;
        check.positive("out_channels", c.out_channels)?;
        check.positive("kernel_size", c.kernel_size)?;
        check.positive("stride", c.stride)?;
        check.positive("dilation", c.dilation)?;
        validate_conv(check, c.in_channels, c.out_channels, c.groups)
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let c = self;
        match *input {
            [n, ch, len] if ch == c.in_channels => {
                let out = window_out(len, c.kernel_size, c.stride, c.padding, c.dilation)
                    .ok_or_else(|| {
                        at.mismatch(format!(
                            "[N, {}, L] with L + 2 * padding ({}) >= dilation * (kernel_size - 1) + 1 ({})",
                            c.in_channels,
                            c.padding.saturating_mul(2),
                            c.dilation.saturating_mul(c.kernel_size - 1).saturating_add(1)
                        ))
                    })?;
                Ok(vec![n, c.out_channels, out])
            }
            _ => Err(at.mismatch(format!("[N, {}, L]", c.in_channels))),
        }
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        let c = self;
        params.weight_and_bias(
            vec![c.out_channels, c.in_channels / c.groups, c.kernel_size],
            c.bias.then_some(c.out_channels),
            c.weight_init.as_ref(),
            c.bias_init.as_ref(),
        )
    }
}

/// `nn.Conv2d` on `[batch, channels, height, width]` (zero padding).
///
/// Sizes are `[height, width]`; in a config file a single number means both.
///
/// ```
/// use kiln_core::model::{Conv2dConfig, Layer};
///
/// let conv: Layer = Conv2dConfig::new(3, 16, [3, 3]).with_padding([1, 1]).with_stride([2, 2]).into();
/// assert_eq!(conv.output_shape(&[8, 3, 32, 32])?, vec![8, 16, 16, 16]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conv2dConfig {
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel size `[kh, kw]`.
    #[serde(deserialize_with = "pair")]
    pub kernel_size: [usize; 2],
    /// Stride (default `[1, 1]`).
    #[serde(default = "ones2", deserialize_with = "pair")]
    pub stride: [usize; 2],
    /// Zero padding on both sides of each dimension (default `[0, 0]`).
    #[serde(default, deserialize_with = "pair")]
    pub padding: [usize; 2],
    /// Spacing between kernel elements (default `[1, 1]`).
    #[serde(default = "ones2", deserialize_with = "pair")]
    pub dilation: [usize; 2],
    /// Number of blocked connections from input to output channels (default 1).
    #[serde(default = "one_usize")]
    pub groups: usize,
    /// Whether to add a learnable bias (default `true`).
    #[serde(default = "yes")]
    pub bias: bool,
    /// Initialiser of `weight`; `None` is PyTorch's default.
    #[serde(default)]
    pub weight_init: Option<Init>,
    /// Initialiser of `bias`; `None` is PyTorch's default.
    #[serde(default)]
    pub bias_init: Option<Init>,
}

config_builder! {
    Conv2dConfig {
        /// A convolution with stride 1, no padding, dilation 1, one group and a bias.
        new(in_channels: usize, out_channels: usize, kernel_size: [usize; 2]) {
            in_channels,
            out_channels,
            kernel_size,
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
            bias: true,
            weight_init: None,
            bias_init: None,
        }
        /// Sets the stride.
        with_stride(stride: [usize; 2]);
        /// Sets the zero padding.
        with_padding(padding: [usize; 2]);
        /// Sets the dilation.
        with_dilation(dilation: [usize; 2]);
        /// Sets the number of groups.
        with_groups(groups: usize);
        /// Sets whether the layer has a bias.
        with_bias(bias: bool);
        /// Sets the initialiser of `weight`.
        with_weight_init(weight_init: Some(Init));
        /// Sets the initialiser of `bias`.
        with_bias_init(bias_init: Some(Init));
    }
}

impl LayerSpec for Conv2dConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        let c = self;
        check.positive("in_channels", c.in_channels)?;
        check.positive("out_channels", c.out_channels)?;
        check.positive_all("kernel_size", &c.kernel_size)?;
        check.positive_all("stride", &c.stride)?;
        check.positive_all("dilation", &c.dilation)?;
        validate_conv(check, c.in_channels, c.out_channels, c.groups)
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let c = self;
        match *input {
            [n, ch, h, w] if ch == c.in_channels => {
                let mut out = [0usize; 2];
                for (i, len) in [h, w].into_iter().enumerate() {
                    out[i] = window_out(
                        len,
                        c.kernel_size[i],
                        c.stride[i],
                        c.padding[i],
                        c.dilation[i],
                    )
                    .ok_or_else(|| {
                        at.mismatch(format!(
                            "[N, {}, H, W] at least as large as the dilated kernel {:?} after padding {:?}",
                            c.in_channels,
                            [0, 1].map(|j| c.dilation[j].saturating_mul(c.kernel_size[j] - 1).saturating_add(1)),
                            c.padding
                        ))
                    })?;
                }
                Ok(vec![n, c.out_channels, out[0], out[1]])
            }
            _ => Err(at.mismatch(format!("[N, {}, H, W]", c.in_channels))),
        }
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        let c = self;
        params.weight_and_bias(
            vec![
                c.out_channels,
                c.in_channels / c.groups,
                c.kernel_size[0],
                c.kernel_size[1],
            ],
            c.bias.then_some(c.out_channels),
            c.weight_init.as_ref(),
            c.bias_init.as_ref(),
        )
    }
}

/// `nn.ConvTranspose2d` on `[batch, channels, height, width]`.
///
/// Its weight is `[in_channels, out_channels / groups, kh, kw]`, as in PyTorch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConvTranspose2dConfig {
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel size `[kh, kw]`.
    #[serde(deserialize_with = "pair")]
    pub kernel_size: [usize; 2],
    /// Stride (default `[1, 1]`).
    #[serde(default = "ones2", deserialize_with = "pair")]
    pub stride: [usize; 2],
    /// Implicit zero padding removed from both sides of the output (default `[0, 0]`).
    #[serde(default, deserialize_with = "pair")]
    pub padding: [usize; 2],
    /// Extra size added to one side of the output (default `[0, 0]`); must be
    /// smaller than the stride or the dilation.
    #[serde(default, deserialize_with = "pair")]
    pub output_padding: [usize; 2],
    /// Spacing between kernel elements (default `[1, 1]`).
    #[serde(default = "ones2", deserialize_with = "pair")]
    pub dilation: [usize; 2],
    /// Number of blocked connections from input to output channels (default 1).
    #[serde(default = "one_usize")]
    pub groups: usize,
    /// Whether to add a learnable bias (default `true`).
    #[serde(default = "yes")]
    pub bias: bool,
    /// Initialiser of `weight`; `None` is PyTorch's default.
    #[serde(default)]
    pub weight_init: Option<Init>,
    /// Initialiser of `bias`; `None` is PyTorch's default.
    #[serde(default)]
    pub bias_init: Option<Init>,
}

config_builder! {
    ConvTranspose2dConfig {
        /// A transposed convolution with stride 1, no padding, dilation 1, one group and a bias.
        new(in_channels: usize, out_channels: usize, kernel_size: [usize; 2]) {
            in_channels,
            out_channels,
            kernel_size,
            stride: [1, 1],
            padding: [0, 0],
            output_padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
            bias: true,
            weight_init: None,
            bias_init: None,
        }
        /// Sets the stride.
        with_stride(stride: [usize; 2]);
        /// Sets the padding.
        with_padding(padding: [usize; 2]);
        /// Sets the output padding.
        with_output_padding(output_padding: [usize; 2]);
        /// Sets the dilation.
        with_dilation(dilation: [usize; 2]);
        /// Sets the number of groups.
        with_groups(groups: usize);
        /// Sets whether the layer has a bias.
        with_bias(bias: bool);
        /// Sets the initialiser of `weight`.
        with_weight_init(weight_init: Some(Init));
        /// Sets the initialiser of `bias`.
        with_bias_init(bias_init: Some(Init));
    }
}

impl LayerSpec for ConvTranspose2dConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        let c = self;
        check.positive("in_channels", c.in_channels)?;
        check.positive("out_channels", c.out_channels)?;
        check.positive_all("kernel_size", &c.kernel_size)?;
        check.positive_all("stride", &c.stride)?;
        check.positive_all("dilation", &c.dilation)?;
        validate_conv(check, c.in_channels, c.out_channels, c.groups)?;
        for i in 0..2 {
            let op = c.output_padding[i];
            if op >= c.stride[i] && op >= c.dilation[i] {
                return Err(check.invalid(
                    "output_padding",
                    format!(
                        "must be smaller than either stride or dilation, got \
                         output_padding {:?}, stride {:?}, dilation {:?}",
                        c.output_padding, c.stride, c.dilation
                    ),
                ));
            }
        }
        Ok(())
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let c = self;
        match *input {
            [n, ch, h, w] if ch == c.in_channels => {
                let mut out = [0usize; 2];
                for (i, len) in [h, w].into_iter().enumerate() {
                    out[i] = transposed_out(
                        len,
                        c.kernel_size[i],
                        c.stride[i],
                        c.padding[i],
                        c.output_padding[i],
                        c.dilation[i],
                    )
                    .ok_or_else(|| {
                        at.mismatch(format!(
                            "[N, {}, H, W] large enough for a positive output with padding {:?}",
                            c.in_channels, c.padding
                        ))
                    })?;
                }
                Ok(vec![n, c.out_channels, out[0], out[1]])
            }
            _ => Err(at.mismatch(format!("[N, {}, H, W]", c.in_channels))),
        }
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        let c = self;
        params.weight_and_bias(
            vec![
                c.in_channels,
                c.out_channels / c.groups,
                c.kernel_size[0],
                c.kernel_size[1],
            ],
            c.bias.then_some(c.out_channels),
            c.weight_init.as_ref(),
            c.bias_init.as_ref(),
        )
    }
}
