//! Transform pipelines as configuration (`transforms = [...]` in a TOML file).

use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;
use serde::{Deserialize, Serialize};

use super::affine::{Interpolation, ShearRange};
use super::autoaugment::AutoAugmentPolicy;
use super::geometry::ResizeTo;
use super::pad::{Padding, PaddingMode};
use kiln_data::{Compose, Transform, TransformRng};
// The transforms the variants' documentation links to.
#[cfg(doc)]
use super::{
    AutoAugment, CenterCrop, ColorJitter, GaussianBlur, Pad, RandAugment, RandomAffine,
    RandomErasing, RandomGrayscale, RandomPerspective, RandomResizedCrop, RandomRotation, Resize,
    TrivialAugmentWide,
};
#[cfg(doc)]
use crate::{Normalize, RandomHorizontalFlip, ToFloat};

mod build;

/// A side length, or `[height, width]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SizeSpec {
    /// A square of this side.
    Square(usize),
    /// `[height, width]`.
    HeightWidth([usize; 2]),
}

impl SizeSpec {
    /// `(height, width)`.
    pub fn height_width(self) -> (usize, usize) {
        match self {
            SizeSpec::Square(s) => (s, s),
            SizeSpec::HeightWidth([h, w]) => (h, w),
        }
    }
}

/// A number, or a `[min, max]` range (torchvision's `degrees = 30` for
/// `[-30, 30]`, or `sigma = 1.0` for `[1.0, 1.0]`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NumberOrRange {
    /// One number.
    Number(f64),
    /// `[min, max]`.
    Range([f64; 2]),
}

impl NumberOrRange {
    /// The range, a single number `v` giving `[-v, v]` (which needs `v >= 0`,
    /// named `name` in the error).
    fn symmetric(self, name: &str) -> Result<(f64, f64)> {
        match self {
            NumberOrRange::Number(v) if v >= 0.0 => Ok((-v, v)),
            NumberOrRange::Number(v) => Err(Error::invalid_argument(
                name,
                format!("a single number is the range [-{name}, {name}] and must be >= 0, got {v}"),
            )),
            NumberOrRange::Range([a, b]) => Ok((a, b)),
        }
    }

    /// The range, a single number `v` giving `[v, v]`.
    fn fixed(self) -> (f64, f64) {
        match self {
            NumberOrRange::Number(v) => (v, v),
            NumberOrRange::Range([a, b]) => (a, b),
        }
    }
}

/// A fill value for every channel, or one per channel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum FillSpec {
    /// One value for all channels.
    Value(f64),
    /// One value per channel.
    PerChannel(Vec<f64>),
}

impl FillSpec {
    fn values(spec: &Option<FillSpec>) -> Vec<f64> {
        match spec {
            None => vec![0.0],
            Some(FillSpec::Value(v)) => vec![*v],
            Some(FillSpec::PerChannel(v)) => v.clone(),
        }
    }
}

/// [`RandomErasing`]'s `value`: a number, one per channel, or `"random"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EraseValueSpec {
    /// One value for all channels.
    Value(f64),
    /// One value per channel.
    PerChannel(Vec<f64>),
    /// `"random"`: standard normal noise.
    Random(RandomWord),
}

/// The word `"random"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RandomWord {
    /// `"random"`.
    Random,
}

/// [`RandomAffine`]'s `shear`: a number `v` (x shear in `[-v, v]`), `[min,
/// max]` (x shear), or `[x_min, x_max, y_min, y_max]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ShearSpec {
    /// x shear in `[-v, v]`.
    Number(f64),
    /// `[min, max]` or `[x_min, x_max, y_min, y_max]`.
    Ranges(Vec<f64>),
}

impl ShearSpec {
    fn range(&self) -> Result<ShearRange> {
        match self {
            ShearSpec::Number(v) => Ok(ShearRange {
                x: NumberOrRange::Number(*v).symmetric("shear")?,
                y: None,
            }),
            ShearSpec::Ranges(v) => match v[..] {
                [a, b] => Ok(ShearRange { x: (a, b), y: None }),
                [a, b, c, d] => Ok(ShearRange {
                    x: (a, b),
                    y: Some((c, d)),
                }),
                _ => Err(Error::invalid_argument(
                    "shear",
                    format!("give a number, 2 or 4 values, got {}", v.len()),
                )),
            },
        }
    }
}

