//! Photometric augmentations with torchvision v2's tensor arithmetic:
//! grayscale, Gaussian blur and random erasing.

use kiln_core::dtype::DType;
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

use super::image::{with_pixels, Layout};
use super::pixel::{check_u8_fill, each_image, Px};
use kiln_data::{Transform, TransformRng};

/// `a * b + c` rounded once to `f32`, as a fused multiply-add (PyTorch's
/// vectorised `add(alpha=...)` and convolutions), through `f64` (where the
/// product is exact) so that it vectorises without hardware FMA; it can
/// differ from a true FMA only when the `f64` sum lands exactly on an `f32`
/// rounding tie.
#[inline(always)]
fn fmadd(a: f32, b: f32, c: f32) -> f32 {
    (f64::from(a) * f64::from(b) + f64::from(c)) as f32
}

fn check_probability(op: &str, p: f64) -> Result<()> {
    if (0.0..=1.0).contains(&p) {
        Ok(())
    } else {
        Err(Error::invalid_argument(
            "p",
            format!("{op} probability must lie in [0, 1], got {p}"),
        ))
    }
}

/// Converts RGB images to grayscale with `num_output_channels` channels (1
/// or 3), as `v2.functional.rgb_to_grayscale`: `0.2989 r + 0.587 g + 0.114
/// b` in `float32` (truncated for `uint8`). One-channel images are copied
/// (or repeated to 3 channels).
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::rgb_to_grayscale;
///
/// // the weights sum to 0.9999 in float32, so white truncates to 254, as in torchvision
/// let img = HostTensor::new(vec![255u8, 255, 255], [3, 1, 1])?;
/// assert_eq!(rgb_to_grayscale(&img, 3)?.as_slice::<u8>()?, &[254, 254, 254]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn rgb_to_grayscale(img: &HostTensor, num_output_channels: usize) -> Result<HostTensor> {
    if num_output_channels != 1 && num_output_channels != 3 {
        return Err(Error::invalid_argument(
            "num_output_channels",
            format!("rgb_to_grayscale gives 1 or 3 channels, got {num_output_channels}"),
        ));
    }
    let l = Layout::of(img, "rgb_to_grayscale")?;
    l.require_gray_or_rgb("rgb_to_grayscale")?;
    let dims = {
        let mut d = img.dims().to_vec();
        let r = d.len();
        d[r - 3] = num_output_channels;
        d
    };
    let plane = l.plane();
    with_pixels!(img, T => {
        let src = img.as_slice::<T>()?;
        let mut out = Vec::with_capacity(l.count * num_output_channels * plane);
        if l.image() > 0 {
            for image in src.chunks_exact(l.image()) {
                let gray: Vec<T> = if l.channels == 1 {
                    image.to_vec()
                } else {
                    gray_plane(image, plane)
                };
                for _ in 0..num_output_channels {
                    out.extend_from_slice(&gray);
                }
            }
        }
        HostTensor::new(out, dims)
    })
}

fn gray_plane<T: Px>(image: &[T], plane: usize) -> Vec<T> {
    let (wr, wg, wb) = (0.2989f64 as f32, 0.587f64 as f32, 0.114f64 as f32);
    (0..plane)
        .map(|i| {
            let (r, g, b) = (
                image[i].f32(),
                image[plane + i].f32(),
                image[2 * plane + i].f32(),
            );
            let v = fmadd(b, wb, fmadd(g, wg, r * wr));
            if T::INTEGER {
                T::from_fill(f64::from(v))
            } else {
                T::from_rounded(v)
            }
        })
        .collect()
}

/// Converts each image to grayscale with probability `p`, keeping the
/// number of channels (`torchvision.transforms.v2.RandomGrayscale(p)`): one
/// uniform draw per image, converted when it is below `p`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RandomGrayscale {
    /// Probability of converting an image.
    pub p: f64,
}

impl Default for RandomGrayscale {
    /// `p = 0.1`, torchvision's default.
    fn default() -> Self {
        RandomGrayscale { p: 0.1 }
    }
}

