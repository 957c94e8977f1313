//! The random warps: [`RandomRotation`], [`RandomAffine`] and
//! [`RandomPerspective`], drawing their parameters as torchvision v2 does and
//! applying the warps of the parent module.

use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

use super::*;
use kiln_data::{Transform, TransformRng};

/// A range of degrees: `[-d, d]` for one number, else `[min, max]`.
fn check_range(name: &str, op: &str, r: (f64, f64)) -> Result<()> {
    if !(r.0.is_finite() && r.1.is_finite() && r.0 <= r.1) {
        return Err(Error::invalid_argument(
            name,
            format!(
                "{op} {name} must be a finite range with min <= max, got ({}, {})",
                r.0, r.1
            ),
        ));
    }
    Ok(())
}

fn uniform(rng: &mut TransformRng, r: (f64, f64)) -> f64 {
    r.0 + (r.1 - r.0) * rng.next_f64()
}

/// Rotates each image by an angle uniform in `degrees`
/// (`torchvision.transforms.v2.RandomRotation(degrees, interpolation,
/// expand, center, fill)`); see [`rotate`]. With `expand`, the output size
/// depends on the angle, so batches are refused (each image draws its own
/// angle).
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::RandomRotation;
/// use kiln_data::{Transform, TransformRng};
///
/// let t = RandomRotation::new(30.0)?;
/// assert!((-30.0..=30.0).contains(&t.get_params(&mut TransformRng::new(2))));
/// let y = t.apply(HostTensor::zeros(kiln_core::DType::U8, [3, 9, 11])?, &mut TransformRng::new(2))?;
/// assert_eq!(y.dims(), &[3, 9, 11]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct RandomRotation {
    /// Range of the angle in degrees.
    pub degrees: (f64, f64),
    /// Sampling.
    pub interpolation: Interpolation,
    /// Whether the output grows to hold the whole rotated image.
    pub expand: bool,
    /// Centre of rotation in pixels (default the image's centre).
    pub center: Option<(f64, f64)>,
    /// Fill value (one, or one per channel); torchvision's default is 0.
    pub fill: Vec<f64>,
}

impl RandomRotation {
    /// Angles in `[-degrees, degrees]`, nearest sampling, fill 0.
    pub fn new(degrees: f64) -> Result<Self> {
        let t = RandomRotation {
            degrees: (-degrees, degrees),
            interpolation: Interpolation::Nearest,
            expand: false,
            center: None,
            fill: vec![0.0],
        };
        t.validate()?;
        Ok(t)
    }

    /// Checks the range of degrees and the fill.
    pub fn validate(&self) -> Result<()> {
        check_range("degrees", "RandomRotation", self.degrees)?;
        check_fill("fill", "RandomRotation", &self.fill, None)
    }

    /// Draws the angle.
    pub fn get_params(&self, rng: &mut TransformRng) -> f64 {
        uniform(rng, self.degrees)
    }
}

impl Transform for RandomRotation {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.validate()?;
        if self.expand && Layout::of(&x, "RandomRotation")?.batched {
            return Err(Error::invalid_argument(
                "expand",
                "RandomRotation with expand draws an angle per image, so the images of a batch \
                 would come out in different sizes: rotate them one at a time",
            ));
        }
        each_image(x, "RandomRotation", |img| {
            let angle = self.get_params(rng);
            rotate(
                img,
                angle,
                self.interpolation,
                self.expand,
                self.center,
                Some(&self.fill),
            )
        })
    }
}

/// The parameters [`RandomAffine`] draws for one image.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AffineParams {
    /// Rotation in degrees.
    pub angle: f64,
    /// Translation in whole pixels `(x, y)`.
    pub translate: (i64, i64),
    /// Scale.
    pub scale: f64,
    /// Shear in degrees `(x, y)`.
    pub shear: (f64, f64),
}

/// The shear ranges of [`RandomAffine`], in degrees: torchvision's `shear`
/// of 2 values (`x` only) or 4 (`x` then `y`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShearRange {
    /// Range of the shear parallel to the x axis.
    pub x: (f64, f64),
    /// Range of the shear parallel to the y axis (none: no y shear).
    pub y: Option<(f64, f64)>,
}

