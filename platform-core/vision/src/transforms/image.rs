//! The image layout the vision functions share: `[C, H, W]` or `[N, C, H, W]`
//! of `uint8` or `float32`.

use kiln_core::dtype::DType;
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// The dimensions of an image tensor: `count` images of `channels` planes of
/// `height` x `width`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Whether the tensor is a batch `[N, C, H, W]` (else `[C, H, W]`).
    pub batched: bool,
    pub count: usize,
    pub channels: usize,
    pub height: usize,
    pub width: usize,
}

impl Layout {
    /// The layout of `img`, checking rank and dtype (`uint8` or `float32`);
    /// `op` names the operation in errors.
    pub fn of(img: &HostTensor, op: &str) -> Result<Layout> {
        match img.dtype() {
            DType::U8 | DType::F32 => {}
            other => {
                return Err(Error::DTypeMismatch {
                    context: format!("{op} takes uint8 or float32 images"),
                    expected: DType::U8,
                    actual: other,
                })
            }
        }
        match *img.dims() {
            [c, h, w] => Ok(Layout {
                batched: false,
                count: 1,
                channels: c,
                height: h,
                width: w,
            }),
            [n, c, h, w] => Ok(Layout {
                batched: true,
                count: n,
                channels: c,
                height: h,
                width: w,
            }),
            _ => Err(Error::ShapeMismatch {
                context: op.into(),
                expected: "[C, H, W] or [N, C, H, W]".into(),
                actual: img.shape().to_string(),
            }),
        }
    }

    /// Elements of one plane.
    pub fn plane(&self) -> usize {
        self.height * self.width
    }

    /// Elements of one image.
    pub fn image(&self) -> usize {
        self.channels * self.plane()
    }

    /// The dims of a tensor like this one with planes of `height` x `width`.
    pub fn dims_with(&self, height: usize, width: usize) -> Vec<usize> {
        if self.batched {
            vec![self.count, self.channels, height, width]
        } else {
            vec![self.channels, height, width]
        }
    }

    /// Fails unless the images have 1 or 3 channels (the colour operations').
    pub fn require_gray_or_rgb(&self, op: &str) -> Result<()> {
        if self.channels == 1 || self.channels == 3 {
            Ok(())
        } else {
            Err(Error::ShapeMismatch {
                context: format!("{op} needs 1 (grayscale) or 3 (RGB) channels"),
                expected: "[1 or 3, H, W] or [N, 1 or 3, H, W]".into(),
                actual: format!(
                    "{} channels ({})",
                    self.channels,
                    self.dims_with(self.height, self.width)
                        .iter()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
        }
    }
}

/// Runs `$body` with `$t` bound to the element type of `$img` (`u8` or `f32`);
/// the caller has checked the dtype with [`Layout::of`].
macro_rules! with_pixels {
    ($img:expr, $t:ident => $body:expr) => {
        match $img.dtype() {
            kiln_core::dtype::DType::U8 => {
                type $t = u8;
                $body
            }
            _ => {
                type $t = f32;
                $body
            }
        }
    };
}
pub(crate) use with_pixels;
