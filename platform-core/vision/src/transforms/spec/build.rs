//! What each [`TransformSpec`] builds: its `type` name, its arguments
//! checked (errors naming the offending one), torchvision's defaults for
//! what is left out, and the transform.

use kiln_core::error::{Error, Result};

use super::{
    EraseValueSpec, FillSpec, NumberOrRange, RandomWord, ShearSpec, SizeSpec, TransformSpec,
};
use crate::transforms::affine::{Interpolation, RandomAffine, RandomPerspective, RandomRotation};
use crate::transforms::augment::{EraseValue, GaussianBlur, RandomErasing, RandomGrayscale};
use crate::transforms::autoaugment::{AutoAugment, RandAugment, TrivialAugmentWide};
use crate::transforms::basic::{CenterCrop, ColorJitter, RandomResizedCrop, Resize};
use crate::transforms::geometry::ResizeTo;
use crate::transforms::pad::{Pad, Padding, RandomCrop};
use crate::{Normalize, RandomHorizontalFlip, ToFloat};
use kiln_data::Transform;

impl TransformSpec {
    /// The `type` name.
    pub fn name(&self) -> &'static str {
        match self {
            TransformSpec::Resize { .. } => "resize",
            TransformSpec::CenterCrop { .. } => "center_crop",
            TransformSpec::RandomResizedCrop { .. } => "random_resized_crop",
            TransformSpec::RandomHorizontalFlip { .. } => "random_horizontal_flip",
            TransformSpec::ColorJitter { .. } => "color_jitter",
            TransformSpec::Normalize { .. } => "normalize",
            TransformSpec::ToTensor {} => "to_tensor",
            TransformSpec::Pad { .. } => "pad",
            TransformSpec::RandomCrop { .. } => "random_crop",
            TransformSpec::RandomGrayscale { .. } => "random_grayscale",
            TransformSpec::GaussianBlur { .. } => "gaussian_blur",
            TransformSpec::RandomErasing { .. } => "random_erasing",
            TransformSpec::RandomRotation { .. } => "random_rotation",
            TransformSpec::RandomAffine { .. } => "random_affine",
            TransformSpec::RandomPerspective { .. } => "random_perspective",
            TransformSpec::AutoAugment { .. } => "auto_augment",
            TransformSpec::RandAugment { .. } => "rand_augment",
            TransformSpec::TrivialAugmentWide { .. } => "trivial_augment_wide",
        }
    }

    pub(super) fn resize_to(
        size: Option<usize>,
        height: Option<usize>,
        width: Option<usize>,
        max_size: Option<usize>,
    ) -> Result<ResizeTo> {
        let to =
            match (size, height, width, max_size) {
                (Some(size), None, None, max_size) => ResizeTo::Shorter { size, max_size },
                (None, Some(height), Some(width), None) => ResizeTo::Exact { height, width },
                _ => return Err(Error::invalid_argument(
                    "resize",
                    "give either `size` (and optionally `max_size`) or both `height` and `width`",
                )),
            };
        to.validate()?;
        Ok(to)
    }

    fn random_resized_crop(
        size: SizeSpec,
        scale: Option<(f64, f64)>,
        ratio: Option<(f64, f64)>,
    ) -> Result<RandomResizedCrop> {
        let (h, w) = size.height_width();
        let mut t = RandomResizedCrop::new(h, w);
        if let Some(s) = scale {
            t.scale = s;
        }
        if let Some(r) = ratio {
            t.ratio = r;
        }
        t.validate()?;
        Ok(t)
    }

    /// Checks the arguments, with errors naming the offending one.
    pub fn validate(&self) -> Result<()> {
        self.build().map(|_| ())
    }

    /// `random_horizontal_flip` with probability `p` (0.5 by default).
    fn random_horizontal_flip(p: Option<f64>) -> Result<RandomHorizontalFlip> {
        let p = p.unwrap_or(0.5);
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::invalid_argument(
                "p",
                format!("random_horizontal_flip probability must lie in [0, 1], got {p}"),
            ));
        }
        Ok(RandomHorizontalFlip { p })
    }

    /// `normalize` by `mean` and `std` (one value each, or one per channel).
    fn normalize(mean: &[f64], std: &[f64]) -> Result<Normalize> {
        if mean.is_empty() || std.is_empty() {
            return Err(Error::invalid_argument(
                if mean.is_empty() { "mean" } else { "std" },
                "normalize needs at least one value",
            ));
        }
        if let Some(c) = std.iter().position(|&s| s == 0.0 || !s.is_finite()) {
            return Err(Error::invalid_argument(
                "std",
                format!(
                    "normalize: std[{c}] = {} must be finite and non-zero",
                    std[c]
                ),
            ));
        }
        if mean.len() != std.len() && mean.len() != 1 && std.len() != 1 {
            return Err(Error::invalid_argument(
                "std",
                format!(
                    "normalize has {} means but {} standard deviations",
                    mean.len(),
                    std.len()
                ),
            ));
        }
        Ok(Normalize {
            mean: mean.to_vec(),
            std: std.to_vec(),
        })
    }

    /// `random_erasing`, torchvision's defaults for what is not given.
    fn random_erasing(
        p: Option<f64>,
        scale: Option<(f64, f64)>,
        ratio: Option<(f64, f64)>,
        value: Option<&EraseValueSpec>,
    ) -> Result<RandomErasing> {
        let mut t = RandomErasing::default();
        t.p = p.unwrap_or(t.p);
        t.scale = scale.unwrap_or(t.scale);
        t.ratio = ratio.unwrap_or(t.ratio);
        t.value = match value {
            None => EraseValue::Constant(vec![0.0]),
            Some(EraseValueSpec::Value(v)) => EraseValue::Constant(vec![*v]),
            Some(EraseValueSpec::PerChannel(v)) => EraseValue::Constant(v.clone()),
            Some(EraseValueSpec::Random(RandomWord::Random)) => EraseValue::Random,
        };
        t.validate()?;
        Ok(t)
    }

    /// `random_affine`, torchvision's defaults for what is not given.
    #[allow(clippy::too_many_arguments)]
    fn random_affine(
        degrees: &NumberOrRange,
        translate: Option<(f64, f64)>,
        scale: Option<(f64, f64)>,
        shear: Option<&ShearSpec>,
        interpolation: Option<Interpolation>,
        fill: &Option<FillSpec>,
        center: Option<[f64; 2]>,
    ) -> Result<RandomAffine> {
        let t = RandomAffine {
            degrees: degrees.symmetric("degrees")?,
            translate,
            scale,
            shear: shear.map(ShearSpec::range).transpose()?,
            interpolation: interpolation.unwrap_or(Interpolation::Nearest),
            fill: FillSpec::values(fill),
            center: center.map(|[x, y]| (x, y)),
        };
        t.validate()?;
        Ok(t)
    }

    /// `rand_augment`, torchvision's defaults for what is not given.
    fn rand_augment(
        num_ops: Option<usize>,
        magnitude: Option<usize>,
        num_magnitude_bins: Option<usize>,
        interpolation: Option<Interpolation>,
        fill: &Option<FillSpec>,
    ) -> Result<RandAugment> {
        let d = RandAugment::default();
        let t = RandAugment {
            num_ops: num_ops.unwrap_or(d.num_ops),
            magnitude: magnitude.unwrap_or(d.magnitude),
            num_magnitude_bins: num_magnitude_bins.unwrap_or(d.num_magnitude_bins),
            interpolation: interpolation.unwrap_or_default(),
            fill: fill.as_ref().map(|_| FillSpec::values(fill)),
        };
        t.validate()?;
        Ok(t)
    }

    /// `random_perspective`, torchvision's defaults for what is not given.
    fn random_perspective(
        distortion_scale: Option<f64>,
        p: Option<f64>,
        interpolation: Option<Interpolation>,
        fill: &Option<FillSpec>,
    ) -> Result<RandomPerspective> {
        let d = RandomPerspective::default();
        let t = RandomPerspective {
            distortion_scale: distortion_scale.unwrap_or(d.distortion_scale),
            p: p.unwrap_or(d.p),
            interpolation: interpolation.unwrap_or(d.interpolation),
            fill: FillSpec::values(fill),
        };
        t.validate()?;
        Ok(t)
    }

    /// `random_rotation`, torchvision's defaults for what is not given.
    fn random_rotation(
        degrees: &NumberOrRange,
        interpolation: Option<Interpolation>,
        expand: Option<bool>,
        center: Option<[f64; 2]>,
        fill: &Option<FillSpec>,
    ) -> Result<RandomRotation> {
        let t = RandomRotation {
            degrees: degrees.symmetric("degrees")?,
            interpolation: interpolation.unwrap_or(Interpolation::Nearest),
            expand: expand.unwrap_or(false),
            center: center.map(|[x, y]| (x, y)),
            fill: FillSpec::values(fill),
        };
        t.validate()?;
        Ok(t)
    }

    /// `trivial_augment_wide`, torchvision's defaults for what is not given.
    fn trivial_augment_wide(
        num_magnitude_bins: Option<usize>,
        interpolation: Option<Interpolation>,
        fill: &Option<FillSpec>,
    ) -> Result<TrivialAugmentWide> {
        let t = TrivialAugmentWide {
            num_magnitude_bins: num_magnitude_bins.unwrap_or(31),
            interpolation: interpolation.unwrap_or_default(),
            fill: fill.as_ref().map(|_| FillSpec::values(fill)),
        };
        t.validate()?;
        Ok(t)
    }

    /// `random_grayscale` with probability `p` (0.1 by default).
    fn random_grayscale(p: Option<f64>) -> Result<RandomGrayscale> {
        let t = RandomGrayscale {
            p: p.unwrap_or(0.1),
        };
        t.validate()?;
        Ok(t)
    }

    /// `gaussian_blur` with a `kernel_size` and a `sigma` (drawn from
    /// `[0.1, 2.0]` by default).
    fn gaussian_blur(kernel_size: SizeSpec, sigma: Option<NumberOrRange>) -> Result<GaussianBlur> {
        let k = match kernel_size {
            SizeSpec::Square(k) => (k, k),
            SizeSpec::HeightWidth([x, y]) => (x, y),
        };
        let sigma = sigma.map_or((0.1, 2.0), NumberOrRange::fixed);
        GaussianBlur::new(k, sigma)
    }

    /// The transform this spec describes.
    pub fn build(&self) -> Result<Box<dyn Transform>> {
        Ok(match self {
            TransformSpec::Resize {
                size,
                height,
                width,
                max_size,
            } => Box::new(Resize::new(Self::resize_to(
                *size, *height, *width, *max_size,
            )?)?),
            TransformSpec::CenterCrop { size } => {
                let (h, w) = size.height_width();
                Box::new(CenterCrop::new(h, w)?)
            }
            TransformSpec::RandomResizedCrop { size, scale, ratio } => {
                Box::new(Self::random_resized_crop(*size, *scale, *ratio)?)
            }
            TransformSpec::RandomHorizontalFlip { p } => {
                Box::new(Self::random_horizontal_flip(*p)?)
            }
            TransformSpec::ColorJitter {
                brightness,
                contrast,
                saturation,
                hue,
            } => Box::new(ColorJitter::new(
                brightness.unwrap_or(0.0),
                contrast.unwrap_or(0.0),
                saturation.unwrap_or(0.0),
                hue.unwrap_or(0.0),
            )?),
            TransformSpec::Normalize { mean, std } => Box::new(Self::normalize(mean, std)?),
            TransformSpec::ToTensor {} => Box::new(ToFloat),
            TransformSpec::Pad {
                padding,
                fill,
                padding_mode,
            } => Box::new(Pad::new(
                Padding::from_values(padding)?,
                FillSpec::values(fill),
                padding_mode.unwrap_or_default(),
            )?),
            TransformSpec::RandomCrop {
                size,
                padding,
                pad_if_needed,
                fill,
                padding_mode,
            } => {
                let (h, w) = size.height_width();
                let mut t = RandomCrop::new(h, w);
                t.padding = padding.as_deref().map(Padding::from_values).transpose()?;
                t.pad_if_needed = pad_if_needed.unwrap_or(false);
                t.fill = FillSpec::values(fill);
                t.padding_mode = padding_mode.unwrap_or_default();
                t.validate()?;
                Box::new(t)
            }
            TransformSpec::RandomGrayscale { p } => Box::new(Self::random_grayscale(*p)?),
            TransformSpec::GaussianBlur { kernel_size, sigma } => {
                Box::new(Self::gaussian_blur(*kernel_size, *sigma)?)
            }
            TransformSpec::RandomErasing {
                p,
                scale,
                ratio,
                value,
            } => Box::new(Self::random_erasing(*p, *scale, *ratio, value.as_ref())?),
            TransformSpec::RandomRotation {
                degrees,
                interpolation,
                expand,
                center,
                fill,
            } => Box::new(Self::random_rotation(
                degrees,
                *interpolation,
                *expand,
                *center,
                fill,
            )?),
            TransformSpec::RandomAffine {
                degrees,
                translate,
                scale,
                shear,
                interpolation,
                fill,
                center,
            } => Box::new(Self::random_affine(
                degrees,
                *translate,
                *scale,
                shear.as_ref(),
                *interpolation,
                fill,
                *center,
            )?),
            TransformSpec::AutoAugment {
                policy,
                interpolation,
                fill,
            } => {
                let t = AutoAugment {
                    policy: policy.unwrap_or_default(),
                    interpolation: interpolation.unwrap_or_default(),
                    fill: fill.as_ref().map(|_| FillSpec::values(fill)),
                };
                t.validate()?;
                Box::new(t)
            }
            TransformSpec::RandAugment {
                num_ops,
                magnitude,
                num_magnitude_bins,
                interpolation,
                fill,
            } => Box::new(Self::rand_augment(
                *num_ops,
                *magnitude,
                *num_magnitude_bins,
                *interpolation,
                fill,
            )?),
            TransformSpec::TrivialAugmentWide {
                num_magnitude_bins,
                interpolation,
                fill,
            } => Box::new(Self::trivial_augment_wide(
                *num_magnitude_bins,
                *interpolation,
                fill,
            )?),
            TransformSpec::RandomPerspective {
                distortion_scale,
                p,
                interpolation,
                fill,
            } => Box::new(Self::random_perspective(
                *distortion_scale,
                *p,
                *interpolation,
                fill,
            )?),
        })
    }
}