/// A random affine warp (`torchvision.transforms.v2.RandomAffine(degrees,
/// translate, scale, shear, interpolation, fill, center)`).
///
/// Per image: an angle uniform in `degrees`; with `translate = Some((a, b))`
/// a shift uniform in `±a * width`, `±b * height`, rounded half to even;
/// with `scale` a factor uniform in it; with `shear` an x shear uniform in
/// `shear.0` and, when `shear.1` is given, a y shear uniform in it.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::RandomAffine;
/// use kiln_data::TransformRng;
///
/// let mut t = RandomAffine::new(10.0)?;
/// t.translate = Some((0.1, 0.2));
/// let p = t.get_params(40, 50, &mut TransformRng::new(1));
/// assert!(p.translate.0.abs() <= 5 && p.translate.1.abs() <= 8);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct RandomAffine {
    /// Range of the rotation in degrees.
    pub degrees: (f64, f64),
    /// Largest shift as fractions of the width and height, each in `[0, 1]`.
    pub translate: Option<(f64, f64)>,
    /// Range of the scale, positive.
    pub scale: Option<(f64, f64)>,
    /// Ranges of the shears in degrees.
    pub shear: Option<ShearRange>,
    /// Sampling.
    pub interpolation: Interpolation,
    /// Fill value (one, or one per channel); torchvision's default is 0.
    pub fill: Vec<f64>,
    /// Centre in pixels (default the image's centre).
    pub center: Option<(f64, f64)>,
}

impl RandomAffine {
    /// Rotations in `[-degrees, degrees]` only.
    pub fn new(degrees: f64) -> Result<Self> {
        let t = RandomAffine {
            degrees: (-degrees, degrees),
            translate: None,
            scale: None,
            shear: None,
            interpolation: Interpolation::Nearest,
            fill: vec![0.0],
            center: None,
        };
        t.validate()?;
        Ok(t)
    }

    /// Checks every range: finite `min <= max`, translations in `[0, 1]`,
    /// positive scales.
    pub fn validate(&self) -> Result<()> {
        check_range("degrees", "RandomAffine", self.degrees)?;
        if let Some((a, b)) = self.translate {
            if !((0.0..=1.0).contains(&a) && (0.0..=1.0).contains(&b)) {
                return Err(Error::invalid_argument(
                    "translate",
                    format!("RandomAffine translate fractions must lie in [0, 1], got ({a}, {b})"),
                ));
            }
        }
        if let Some(s) = self.scale {
            check_range("scale", "RandomAffine", s)?;
            if s.0 <= 0.0 {
                return Err(Error::invalid_argument(
                    "scale",
                    format!(
                        "RandomAffine scale values must be positive, got ({}, {})",
                        s.0, s.1
                    ),
                ));
            }
        }
        if let Some(s) = self.shear {
            check_range("shear", "RandomAffine", s.x)?;
            if let Some(y) = s.y {
                check_range("shear", "RandomAffine", y)?;
            }
        }
        check_fill("fill", "RandomAffine", &self.fill, None)
    }

    /// Draws the parameters for an image of `height` x `width`, in
    /// torchvision's order (angle, translation, scale, shear).
    pub fn get_params(&self, height: usize, width: usize, rng: &mut TransformRng) -> AffineParams {
        let angle = uniform(rng, self.degrees);
        let translate = match self.translate {
            Some((a, b)) => {
                let (mx, my) = (a * width as f64, b * height as f64);
                let tx = uniform(rng, (-mx, mx)).round_ties_even() as i64;
                let ty = uniform(rng, (-my, my)).round_ties_even() as i64;
                (tx, ty)
            }
            None => (0, 0),
        };
        let scale = self.scale.map_or(1.0, |s| uniform(rng, s));
        let shear = match self.shear {
            Some(s) => (uniform(rng, s.x), s.y.map_or(0.0, |y| uniform(rng, y))),
            None => (0.0, 0.0),
        };
        AffineParams {
            angle,
            translate,
            scale,
            shear,
        }
    }

    /// Warps `img` with `params`.
    pub fn apply_params(&self, img: &HostTensor, params: &AffineParams) -> Result<HostTensor> {
        affine(
            img,
            params.angle,
            (params.translate.0 as f64, params.translate.1 as f64),
            params.scale,
            params.shear,
            self.interpolation,
            Some(&self.fill),
            self.center,
        )
    }
}

impl Transform for RandomAffine {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.validate()?;
        each_image(x, "RandomAffine", |img| {
            let l = Layout::of(img, "RandomAffine")?;
            let params = self.get_params(l.height, l.width, rng);
            self.apply_params(img, &params)
        })
    }
}

