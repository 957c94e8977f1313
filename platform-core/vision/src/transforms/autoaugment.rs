//! The AutoAugment family (`v2.AutoAugment`, `v2.RandAugment`,
//! `v2.TrivialAugmentWide`): random sequences of geometric and photometric
//! operations with torchvision's magnitude tables and draws.

use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;
use serde::{Deserialize, Serialize};

use super::affine::{affine, rotate, Interpolation};
use super::color::{adjust_brightness, adjust_contrast, adjust_saturation};
use super::image::Layout;
use super::ops::{adjust_sharpness, autocontrast, equalize, invert, posterize, solarize};
use super::pixel::{check_fill, each_image};
use kiln_data::{Transform, TransformRng};

/// One operation of the AutoAugment family (torchvision's `transform_id`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AugmentOp {
    /// The image unchanged.
    Identity,
    /// Shear along x by `atan(magnitude)`, about the top-left corner.
    ShearX,
    /// Shear along y by `atan(magnitude)`, about the top-left corner.
    ShearY,
    /// Shift along x by `int(magnitude)` pixels.
    TranslateX,
    /// Shift along y by `int(magnitude)` pixels.
    TranslateY,
    /// Rotate by `magnitude` degrees.
    Rotate,
    /// [`adjust_brightness`](super::adjust_brightness) by `1 + magnitude`.
    Brightness,
    /// [`adjust_saturation`](super::adjust_saturation) by `1 + magnitude`.
    Color,
    /// [`adjust_contrast`](super::adjust_contrast) by `1 + magnitude`.
    Contrast,
    /// [`adjust_sharpness`](super::adjust_sharpness) by `1 + magnitude`.
    Sharpness,
    /// [`posterize`](super::posterize) to `int(magnitude)` bits.
    Posterize,
    /// [`solarize`](super::solarize) above `magnitude` of the range.
    Solarize,
    /// [`autocontrast`](super::autocontrast).
    AutoContrast,
    /// [`equalize`](super::equalize).
    Equalize,
    /// [`invert`](super::invert).
    Invert,
}

use AugmentOp::*;

impl AugmentOp {
    /// torchvision's name (`"ShearX"`, `"AutoContrast"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Identity => "Identity",
            ShearX => "ShearX",
            ShearY => "ShearY",
            TranslateX => "TranslateX",
            TranslateY => "TranslateY",
            Rotate => "Rotate",
            Brightness => "Brightness",
            Color => "Color",
            Contrast => "Contrast",
            Sharpness => "Sharpness",
            Posterize => "Posterize",
            Solarize => "Solarize",
            AutoContrast => "AutoContrast",
            Equalize => "Equalize",
            Invert => "Invert",
        }
    }

    /// Whether a drawn magnitude gets a random sign.
    fn signed(self) -> bool {
        !matches!(
            self,
            Identity | Posterize | Solarize | AutoContrast | Equalize | Invert
        )
    }
}

/// An operation with its magnitude (sign included), as drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AugmentStep {
    /// The operation.
    pub op: AugmentOp,
    /// Its magnitude (0 for operations without one).
    pub magnitude: f64,
}