impl RandomGrayscale {
    /// Checks that `p` lies in `[0, 1]`.
    pub fn validate(&self) -> Result<()> {
        check_probability("RandomGrayscale", self.p)
    }

    /// Whether the next image is converted.
    pub fn get_params(&self, rng: &mut TransformRng) -> bool {
        rng.next_f64() < self.p
    }
}

impl Transform for RandomGrayscale {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.validate()?;
        each_image(x, "RandomGrayscale", |img| {
            let l = Layout::of(img, "RandomGrayscale")?;
            if self.get_params(rng) {
                rgb_to_grayscale(img, l.channels)
            } else {
                Ok(img.clone())
            }
        })
    }
}

/// torchvision's 1-D Gaussian kernel in `float32`: `softmax(-(x / sigma)^2)`
/// over `x = linspace(-lim, lim, size)`, `lim = (size - 1) / (2 sqrt 2)`.
fn gaussian_kernel1d(size: usize, sigma: f64) -> Vec<f32> {
    let lim = (size as f64 - 1.0) / (2.0 * 2f64.sqrt());
    let (start, end) = (-lim as f32, lim as f32);
    let xs: Vec<f32> = if size == 1 {
        vec![start]
    } else {
        // PyTorch's linspace: from the start for the first half, from the
        // end for the second, each a fused multiply-add as compiled.
        let step = (end - start) / (size - 1) as f32;
        (0..size)
            .map(|i| {
                if i < size / 2 {
                    step.mul_add(i as f32, start)
                } else {
                    (-step).mul_add((size - 1 - i) as f32, end)
                }
            })
            .collect()
    };
    let s = sigma as f32;
    let logits: Vec<f32> = xs
        .iter()
        .map(|&x| {
            let v = x / s;
            -(v * v)
        })
        .collect();
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.iter().map(|&v| (v - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    let inv = 1.0 / sum;
    e.iter().map(|&v| v * inv).collect()
}

fn check_kernel_size(kernel_size: (usize, usize)) -> Result<()> {
    let (kx, ky) = kernel_size;
    if kx % 2 == 0 || ky % 2 == 0 {
        return Err(Error::invalid_argument(
            "kernel_size",
            format!("Gaussian blur kernel sides must be odd and positive, got [{kx}, {ky}]"),
        ));
    }
    Ok(())
}

fn check_sigma(sigma: (f64, f64)) -> Result<()> {
    if !(sigma.0 > 0.0 && sigma.1 > 0.0 && sigma.0.is_finite() && sigma.1.is_finite()) {
        return Err(Error::invalid_argument(
            "sigma",
            format!(
                "Gaussian blur sigma must be finite and positive, got ({}, {})",
                sigma.0, sigma.1
            ),
        ));
    }
    Ok(())
}

/// Blurs every image with a Gaussian kernel, as
/// `v2.functional.gaussian_blur(img, kernel_size, sigma)`: `kernel_size` and
/// `sigma` are `(x, y)` (width first, torchvision's order), the image is
/// padded by reflection (each half kernel must be smaller than the side), the
/// 2-D kernel is the outer product of the 1-D ones in `float32`, and a
/// `uint8` result is rounded half to even.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::gaussian_blur;
///
/// let flat = HostTensor::new(vec![100u8; 25], [1, 5, 5])?;
/// assert_eq!(gaussian_blur(&flat, (3, 3), (1.0, 1.0))?.as_slice::<u8>()?, &[100u8; 25]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn gaussian_blur(
    img: &HostTensor,
    kernel_size: (usize, usize),
    sigma: (f64, f64),
) -> Result<HostTensor> {
    check_kernel_size(kernel_size)?;
    check_sigma(sigma)?;
    let l = Layout::of(img, "gaussian_blur")?;
    let (kx, ky) = kernel_size;
    let (px, py) = (kx / 2, ky / 2);
    if l.image() == 0 {
        return Ok(img.clone());
    }
    if px >= l.width || py >= l.height {
        return Err(Error::invalid_argument(
            "kernel_size",
            format!(
                "gaussian_blur with a [{kx}, {ky}] kernel pads by reflection, which needs images larger than half the kernel; got [{}, {}]",
                l.height, l.width
            ),
        ));
    }
    let wx = gaussian_kernel1d(kx, sigma.0);
    let wy = gaussian_kernel1d(ky, sigma.1);
    let k2: Vec<f32> = wy
        .iter()
        .flat_map(|&a| wx.iter().map(move |&b| a * b))
        .collect();
    let (h, w) = (l.height, l.width);
    let reflect = |i: i64, n: usize| -> usize {
        let n = n as i64;
        let j = if i < 0 {
            -i
        } else if i >= n {
            2 * (n - 1) - i
        } else {
            i
        };
        j as usize
    };
    // Padded rows and columns, as indices into the image.
    let rows: Vec<usize> = (0..h + 2 * py)
        .map(|y| reflect(y as i64 - py as i64, h))
        .collect();
    let cols: Vec<usize> = (0..w + 2 * px)
        .map(|x| reflect(x as i64 - px as i64, w))
        .collect();
    with_pixels!(img, T => {
        let src = img.as_slice::<T>()?;
        let mut out = Vec::with_capacity(src.len());
        let mut padded = vec![0f32; (h + 2 * py) * (w + 2 * px)];
        let pw = w + 2 * px;
        for plane in src.chunks_exact(l.plane()) {
            for (prow, &sy) in padded.chunks_exact_mut(pw).zip(&rows) {
                for (o, &sx) in prow.iter_mut().zip(&cols) {
                    *o = plane[sy * w + sx].f32();
                }
            }
            let mut acc = vec![0f32; w];
            for y in 0..h {
                acc.fill(0.0);
                // PyTorch's convolution order: taps row-major, each a fused
                // multiply-add, one output row at a time (vectorisable).
                for i in 0..ky {
                    let prow = &padded[(y + i) * pw..(y + i + 1) * pw];
                    for (j, &kv) in k2[i * kx..(i + 1) * kx].iter().enumerate() {
                        for (a, &pv) in acc.iter_mut().zip(&prow[j..j + w]) {
                            *a = fmadd(pv, kv, *a);
                        }
                    }
                }
                out.extend(acc.iter().map(|&v| T::from_rounded(v)));
            }
        }
        HostTensor::new(out, img.dims().to_vec())
    })
}

/// Blurs each image with a Gaussian of random width
/// (`torchvision.transforms.v2.GaussianBlur(kernel_size, sigma)`): sigma
/// uniform in `sigma` (default `(0.1, 2.0)`), the same along both axes.
///
/// ```
/// use kiln_vision::transforms::GaussianBlur;
/// use kiln_data::TransformRng;
///
/// let t = GaussianBlur::new((5, 5), (0.1, 2.0))?;
/// let s = t.get_params(&mut TransformRng::new(3));
/// assert!((0.1..=2.0).contains(&s));
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GaussianBlur {
    /// Kernel `(width, height)`, both odd.
    pub kernel_size: (usize, usize),
    /// Range of sigma, `0 < min <= max`.
    pub sigma: (f64, f64),
}

impl GaussianBlur {
    /// A blur, validated.
    pub fn new(kernel_size: (usize, usize), sigma: (f64, f64)) -> Result<Self> {
        let b = GaussianBlur { kernel_size, sigma };
        b.validate()?;
        Ok(b)
    }

    /// Checks odd kernel sides and `0 < sigma.0 <= sigma.1`.
    pub fn validate(&self) -> Result<()> {
        check_kernel_size(self.kernel_size)?;
        check_sigma(self.sigma)?;
        if self.sigma.0 > self.sigma.1 {
            return Err(Error::invalid_argument(
                "sigma",
                format!(
                    "GaussianBlur sigma range must satisfy min <= max, got ({}, {})",
                    self.sigma.0, self.sigma.1
                ),
            ));
        }
        Ok(())
    }

    /// Draws sigma.
    pub fn get_params(&self, rng: &mut TransformRng) -> f64 {
        self.sigma.0 + (self.sigma.1 - self.sigma.0) * rng.next_f64()
    }
}

impl Transform for GaussianBlur {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.validate()?;
        each_image(x, "GaussianBlur", |img| {
            let s = self.get_params(rng);
            gaussian_blur(img, self.kernel_size, (s, s))
        })
    }
}

