//! The vision operations as [`Transform`]s, with torchvision's parameter
//! sampling (drawn from the sample's [`TransformRng`]).

use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

use super::color::{adjust_brightness, adjust_contrast, adjust_hue, adjust_saturation};
use super::geometry::{center_crop, resize, resized_crop, ResizeTo};
use super::image::Layout;
use super::pixel::each_image;
use kiln_data::{Transform, TransformRng};

/// Resizes images (`torchvision.transforms.v2.Resize(size, antialias=True)`,
/// bilinear); see [`resize`](super::resize).
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::{Resize, ResizeTo};
/// use kiln_data::{Transform, TransformRng};
///
/// let t = Resize::new(ResizeTo::shorter(2))?;
/// let y = t.apply(HostTensor::zeros(kiln_core::DType::U8, [3, 4, 6])?, &mut TransformRng::new(0))?;
/// assert_eq!(y.dims(), &[3, 2, 3]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resize {
    /// The output size.
    pub size: ResizeTo,
}

impl Resize {
    /// A resize to `size`, validated.
    pub fn new(size: ResizeTo) -> Result<Self> {
        size.validate()?;
        Ok(Resize { size })
    }
}

impl Transform for Resize {
    fn apply(&self, x: HostTensor, _rng: &mut TransformRng) -> Result<HostTensor> {
        resize(&x, self.size)
    }
}

/// Crops the centre (`torchvision.transforms.v2.CenterCrop`), padding with
/// zeros where the image is smaller; see [`center_crop`](super::center_crop).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CenterCrop {
    /// Output height.
    pub height: usize,
    /// Output width.
    pub width: usize,
}

impl CenterCrop {
    /// A centre crop of `height` x `width`, validated.
    pub fn new(height: usize, width: usize) -> Result<Self> {
        let c = CenterCrop { height, width };
        c.validate()?;
        Ok(c)
    }

    /// Checks that both sides are positive.
    pub fn validate(&self) -> Result<()> {
        if self.height == 0 || self.width == 0 {
            return Err(Error::invalid_argument(
                "size",
                format!(
                    "CenterCrop to [{}, {}]: both sides must be positive",
                    self.height, self.width
                ),
            ));
        }
        Ok(())
    }
}

impl Transform for CenterCrop {
    fn apply(&self, x: HostTensor, _rng: &mut TransformRng) -> Result<HostTensor> {
        center_crop(&x, self.height, self.width)
    }
}

/// A crop box in image coordinates, inside the image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CropBox {
    /// First row.
    pub top: usize,
    /// First column.
    pub left: usize,
    /// Number of rows.
    pub height: usize,
    /// Number of columns.
    pub width: usize,
}

/// A random crop of random area and aspect ratio, resized to `size`
/// (`torchvision.transforms.v2.RandomResizedCrop(size, scale, ratio,
/// antialias=True)`).
///
/// [`get_params`](RandomResizedCrop::get_params) draws the box as
/// torchvision does, with [`TransformRng`] in place of torch's generator.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::RandomResizedCrop;
/// use kiln_data::{Transform, TransformRng};
///
/// let t = RandomResizedCrop::new(8, 8);
/// let y = t.apply(HostTensor::zeros(kiln_core::DType::U8, [3, 30, 40])?, &mut TransformRng::new(1))?;
/// assert_eq!(y.dims(), &[3, 8, 8]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RandomResizedCrop {
    /// Output `(height, width)`.
    pub size: (usize, usize),
    /// Range of the crop's area as a fraction of the image's, in `(0, 1]`.
    pub scale: (f64, f64),
    /// Range of the crop's aspect ratio (width / height).
    pub ratio: (f64, f64),
}

impl RandomResizedCrop {
    /// torchvision's defaults: `scale = (0.08, 1.0)`, `ratio = (3/4, 4/3)`.
    pub fn new(height: usize, width: usize) -> Self {
        RandomResizedCrop {
            size: (height, width),
            scale: (0.08, 1.0),
            ratio: (3.0 / 4.0, 4.0 / 3.0),
        }
    }

