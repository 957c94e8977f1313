//! Padding (`v2.functional.pad`, `v2.Pad`) and `v2.RandomCrop` with
//! padding.

use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;
use serde::{Deserialize, Serialize};

use super::geometry::crop;
use super::image::{with_pixels, Layout};
use super::pixel::{check_fill, check_u8_fill, each_image, fill_of, Px};
use kiln_data::{Transform, TransformRng};

/// How [`pad`] fills the border (torchvision's `padding_mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PaddingMode {
    /// A constant value (`fill`).
    #[default]
    Constant,
    /// The edge pixel repeated.
    Edge,
    /// Mirrored without repeating the edge: `[1, 2, 3]` padded by 2 on the
    /// left is `[3, 2, 1, 2, 3]`. Each padding must be smaller than the side.
    Reflect,
    /// Mirrored with the edge repeated: `[1, 2, 3]` padded by 2 on the left
    /// is `[2, 1, 1, 2, 3]`. Each padding must be at most the side.
    Symmetric,
}

impl PaddingMode {
    fn name(self) -> &'static str {
        match self {
            PaddingMode::Constant => "constant",
            PaddingMode::Edge => "edge",
            PaddingMode::Reflect => "reflect",
            PaddingMode::Symmetric => "symmetric",
        }
    }

    /// The source index of padded position `i - before` on an axis of `n`
    /// (`None`: the fill value).
    #[inline]
    fn source(self, i: i64, n: i64) -> Option<usize> {
        if (0..n).contains(&i) {
            return Some(i as usize);
        }
        let j = match self {
            PaddingMode::Constant => return None,
            PaddingMode::Edge => i.clamp(0, n - 1),
            PaddingMode::Reflect => {
                if i < 0 {
                    -i
                } else {
                    2 * (n - 1) - i
                }
            }
            PaddingMode::Symmetric => {
                if i < 0 {
                    -i - 1
                } else {
                    2 * n - 1 - i
                }
            }
        };
        Some(j as usize)
    }
}

/// Pixels added on each side, in torchvision's order `[left, top, right,
/// bottom]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Padding {
    /// Columns added on the left.
    pub left: usize,
    /// Rows added on top.
    pub top: usize,
    /// Columns added on the right.
    pub right: usize,
    /// Rows added at the bottom.
    pub bottom: usize,
}

impl Padding {
    /// The same padding on all four sides.
    pub fn uniform(p: usize) -> Self {
        Padding {
            left: p,
            top: p,
            right: p,
            bottom: p,
        }
    }

    /// torchvision's forms: `[all]`, `[left/right, top/bottom]` or `[left,
    /// top, right, bottom]`.
    pub fn from_values(values: &[usize]) -> Result<Self> {
        match *values {
            [p] => Ok(Padding::uniform(p)),
            [x, y] => Ok(Padding {
                left: x,
                top: y,
                right: x,
                bottom: y,
            }),
            [left, top, right, bottom] => Ok(Padding {
                left,
                top,
                right,
                bottom,
            }),
            _ => Err(Error::invalid_argument(
                "padding",
                format!(
                    "give 1, 2 ([left/right, top/bottom]) or 4 ([left, top, right, bottom]) values, got {}",
                    values.len()
                ),
            )),
        }
    }

    /// Whether nothing is added.
    pub fn is_zero(&self) -> bool {
        *self == Padding::default()
    }

    /// `(height, width)` after padding (saturating at `usize::MAX`).
    pub fn padded(&self, height: usize, width: usize) -> (usize, usize) {
        (
            height.saturating_add(self.top).saturating_add(self.bottom),
            width.saturating_add(self.left).saturating_add(self.right),
        )
    }

    /// `[left, top, right, bottom]`.
    pub fn to_array(&self) -> [usize; 4] {
        [self.left, self.top, self.right, self.bottom]
    }
}

