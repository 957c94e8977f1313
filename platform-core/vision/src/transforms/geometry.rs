//! Geometric operations: resize (bilinear with antialias), crops, flips.

use kiln_core::dtype::Element;
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;
use serde::{Deserialize, Serialize};

use super::image::{with_pixels, Layout};
use super::taps::taps_f32;

/// The size [`resize`] produces.
///
/// ```
/// use kiln_vision::transforms::ResizeTo;
///
/// // the shorter side becomes 32, the longer int(32 * 300 / 200) = 48
/// assert_eq!(ResizeTo::shorter(32).output_size(200, 300)?, (32, 48));
/// assert_eq!(ResizeTo::Exact { height: 5, width: 7 }.output_size(200, 300)?, (5, 7));
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResizeTo {
    /// torchvision's `size=int`: the shorter side becomes `size`, the longer
    /// `int(size * long / short)`; if that exceeds `max_size`, the longer side
    /// becomes `max_size` and the shorter `int(max_size * size / long)`.
    Shorter {
        /// Length of the shorter side.
        size: usize,
        /// Upper bound of the longer side; must exceed `size`.
        max_size: Option<usize>,
    },
    /// torchvision's `size=(height, width)`.
    Exact {
        /// Output height.
        height: usize,
        /// Output width.
        width: usize,
    },
}

impl ResizeTo {
    /// The shorter side becomes `size` (no `max_size`).
    pub fn shorter(size: usize) -> Self {
        ResizeTo::Shorter {
            size,
            max_size: None,
        }
    }

    /// Checks the sizes: all positive, `max_size > size`.
    pub fn validate(&self) -> Result<()> {
        match *self {
            ResizeTo::Shorter { size, max_size } => {
                if size == 0 {
                    return Err(Error::invalid_argument(
                        "size",
                        "Resize size must be positive, got 0",
                    ));
                }
                if let Some(max) = max_size {
                    if max <= size {
                        return Err(Error::invalid_argument(
                            "max_size",
                            format!("Resize max_size ({max}) must be greater than size ({size})"),
                        ));
                    }
                }
                Ok(())
            }
            ResizeTo::Exact { height, width } => {
                if height == 0 || width == 0 {
                    return Err(Error::invalid_argument(
                        "size",
                        format!("Resize to [{height}, {width}]: both sides must be positive"),
                    ));
                }
                Ok(())
            }
        }
    }

    /// `(height, width)` of the output for an input of `height` x `width`
    /// (torchvision's `_compute_resized_output_size`).
    pub fn output_size(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        self.validate()?;
        match *self {
            ResizeTo::Exact { height, width } => Ok((height, width)),
            ResizeTo::Shorter { size, max_size } => {
                let (short, long) = if width <= height {
                    (width, height)
                } else {
                    (height, width)
                };
                if short == 0 {
                    return Err(Error::invalid_argument(
                        "image",
                        format!("cannot resize an empty image of [{height}, {width}]"),
                    ));
                }
                // Python's int(a * b / c): an exact product, a correctly rounded
                // true division, then truncation.
                let scaled =
                    |a: usize, b: usize, c: usize| ((a as f64 * b as f64) / c as f64) as usize;
                let (mut new_short, mut new_long) = (size, scaled(size, long, short));
                if let Some(max) = max_size {
                    if new_long > max {
                        new_short = scaled(max, new_short, new_long);
                        new_long = max;
                    }
                }
                Ok(if width <= height {
                    (new_long, new_short)
                } else {
                    (new_short, new_long)
                })
            }
        }
    }
}

/// Resizes images with bilinear interpolation and antialiasing, as
/// torchvision's `v2.functional.resize(img, size, antialias=True)` on tensors
/// (`torch.nn.functional.interpolate(mode="bilinear", antialias=True,
/// align_corners=False)`).
///
/// `img` is `[C, H, W]` or `[N, C, H, W]`, `uint8` or `float32`. `uint8` uses
/// PyTorch's fixed-point CPU kernel (int16 weights, a horizontal pass rounded
/// to `uint8`, then a vertical pass); `float32` PyTorch's float kernel. An axis
/// whose size does not change is not resampled; an unchanged image is
/// returned as is.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::{resize, ResizeTo};
///
/// let img = HostTensor::new(vec![0u8, 100, 200, 250], [1, 2, 2])?;
/// let y = resize(&img, ResizeTo::Exact { height: 1, width: 1 })?;
/// assert_eq!(y.as_slice::<u8>()?, &[138]); // the mean, rounded
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn resize(img: &HostTensor, size: ResizeTo) -> Result<HostTensor> {
    let l = Layout::of(img, "resize")?;
    let (oh, ow) = size.output_size(l.height, l.width)?;
    resize_to(img, &l, oh, ow)
}