    /// Checks the arguments: positive size, `0 < scale.0 <= scale.1 <= 1`,
    /// `0 < ratio.0 <= ratio.1`, all finite.
    pub fn validate(&self) -> Result<()> {
        let (h, w) = self.size;
        if h == 0 || w == 0 {
            return Err(Error::invalid_argument(
                "size",
                format!("RandomResizedCrop to [{h}, {w}]: both sides must be positive"),
            ));
        }
        let (s0, s1) = self.scale;
        if !(s0 > 0.0 && s0 <= s1 && s1 <= 1.0) {
            return Err(Error::invalid_argument(
                "scale",
                format!(
                    "RandomResizedCrop scale must satisfy 0 < min <= max <= 1, got ({s0}, {s1})"
                ),
            ));
        }
        let (r0, r1) = self.ratio;
        if !(r0 > 0.0 && r0 <= r1 && r1.is_finite()) {
            return Err(Error::invalid_argument(
                "ratio",
                format!("RandomResizedCrop ratio must satisfy 0 < min <= max (finite), got ({r0}, {r1})"),
            ));
        }
        Ok(())
    }

    /// The crop box for an image of `height` x `width`: up to ten draws of
    /// an area fraction uniform in `scale` and an aspect ratio log-uniform in
    /// `ratio`, the first box that fits taken at a uniform position; else
    /// the central crop of the image clamped to `ratio` (torchvision's
    /// `RandomResizedCrop.make_params`). Sides are rounded half to even, as
    /// Python's `round`.
    pub fn get_params(&self, height: usize, width: usize, rng: &mut TransformRng) -> CropBox {
        if height == 0 || width == 0 {
            return CropBox {
                top: 0,
                left: 0,
                height,
                width,
            };
        }
        let area = (height * width) as f64;
        let (log_r0, log_r1) = (self.ratio.0.ln(), self.ratio.1.ln());
        let uniform = |rng: &mut TransformRng, lo: f64, hi: f64| lo + (hi - lo) * rng.next_f64();
        for _ in 0..10 {
            let target_area = area * uniform(rng, self.scale.0, self.scale.1);
            let aspect = uniform(rng, log_r0, log_r1).exp();
            let w = (target_area * aspect).sqrt().round_ties_even();
            let h = (target_area / aspect).sqrt().round_ties_even();
            if w > 0.0 && w <= width as f64 && h > 0.0 && h <= height as f64 {
                let (w, h) = (w as usize, h as usize);
                let top = rng.below((height - h + 1) as u64) as usize;
                let left = rng.below((width - w + 1) as u64) as usize;
                return CropBox {
                    top,
                    left,
                    height: h,
                    width: w,
                };
            }
        }
        let in_ratio = width as f64 / height as f64;
        let (r_min, r_max) = (
            self.ratio.0.min(self.ratio.1),
            self.ratio.0.max(self.ratio.1),
        );
        let (h, w) = if in_ratio < r_min {
            (
                ((width as f64 / r_min).round_ties_even() as usize).min(height),
                width,
            )
        } else if in_ratio > r_max {
            (
                height,
                ((height as f64 * r_max).round_ties_even() as usize).min(width),
            )
        } else {
            (height, width)
        };
        CropBox {
            top: (height - h) / 2,
            left: (width - w) / 2,
            height: h,
            width: w,
        }
    }
}

impl Transform for RandomResizedCrop {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.validate()?;
        each_image(x, "RandomResizedCrop", |img| {
            let l = Layout::of(img, "RandomResizedCrop")?;
            if l.height == 0 || l.width == 0 {
                return Err(Error::invalid_argument(
                    "img",
                    format!(
                        "RandomResizedCrop of an empty image [{}, {}]",
                        l.height, l.width
                    ),
                ));
            }
            let b = self.get_params(l.height, l.width, rng);
            resized_crop(
                img,
                b.top as i64,
                b.left as i64,
                b.height,
                b.width,
                self.size.0,
                self.size.1,
            )
        })
    }
}

/// One of [`ColorJitter`]'s four adjustments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JitterOp {
    /// [`adjust_brightness`](super::adjust_brightness).
    Brightness,
    /// [`adjust_contrast`](super::adjust_contrast).
    Contrast,
    /// [`adjust_saturation`](super::adjust_saturation).
    Saturation,
    /// [`adjust_hue`](super::adjust_hue).
    Hue,
}