/// Pads every image of `img` (`v2.functional.pad(img, padding, fill,
/// padding_mode)`): `fill` (one value, or one per channel) is used in
/// [`PaddingMode::Constant`] mode only; for `uint8` it must lie in `[0, 255]`
/// and is truncated, as PyTorch casts it.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::{pad, Padding, PaddingMode};
///
/// let img = HostTensor::new(vec![1u8, 2, 3], [1, 1, 3])?;
/// let p = Padding { left: 2, top: 0, right: 1, bottom: 0 };
/// assert_eq!(pad(&img, p, &[0.0], PaddingMode::Reflect)?.as_slice::<u8>()?, &[3, 2, 1, 2, 3, 2]);
/// assert_eq!(pad(&img, p, &[0.0], PaddingMode::Symmetric)?.as_slice::<u8>()?, &[2, 1, 1, 2, 3, 3]);
/// assert_eq!(pad(&img, p, &[9.0], PaddingMode::Constant)?.as_slice::<u8>()?, &[9, 9, 1, 2, 3, 9]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn pad(
    img: &HostTensor,
    padding: Padding,
    fill: &[f64],
    mode: PaddingMode,
) -> Result<HostTensor> {
    let l = Layout::of(img, "pad")?;
    check_fill("fill", "pad", fill, Some(l.channels))?;
    if mode == PaddingMode::Constant && img.dtype() == kiln_core::DType::U8 {
        check_u8_fill("fill", "pad", fill)?;
    }
    let (h, w) = (l.height, l.width);
    let limit_ok = |p: usize, n: usize| match mode {
        PaddingMode::Constant => true,
        PaddingMode::Edge => n > 0 || p == 0,
        PaddingMode::Reflect => p < n || p == 0,
        PaddingMode::Symmetric => p <= n,
    };
    for (side, p, n) in [
        ("left", padding.left, w),
        ("right", padding.right, w),
        ("top", padding.top, h),
        ("bottom", padding.bottom, h),
    ] {
        if !limit_ok(p, n) {
            let bound = match mode {
                PaddingMode::Reflect => "smaller than",
                PaddingMode::Symmetric => "at most",
                _ => "possible only with a non-empty side of",
            };
            return Err(Error::invalid_argument(
                "padding",
                format!(
                    "{} padding of {p} on the {side} of an image of [{h}, {w}]: it must be {bound} the side ({n})",
                    mode.name()
                ),
            ));
        }
    }
    if padding.is_zero() {
        return Ok(img.clone());
    }
    let (oh, ow) = padding.padded(h, w);
    let elements = oh
        .checked_mul(ow)
        .and_then(|n| n.checked_mul(l.count * l.channels));
    if elements.is_none_or(|n| n > isize::MAX as usize / 8) {
        return Err(Error::invalid_argument(
            "padding",
            format!("pad to [{oh}, {ow}] is too large"),
        ));
    }
    let dims = l.dims_with(oh, ow);
    with_pixels!(img, T => {
        let src = img.as_slice::<T>()?;
        let out = pad_planes::<T>(src, &l, padding, fill, mode, oh, ow);
        HostTensor::new(out, dims)
    })
}

fn pad_planes<T: Px>(
    src: &[T],
    l: &Layout,
    p: Padding,
    fill: &[f64],
    mode: PaddingMode,
    oh: usize,
    ow: usize,
) -> Vec<T> {
    let planes = l.count * l.channels;
    let (h, w) = (l.height as i64, l.width as i64);
    let cols: Vec<Option<usize>> = (0..ow)
        .map(|x| mode.source(x as i64 - p.left as i64, w))
        .collect();
    let mut out = Vec::with_capacity(planes * oh * ow);
    for plane in 0..planes {
        let value = T::from_fill(fill_of(fill, plane % l.channels.max(1)));
        let plane_in = &src[plane * l.plane()..(plane + 1) * l.plane()];
        for y in 0..oh {
            match mode.source(y as i64 - p.top as i64, h) {
                Some(sy) => {
                    let row = &plane_in[sy * l.width..(sy + 1) * l.width];
                    out.extend(cols.iter().map(|c| c.map_or(value, |sx| row[sx])));
                }
                None => out.extend(std::iter::repeat_n(value, ow)),
            }
        }
    }
    out
}

/// Pads images by a fixed amount (`torchvision.transforms.v2.Pad(padding,
/// fill, padding_mode)`); see [`pad`].
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::{Pad, Padding, PaddingMode};
/// use kiln_data::{Transform, TransformRng};
///
/// let t = Pad::new(Padding::from_values(&[1, 2])?, vec![0.0], PaddingMode::Edge)?;
/// let y = t.apply(HostTensor::zeros(kiln_core::DType::U8, [3, 5, 6])?, &mut TransformRng::new(0))?;
/// assert_eq!(y.dims(), &[3, 9, 8]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Pad {
    /// Pixels added on each side.
    pub padding: Padding,
    /// Fill value (one, or one per channel) for [`PaddingMode::Constant`].
    pub fill: Vec<f64>,
    /// How to fill the border.
    pub padding_mode: PaddingMode,
}

