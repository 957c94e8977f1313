//! The photometric operations of the AutoAugment family, with torchvision
//! v2's tensor arithmetic: sharpness, posterize, solarize, autocontrast,
//! equalize and invert.

use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

use super::image::{with_pixels, Layout};
use super::pixel::Px;

/// What the operations need of an element beyond [`Px`].
pub(crate) trait Photo: Px {
    /// The largest valid value (torchvision's `_max_value`).
    const BOUND: f32;
    /// `bound - x` (`uint8`: bitwise not).
    fn invert(self) -> Self;
    /// Keeps the top `bits` bits (`uint8`), or `floor(x * 2^bits)` clamped
    /// and scaled back (`float32`).
    fn posterize(self, bits: u32) -> Self;
    /// torchvision's `to_dtype(uint8, scale=True)`.
    fn to_u8(self) -> u8;
    /// torchvision's `to_dtype(this, scale=True)` from `uint8`.
    fn from_u8(v: u8) -> Self;
    /// A clamped float result, truncated for `uint8` (PyTorch's cast).
    fn from_clamped(v: f32) -> Self;
}

impl Photo for u8 {
    const BOUND: f32 = 255.0;
    fn invert(self) -> Self {
        !self
    }
    fn posterize(self, bits: u32) -> Self {
        if bits >= 8 {
            self
        } else {
            let mask = (((1u32 << bits) - 1) << (8 - bits)) as u8;
            self & mask
        }
    }
    fn to_u8(self) -> u8 {
        self
    }
    fn from_u8(v: u8) -> Self {
        v
    }
    fn from_clamped(v: f32) -> Self {
        v as u8
    }
}

impl Photo for f32 {
    const BOUND: f32 = 1.0;
    fn invert(self) -> Self {
        1.0 - self
    }
    fn posterize(self, bits: u32) -> Self {
        let levels = (1u32 << bits) as f32;
        (self * levels).floor().clamp(0.0, levels - 1.0) * (1.0f64 / f64::from(levels)) as f32
    }
    fn to_u8(self) -> u8 {
        (self * (255.0f64 + 1.0 - 1e-3) as f32) as u8
    }
    fn from_u8(v: u8) -> Self {
        f32::from(v) * (1.0f64 / 255.0) as f32
    }
    fn from_clamped(v: f32) -> Self {
        v
    }
}

/// `img` with each element mapped by `f` (either dtype).
macro_rules! map_elements {
    ($img:expr, |$x:ident : $t:ident| $body:expr) => {{
        let mut out = $img.clone();
        with_pixels!($img, $t => {
            for o in out.as_mut_slice::<$t>()?.iter_mut() {
                let $x = *o;
                *o = $body;
            }
        });
        Ok::<HostTensor, Error>(out)
    }};
}

/// Inverts colours (`v2.functional.invert`): `255 - x` for `uint8`, `1 - x`
/// for `float32`.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::invert;
///
/// let img = HostTensor::new(vec![0u8, 55, 255], [1, 1, 3])?;
/// assert_eq!(invert(&img)?.as_slice::<u8>()?, &[255, 200, 0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn invert(img: &HostTensor) -> Result<HostTensor> {
    Layout::of(img, "invert")?;
    map_elements!(img, |x: T| x.invert())
}

/// Keeps `bits` (0 to 8) bits per channel (`v2.functional.posterize`):
/// `uint8` values are masked; `float32` values become `floor(x 2^bits) /
/// 2^bits`, at most `1 - 2^-bits`.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::posterize;
///
/// let img = HostTensor::new(vec![0u8, 100, 255], [1, 1, 3])?;
/// assert_eq!(posterize(&img, 2)?.as_slice::<u8>()?, &[0, 64, 192]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn posterize(img: &HostTensor, bits: u32) -> Result<HostTensor> {
    if bits > 8 {
        return Err(Error::invalid_argument(
            "bits",
            format!("posterize keeps 0 to 8 bits, got {bits}"),
        ));
    }
    Layout::of(img, "posterize")?;
    map_elements!(img, |x: T| x.posterize(bits))
}