/// The parameters [`ColorJitter`] draws for one image: the order of the
/// adjustments and each factor (`None`: that adjustment is off).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct JitterParams {
    /// The order the adjustments run in (torchvision's `randperm(4)`).
    pub order: [JitterOp; 4],
    /// Brightness factor.
    pub brightness: Option<f64>,
    /// Contrast factor.
    pub contrast: Option<f64>,
    /// Saturation factor.
    pub saturation: Option<f64>,
    /// Hue shift.
    pub hue: Option<f64>,
}

/// Random brightness, contrast, saturation and hue, applied in a random
/// order (`torchvision.transforms.v2.ColorJitter(brightness, contrast,
/// saturation, hue)`).
///
/// Brightness, contrast and saturation factors are uniform in
/// `[max(0, 1 - v), 1 + v]`, the hue shift in `[-hue, hue]` (`hue <= 0.5`);
/// 0 turns an adjustment off.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::ColorJitter;
/// use kiln_data::{Transform, TransformRng};
///
/// let jitter = ColorJitter::new(0.4, 0.4, 0.4, 0.1)?;
/// let params = jitter.get_params(&mut TransformRng::new(7));
/// let b = params.brightness.expect("brightness is on");
/// assert!((0.6..=1.4).contains(&b));
/// let img = HostTensor::zeros(kiln_core::DType::U8, [3, 4, 4])?;
/// let y = ColorJitter::apply_params(&img, &params)?;
/// assert_eq!(y.dims(), img.dims());
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ColorJitter {
    /// How much to jitter brightness (>= 0).
    pub brightness: f64,
    /// How much to jitter contrast (>= 0).
    pub contrast: f64,
    /// How much to jitter saturation (>= 0).
    pub saturation: f64,
    /// Largest hue shift, in `[0, 0.5]`.
    pub hue: f64,
}

impl ColorJitter {
    /// A colour jitter, validated.
    pub fn new(brightness: f64, contrast: f64, saturation: f64, hue: f64) -> Result<Self> {
        let j = ColorJitter {
            brightness,
            contrast,
            saturation,
            hue,
        };
        j.validate()?;
        Ok(j)
    }

    /// Checks that every amount is finite and non-negative and `hue <= 0.5`.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("brightness", self.brightness),
            ("contrast", self.contrast),
            ("saturation", self.saturation),
            ("hue", self.hue),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::invalid_argument(
                    name,
                    format!("ColorJitter {name} must be a finite number >= 0, got {v}"),
                ));
            }
        }
        if self.hue > 0.5 {
            return Err(Error::invalid_argument(
                "hue",
                format!("ColorJitter hue must be at most 0.5, got {}", self.hue),
            ));
        }
        Ok(())
    }

    /// Draws the order (a uniform permutation, Fisher-Yates) then the
    /// brightness, contrast, saturation and hue factors of the adjustments
    /// that are on, in that order.
    pub fn get_params(&self, rng: &mut TransformRng) -> JitterParams {
        let mut order = [
            JitterOp::Brightness,
            JitterOp::Contrast,
            JitterOp::Saturation,
            JitterOp::Hue,
        ];
        for i in (1..order.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            order.swap(i, j);
        }
        let mut factor = |v: f64| {
            (v > 0.0).then(|| {
                let (lo, hi) = ((1.0 - v).max(0.0), 1.0 + v);
                lo + (hi - lo) * rng.next_f64()
            })
        };
        let brightness = factor(self.brightness);
        let contrast = factor(self.contrast);
        let saturation = factor(self.saturation);
        let hue = (self.hue > 0.0).then(|| -self.hue + 2.0 * self.hue * rng.next_f64());
        JitterParams {
            order,
            brightness,
            contrast,
            saturation,
            hue,
        }
    }

    /// Applies the adjustments of `params` in their order to `img` (every
    /// image of a batch alike).
    pub fn apply_params(img: &HostTensor, params: &JitterParams) -> Result<HostTensor> {
        let mut out = img.clone();
        for op in params.order {
            out = match op {
                JitterOp::Brightness => match params.brightness {
                    Some(f) => adjust_brightness(&out, f)?,
                    None => out,
                },
                JitterOp::Contrast => match params.contrast {
                    Some(f) => adjust_contrast(&out, f)?,
                    None => out,
                },
                JitterOp::Saturation => match params.saturation {
                    Some(f) => adjust_saturation(&out, f)?,
                    None => out,
                },
                JitterOp::Hue => match params.hue {
                    Some(f) => adjust_hue(&out, f)?,
                    None => out,
                },
            };
        }
        Ok(out)
    }
}