/// Resizes to exactly `oh` x `ow` (sizes already validated).
fn resize_to(img: &HostTensor, l: &Layout, oh: usize, ow: usize) -> Result<HostTensor> {
    if (oh, ow) == (l.height, l.width) {
        return Ok(img.clone());
    }
    let dims = l.dims_with(oh, ow);
    if l.count * l.channels == 0 {
        return HostTensor::zeros(img.dtype(), dims);
    }
    if l.height == 0 || l.width == 0 {
        return Err(Error::invalid_argument(
            "img",
            format!(
                "cannot resize an empty image of [{}, {}]",
                l.height, l.width
            ),
        ));
    }
    let planes = l.count * l.channels;
    match img.dtype() {
        kiln_core::DType::U8 => {
            let out = super::resize_u8::resize_u8(
                img.as_slice::<u8>()?,
                planes,
                l.channels,
                (l.height, l.width),
                (oh, ow),
            );
            HostTensor::new(out, dims)
        }
        _ => {
            let out = resize_f32(img.as_slice::<f32>()?, planes, l.height, l.width, oh, ow);
            HostTensor::new(out, dims)
        }
    }
}

fn resize_f32(src: &[f32], planes: usize, h: usize, w: usize, oh: usize, ow: usize) -> Vec<f32> {
    let horizontal: Vec<f32>;
    let src = if ow != w {
        let taps = taps_f32(w, ow);
        let mut out = vec![0f32; planes * h * ow];
        for (row_in, row_out) in src.chunks_exact(w).zip(out.chunks_exact_mut(ow)) {
            for (x, o) in row_out.iter_mut().enumerate() {
                let (start, k) = taps.get(x);
                let mut sum = 0.0f32;
                for (&p, &kk) in row_in[start..start + k.len()].iter().zip(k) {
                    sum += p * kk;
                }
                *o = sum;
            }
        }
        horizontal = out;
        &horizontal[..]
    } else {
        src
    };
    if oh == h {
        return src.to_vec();
    }
    let taps = taps_f32(h, oh);
    let mut out = vec![0f32; planes * oh * ow];
    for (plane_in, plane_out) in src.chunks_exact(h * ow).zip(out.chunks_exact_mut(oh * ow)) {
        for (y, row_out) in plane_out.chunks_exact_mut(ow).enumerate() {
            let (start, k) = taps.get(y);
            for (j, &kk) in k.iter().enumerate() {
                let row = &plane_in[(start + j) * ow..(start + j + 1) * ow];
                for (o, &p) in row_out.iter_mut().zip(row) {
                    *o += p * kk;
                }
            }
        }
    }
    out
}

/// Crops the box at (`top`, `left`) of `height` x `width` out of every image,
/// as torchvision's `v2.functional.crop`: the parts of the box outside the
/// image (negative `top`/`left`, or past the bottom/right) are zeros.
///
/// Works for `[C, H, W]` and `[N, C, H, W]` of `uint8` or `float32`.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::crop;
///
/// let img = HostTensor::new((1..=6).collect::<Vec<u8>>(), [1, 2, 3])?;
/// assert_eq!(crop(&img, 0, 1, 2, 2)?.as_slice::<u8>()?, &[2, 3, 5, 6]);
/// assert_eq!(crop(&img, -1, 2, 2, 2)?.as_slice::<u8>()?, &[0, 0, 3, 0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn crop(
    img: &HostTensor,
    top: i64,
    left: i64,
    height: usize,
    width: usize,
) -> Result<HostTensor> {
    let l = Layout::of(img, "crop")?;
    if height == 0 || width == 0 {
        return Err(Error::invalid_argument(
            "height",
            format!("crop of [{height}, {width}]: both sides must be positive"),
        ));
    }
    crop_unchecked(img, &l, top, left, height, width)
}