/// Applies one operation as torchvision's `_apply_image_or_video_transform`
/// does: shears about the top-left corner, translations truncated to whole
/// pixels, colour factors `1 + magnitude`, solarize at `magnitude` times the
/// dtype's maximum. `fill = None` fills warps with zeros (torchvision's
/// default for these transforms); `Some` blends the fill in as
/// [`affine`](super::affine) does.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::{augment_op, AugmentOp, Interpolation};
///
/// let img = HostTensor::new(vec![10u8, 200], [1, 1, 2])?;
/// let y = augment_op(&img, AugmentOp::Solarize, 0.5, Interpolation::Nearest, None)?;
/// assert_eq!(y.as_slice::<u8>()?, &[10, 55]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn augment_op(
    img: &HostTensor,
    op: AugmentOp,
    magnitude: f64,
    interpolation: Interpolation,
    fill: Option<&[f64]>,
) -> Result<HostTensor> {
    if !magnitude.is_finite() {
        return Err(Error::invalid_argument(
            "magnitude",
            format!(
                "{}: the magnitude must be finite, got {magnitude}",
                op.name()
            ),
        ));
    }
    let none = (0.0, 0.0);
    match op {
        Identity => Ok(img.clone()),
        ShearX | ShearY => {
            let s = magnitude.atan().to_degrees();
            let shear = if op == ShearX { (s, 0.0) } else { (0.0, s) };
            affine(
                img,
                0.0,
                none,
                1.0,
                shear,
                interpolation,
                fill,
                Some((0.0, 0.0)),
            )
        }
        TranslateX | TranslateY => {
            let t = magnitude.trunc();
            let translate = if op == TranslateX { (t, 0.0) } else { (0.0, t) };
            affine(img, 0.0, translate, 1.0, none, interpolation, fill, None)
        }
        Rotate => rotate(img, magnitude, interpolation, false, None, fill),
        Brightness => adjust_brightness(img, 1.0 + magnitude),
        Color => adjust_saturation(img, 1.0 + magnitude),
        Contrast => adjust_contrast(img, 1.0 + magnitude),
        Sharpness => adjust_sharpness(img, 1.0 + magnitude),
        Posterize => {
            let bits = magnitude.trunc();
            if !(0.0..=8.0).contains(&bits) {
                return Err(Error::invalid_argument(
                    "magnitude",
                    format!("Posterize keeps 0 to 8 bits, got {magnitude}"),
                ));
            }
            posterize(img, bits as u32)
        }
        Solarize => {
            let bound = if img.dtype() == kiln_core::DType::U8 {
                255.0
            } else {
                1.0
            };
            solarize(img, bound * magnitude)
        }
        AutoContrast => autocontrast(img),
        Equalize => equalize(img),
        Invert => invert(img),
    }
}

/// PyTorch's `float32` `linspace(start, end, n)`.
fn linspace(start: f64, end: f64, n: usize) -> Vec<f64> {
    let (s, e) = (start as f32, end as f32);
    if n == 1 {
        return vec![f64::from(s)];
    }
    let step = (e - s) / (n - 1) as f32;
    (0..n)
        .map(|i| {
            let v = if i < n / 2 {
                step.mul_add(i as f32, s)
            } else {
                (-step).mul_add((n - 1 - i) as f32, e)
            };
            f64::from(v)
        })
        .collect()
}

/// The bits of posterize: `round(8 - i / ((n - 1) / levels))` in `float32`.
fn posterize_bits(n: usize, levels: f64) -> Vec<f64> {
    let d = ((n as f64 - 1.0) / levels) as f32;
    (0..n)
        .map(|i| f64::from((8.0 - i as f32 / d).round_ties_even()))
        .collect()
}

/// Which magnitude table an operation's bins come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Space {
    /// AutoAugment's and RandAugment's.
    Standard,
    /// TrivialAugmentWide's (wider ranges).
    Wide,
}

/// The `bins` magnitudes of `op` for an image of `height` x `width` (`None`:
/// the operation has none).
fn magnitudes(
    op: AugmentOp,
    space: Space,
    bins: usize,
    height: usize,
    width: usize,
) -> Option<Vec<f64>> {
    let wide = space == Space::Wide;
    Some(match op {
        ShearX | ShearY => linspace(0.0, if wide { 0.99 } else { 0.3 }, bins),
        TranslateX if wide => linspace(0.0, 32.0, bins),
        TranslateY if wide => linspace(0.0, 32.0, bins),
        TranslateX => linspace(0.0, 150.0 / 331.0 * width as f64, bins),
        TranslateY => linspace(0.0, 150.0 / 331.0 * height as f64, bins),
        Rotate => linspace(0.0, if wide { 135.0 } else { 30.0 }, bins),
        Brightness | Color | Contrast | Sharpness => {
            linspace(0.0, if wide { 0.99 } else { 0.9 }, bins)
        }
        Posterize => posterize_bits(bins, if wide { 6.0 } else { 4.0 }),
        Solarize => linspace(1.0, 0.0, bins),
        Identity | AutoContrast | Equalize | Invert => return None,
    })
}