/// Inverts the values at or above `threshold` (`v2.functional.solarize`;
/// `threshold` in the dtype's range, at most 255 or 1.0).
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::solarize;
///
/// let img = HostTensor::new(vec![10u8, 128, 250], [1, 1, 3])?;
/// assert_eq!(solarize(&img, 128.0)?.as_slice::<u8>()?, &[10, 127, 5]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn solarize(img: &HostTensor, threshold: f64) -> Result<HostTensor> {
    Layout::of(img, "solarize")?;
    let bound = if img.dtype() == kiln_core::DType::U8 {
        255.0
    } else {
        1.0
    };
    if threshold > bound || threshold.is_nan() {
        return Err(Error::invalid_argument(
            "threshold",
            format!("solarize threshold must be at most {bound} for this dtype, got {threshold}"),
        ));
    }
    // PyTorch compares in float32.
    let t = threshold as f32;
    map_elements!(img, |x: T| if x.f32() >= t { x.invert() } else { x })
}

/// Stretches each channel of each image to the full range
/// (`v2.functional.autocontrast`): `(x - min) / ((max - min) / bound)` in
/// `float32`, clamped (and truncated for `uint8`); a constant channel is
/// kept.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::autocontrast;
///
/// // 100 / (100 / 255) is 254.99998 in float32, truncated to 254 as in torchvision
/// let img = HostTensor::new(vec![50u8, 100, 150], [1, 1, 3])?;
/// assert_eq!(autocontrast(&img)?.as_slice::<u8>()?, &[0, 127, 254]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn autocontrast(img: &HostTensor) -> Result<HostTensor> {
    let l = Layout::of(img, "autocontrast")?;
    l.require_gray_or_rgb("autocontrast")?;
    let mut out = img.clone();
    if l.plane() == 0 {
        return Ok(out);
    }
    with_pixels!(img, T => {
        let inv_bound = (1.0f64 / f64::from(T::BOUND)) as f32;
        for plane in out.as_mut_slice::<T>()?.chunks_exact_mut(l.plane()) {
            let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
            for &x in plane.iter() {
                lo = lo.min(x.f32());
                hi = hi.max(x.f32());
            }
            let (min, scale) = if lo == hi { (0.0, 1.0) } else { (lo, (hi - lo) * inv_bound) };
            for o in plane.iter_mut() {
                *o = T::from_clamped(((o.f32() - min) / scale).clamp(0.0, T::BOUND));
            }
        }
    });
    Ok(out)
}

/// Equalizes the histogram of each channel of each image
/// (`v2.functional.equalize`, PIL's lookup table): `float32` images are
/// quantised to `uint8` first and scaled back after, as torchvision does. A
/// channel with too few values off its maximum is left as it is.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::equalize;
///
/// // half the pixels 10, half 20: spread to the ends of the range
/// let img = HostTensor::new((0..512).map(|i| if i < 256 { 10u8 } else { 20 }).collect(), [1, 16, 32])?;
/// let y = equalize(&img)?;
/// assert_eq!((y.as_slice::<u8>()?[0], y.as_slice::<u8>()?[511]), (0, 255));
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn equalize(img: &HostTensor) -> Result<HostTensor> {
    let l = Layout::of(img, "equalize")?;
    let mut out = img.clone();
    if l.plane() == 0 {
        return Ok(out);
    }
    with_pixels!(img, T => {
        for plane in out.as_mut_slice::<T>()?.chunks_exact_mut(l.plane()) {
            let q: Vec<u8> = plane.iter().map(|&x| x.to_u8()).collect();
            let mut hist = [0usize; 256];
            for &v in &q {
                hist[usize::from(v)] += 1;
            }
            let last = hist.iter().rposition(|&c| c > 0).unwrap_or(0);
            let step = (q.len() - hist[last]) / 255;
            let mut lut = [0u8; 256];
            if step > 0 {
                let mut cum = 0usize;
                for k in 1..256 {
                    cum += hist[k - 1];
                    lut[k] = (cum + step / 2).checked_div(step).unwrap_or(0).min(255) as u8;
                }
            }
            for (o, &v) in plane.iter_mut().zip(&q) {
                *o = T::from_u8(if step > 0 { lut[usize::from(v)] } else { v });
            }
        }
    });
    Ok(out)
}