impl Pad {
    /// A pad, validated.
    pub fn new(padding: Padding, fill: Vec<f64>, padding_mode: PaddingMode) -> Result<Self> {
        let p = Pad {
            padding,
            fill,
            padding_mode,
        };
        p.validate()?;
        Ok(p)
    }

    /// Checks the fill values (finite, at least one).
    pub fn validate(&self) -> Result<()> {
        check_fill("fill", "Pad", &self.fill, None)
    }
}

impl Transform for Pad {
    fn apply(&self, x: HostTensor, _rng: &mut TransformRng) -> Result<HostTensor> {
        pad(&x, self.padding, &self.fill, self.padding_mode)
    }
}

/// What [`RandomCrop`] draws for one image: the padding applied first and
/// the crop box in padded coordinates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RandomCropParams {
    /// Padding before the crop (the configured padding, plus what
    /// `pad_if_needed` adds).
    pub padding: Padding,
    /// First row of the crop in the padded image.
    pub top: usize,
    /// First column of the crop in the padded image.
    pub left: usize,
}

/// A random crop after optional padding (`torchvision.transforms.v2.RandomCrop(size,
/// padding, pad_if_needed, fill, padding_mode)`).
///
/// With `pad_if_needed`, a padded side shorter than the crop grows by the
/// difference on *both* ends (torchvision v2's rule). The corner is uniform
/// over the positions where the crop fits (row drawn first, each only when
/// there is a choice). Unlike [`crate::RandomCrop`] (zero padding, every
/// dtype), this one has torchvision's full set of options.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::{Padding, RandomCrop};
/// use kiln_data::{Transform, TransformRng};
///
/// let mut t = RandomCrop::new(32, 32);
/// t.padding = Some(Padding::uniform(4));
/// let img = HostTensor::zeros(kiln_core::DType::U8, [3, 32, 32])?;
/// let p = t.get_params(32, 32, &mut TransformRng::new(5))?;
/// assert!(p.top <= 8 && p.left <= 8);
/// assert_eq!(t.apply(img, &mut TransformRng::new(5))?.dims(), &[3, 32, 32]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct RandomCrop {
    /// Output `(height, width)`.
    pub size: (usize, usize),
    /// Padding applied before cropping.
    pub padding: Option<Padding>,
    /// Pads a side shorter than the crop (after `padding`) so that it fits.
    pub pad_if_needed: bool,
    /// Fill value (one, or one per channel) for [`PaddingMode::Constant`].
    pub fill: Vec<f64>,
    /// How to fill the padding.
    pub padding_mode: PaddingMode,
}

impl RandomCrop {
    /// A crop to `height` x `width` without padding (torchvision's defaults).
    pub fn new(height: usize, width: usize) -> Self {
        RandomCrop {
            size: (height, width),
            padding: None,
            pad_if_needed: false,
            fill: vec![0.0],
            padding_mode: PaddingMode::Constant,
        }
    }

    /// Checks the size (positive) and fill values.
    pub fn validate(&self) -> Result<()> {
        let (h, w) = self.size;
        if h == 0 || w == 0 {
            return Err(Error::invalid_argument(
                "size",
                format!("RandomCrop to [{h}, {w}]: both sides must be positive"),
            ));
        }
        check_fill("fill", "RandomCrop", &self.fill, None)
    }

    /// The padding and crop corner for an image of `height` x `width`
    /// (torchvision's `RandomCrop.make_params`); an error when the crop
    /// does not fit the padded image.
    pub fn get_params(
        &self,
        height: usize,
        width: usize,
        rng: &mut TransformRng,
    ) -> Result<RandomCropParams> {
        let mut padding = self.padding.unwrap_or_default();
        let (ch, cw) = self.size;
        let (mut ph, mut pw) = padding.padded(height, width);
        if self.pad_if_needed {
            if ph < ch {
                let d = ch - ph;
                padding.top = padding.top.saturating_add(d);
                padding.bottom = padding.bottom.saturating_add(d);
                ph = ph.saturating_add(d.saturating_mul(2));
            }
            if pw < cw {
                let d = cw - pw;
                padding.left = padding.left.saturating_add(d);
                padding.right = padding.right.saturating_add(d);
                pw = pw.saturating_add(d.saturating_mul(2));
            }
        }
        if ph < ch || pw < cw {
            return Err(Error::invalid_argument(
                "size",
                format!(
                    "RandomCrop of [{ch}, {cw}] is larger than the {}image [{ph}, {pw}] (set pad_if_needed to pad it)",
                    if self.padding.is_some() { "padded " } else { "" }
                ),
            ));
        }
        let top = if ph > ch {
            rng.below((ph - ch + 1) as u64) as usize
        } else {
            0
        };
        let left = if pw > cw {
            rng.below((pw - cw + 1) as u64) as usize
        } else {
            0
        };
        Ok(RandomCropParams { padding, top, left })
    }