/// The random sign torchvision gives a signed magnitude: negative when a
/// uniform draw is at most 0.5.
fn signed(op: AugmentOp, magnitude: f64, rng: &mut TransformRng) -> f64 {
    if op.signed() && rng.next_f64() <= 0.5 {
        -magnitude
    } else {
        magnitude
    }
}

fn check_image(img: &HostTensor, op: &str) -> Result<Layout> {
    let l = Layout::of(img, op)?;
    l.require_gray_or_rgb(op)?;
    Ok(l)
}

fn apply_steps(
    img: &HostTensor,
    steps: &[AugmentStep],
    interpolation: Interpolation,
    fill: Option<&[f64]>,
) -> Result<HostTensor> {
    steps.iter().try_fold(img.clone(), |x, s| {
        augment_op(&x, s.op, s.magnitude, interpolation, fill)
    })
}

fn check_bins(bins: usize, op: &str) -> Result<()> {
    if bins < 2 {
        return Err(Error::invalid_argument(
            "num_magnitude_bins",
            format!("{op} needs at least 2 magnitude bins, got {bins}"),
        ));
    }
    Ok(())
}

/// A learned AutoAugment policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AutoAugmentPolicy {
    /// Learned on ImageNet (the default).
    #[default]
    Imagenet,
    /// Learned on CIFAR-10.
    Cifar10,
    /// Learned on SVHN.
    Svhn,
}

/// One sub-policy: two operations, each with its probability and magnitude
/// bin (of 10).
type SubPolicy = [(AugmentOp, f64, usize); 2];

/// The ImageNet policy's 25 sub-policies.
const IMAGENET: [SubPolicy; 25] = [
    [(Posterize, 0.4, 8), (Rotate, 0.6, 9)],
    [(Solarize, 0.6, 5), (AutoContrast, 0.6, 0)],
    [(Equalize, 0.8, 0), (Equalize, 0.6, 0)],
    [(Posterize, 0.6, 7), (Posterize, 0.6, 6)],
    [(Equalize, 0.4, 0), (Solarize, 0.2, 4)],
    [(Equalize, 0.4, 0), (Rotate, 0.8, 8)],
    [(Solarize, 0.6, 3), (Equalize, 0.6, 0)],
    [(Posterize, 0.8, 5), (Equalize, 1.0, 0)],
    [(Rotate, 0.2, 3), (Solarize, 0.6, 8)],
    [(Equalize, 0.6, 0), (Posterize, 0.4, 6)],
    [(Rotate, 0.8, 8), (Color, 0.4, 0)],
    [(Rotate, 0.4, 9), (Equalize, 0.6, 0)],
    [(Equalize, 0.0, 0), (Equalize, 0.8, 0)],
    [(Invert, 0.6, 0), (Equalize, 1.0, 0)],
    [(Color, 0.6, 4), (Contrast, 1.0, 8)],
    [(Rotate, 0.8, 8), (Color, 1.0, 2)],
    [(Color, 0.8, 8), (Solarize, 0.8, 7)],
    [(Sharpness, 0.4, 7), (Invert, 0.6, 0)],
    [(ShearX, 0.6, 5), (Equalize, 1.0, 0)],
    [(Color, 0.4, 0), (Equalize, 0.6, 0)],
    [(Equalize, 0.4, 0), (Solarize, 0.2, 4)],
    [(Solarize, 0.6, 5), (AutoContrast, 0.6, 0)],
    [(Invert, 0.6, 0), (Equalize, 1.0, 0)],
    [(Color, 0.6, 4), (Contrast, 1.0, 8)],
    [(Equalize, 0.8, 0), (Equalize, 0.6, 0)],
];