/// Sets the box at (`top`, `left`) of `height` x `width` of every image to
/// `values` (`v2.functional.erase`): one value for all channels, one per
/// channel, or `channels * height * width` values. For `uint8` images the
/// values must lie in `[0, 255]` and are truncated.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::erase;
///
/// let img = HostTensor::new(vec![1u8; 6], [1, 2, 3])?;
/// assert_eq!(erase(&img, 0, 1, 2, 1, &[0.0])?.as_slice::<u8>()?, &[1, 0, 1, 1, 0, 1]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn erase(
    img: &HostTensor,
    top: usize,
    left: usize,
    height: usize,
    width: usize,
    values: &[f32],
) -> Result<HostTensor> {
    let l = Layout::of(img, "erase")?;
    let fits = |start: usize, len: usize, side: usize| {
        start.checked_add(len).is_some_and(|end| end <= side)
    };
    if !fits(top, height, l.height) || !fits(left, width, l.width) {
        return Err(Error::invalid_argument(
            "height",
            format!(
                "erase box at ({top}, {left}) of [{height}, {width}] leaves the image [{}, {}]",
                l.height, l.width
            ),
        ));
    }
    let c = l.channels;
    let per_pixel = c * height * width;
    if values.len() != 1 && values.len() != c && values.len() != per_pixel {
        return Err(Error::invalid_argument(
            "value",
            format!(
                "erase takes 1, {c} (per channel) or {per_pixel} (per pixel) values, got {}",
                values.len()
            ),
        ));
    }
    if img.dtype() == DType::U8 {
        let as_f64: Vec<f64> = values.iter().map(|&v| f64::from(v)).collect();
        check_u8_fill("value", "erase", &as_f64)?;
    }
    let mut out = img.clone();
    if height == 0 || width == 0 || l.image() == 0 {
        return Ok(out);
    }
    with_pixels!(img, T => {
        let dst = out.as_mut_slice::<T>()?;
        for image in dst.chunks_exact_mut(l.image()) {
            for (ch, plane) in image.chunks_exact_mut(l.plane()).enumerate() {
                for y in 0..height {
                    let row = &mut plane[(top + y) * l.width + left..(top + y) * l.width + left + width];
                    for (x, o) in row.iter_mut().enumerate() {
                        let v = match values.len() {
                            1 => values[0],
                            n if n == per_pixel => values[(ch * height + y) * width + x],
                            _ => values[ch],
                        };
                        *o = T::from_fill(f64::from(v));
                    }
                }
            }
        }
    });
    Ok(out)
}