/// A random perspective warp with probability `p`
/// (`torchvision.transforms.v2.RandomPerspective(distortion_scale, p,
/// interpolation, fill)`): each corner moves inwards by up to
/// `distortion_scale` of the half side. Images of one row or column (which
/// have no perspective) are returned as they are.
///
/// ```
/// use kiln_vision::transforms::RandomPerspective;
/// use kiln_data::TransformRng;
///
/// let t = RandomPerspective { p: 1.0, ..RandomPerspective::default() };
/// let corners = t.get_params(20, 30, &mut TransformRng::new(4)).expect("p = 1");
/// assert!(corners[0][0] <= 7 && corners[2][0] >= 22);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct RandomPerspective {
    /// How far corners move, in `[0, 1]`.
    pub distortion_scale: f64,
    /// Probability of warping an image.
    pub p: f64,
    /// Sampling (torchvision's default is bilinear).
    pub interpolation: Interpolation,
    /// Fill value (one, or one per channel).
    pub fill: Vec<f64>,
}

impl Default for RandomPerspective {
    /// torchvision's defaults: `distortion_scale = 0.5`, `p = 0.5`,
    /// bilinear, fill 0.
    fn default() -> Self {
        RandomPerspective {
            distortion_scale: 0.5,
            p: 0.5,
            interpolation: Interpolation::Bilinear,
            fill: vec![0.0],
        }
    }
}

impl RandomPerspective {
    /// Checks `distortion_scale` and `p` in `[0, 1]` and the fill.
    pub fn validate(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.distortion_scale) {
            return Err(Error::invalid_argument(
                "distortion_scale",
                format!(
                    "RandomPerspective distortion_scale must lie in [0, 1], got {}",
                    self.distortion_scale
                ),
            ));
        }
        if !(0.0..=1.0).contains(&self.p) {
            return Err(Error::invalid_argument(
                "p",
                format!(
                    "RandomPerspective probability must lie in [0, 1], got {}",
                    self.p
                ),
            ));
        }
        check_fill("fill", "RandomPerspective", &self.fill, None)
    }

    /// The start points of an image of `height` x `width`: its corners,
    /// top-left, top-right, bottom-right, bottom-left.
    pub fn startpoints(height: usize, width: usize) -> [[i64; 2]; 4] {
        let (w, h) = (width as i64 - 1, height as i64 - 1);
        [[0, 0], [w, 0], [w, h], [0, h]]
    }

    /// Draws whether to warp (`None`: not) and the corners' end points, in
    /// torchvision's order (top-left, top-right, bottom-right, bottom-left,
    /// x before y).
    pub fn get_params(
        &self,
        height: usize,
        width: usize,
        rng: &mut TransformRng,
    ) -> Option<[[i64; 2]; 4]> {
        if rng.next_f64() >= self.p {
            return None;
        }
        let (h, w) = (height as i64, width as i64);
        let bh = (self.distortion_scale * (h / 2) as f64) as i64 + 1;
        let bw = (self.distortion_scale * (w / 2) as f64) as i64 + 1;
        let mut draw = |lo: i64, hi: i64| lo + rng.below((hi - lo).max(0) as u64) as i64;
        let tl = [draw(0, bw), draw(0, bh)];
        let tr = [draw(w - bw, w), draw(0, bh)];
        let br = [draw(w - bw, w), draw(h - bh, h)];
        let bl = [draw(0, bw), draw(h - bh, h)];
        Some([tl, tr, br, bl])
    }

    /// Warps `img` so that its corners move to `endpoints`.
    pub fn apply_params(&self, img: &HostTensor, endpoints: &[[i64; 2]; 4]) -> Result<HostTensor> {
        let l = Layout::of(img, "RandomPerspective")?;
        let start = Self::startpoints(l.height, l.width);
        let c = perspective_coefficients(&start, endpoints)?;
        perspective(img, &c, self.interpolation, Some(&self.fill))
    }
}

impl Transform for RandomPerspective {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.validate()?;
        each_image(x, "RandomPerspective", |img| {
            let l = Layout::of(img, "RandomPerspective")?;
            if l.height < 2 || l.width < 2 {
                return Ok(img.clone());
            }
            match self.get_params(l.height, l.width, rng) {
                Some(end) => self.apply_params(img, &end),
                None => Ok(img.clone()),
            }
        })
    }
}
