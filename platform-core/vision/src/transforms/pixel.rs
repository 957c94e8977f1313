//! Element conversions the augmentations share (`uint8` or `float32`
//! pixels), with torchvision's casts.

use kiln_core::dtype::Element;
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

use super::image::Layout;

/// An image element: `uint8` in `[0, 255]` or `float32` in `[0, 1]`.
pub(crate) trait Px: Element {
    /// Whether this is `uint8`.
    const INTEGER: bool;
    /// The value as `f32` (exact).
    fn f32(self) -> f32;
    /// A fill value as an element: truncated for `uint8` (PyTorch's cast of
    /// a float to an integer type), rounded to `f32` otherwise. The caller
    /// has checked the range with [`check_fill`].
    fn from_fill(v: f64) -> Self;
    /// A float result back to the element type: rounded half to even for
    /// `uint8` (torchvision's `round_().to(uint8)`, after a clamp to
    /// `[0, 255]` that only ever removes rounding noise), unchanged for
    /// `float32`.
    fn from_rounded(v: f32) -> Self;
}

impl Px for u8 {
    const INTEGER: bool = true;
    fn f32(self) -> f32 {
        f32::from(self)
    }
    fn from_fill(v: f64) -> Self {
        v as u8
    }
    fn from_rounded(v: f32) -> Self {
        v.round_ties_even().clamp(0.0, 255.0) as u8
    }
}

impl Px for f32 {
    const INTEGER: bool = false;
    fn f32(self) -> f32 {
        self
    }
    fn from_fill(v: f64) -> Self {
        v as f32
    }
    fn from_rounded(v: f32) -> Self {
        v
    }
}

/// Checks `fill` (named `name`, for `op`): finite values, one for all
/// channels or one per channel (when `channels` is known).
pub(crate) fn check_fill(
    name: &str,
    op: &str,
    fill: &[f64],
    channels: Option<usize>,
) -> Result<()> {
    if fill.is_empty() {
        return Err(Error::invalid_argument(
            name,
            format!("{op}: give one fill value, or one per channel"),
        ));
    }
    if let Some(v) = fill.iter().find(|v| !v.is_finite()) {
        return Err(Error::invalid_argument(
            name,
            format!("{op}: fill values must be finite, got {v}"),
        ));
    }
    if let Some(c) = channels {
        if fill.len() != 1 && fill.len() != c {
            return Err(Error::invalid_argument(
                name,
                format!(
                    "{op}: {} fill values for images of {c} channels; expected 1 or {c}",
                    fill.len()
                ),
            ));
        }
    }
    Ok(())
}

/// Checks that `fill` suits `uint8` pixels (each in `[0, 255]`).
pub(crate) fn check_u8_fill(name: &str, op: &str, fill: &[f64]) -> Result<()> {
    if let Some(v) = fill.iter().find(|v| !(0.0..256.0).contains(*v)) {
        return Err(Error::invalid_argument(
            name,
            format!("{op}: fill {v} does not fit uint8 images; expected values in [0, 255]"),
        ));
    }
    Ok(())
}

/// The fill value of channel `c` (`fill` has one value or one per channel).
pub(crate) fn fill_of(fill: &[f64], c: usize) -> f64 {
    if fill.len() == 1 {
        fill[0]
    } else {
        fill[c]
    }
}

/// Applies `f` to every image of `x` (`[C, H, W]`, or each of `[N, C, H, W]`
/// in order, so a random transform draws separately for each).
pub(crate) fn each_image(
    x: HostTensor,
    op: &str,
    mut f: impl FnMut(&HostTensor) -> Result<HostTensor>,
) -> Result<HostTensor> {
    let l = Layout::of(&x, op)?;
    if !l.batched {
        return f(&x);
    }
    let images = (0..l.count)
        .map(|i| f(&x.row(i)?))
        .collect::<Result<Vec<_>>>()?;
    if images.is_empty() {
        return Ok(x);
    }
    HostTensor::stack(&images)
}