/// The CIFAR-10 policy's 25 sub-policies.
const CIFAR10: [SubPolicy; 25] = [
    [(Invert, 0.1, 0), (Contrast, 0.2, 6)],
    [(Rotate, 0.7, 2), (TranslateX, 0.3, 9)],
    [(Sharpness, 0.8, 1), (Sharpness, 0.9, 3)],
    [(ShearY, 0.5, 8), (TranslateY, 0.7, 9)],
    [(AutoContrast, 0.5, 0), (Equalize, 0.9, 0)],
    [(ShearY, 0.2, 7), (Posterize, 0.3, 7)],
    [(Color, 0.4, 3), (Brightness, 0.6, 7)],
    [(Sharpness, 0.3, 9), (Brightness, 0.7, 9)],
    [(Equalize, 0.6, 0), (Equalize, 0.5, 0)],
    [(Contrast, 0.6, 7), (Sharpness, 0.6, 5)],
    [(Color, 0.7, 7), (TranslateX, 0.5, 8)],
    [(Equalize, 0.3, 0), (AutoContrast, 0.4, 0)],
    [(TranslateY, 0.4, 3), (Sharpness, 0.2, 6)],
    [(Brightness, 0.9, 6), (Color, 0.2, 8)],
    [(Solarize, 0.5, 2), (Invert, 0.0, 0)],
    [(Equalize, 0.2, 0), (AutoContrast, 0.6, 0)],
    [(Equalize, 0.2, 0), (Equalize, 0.6, 0)],
    [(Color, 0.9, 9), (Equalize, 0.6, 0)],
    [(AutoContrast, 0.8, 0), (Solarize, 0.2, 8)],
    [(Brightness, 0.1, 3), (Color, 0.7, 0)],
    [(Solarize, 0.4, 5), (AutoContrast, 0.9, 0)],
    [(TranslateY, 0.9, 9), (TranslateY, 0.7, 9)],
    [(AutoContrast, 0.9, 0), (Solarize, 0.8, 3)],
    [(Equalize, 0.8, 0), (Invert, 0.1, 0)],
    [(TranslateY, 0.7, 9), (AutoContrast, 0.9, 0)],
];

/// The SVHN policy's 25 sub-policies.
const SVHN: [SubPolicy; 25] = [
    [(ShearX, 0.9, 4), (Invert, 0.2, 0)],
    [(ShearY, 0.9, 8), (Invert, 0.7, 0)],
    [(Equalize, 0.6, 0), (Solarize, 0.6, 6)],
    [(Invert, 0.9, 0), (Equalize, 0.6, 0)],
    [(Equalize, 0.6, 0), (Rotate, 0.9, 3)],
    [(ShearX, 0.9, 4), (AutoContrast, 0.8, 0)],
    [(ShearY, 0.9, 8), (Invert, 0.4, 0)],
    [(ShearY, 0.9, 5), (Solarize, 0.2, 6)],
    [(Invert, 0.9, 0), (AutoContrast, 0.8, 0)],
    [(Equalize, 0.6, 0), (Rotate, 0.9, 3)],
    [(ShearX, 0.9, 4), (Solarize, 0.3, 3)],
    [(ShearY, 0.8, 8), (Invert, 0.7, 0)],
    [(Equalize, 0.9, 0), (TranslateY, 0.6, 6)],
    [(Invert, 0.9, 0), (Equalize, 0.6, 0)],
    [(Contrast, 0.3, 3), (Rotate, 0.8, 4)],
    [(Invert, 0.8, 0), (TranslateY, 0.0, 2)],
    [(ShearY, 0.7, 6), (Solarize, 0.4, 8)],
    [(Invert, 0.6, 0), (Rotate, 0.8, 4)],
    [(ShearY, 0.3, 7), (TranslateX, 0.9, 3)],
    [(ShearX, 0.1, 6), (Invert, 0.6, 0)],
    [(Solarize, 0.7, 2), (TranslateY, 0.6, 7)],
    [(ShearY, 0.8, 4), (Invert, 0.8, 0)],
    [(ShearX, 0.7, 9), (TranslateY, 0.8, 3)],
    [(ShearY, 0.8, 5), (AutoContrast, 0.7, 0)],
    [(ShearX, 0.7, 2), (Invert, 0.1, 0)],
];