fn crop_unchecked(
    img: &HostTensor,
    l: &Layout,
    top: i64,
    left: i64,
    height: usize,
    width: usize,
) -> Result<HostTensor> {
    let dims = l.dims_with(height, width);
    if top == 0 && left == 0 && (height, width) == (l.height, l.width) {
        return Ok(img.clone());
    }
    with_pixels!(img, T => {
        let out = crop_planes::<T>(img.as_slice::<T>()?, l, top, left, height, width);
        HostTensor::new(out, dims)
    })
}

fn crop_planes<T: Element>(
    src: &[T],
    l: &Layout,
    top: i64,
    left: i64,
    height: usize,
    width: usize,
) -> Vec<T> {
    let planes = l.count * l.channels;
    let (h, w) = (l.height as i64, l.width as i64);
    let zero = T::zeroed();
    let mut out = vec![zero; planes * height * width];
    // The columns of the box inside the image, in box and image coordinates.
    let x0 = left.clamp(0, w);
    let x1 = (left + width as i64).clamp(0, w);
    if l.plane() == 0 {
        return out;
    }
    for (p, plane_out) in out.chunks_exact_mut(height * width).enumerate() {
        let plane_in = &src[p * l.plane()..(p + 1) * l.plane()];
        for (y, row_out) in plane_out.chunks_exact_mut(width).enumerate() {
            let yy = top + y as i64;
            if yy < 0 || yy >= h || x1 <= x0 {
                continue;
            }
            let row_in = &plane_in[(yy * w) as usize..((yy + 1) * w) as usize];
            let dst = (x0 - left) as usize;
            row_out[dst..dst + (x1 - x0) as usize]
                .copy_from_slice(&row_in[x0 as usize..x1 as usize]);
        }
    }
    out
}

/// Python's `round` (ties to even) of `x / 2` for an integer `x`.
fn half_round_even(x: i64) -> i64 {
    (x as f64 / 2.0).round_ties_even() as i64
}

/// Crops the `height` x `width` centre of every image, as torchvision's
/// `v2.functional.center_crop`: the offset is `round((H - height) / 2)`
/// (ties to even), and an image smaller than the crop is padded with zeros
/// (`(height - H) // 2` rows on top, the rest below; likewise for columns).
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::center_crop;
///
/// let img = HostTensor::new((1..=9).collect::<Vec<u8>>(), [1, 3, 3])?;
/// assert_eq!(center_crop(&img, 1, 1)?.as_slice::<u8>()?, &[5]);
/// assert_eq!(center_crop(&img, 1, 4)?.as_slice::<u8>()?, &[4, 5, 6, 0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn center_crop(img: &HostTensor, height: usize, width: usize) -> Result<HostTensor> {
    let l = Layout::of(img, "center_crop")?;
    if height == 0 || width == 0 {
        return Err(Error::invalid_argument(
            "size",
            format!("center_crop to [{height}, {width}]: both sides must be positive"),
        ));
    }
    let (top, left) = center_crop_offset(l.height, l.width, height, width);
    crop_unchecked(img, &l, top, left, height, width)
}

/// The top-left corner of torchvision's centre crop, in image coordinates
/// (negative where the crop is padded).
pub(crate) fn center_crop_offset(h: usize, w: usize, ch: usize, cw: usize) -> (i64, i64) {
    let axis = |size: usize, crop: usize| -> i64 {
        if crop > size {
            // Padded by (crop - size) // 2 before, then the crop is the whole padded axis.
            -(((crop - size) / 2) as i64)
        } else {
            half_round_even(size as i64 - crop as i64)
        }
    };
    (axis(h, ch), axis(w, cw))
}