    /// Pads `img` and crops it as `params` say.
    pub fn apply_params(&self, img: &HostTensor, params: &RandomCropParams) -> Result<HostTensor> {
        let padded = pad(img, params.padding, &self.fill, self.padding_mode)?;
        let l = Layout::of(&padded, "RandomCrop")?;
        if (l.height, l.width) == self.size {
            return Ok(padded);
        }
        crop(
            &padded,
            params.top as i64,
            params.left as i64,
            self.size.0,
            self.size.1,
        )
    }
}

impl Transform for RandomCrop {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.validate()?;
        each_image(x, "RandomCrop", |img| {
            let l = Layout::of(img, "RandomCrop")?;
            let params = self.get_params(l.height, l.width, rng)?;
            self.apply_params(img, &params)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(values: &[u8]) -> HostTensor {
        HostTensor::new(values.to_vec(), [1, 1, values.len()]).expect("image")
    }

    #[test]
    fn modes_follow_numpy_names() -> Result<()> {
        let img = row(&[1, 2, 3, 4]);
        let p = Padding {
            left: 3,
            top: 0,
            right: 3,
            bottom: 0,
        };
        let y = |m| -> Result<Vec<u8>> { Ok(pad(&img, p, &[7.0], m)?.as_slice::<u8>()?.to_vec()) };
        assert_eq!(y(PaddingMode::Constant)?, [7, 7, 7, 1, 2, 3, 4, 7, 7, 7]);
        assert_eq!(y(PaddingMode::Edge)?, [1, 1, 1, 1, 2, 3, 4, 4, 4, 4]);
        assert_eq!(y(PaddingMode::Reflect)?, [4, 3, 2, 1, 2, 3, 4, 3, 2, 1]);
        assert_eq!(y(PaddingMode::Symmetric)?, [3, 2, 1, 1, 2, 3, 4, 4, 3, 2]);
        Ok(())
    }

    #[test]
    fn bad_padding_names_the_argument() {
        let img = row(&[1, 2, 3]);
        let err = pad(&img, Padding::uniform(3), &[0.0], PaddingMode::Reflect)
            .expect_err("reflect wider than the image");
        assert!(err.to_string().contains("`padding`"), "{err}");
        assert!(pad(&img, Padding::uniform(3), &[0.0], PaddingMode::Symmetric).is_err());
        let err = pad(
            &img,
            Padding::uniform(1),
            &[0.0, 1.0],
            PaddingMode::Constant,
        )
        .expect_err("two fills for one channel");
        assert!(err.to_string().contains("`fill`"), "{err}");
        assert!(pad(&img, Padding::uniform(1), &[300.0], PaddingMode::Constant).is_err());
        assert!(Padding::from_values(&[1, 2, 3]).is_err());
        let huge = Padding::uniform(usize::MAX / 2);
        let err = pad(&img, huge, &[0.0], PaddingMode::Constant).expect_err("too large");
        assert!(err.to_string().contains("`padding`"), "{err}");
        let mut t = RandomCrop::new(usize::MAX, 4);
        t.pad_if_needed = true;
        t.padding = Some(huge);
        assert!(t.apply(img.clone(), &mut TransformRng::new(0)).is_err());
    }

    #[test]
    fn random_crop_pads_if_needed() -> Result<()> {
        let mut t = RandomCrop::new(6, 5);
        assert!(t.get_params(4, 4, &mut TransformRng::new(0)).is_err());
        t.pad_if_needed = true;
        let p = t.get_params(4, 4, &mut TransformRng::new(0))?;
        // 6 - 4 = 2 rows on each side, 1 column on each side
        assert_eq!(p.padding.to_array(), [1, 2, 1, 2]);
        let y = t.apply(
            HostTensor::zeros(kiln_core::DType::F32, [2, 3, 4, 4])?,
            &mut TransformRng::new(1),
        )?;
        assert_eq!(y.dims(), &[2, 3, 6, 5]);
        Ok(())
    }
}