impl AutoAugmentPolicy {
    fn sub_policies(self) -> &'static [SubPolicy; 25] {
        match self {
            AutoAugmentPolicy::Imagenet => &IMAGENET,
            AutoAugmentPolicy::Cifar10 => &CIFAR10,
            AutoAugmentPolicy::Svhn => &SVHN,
        }
    }
}

/// AutoAugment (`torchvision.transforms.v2.AutoAugment(policy,
/// interpolation, fill)`): per image, one of the policy's 25 sub-policies,
/// uniformly; each of its two operations applies with its probability, at
/// its magnitude bin of 10, with a random sign where the operation is signed.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::AutoAugment;
/// use kiln_data::{Transform, TransformRng};
///
/// let t = AutoAugment::default();
/// let steps = t.get_params(32, 32, &mut TransformRng::new(0));
/// assert!(steps.len() <= 2);
/// let y = t.apply(HostTensor::zeros(kiln_core::DType::U8, [3, 32, 32])?, &mut TransformRng::new(0))?;
/// assert_eq!(y.dims(), &[3, 32, 32]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AutoAugment {
    /// The policy.
    pub policy: AutoAugmentPolicy,
    /// Sampling of the geometric operations (default nearest).
    pub interpolation: Interpolation,
    /// Fill of the geometric operations (`None`: zeros, torchvision's default).
    pub fill: Option<Vec<f64>>,
}

impl AutoAugment {
    /// Checks the fill.
    pub fn validate(&self) -> Result<()> {
        match &self.fill {
            Some(f) => check_fill("fill", "AutoAugment", f, None),
            None => Ok(()),
        }
    }

    /// The operations drawn for an image of `height` x `width`, in order.
    pub fn get_params(
        &self,
        height: usize,
        width: usize,
        rng: &mut TransformRng,
    ) -> Vec<AugmentStep> {
        let policies = self.policy.sub_policies();
        let sub = &policies[rng.below(policies.len() as u64) as usize];
        let mut steps = Vec::with_capacity(2);
        for &(op, p, bin) in sub {
            // applied when the draw is at most p (never for a NaN p)
            if rng.next_f64() > p || p.is_nan() {
                continue;
            }
            let magnitude = match magnitudes(op, Space::Standard, 10, height, width) {
                Some(m) => signed(op, m[bin], rng),
                None => 0.0,
            };
            steps.push(AugmentStep { op, magnitude });
        }
        steps
    }

    /// Applies drawn `steps` to `img`.
    pub fn apply_params(&self, img: &HostTensor, steps: &[AugmentStep]) -> Result<HostTensor> {
        apply_steps(img, steps, self.interpolation, self.fill.as_deref())
    }
}

impl Transform for AutoAugment {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.validate()?;
        each_image(x, "AutoAugment", |img| {
            let l = check_image(img, "AutoAugment")?;
            let steps = self.get_params(l.height, l.width, rng);
            self.apply_params(img, &steps)
        })
    }
}

/// RandAugment's and TrivialAugmentWide's operations, in torchvision's order.
const RAND_OPS: [AugmentOp; 14] = [
    Identity,
    ShearX,
    ShearY,
    TranslateX,
    TranslateY,
    Rotate,
    Brightness,
    Color,
    Contrast,
    Sharpness,
    Posterize,
    Solarize,
    AutoContrast,
    Equalize,
];