/// Sharpens (factor > 1) or blurs (factor < 1) each image
/// (`v2.functional.adjust_sharpness`): blends the interior with a 3x3
/// smoothing of it (`[1 1 1; 1 5 1; 1 1 1] / 13`, rounded for `uint8`); the
/// one-pixel border is kept, as are images of at most 2 rows or columns.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::adjust_sharpness;
///
/// let img = HostTensor::new(vec![9u8; 16], [1, 4, 4])?;
/// assert_eq!(adjust_sharpness(&img, 2.0)?.as_slice::<u8>()?, &[9u8; 16]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn adjust_sharpness(img: &HostTensor, factor: f64) -> Result<HostTensor> {
    if !(factor.is_finite() && factor >= 0.0) {
        return Err(Error::invalid_argument(
            "sharpness_factor",
            format!("adjust_sharpness: the factor must be a finite number >= 0, got {factor}"),
        ));
    }
    let l = Layout::of(img, "adjust_sharpness")?;
    l.require_gray_or_rgb("adjust_sharpness")?;
    let (h, w) = (l.height, l.width);
    let mut out = img.clone();
    if l.image() == 0 || h <= 2 || w <= 2 {
        return Ok(out);
    }
    let (a, b) = ((1.0f64 / 13.0) as f32, (5.0f64 / 13.0) as f32);
    let kernel = [a, a, a, a, b, a, a, a, a];
    let alpha = (1.0 - factor) as f32;
    with_pixels!(img, T => {
        let src = img.as_slice::<T>()?;
        let dst = out.as_mut_slice::<T>()?;
        for (plane_in, plane_out) in src.chunks_exact(l.plane()).zip(dst.chunks_exact_mut(l.plane())) {
            for y in 1..h - 1 {
                for x in 1..w - 1 {
                    let mut acc = 0f32;
                    for i in 0..3 {
                        for j in 0..3 {
                            // PyTorch's convolution: row-major fused multiply-adds
                            acc = plane_in[(y + i - 1) * w + x + j - 1].f32().mul_add(kernel[i * 3 + j], acc);
                        }
                    }
                    let blurred = if T::INTEGER { acc.round_ties_even() } else { acc };
                    let v = plane_in[y * w + x].f32();
                    let mixed = (blurred - v).mul_add(alpha, v);
                    plane_out[y * w + x] = T::from_clamped(mixed.clamp(0.0, T::BOUND));
                }
            }
        }
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_and_uint8_agree_on_simple_values() -> Result<()> {
        let img = HostTensor::new(vec![0.0f32, 0.3, 0.75, 1.0], [1, 2, 2])?;
        assert_eq!(invert(&img)?.as_slice::<f32>()?, &[1.0, 0.7, 0.25, 0.0]);
        assert_eq!(
            posterize(&img, 1)?.as_slice::<f32>()?,
            &[0.0, 0.0, 0.5, 0.5]
        );
        assert_eq!(
            solarize(&img, 0.5)?.as_slice::<f32>()?,
            &[0.0, 0.3, 0.25, 0.0]
        );
        Ok(())
    }

    #[test]
    fn bad_arguments_name_themselves() {
        let img = HostTensor::zeros(kiln_core::DType::U8, [3, 4, 4]).expect("image");
        assert!(posterize(&img, 9)
            .expect_err("bits")
            .to_string()
            .contains("`bits`"));
        assert!(solarize(&img, 256.0)
            .expect_err("threshold")
            .to_string()
            .contains("`threshold`"));
        assert!(adjust_sharpness(&img, -1.0)
            .expect_err("factor")
            .to_string()
            .contains("`sharpness_factor`"));
        let two = HostTensor::zeros(kiln_core::DType::U8, [2, 4, 4]).expect("image");
        assert!(autocontrast(&two).is_err());
    }
}