/// What [`RandomErasing`] writes into the box.
#[derive(Clone, Debug, PartialEq)]
pub enum EraseValue {
    /// One value for all channels, or one per channel.
    Constant(Vec<f64>),
    /// Standard normal noise per pixel (`value="random"`; float images only).
    Random,
}

/// The box [`RandomErasing`] drew for one image and the values to write.
#[derive(Clone, Debug, PartialEq)]
pub struct ErasingParams {
    /// First row.
    pub top: usize,
    /// First column.
    pub left: usize,
    /// Rows.
    pub height: usize,
    /// Columns.
    pub width: usize,
    /// The values for [`erase`] (one, per channel, or per pixel).
    pub values: Vec<f32>,
}

/// Erases a random box of each image with probability `p`
/// (`torchvision.transforms.v2.RandomErasing(p, scale, ratio, value)`).
///
/// The box's area is a fraction uniform in `scale` of the image's, its
/// aspect ratio (height / width) log-uniform in `ratio`; of up to ten
/// draws the first whose sides are both smaller than the image's is used,
/// at a uniform position, else the image is left as it is. Recipes apply it
/// after [`ToTensor`](super::ToTensor); `uint8` images take constant values
/// in `[0, 255]` only (torchvision would cast normal noise to `uint8`).
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::RandomErasing;
/// use kiln_data::{Transform, TransformRng};
///
/// let mut t = RandomErasing::default();
/// t.p = 1.0;
/// let img = HostTensor::new(vec![1.0f32; 3 * 20 * 20], [3, 20, 20])?;
/// let y = t.apply(img, &mut TransformRng::new(0))?;
/// assert!(y.as_slice::<f32>()?.iter().any(|&v| v == 0.0));
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct RandomErasing {
    /// Probability of erasing an image.
    pub p: f64,
    /// Range of the box's area as a fraction of the image's.
    pub scale: (f64, f64),
    /// Range of the box's aspect ratio (height / width).
    pub ratio: (f64, f64),
    /// What to write.
    pub value: EraseValue,
}