/// RandAugment (`torchvision.transforms.v2.RandAugment(num_ops, magnitude,
/// num_magnitude_bins, interpolation, fill)`): per image, `num_ops`
/// operations drawn uniformly (with repetition), each at bin `magnitude` of
/// `num_magnitude_bins`, with a random sign where the operation is signed.
///
/// ```
/// use kiln_vision::transforms::RandAugment;
/// use kiln_data::TransformRng;
///
/// let t = RandAugment::default();
/// assert_eq!(t.get_params(32, 32, &mut TransformRng::new(1)).len(), 2);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct RandAugment {
    /// Operations per image.
    pub num_ops: usize,
    /// The magnitude bin, below `num_magnitude_bins`.
    pub magnitude: usize,
    /// Number of magnitude bins (at least 2).
    pub num_magnitude_bins: usize,
    /// Sampling of the geometric operations (default nearest).
    pub interpolation: Interpolation,
    /// Fill of the geometric operations (`None`: zeros).
    pub fill: Option<Vec<f64>>,
}

impl Default for RandAugment {
    /// torchvision's defaults: 2 operations at bin 9 of 31.
    fn default() -> Self {
        RandAugment {
            num_ops: 2,
            magnitude: 9,
            num_magnitude_bins: 31,
            interpolation: Interpolation::Nearest,
            fill: None,
        }
    }
}

impl RandAugment {
    /// Checks `magnitude < num_magnitude_bins`, at least 2 bins, the fill.
    pub fn validate(&self) -> Result<()> {
        check_bins(self.num_magnitude_bins, "RandAugment")?;
        if self.magnitude >= self.num_magnitude_bins {
            return Err(Error::invalid_argument(
                "magnitude",
                format!(
                    "RandAugment magnitude is a bin below num_magnitude_bins = {}, got {}",
                    self.num_magnitude_bins, self.magnitude
                ),
            ));
        }
        match &self.fill {
            Some(f) => check_fill("fill", "RandAugment", f, None),
            None => Ok(()),
        }
    }

    /// The operations drawn for an image of `height` x `width`, in order.
    pub fn get_params(
        &self,
        height: usize,
        width: usize,
        rng: &mut TransformRng,
    ) -> Vec<AugmentStep> {
        (0..self.num_ops)
            .map(|_| {
                let op = RAND_OPS[rng.below(RAND_OPS.len() as u64) as usize];
                let magnitude =
                    match magnitudes(op, Space::Standard, self.num_magnitude_bins, height, width) {
                        Some(m) => signed(op, m[self.magnitude.min(m.len() - 1)], rng),
                        None => 0.0,
                    };
                AugmentStep { op, magnitude }
            })
            .collect()
    }

    /// Applies drawn `steps` to `img`.
    pub fn apply_params(&self, img: &HostTensor, steps: &[AugmentStep]) -> Result<HostTensor> {
        apply_steps(img, steps, self.interpolation, self.fill.as_deref())
    }
}

impl Transform for RandAugment {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.validate()?;
        each_image(x, "RandAugment", |img| {
            let l = check_image(img, "RandAugment")?;
            let steps = self.get_params(l.height, l.width, rng);
            self.apply_params(img, &steps)
        })
    }
}

/// TrivialAugment Wide (`torchvision.transforms.v2.TrivialAugmentWide(num_magnitude_bins,
/// interpolation, fill)`): per image, one operation drawn uniformly at a
/// uniform magnitude bin of the wide ranges, with a random sign where the
/// operation is signed.
///
/// ```
/// use kiln_vision::transforms::TrivialAugmentWide;
/// use kiln_data::TransformRng;
///
/// let t = TrivialAugmentWide::default();
/// assert_eq!(t.get_params(32, 32, &mut TransformRng::new(1)).len(), 1);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct TrivialAugmentWide {
    /// Number of magnitude bins (at least 2).
    pub num_magnitude_bins: usize,
    /// Sampling of the geometric operations (default nearest).
    pub interpolation: Interpolation,
    /// Fill of the geometric operations (`None`: zeros).
    pub fill: Option<Vec<f64>>,
}

impl Default for TrivialAugmentWide {
    /// torchvision's defaults: 31 bins, nearest, zeros.
    fn default() -> Self {
        TrivialAugmentWide {
            num_magnitude_bins: 31,
            interpolation: Interpolation::Nearest,
            fill: None,
        }
    }
}

