//! Pooling: `MaxPool2d`, `AvgPool2d` (one config, the same rules) and
//! `AdaptiveAvgPool2d`.

use serde::{Deserialize, Serialize};

use super::builder::config_builder;
use super::conv::window_out;
use super::defaults::{opt_pair, pair};
use super::{FieldCheck, LayerSpec, ShapeCheck};
use crate::error::Result;

/// `nn.MaxPool2d` / `nn.AvgPool2d` (PyTorch defaults: `ceil_mode=False`,
/// `count_include_pad=True`, dilation 1).
///
/// ```
/// use kiln_core::model::{Layer, Pool2dConfig};
///
/// let pool = Layer::MaxPool2d(Pool2dConfig::new([2, 2]));
/// assert_eq!(pool.output_shape(&[1, 8, 7, 7])?, vec![1, 8, 3, 3]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pool2dConfig {
    /// Window size `[kh, kw]`.
    #[serde(deserialize_with = "pair")]
    pub kernel_size: [usize; 2],
    /// Stride; `None` (the default) means the kernel size.
    #[serde(
        default,
        deserialize_with = "opt_pair",
        skip_serializing_if = "Option::is_none"
    )]
    pub stride: Option<[usize; 2]>,
    /// Implicit padding on both sides (default `[0, 0]`); at most half the kernel size.
    #[serde(default, deserialize_with = "pair")]
    pub padding: [usize; 2],
}

config_builder! {
    Pool2dConfig {
        /// A pooling window with stride equal to its size and no padding.
        new(kernel_size: [usize; 2]) {
            kernel_size,
            stride: None,
            padding: [0, 0],
        }
        /// Sets the stride.
        with_stride(stride: Some([usize; 2]));
        /// Sets the padding.
        with_padding(padding: [usize; 2]);
    }
}

impl Pool2dConfig {
    /// The stride in effect: the configured one, or the kernel size.
    pub fn effective_stride(&self) -> [usize; 2] {
        self.stride.unwrap_or(self.kernel_size)
    }
}

// `Layer::MaxPool2d` and `Layer::AvgPool2d`.
impl LayerSpec for Pool2dConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        let c = self;
        check.positive_all("kernel_size", &c.kernel_size)?;
        if let Some(stride) = c.stride {
            check.positive_all("stride", &stride)?;
        }
        for i in 0..2 {
            if c.padding[i] > c.kernel_size[i] / 2 {
                return Err(check.invalid(
                    "padding",
                    format!(
                        "must be at most half the kernel size {:?}, got {:?}",
                        c.kernel_size, c.padding
                    ),
                ));
            }
        }
        Ok(())
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let c = self;
        match *input {
            [n, ch, h, w] => {
                let stride = c.effective_stride();
                let mut out = [0usize; 2];
                for (i, len) in [h, w].into_iter().enumerate() {
                    out[i] = window_out(len, c.kernel_size[i], stride[i], c.padding[i], 1)
                        .ok_or_else(|| {
                            at.mismatch(format!(
                                "[N, C, H, W] at least as large as the kernel {:?} after padding {:?}",
                                c.kernel_size, c.padding
                            ))
                        })?;
                }
                Ok(vec![n, ch, out[0], out[1]])
            }
            _ => Err(at.mismatch("[N, C, H, W]".to_owned())),
        }
    }
}

/// [`Layer::AdaptiveAvgPool2d`](crate::model::Layer::AdaptiveAvgPool2d)'s `output_size`.
pub(crate) struct AdaptiveAvgPool2d(pub(crate) [usize; 2]);

impl LayerSpec for AdaptiveAvgPool2d {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        check.positive_all("output_size", &self.0)
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let output_size = self.0;
        match *input {
            [n, ch, h, w] if h > 0 && w > 0 => Ok(vec![n, ch, output_size[0], output_size[1]]),
            _ => Err(at.mismatch("[N, C, H, W] with H, W >= 1".to_owned())),
        }
    }
}
