//! Colour adjustments with torchvision v2's tensor formulas, `uint8`
//! behaviour included.
//!
//! torchvision computes these in `float32`: a `uint8` pixel times a factor is
//! a `float32`, `_blend` is `a * ratio + b * (1 - ratio)` (the second product
//! fused, as PyTorch's vectorised `add(alpha=...)`), clamped to `[0, 255]`
//! (or `[0, 1]` for floats) and, for `uint8`, truncated by the cast back.

use kiln_core::dtype::Element;
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

use super::image::{with_pixels, Layout};

/// An image element the colour operations take: `uint8` in `[0, 255]` or
/// `float32` in `[0, 1]`.
trait Pixel: Element {
    /// The largest valid value (torchvision's `_max_value`).
    const BOUND: f32;
    /// Whether this is an integer type (grayscale is floored for those).
    const INTEGER: bool;
    fn to_f32(self) -> f32;
    /// The element for `v`, already clamped to `[0, BOUND]` (truncates for ints).
    fn from_clamped(v: f32) -> Self;
    /// `v` in `[0, 1]` (torchvision's `to_dtype(float32, scale=True)`).
    fn to_unit(self) -> f32;
    /// Back from `[0, 1]` (`to_dtype(orig, scale=True)`).
    fn from_unit(v: f32) -> Self;
}

impl Pixel for u8 {
    const BOUND: f32 = 255.0;
    const INTEGER: bool = true;
    fn to_f32(self) -> f32 {
        f32::from(self)
    }
    fn from_clamped(v: f32) -> Self {
        v as u8
    }
    fn to_unit(self) -> f32 {
        f32::from(self) * (1.0f64 / 255.0) as f32
    }
    fn from_unit(v: f32) -> Self {
        // torchvision multiplies by 255 + 1 - 1e-3 and truncates.
        (v * (255.0f64 + 1.0 - 1e-3) as f32) as u8
    }
}

impl Pixel for f32 {
    const BOUND: f32 = 1.0;
    const INTEGER: bool = false;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_clamped(v: f32) -> Self {
        v
    }
    fn to_unit(self) -> f32 {
        self
    }
    fn from_unit(v: f32) -> Self {
        v
    }
}

/// `a * b + c` rounded once (PyTorch's vectorised `fmadd`). The product of
/// two `f32`s is exact in `f64`, so only the sum is rounded (twice, which
/// matters only on exact ties of the second rounding).
#[inline]
fn fmadd(a: f32, b: f32, c: f32) -> f32 {
    (f64::from(a) * f64::from(b) + f64::from(c)) as f32
}

#[inline]
fn clamp_to<P: Pixel>(v: f32) -> P {
    P::from_clamped(v.clamp(0.0, P::BOUND))
}

/// torchvision's `_blend(x, other, ratio)` for one element.
#[inline]
fn blend<P: Pixel>(x: P, other: f32, ratio: f32, alpha: f32) -> P {
    clamp_to(fmadd(other, alpha, x.to_f32() * ratio))
}

/// `ratio` and `1 - ratio` (computed in `f64` as Python does) as `f32`.
fn blend_factors(ratio: f64) -> (f32, f32) {
    (ratio as f32, (1.0 - ratio) as f32)
}

fn check_factor(name: &str, op: &str, factor: f64) -> Result<()> {
    if factor.is_finite() && factor >= 0.0 {
        Ok(())
    } else {
        Err(Error::invalid_argument(
            name,
            format!("{op}: the factor must be a finite number >= 0, got {factor}"),
        ))
    }
}

/// Maps every image of `img` (each `channels * height * width` elements)
/// through `op`, for either element type.
macro_rules! map_images {
    ($img:expr, $l:expr, |$src:ident, $dst:ident : $t:ident| $body:block) => {{
        let l: &Layout = $l;
        let mut out = $img.clone();
        if l.image() > 0 {
            with_pixels!($img, $t => {
                let input = $img.as_slice::<$t>()?;
                let output = out.as_mut_slice::<$t>()?;
                for ($src, $dst) in input.chunks_exact(l.image()).zip(output.chunks_exact_mut(l.image())) {
                    $body
                }
            });
        }
        Ok::<HostTensor, Error>(out)
    }};
}