impl TrivialAugmentWide {
    /// Checks at least 2 bins and the fill.
    pub fn validate(&self) -> Result<()> {
        check_bins(self.num_magnitude_bins, "TrivialAugmentWide")?;
        match &self.fill {
            Some(f) => check_fill("fill", "TrivialAugmentWide", f, None),
            None => Ok(()),
        }
    }

    /// The operation drawn for an image of `height` x `width` (one step).
    pub fn get_params(
        &self,
        height: usize,
        width: usize,
        rng: &mut TransformRng,
    ) -> Vec<AugmentStep> {
        let op = RAND_OPS[rng.below(RAND_OPS.len() as u64) as usize];
        let magnitude = match magnitudes(op, Space::Wide, self.num_magnitude_bins, height, width) {
            Some(m) => {
                let bin = rng.below(m.len() as u64) as usize;
                signed(op, m[bin], rng)
            }
            None => 0.0,
        };
        vec![AugmentStep { op, magnitude }]
    }

    /// Applies drawn `steps` to `img`.
    pub fn apply_params(&self, img: &HostTensor, steps: &[AugmentStep]) -> Result<HostTensor> {
        apply_steps(img, steps, self.interpolation, self.fill.as_deref())
    }
}

impl Transform for TrivialAugmentWide {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.validate()?;
        each_image(x, "TrivialAugmentWide", |img| {
            let l = check_image(img, "TrivialAugmentWide")?;
            let steps = self.get_params(l.height, l.width, rng);
            self.apply_params(img, &steps)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magnitude_tables_follow_torchvision() {
        // torch.linspace(0, 0.3, 10)[9] == 0.3 (as float32)
        let shear = magnitudes(ShearX, Space::Standard, 10, 8, 8).expect("table");
        assert_eq!(shear[9], f64::from(0.3f32));
        assert_eq!(shear[0], 0.0);
        // (8 - arange(10) / (9 / 4)).round(): 8 8 7 7 6 6 5 5 4 4
        let bits = magnitudes(Posterize, Space::Standard, 10, 8, 8).expect("table");
        assert_eq!(bits, [8.0, 8.0, 7.0, 7.0, 6.0, 6.0, 5.0, 5.0, 4.0, 4.0]);
        let wide = magnitudes(Posterize, Space::Wide, 31, 8, 8).expect("table");
        assert_eq!((wide[0], wide[30]), (8.0, 2.0));
        assert!(magnitudes(Equalize, Space::Wide, 31, 8, 8).is_none());
    }

    #[test]
    fn draws_cover_the_operations() {
        let t = TrivialAugmentWide::default();
        let mut rng = TransformRng::new(5);
        let mut seen = std::collections::HashSet::new();
        let mut negative = false;
        for _ in 0..2000 {
            for s in t.get_params(20, 20, &mut rng) {
                seen.insert(s.op);
                negative |= s.magnitude < 0.0;
                if !s.op.signed() {
                    assert!(s.magnitude >= 0.0, "{s:?}");
                }
            }
        }
        assert_eq!(seen.len(), RAND_OPS.len());
        assert!(negative);
        let a = AutoAugment::default();
        let mut lens = [0usize; 3];
        for _ in 0..500 {
            lens[a.get_params(20, 20, &mut rng).len()] += 1;
        }
        assert!(lens.iter().all(|&n| n > 0), "{lens:?}");
    }

    #[test]
    fn bad_arguments_name_themselves() {
        let t = RandAugment {
            magnitude: 31,
            ..RandAugment::default()
        };
        assert!(t
            .validate()
            .expect_err("bin")
            .to_string()
            .contains("`magnitude`"));
        let t = TrivialAugmentWide {
            num_magnitude_bins: 1,
            ..TrivialAugmentWide::default()
        };
        assert!(t
            .validate()
            .expect_err("bins")
            .to_string()
            .contains("`num_magnitude_bins`"));
        let img = HostTensor::zeros(kiln_core::DType::U8, [2, 8, 8]).expect("image");
        assert!(AutoAugment::default()
            .apply(img, &mut TransformRng::new(0))
            .is_err());
    }
}