impl Transform for ColorJitter {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.validate()?;
        each_image(x, "ColorJitter", |img| {
            let params = self.get_params(rng);
            ColorJitter::apply_params(img, &params)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_params_boxes_fit() {
        let t = RandomResizedCrop::new(4, 4);
        let mut rng = TransformRng::new(3);
        for (h, w) in [(10, 10), (37, 53), (300, 200), (1, 1), (2, 1000)] {
            for _ in 0..200 {
                let b = t.get_params(h, w, &mut rng);
                assert!(b.height > 0 && b.width > 0, "{b:?}");
                assert!(
                    b.top + b.height <= h && b.left + b.width <= w,
                    "{h}x{w}: {b:?}"
                );
            }
        }
    }

    #[test]
    fn extreme_aspect_falls_back_to_a_central_crop() {
        // 2 x 1000: no box of ratio <= 4/3 and area >= 8% fits, so the
        // fallback clamps the width to round(2 * 4/3) = 3, centred.
        let t = RandomResizedCrop::new(4, 4);
        let b = t.get_params(2, 1000, &mut TransformRng::new(0));
        assert_eq!(
            b,
            CropBox {
                top: 0,
                left: 498,
                height: 2,
                width: 3
            }
        );
        // tall: the height becomes round(2 / (3/4)) = 3, centred
        let b = t.get_params(1000, 2, &mut TransformRng::new(0));
        assert_eq!((b.height, b.width, b.top, b.left), (3, 2, 498, 0));
    }

    #[test]
    fn validation_names_the_argument() {
        let mut t = RandomResizedCrop::new(4, 4);
        t.scale = (0.5, 0.2);
        assert!(t
            .validate()
            .expect_err("order")
            .to_string()
            .contains("`scale`"));
        t.scale = (0.1, 1.5);
        assert!(t.validate().is_err());
        t.scale = (0.1, 1.0);
        t.ratio = (0.0, 1.0);
        assert!(t
            .validate()
            .expect_err("ratio")
            .to_string()
            .contains("`ratio`"));
        assert!(RandomResizedCrop::new(0, 4).validate().is_err());
        assert!(ColorJitter::new(-0.1, 0.0, 0.0, 0.0)
            .expect_err("negative")
            .to_string()
            .contains("`brightness`"));
        assert!(ColorJitter::new(0.0, 0.0, 0.0, 0.6)
            .expect_err("hue")
            .to_string()
            .contains("`hue`"));
        assert!(CenterCrop::new(0, 1).is_err());
    }

    #[test]
    fn jitter_params_cover_every_order_and_range() {
        let j = ColorJitter::new(0.5, 2.0, 0.3, 0.2).expect("valid");
        let mut rng = TransformRng::new(9);
        let mut orders = std::collections::HashSet::new();
        for _ in 0..2000 {
            let p = j.get_params(&mut rng);
            orders.insert(format!("{:?}", p.order));
            assert!((0.5..=1.5).contains(&p.brightness.expect("on")));
            assert!((0.0..=3.0).contains(&p.contrast.expect("on")));
            assert!((0.7..=1.3).contains(&p.saturation.expect("on")));
            assert!((-0.2..=0.2).contains(&p.hue.expect("on")));
        }
        assert_eq!(orders.len(), 24);
        let off = ColorJitter::default().get_params(&mut rng);
        assert_eq!(
            (off.brightness, off.contrast, off.saturation, off.hue),
            (None, None, None, None)
        );
    }

    #[test]
    fn batches_draw_per_image() -> Result<()> {
        let x = HostTensor::new(
            (0..2 * 3 * 20 * 20).map(|v| (v % 251) as u8).collect(),
            [2, 3, 20, 20],
        )?;
        let y = RandomResizedCrop::new(5, 5).apply(x, &mut TransformRng::new(4))?;
        assert_eq!(y.dims(), &[2, 3, 5, 5]);
        Ok(())
    }
}