/// Crops a box and resizes it to `out_height` x `out_width`, as torchvision's
/// `v2.functional.resized_crop(img, top, left, height, width, size,
/// antialias=True)`: [`crop`] then [`resize`].
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::resized_crop;
///
/// let img = HostTensor::new(vec![0.0f32, 1.0, 2.0, 3.0], [1, 2, 2])?;
/// let y = resized_crop(&img, 0, 0, 2, 1, 1, 1)?;
/// assert_eq!(y.as_slice::<f32>()?, &[1.0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn resized_crop(
    img: &HostTensor,
    top: i64,
    left: i64,
    height: usize,
    width: usize,
    out_height: usize,
    out_width: usize,
) -> Result<HostTensor> {
    ResizeTo::Exact {
        height: out_height,
        width: out_width,
    }
    .validate()?;
    let cropped = crop(img, top, left, height, width)?;
    let l = Layout::of(&cropped, "resized_crop")?;
    resize_to(&cropped, &l, out_height, out_width)
}

/// Mirrors every image left to right (`v2.functional.horizontal_flip`).
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::hflip;
///
/// let img = HostTensor::new(vec![1u8, 2, 3, 4], [1, 2, 2])?;
/// assert_eq!(hflip(&img)?.as_slice::<u8>()?, &[2, 1, 4, 3]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn hflip(img: &HostTensor) -> Result<HostTensor> {
    let l = Layout::of(img, "hflip")?;
    let mut out = img.clone();
    if l.width == 0 {
        return Ok(out);
    }
    with_pixels!(img, T => {
        for row in out.as_mut_slice::<T>()?.chunks_exact_mut(l.width) {
            row.reverse();
        }
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_sizes_follow_torchvision() -> Result<()> {
        // int(size * long / short), portrait and landscape
        assert_eq!(ResizeTo::shorter(224).output_size(375, 500)?, (224, 298));
        assert_eq!(ResizeTo::shorter(224).output_size(500, 375)?, (298, 224));
        assert_eq!(ResizeTo::shorter(10).output_size(10, 10)?, (10, 10));
        let capped = ResizeTo::Shorter {
            size: 100,
            max_size: Some(150),
        };
        // long would be 200 > 150: long = 150, short = int(150 * 100 / 200) = 75
        assert_eq!(capped.output_size(100, 200)?, (75, 150));
        let bad = ResizeTo::Shorter {
            size: 100,
            max_size: Some(100),
        };
        assert!(bad.output_size(10, 10).is_err());
        assert!(ResizeTo::shorter(0).validate().is_err());
        assert!(ResizeTo::Exact {
            height: 0,
            width: 3
        }
        .validate()
        .is_err());
        Ok(())
    }

    #[test]
    fn center_offsets_round_half_to_even() {
        // (5 - 2) / 2 = 1.5 -> 2; (7 - 2) / 2 = 2.5 -> 2
        assert_eq!(center_crop_offset(5, 7, 2, 2), (2, 2));
        // padding: (4 - 1) // 2 = 1 before
        assert_eq!(center_crop_offset(1, 1, 4, 4), (-1, -1));
    }

    #[test]
    fn taps_sum_to_one() {
        for (i, o) in [(10, 3), (3, 10), (37, 16), (224, 224)] {
            let t = taps_f32(i, o);
            for x in 0..o {
                let (start, w) = t.get(x);
                assert!(start + w.len() <= i);
                let s: f32 = w.iter().sum();
                assert!((s - 1.0).abs() < 1e-5, "{i}->{o} at {x}: {s}");
            }
        }
    }

    #[test]
    fn rejects_bad_arguments() -> Result<()> {
        let img = HostTensor::zeros(kiln_core::DType::U8, [3, 4, 4])?;
        assert!(crop(&img, 0, 0, 0, 2).is_err());
        assert!(center_crop(&img, 2, 0).is_err());
        assert!(resized_crop(&img, 0, 0, 2, 2, 0, 2).is_err());
        let i64_img = HostTensor::zeros(kiln_core::DType::I64, [3, 4, 4])?;
        assert!(matches!(hflip(&i64_img), Err(Error::DTypeMismatch { .. })));
        let flat = HostTensor::zeros(kiln_core::DType::U8, [4, 4])?;
        assert!(matches!(
            resize(&flat, ResizeTo::shorter(2)),
            Err(Error::ShapeMismatch { .. })
        ));
        Ok(())
    }
}