impl Default for RandomErasing {
    /// torchvision's defaults: `p = 0.5`, `scale = (0.02, 0.33)`, `ratio =
    /// (0.3, 3.3)`, `value = 0`.
    fn default() -> Self {
        RandomErasing {
            p: 0.5,
            scale: (0.02, 0.33),
            ratio: (0.3, 3.3),
            value: EraseValue::Constant(vec![0.0]),
        }
    }
}

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut TransformRng) -> f32 {
    let u1 = 1.0 - rng.next_f64();
    let u2 = rng.next_f64();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

impl RandomErasing {
    /// Checks `p` in `[0, 1]`, `0 <= scale.0 <= scale.1 <= 1`, `0 < ratio.0
    /// <= ratio.1` and finite constant values.
    pub fn validate(&self) -> Result<()> {
        check_probability("RandomErasing", self.p)?;
        let (s0, s1) = self.scale;
        if !(0.0 <= s0 && s0 <= s1 && s1 <= 1.0) {
            return Err(Error::invalid_argument(
                "scale",
                format!("RandomErasing scale must satisfy 0 <= min <= max <= 1, got ({s0}, {s1})"),
            ));
        }
        let (r0, r1) = self.ratio;
        if !(r0 > 0.0 && r0 <= r1 && r1.is_finite()) {
            return Err(Error::invalid_argument(
                "ratio",
                format!(
                    "RandomErasing ratio must satisfy 0 < min <= max (finite), got ({r0}, {r1})"
                ),
            ));
        }
        if let EraseValue::Constant(v) = &self.value {
            super::pixel::check_fill("value", "RandomErasing", v, None)?;
        }
        Ok(())
    }

    /// Draws whether to erase (`None`: no, or no box fitted) and the box
    /// and values for an image of `channels` x `height` x `width`
    /// (torchvision's `RandomErasing.make_params`, after its `p` draw).
    pub fn get_params(
        &self,
        channels: usize,
        height: usize,
        width: usize,
        rng: &mut TransformRng,
    ) -> Result<Option<ErasingParams>> {
        if let EraseValue::Constant(v) = &self.value {
            if v.len() != 1 && v.len() != channels {
                return Err(Error::invalid_argument(
                    "value",
                    format!(
                        "RandomErasing has {} values for images of {channels} channels; expected 1 or {channels}",
                        v.len()
                    ),
                ));
            }
        }
        if rng.next_f64() >= self.p {
            return Ok(None);
        }
        let area = (height * width) as f64;
        let (l0, l1) = (self.ratio.0.ln(), self.ratio.1.ln());
        for _ in 0..10 {
            let erase_area = area * (self.scale.0 + (self.scale.1 - self.scale.0) * rng.next_f64());
            let aspect = (l0 + (l1 - l0) * rng.next_f64()).exp();
            let h = (erase_area * aspect).sqrt().round_ties_even() as usize;
            let w = (erase_area / aspect).sqrt().round_ties_even() as usize;
            if !(h < height && w < width) {
                continue;
            }
            let values = match &self.value {
                EraseValue::Constant(v) => v.iter().map(|&x| x as f32).collect(),
                EraseValue::Random => (0..channels * h * w).map(|_| normal(rng)).collect(),
            };
            let top = rng.below((height - h + 1) as u64) as usize;
            let left = rng.below((width - w + 1) as u64) as usize;
            return Ok(Some(ErasingParams {
                top,
                left,
                height: h,
                width: w,
                values,
            }));
        }
        Ok(None)
    }
}

impl Transform for RandomErasing {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.validate()?;
        if self.value == EraseValue::Random && x.dtype() == DType::U8 {
            return Err(Error::invalid_argument(
                "value",
                "RandomErasing with random values needs float images: put to_tensor before it",
            ));
        }
        each_image(x, "RandomErasing", |img| {
            let l = Layout::of(img, "RandomErasing")?;
            match self.get_params(l.channels, l.height, l.width, rng)? {
                Some(p) => erase(img, p.top, p.left, p.height, p.width, &p.values),
                None => Ok(img.clone()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_is_normalised_and_symmetric() {
        for (k, s) in [(3, 0.5), (5, 1.3), (9, 2.0), (1, 1.0)] {
            let w = gaussian_kernel1d(k, s);
            let sum: f32 = w.iter().sum();
            assert!((sum - 1.0).abs() < 1e-6, "{k} {s}: {sum}");
            for i in 0..k {
                assert!((w[i] - w[k - 1 - i]).abs() < 1e-7);
            }
        }
    }

    #[test]
    fn bad_arguments_name_themselves() {
        let img = HostTensor::zeros(DType::U8, [3, 8, 8]).expect("image");
        let err = gaussian_blur(&img, (4, 3), (1.0, 1.0)).expect_err("even");
        assert!(err.to_string().contains("`kernel_size`"), "{err}");
        let err = gaussian_blur(&img, (3, 3), (0.0, 1.0)).expect_err("sigma");
        assert!(err.to_string().contains("`sigma`"), "{err}");
        assert!(gaussian_blur(&img, (17, 3), (1.0, 1.0)).is_err());
        assert!(GaussianBlur::new((3, 3), (2.0, 1.0)).is_err());
        let err = erase(&img, 5, 0, 4, 1, &[0.0]).expect_err("outside");
        assert!(err.to_string().contains("`height`"), "{err}");
        assert!(erase(&img, 0, 0, 1, 1, &[0.0, 1.0]).is_err());
        assert!(erase(&img, 0, 0, 1, 1, &[-1.0]).is_err());
        assert!(erase(&img, usize::MAX, 0, 2, 1, &[0.0]).is_err());
        let mut t = RandomErasing {
            scale: (0.5, 0.1),
            ..RandomErasing::default()
        };
        assert!(t
            .validate()
            .expect_err("scale")
            .to_string()
            .contains("`scale`"));
        t.scale = (0.1, 0.5);
        t.value = EraseValue::Random;
        let err = t
            .apply(img.clone(), &mut TransformRng::new(0))
            .expect_err("random on uint8");
        assert!(err.to_string().contains("`value`"), "{err}");
        assert!(RandomGrayscale { p: 1.5 }.validate().is_err());
        assert!(rgb_to_grayscale(&img, 2).is_err());
    }

    #[test]
    fn erasing_boxes_fit_and_random_values_are_normal() -> Result<()> {
        let t = RandomErasing {
            p: 1.0,
            value: EraseValue::Random,
            ..RandomErasing::default()
        };
        let mut rng = TransformRng::new(11);
        let mut values = Vec::new();
        for _ in 0..200 {
            if let Some(p) = t.get_params(3, 37, 53, &mut rng)? {
                assert!(p.top + p.height <= 37 && p.left + p.width <= 53);
                assert_eq!(p.values.len(), 3 * p.height * p.width);
                values.extend(p.values);
            }
        }
        let n = values.len() as f64;
        let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let var = values
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(
            mean.abs() < 0.05 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
        Ok(())
    }
}