/// Scales brightness: `clamp(x * factor)`, as
/// `v2.functional.adjust_brightness` (0 gives black, 1 the original).
///
/// `img` has 1 or 3 channels, `uint8` or `float32`; `factor >= 0`.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::adjust_brightness;
///
/// let img = HostTensor::new(vec![10u8, 100, 200], [3, 1, 1])?;
/// assert_eq!(adjust_brightness(&img, 1.5)?.as_slice::<u8>()?, &[15, 150, 255]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn adjust_brightness(img: &HostTensor, factor: f64) -> Result<HostTensor> {
    check_factor("brightness_factor", "adjust_brightness", factor)?;
    let l = Layout::of(img, "adjust_brightness")?;
    l.require_gray_or_rgb("adjust_brightness")?;
    let f = factor as f32;
    map_images!(img, &l, |src, dst: T| {
        for (o, &x) in dst.iter_mut().zip(src) {
            *o = clamp_to::<T>(x.to_f32() * f);
        }
    })
}

/// torchvision's grayscale of an RGB image: `0.2989 r + 0.587 g + 0.114 b`
/// in `float32`, floored for integer images.
fn grayscale<P: Pixel>(image: &[P], plane: usize) -> Vec<f32> {
    let (r, rest) = image.split_at(plane);
    let (g, b) = rest.split_at(plane);
    let (wr, wg, wb) = (0.2989f64 as f32, 0.587f64 as f32, 0.114f64 as f32);
    r.iter()
        .zip(g)
        .zip(&b[..plane])
        .map(|((&r, &g), &b)| {
            let l = fmadd(b.to_f32(), wb, fmadd(g.to_f32(), wg, r.to_f32() * wr));
            if P::INTEGER {
                l.floor()
            } else {
                l
            }
        })
        .collect()
}

/// Scales contrast: blends each image with the mean of its grayscale, as
/// `v2.functional.adjust_contrast` (0 gives a uniform gray image, 1 the
/// original). For `uint8` the grayscale is floored before the mean, as
/// torchvision does.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::adjust_contrast;
///
/// let img = HostTensor::new(vec![0.0f32, 1.0], [1, 1, 2])?;
/// assert_eq!(adjust_contrast(&img, 0.0)?.as_slice::<f32>()?, &[0.5, 0.5]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn adjust_contrast(img: &HostTensor, factor: f64) -> Result<HostTensor> {
    check_factor("contrast_factor", "adjust_contrast", factor)?;
    let l = Layout::of(img, "adjust_contrast")?;
    l.require_gray_or_rgb("adjust_contrast")?;
    let (ratio, alpha) = blend_factors(factor);
    let plane = l.plane();
    map_images!(img, &l, |src, dst: T| {
        // PyTorch sums float32 accurately (cascade) and divides in float32.
        let sum: f64 = if l.channels == 3 {
            grayscale(src, plane).iter().map(|&v| f64::from(v)).sum()
        } else {
            src.iter().map(|&v| f64::from(v.to_f32())).sum()
        };
        let mean = sum as f32 / plane as f32;
        for (o, &x) in dst.iter_mut().zip(src) {
            *o = blend(x, mean, ratio, alpha);
        }
    })
}

/// Scales saturation: blends each RGB image with its grayscale, as
/// `v2.functional.adjust_saturation` (0 gives grayscale, 1 the original).
/// One-channel images are returned unchanged.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::adjust_saturation;
///
/// let img = HostTensor::new(vec![1.0f32, 0.0, 0.0], [3, 1, 1])?;
/// let gray = adjust_saturation(&img, 0.0)?;
/// assert!(gray.as_slice::<f32>()?.iter().all(|&v| (v - 0.2989).abs() < 1e-6));
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn adjust_saturation(img: &HostTensor, factor: f64) -> Result<HostTensor> {
    check_factor("saturation_factor", "adjust_saturation", factor)?;
    let l = Layout::of(img, "adjust_saturation")?;
    l.require_gray_or_rgb("adjust_saturation")?;
    if l.channels == 1 {
        return Ok(img.clone());
    }
    let (ratio, alpha) = blend_factors(factor);
    let plane = l.plane();
    map_images!(img, &l, |src, dst: T| {
        let gray = grayscale(src, plane);
        for (ch_in, ch_out) in src.chunks_exact(plane).zip(dst.chunks_exact_mut(plane)) {
            for ((o, &x), &g) in ch_out.iter_mut().zip(ch_in).zip(&gray) {
                *o = blend(x, g, ratio, alpha);
            }
        }
    })
}