/// One transform of a configured pipeline, tagged by `type`.
///
/// ```
/// use kiln_vision::transforms::{compose, output_shape, TransformSpec};
///
/// let specs: Vec<TransformSpec> = serde_json::from_str(r#"[
///     {"type": "random_resized_crop", "size": 64},
///     {"type": "random_horizontal_flip"},
///     {"type": "to_tensor"},
///     {"type": "normalize", "mean": [0.5], "std": [0.5]}
/// ]"#).expect("valid JSON");
/// let pipeline = compose(&specs)?;
/// assert_eq!(pipeline.len(), 4);
/// assert_eq!(output_shape(&specs, 3, None), Some([3, 64, 64]));
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum TransformSpec {
    /// [`Resize`]: `size` (shorter side, optional `max_size`) or `height` and `width`.
    Resize {
        /// Length of the shorter side.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        size: Option<usize>,
        /// Exact output height (with `width`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        height: Option<usize>,
        /// Exact output width (with `height`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        width: Option<usize>,
        /// Upper bound of the longer side (with `size`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_size: Option<usize>,
    },
    /// [`CenterCrop`].
    CenterCrop {
        /// Output size.
        size: SizeSpec,
    },
    /// [`RandomResizedCrop`].
    RandomResizedCrop {
        /// Output size.
        size: SizeSpec,
        /// Area range, default `[0.08, 1.0]`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        scale: Option<(f64, f64)>,
        /// Aspect ratio range, default `[3/4, 4/3]`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ratio: Option<(f64, f64)>,
    },
    /// [`RandomHorizontalFlip`].
    RandomHorizontalFlip {
        /// Flip probability, default 0.5.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        p: Option<f64>,
    },
    /// [`ColorJitter`]; an amount left out is 0 (off).
    ColorJitter {
        /// Brightness amount.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        brightness: Option<f64>,
        /// Contrast amount.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        contrast: Option<f64>,
        /// Saturation amount.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        saturation: Option<f64>,
        /// Largest hue shift.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        hue: Option<f64>,
    },
    /// [`Normalize`] (float images only: put `to_tensor` first).
    Normalize {
        /// Per-channel mean (or one for all).
        mean: Vec<f64>,
        /// Per-channel standard deviation (or one for all).
        std: Vec<f64>,
    },
    /// `uint8` to `float32` in `[0, 1]` ([`ToFloat`]).
    ToTensor {},
    /// [`Pad`]: `padding` as 1, 2 (`[left/right, top/bottom]`) or 4
    /// (`[left, top, right, bottom]`) numbers.
    Pad {
        /// Pixels added on the sides.
        padding: Vec<usize>,
        /// Fill for `constant` mode, default 0.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fill: Option<FillSpec>,
        /// `constant` (default), `edge`, `reflect` or `symmetric`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        padding_mode: Option<PaddingMode>,
    },
    /// [`RandomCrop`](super::RandomCrop).
    RandomCrop {
        /// Output size.
        size: SizeSpec,
        /// Padding before the crop (1, 2 or 4 numbers, as for `pad`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        padding: Option<Vec<usize>>,
        /// Pad images smaller than the crop, default false.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pad_if_needed: Option<bool>,
        /// Fill for `constant` mode, default 0.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fill: Option<FillSpec>,
        /// `constant` (default), `edge`, `reflect` or `symmetric`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        padding_mode: Option<PaddingMode>,
    },
    /// [`RandomGrayscale`].
    RandomGrayscale {
        /// Probability, default 0.1.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        p: Option<f64>,
    },
    /// [`GaussianBlur`].
    GaussianBlur {
        /// Kernel side, or `[x, y]` (width first, as torchvision), odd.
        kernel_size: SizeSpec,
        /// Sigma, or its `[min, max]` range; default `[0.1, 2.0]`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sigma: Option<NumberOrRange>,
    },
    /// [`RandomErasing`] (after `to_tensor`, as in torchvision's recipes).
    RandomErasing {
        /// Probability, default 0.5.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        p: Option<f64>,
        /// Area range, default `[0.02, 0.33]`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        scale: Option<(f64, f64)>,
        /// Aspect ratio range, default `[0.3, 3.3]`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ratio: Option<(f64, f64)>,
        /// A value, one per channel, or `"random"`; default 0.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        value: Option<EraseValueSpec>,
    },
    /// [`RandomRotation`].
    RandomRotation {
        /// Largest angle (the range `[-degrees, degrees]`) or `[min, max]`.
        degrees: NumberOrRange,
        /// `nearest` (default) or `bilinear`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        interpolation: Option<Interpolation>,
        /// Grow the output to hold the whole rotated image, default false.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expand: Option<bool>,
        /// Centre `[x, y]` in pixels, default the image's centre.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        center: Option<[f64; 2]>,
        /// Fill, default 0.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fill: Option<FillSpec>,
    },
    /// [`RandomAffine`].
    RandomAffine {
        /// Largest angle (the range `[-degrees, degrees]`) or `[min, max]`.
        degrees: NumberOrRange,
        /// Largest shifts `[x, y]` as fractions of the width and height.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        translate: Option<(f64, f64)>,
        /// Scale range.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        scale: Option<(f64, f64)>,
        /// x shear (a number for `[-v, v]`, or `[min, max]`), or `[x_min,
        /// x_max, y_min, y_max]`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shear: Option<ShearSpec>,
        /// `nearest` (default) or `bilinear`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        interpolation: Option<Interpolation>,
        /// Fill, default 0.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fill: Option<FillSpec>,
        /// Centre `[x, y]` in pixels, default the image's centre.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        center: Option<[f64; 2]>,
    },
    /// [`AutoAugment`].
    AutoAugment {
        /// `imagenet` (default), `cifar10` or `svhn`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        policy: Option<AutoAugmentPolicy>,
        /// `nearest` (default) or `bilinear`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        interpolation: Option<Interpolation>,
        /// Fill of the warps; default none (zeros).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fill: Option<FillSpec>,
    },
    /// [`RandAugment`].
    RandAugment {
        /// Operations per image, default 2.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        num_ops: Option<usize>,
        /// Magnitude bin, default 9.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        magnitude: Option<usize>,
        /// Number of bins, default 31.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        num_magnitude_bins: Option<usize>,
        /// `nearest` (default) or `bilinear`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        interpolation: Option<Interpolation>,
        /// Fill of the warps; default none (zeros).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fill: Option<FillSpec>,
    },
    /// [`TrivialAugmentWide`].
    TrivialAugmentWide {
        /// Number of bins, default 31.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        num_magnitude_bins: Option<usize>,
        /// `nearest` (default) or `bilinear`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        interpolation: Option<Interpolation>,
        /// Fill of the warps; default none (zeros).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fill: Option<FillSpec>,
    },
    /// [`RandomPerspective`].
    RandomPerspective {
        /// How far corners move, default 0.5.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        distortion_scale: Option<f64>,
        /// Probability, default 0.5.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        p: Option<f64>,
        /// `bilinear` (default) or `nearest`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        interpolation: Option<Interpolation>,
        /// Fill, default 0.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fill: Option<FillSpec>,
    },
}