/// torchvision's `_rgb_to_hsv` for one pixel in `[0, 1]`.
#[inline]
fn rgb_to_hsv(r: f32, g: f32, b: f32) -> (f32, f32, f32) {
    let maxc = r.max(g).max(b);
    let minc = r.min(g).min(b);
    let eqc = maxc == minc;
    let range = maxc - minc;
    let s = range / if eqc { 1.0 } else { maxc };
    let div = if eqc { 1.0 } else { range };
    let rc = (maxc - r) / div;
    let gc = (maxc - g) / div;
    let bc = (maxc - b) / div;
    let mask = |m: bool| if m { 1.0f32 } else { 0.0 };
    let hr = (bc - gc) * mask(maxc == r);
    let hg = ((rc + 2.0) - bc) * mask(maxc == g && maxc != r);
    let hb = ((gc + 4.0) - rc) * mask(maxc != r && maxc != g);
    let h = (hr + hg) + hb;
    let h = (h * (1.0f64 / 6.0) as f32 + 1.0) % 1.0;
    (h, s, maxc)
}

/// torchvision's `_hsv_to_rgb` for one pixel.
#[inline]
fn hsv_to_rgb(h: f32, s: f32, v: f32) -> (f32, f32, f32) {
    let h6 = h * 6.0;
    let i = h6.floor();
    let f = h6 - i;
    let i = (i as i32).rem_euclid(6);
    let sxf = s * f;
    let one_minus_s = 1.0 - s;
    let q = ((1.0 - sxf) * v).clamp(0.0, 1.0);
    let t = ((sxf + one_minus_s) * v).clamp(0.0, 1.0);
    let p = (one_minus_s * v).clamp(0.0, 1.0);
    match i {
        0 => (v, t, p),
        1 => (q, v, p),
        2 => (p, v, t),
        3 => (p, q, v),
        4 => (t, p, v),
        _ => (v, p, q),
    }
}

/// PyTorch's `remainder(x, 1.0)` on floats: `fmod`, shifted into `[0, 1)`.
#[inline]
fn remainder_one(x: f32) -> f32 {
    let m = x % 1.0;
    if m != 0.0 && m < 0.0 {
        m + 1.0
    } else {
        m
    }
}

/// Shifts hue by `factor` (in `[-0.5, 0.5]`, a fraction of the colour
/// circle), as `v2.functional.adjust_hue`: RGB to HSV in `float32`, `h =
/// (h + factor) mod 1`, back to RGB; `uint8` goes through `[0, 1]` floats
/// and back with torchvision's scaling. One-channel images are unchanged.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::adjust_hue;
///
/// // red shifted by a third of the circle is green
/// let img = HostTensor::new(vec![1.0f32, 0.0, 0.0], [3, 1, 1])?;
/// assert_eq!(adjust_hue(&img, 1.0 / 3.0)?.as_slice::<f32>()?, &[0.0, 1.0, 0.0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn adjust_hue(img: &HostTensor, factor: f64) -> Result<HostTensor> {
    if !(-0.5..=0.5).contains(&factor) {
        return Err(Error::invalid_argument(
            "hue_factor",
            format!("adjust_hue: the factor must lie in [-0.5, 0.5], got {factor}"),
        ));
    }
    let l = Layout::of(img, "adjust_hue")?;
    l.require_gray_or_rgb("adjust_hue")?;
    if l.channels == 1 {
        return Ok(img.clone());
    }
    let f = factor as f32;
    let plane = l.plane();
    map_images!(img, &l, |src, dst: T| {
        let (r, rest) = src.split_at(plane);
        let (g, b) = rest.split_at(plane);
        let (ro, rest) = dst.split_at_mut(plane);
        let (go, bo) = rest.split_at_mut(plane);
        for i in 0..plane {
            let (h, s, v) = rgb_to_hsv(r[i].to_unit(), g[i].to_unit(), b[i].to_unit());
            let h = remainder_one(h + f);
            let (nr, ng, nb) = hsv_to_rgb(h, s, v);
            ro[i] = T::from_unit(nr);
            go[i] = T::from_unit(ng);
            bo[i] = T::from_unit(nb);
        }
    })
}