/// A boxed transform as a `Transform` (for [`Compose::then`]).
struct Boxed(Box<dyn Transform>);

impl Transform for Boxed {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.0.apply(x, rng)
    }
}

/// The pipeline of `specs`, in order; the first invalid spec's error names
/// its position.
pub fn compose(specs: &[TransformSpec]) -> Result<Compose> {
    specs
        .iter()
        .enumerate()
        .try_fold(Compose::new(), |c, (i, spec)| {
            let t = spec.build().map_err(|e| match e {
                Error::InvalidArgument { name, reason } => Error::invalid_argument(
                    format!("transforms[{i}].{name}"),
                    format!("({}) {reason}", spec.name()),
                ),
                other => other,
            })?;
            Ok(c.then(Boxed(t)))
        })
}

/// The `[C, H, W]` shape `specs` produce from `channels`-channel images of
/// `size = Some((height, width))`, or of any size where `size` is `None`;
/// `None` when the output size depends on an unknown input size (e.g. no
/// crop or exact resize at the end) or a spec is invalid.
pub fn output_shape(
    specs: &[TransformSpec],
    channels: usize,
    size: Option<(usize, usize)>,
) -> Option<[usize; 3]> {
    let mut hw = size;
    for spec in specs {
        spec.validate().ok()?;
        hw = match spec {
            TransformSpec::Resize {
                size,
                height,
                width,
                max_size,
            } => {
                let to = TransformSpec::resize_to(*size, *height, *width, *max_size).ok()?;
                match (to, hw) {
                    (ResizeTo::Exact { height, width }, _) => Some((height, width)),
                    (to, Some((h, w))) => Some(to.output_size(h, w).ok()?),
                    (_, None) => None,
                }
            }
            TransformSpec::CenterCrop { size }
            | TransformSpec::RandomResizedCrop { size, .. }
            | TransformSpec::RandomCrop { size, .. } => Some(size.height_width()),
            TransformSpec::Pad { padding, .. } => {
                let p = Padding::from_values(padding).ok()?;
                hw.map(|(h, w)| p.padded(h, w))
            }
            TransformSpec::RandomRotation {
                expand: Some(true), ..
            } => None,
            _ => hw,
        };
    }
    hw.map(|(h, w)| [channels, h, w])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_cli_toml_form() {
        #[derive(Deserialize)]
        struct Cfg {
            transforms: Vec<TransformSpec>,
        }
        let cfg: Cfg = serde_json::from_value(serde_json::json!({
            "transforms": [
                {"type": "resize", "size": 72, "max_size": 100},
                {"type": "resize", "height": 70, "width": 80},
                {"type": "center_crop", "size": [64, 60]},
                {"type": "color_jitter", "brightness": 0.4, "hue": 0.1},
                {"type": "to_tensor"}
            ]
        }))
        .expect("valid");
        assert_eq!(
            cfg.transforms[2],
            TransformSpec::CenterCrop {
                size: SizeSpec::HeightWidth([64, 60])
            }
        );
        assert_eq!(output_shape(&cfg.transforms, 3, None), Some([3, 64, 60]));
        assert!(compose(&cfg.transforms).is_ok());
        // round trip
        let text = serde_json::to_string(&cfg.transforms).expect("serialize");
        let back: Vec<TransformSpec> = serde_json::from_str(&text).expect("parse back");
        assert_eq!(back, cfg.transforms);
    }

    #[test]
    fn unknown_fields_and_types_are_rejected() {
        let err = serde_json::from_str::<TransformSpec>(
            r#"{"type": "center_crop", "size": 3, "pad": 1}"#,
        )
        .expect_err("unknown field");
        assert!(err.to_string().contains("pad"), "{err}");
        assert!(serde_json::from_str::<TransformSpec>(r#"{"type": "rotate"}"#).is_err());
    }

    #[test]
    fn invalid_specs_name_their_position_and_argument() {
        let specs = vec![
            TransformSpec::ToTensor {},
            TransformSpec::RandomResizedCrop {
                size: SizeSpec::Square(8),
                scale: Some((0.9, 0.1)),
                ratio: None,
            },
        ];
        let err = compose(&specs).expect_err("scale out of order");
        assert!(err.to_string().contains("transforms[1].scale"), "{err}");
        let bad_resize = TransformSpec::Resize {
            size: Some(8),
            height: Some(3),
            width: None,
            max_size: None,
        };
        assert!(bad_resize.validate().is_err());
        let bad_jitter = TransformSpec::ColorJitter {
            brightness: None,
            contrast: None,
            saturation: None,
            hue: Some(0.7),
        };
        assert!(bad_jitter
            .validate()
            .expect_err("hue")
            .to_string()
            .contains("`hue`"));
    }

    #[test]
    fn shapes_follow_the_pipeline() {
        let shorter = TransformSpec::Resize {
            size: Some(32),
            height: None,
            width: None,
            max_size: None,
        };
        assert_eq!(
            output_shape(std::slice::from_ref(&shorter), 3, Some((64, 128))),
            Some([3, 32, 64])
        );
        assert_eq!(output_shape(&[shorter], 3, None), None);
        assert_eq!(
            output_shape(&[TransformSpec::ToTensor {}], 1, Some((5, 6))),
            Some([1, 5, 6])
        );
    }

    #[test]
    fn parses_the_augmentations() {
        let specs: Vec<TransformSpec> = serde_json::from_value(serde_json::json!([
            {"type": "pad", "padding": [1, 2], "padding_mode": "reflect"},
            {"type": "random_crop", "size": 32, "padding": [4], "pad_if_needed": true,
             "fill": [0, 127, 255], "padding_mode": "constant"},
            {"type": "random_grayscale", "p": 0.2},
            {"type": "gaussian_blur", "kernel_size": [5, 3], "sigma": [0.5, 1.5]},
            {"type": "gaussian_blur", "kernel_size": 3, "sigma": 0.8},
            {"type": "random_rotation", "degrees": 15, "interpolation": "bilinear", "fill": 0},
            {"type": "random_affine", "degrees": [-10, 20], "translate": [0.1, 0.1],
             "scale": [0.9, 1.1], "shear": [-5, 5, -3, 3]},
            {"type": "random_affine", "degrees": 0, "shear": 10},
            {"type": "random_perspective", "distortion_scale": 0.3, "p": 0.4},
            {"type": "auto_augment", "policy": "cifar10"},
            {"type": "rand_augment", "num_ops": 3, "magnitude": 5, "interpolation": "bilinear", "fill": [1, 2, 3]},
            {"type": "trivial_augment_wide", "num_magnitude_bins": 11},
            {"type": "to_tensor"},
            {"type": "random_erasing", "p": 0.25, "value": "random"},
            {"type": "random_erasing", "value": [0.5, 0.4, 0.3]}
        ]))
        .expect("valid");
        assert_eq!(
            specs[0],
            TransformSpec::Pad {
                padding: vec![1, 2],
                fill: None,
                padding_mode: Some(PaddingMode::Reflect)
            }
        );
        assert_eq!(
            specs[13],
            TransformSpec::RandomErasing {
                p: Some(0.25),
                scale: None,
                ratio: None,
                value: Some(EraseValueSpec::Random(RandomWord::Random))
            }
        );
        let names: Vec<&str> = specs.iter().map(TransformSpec::name).collect();
        assert_eq!(names[..3], ["pad", "random_crop", "random_grayscale"]);
        let pipeline = compose(&specs).expect("valid pipeline");
        assert_eq!(pipeline.len(), specs.len());
        let text = serde_json::to_string(&specs).expect("serialize");
        let back: Vec<TransformSpec> = serde_json::from_str(&text).expect("parse back");
        assert_eq!(back, specs);
        // a pipeline runs end to end on a uint8 image
        let img = HostTensor::new(
            (0..3 * 30 * 34)
                .map(|v| (v % 251) as u8)
                .collect::<Vec<u8>>(),
            [3, 30, 34],
        )
        .expect("image");
        let y = pipeline
            .apply(img, &mut TransformRng::new(3))
            .expect("pipeline runs");
        assert_eq!(y.dims(), &[3, 32, 32]);
    }

    #[test]
    fn augmentation_shapes() {
        let pad = TransformSpec::Pad {
            padding: vec![1, 2, 3, 4],
            fill: None,
            padding_mode: None,
        };
        // [left, top, right, bottom]: height + 2 + 4, width + 1 + 3
        assert_eq!(
            output_shape(std::slice::from_ref(&pad), 3, Some((10, 20))),
            Some([3, 16, 24])
        );
        assert_eq!(output_shape(std::slice::from_ref(&pad), 3, None), None);
        let expand = TransformSpec::RandomRotation {
            degrees: NumberOrRange::Number(30.0),
            interpolation: None,
            expand: Some(true),
            center: None,
            fill: None,
        };
        let crop = TransformSpec::RandomCrop {
            size: SizeSpec::Square(8),
            padding: None,
            pad_if_needed: Some(true),
            fill: None,
            padding_mode: None,
        };
        assert_eq!(
            output_shape(std::slice::from_ref(&expand), 3, Some((10, 10))),
            None
        );
        assert_eq!(
            output_shape(&[expand, crop], 3, Some((10, 10))),
            Some([3, 8, 8])
        );
    }

    #[test]
    fn invalid_augmentations_name_their_argument() {
        let cases = [
            (
                r#"{"type": "pad", "padding": [1, 2, 3]}"#,
                "transforms[0].padding",
            ),
            (
                r#"{"type": "random_crop", "size": 0}"#,
                "transforms[0].size",
            ),
            (r#"{"type": "random_grayscale", "p": 2}"#, "transforms[0].p"),
            (
                r#"{"type": "gaussian_blur", "kernel_size": 4}"#,
                "transforms[0].kernel_size",
            ),
            (
                r#"{"type": "gaussian_blur", "kernel_size": 3, "sigma": [2, 1]}"#,
                "transforms[0].sigma",
            ),
            (
                r#"{"type": "random_erasing", "scale": [0.5, 0.1]}"#,
                "transforms[0].scale",
            ),
            (
                r#"{"type": "random_rotation", "degrees": -5}"#,
                "transforms[0].degrees",
            ),
            (
                r#"{"type": "random_affine", "degrees": 0, "translate": [2, 0]}"#,
                "transforms[0].translate",
            ),
            (
                r#"{"type": "random_affine", "degrees": 0, "shear": [1, 2, 3]}"#,
                "transforms[0].shear",
            ),
            (
                r#"{"type": "rand_augment", "magnitude": 40}"#,
                "transforms[0].magnitude",
            ),
            (
                r#"{"type": "trivial_augment_wide", "num_magnitude_bins": 0}"#,
                "transforms[0].num_magnitude_bins",
            ),
            (
                r#"{"type": "random_perspective", "distortion_scale": 3}"#,
                "transforms[0].distortion_scale",
            ),
        ];
        for (json, expected) in cases {
            let spec: TransformSpec = serde_json::from_str(json).expect(json);
            let err = compose(&[spec]).expect_err(json);
            assert!(err.to_string().contains(expected), "{json}: {err}");
        }
        assert!(serde_json::from_str::<TransformSpec>(
            r#"{"type": "pad", "padding": [1], "padding_mode": "wrap"}"#
        )
        .is_err());
        assert!(serde_json::from_str::<TransformSpec>(
            r#"{"type": "random_erasing", "value": "noise"}"#
        )
        .is_err());
    }
}
