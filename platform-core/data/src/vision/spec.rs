//! Transform pipelines as configuration (`transforms = [...]` in a TOML file).

use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;
use serde::{Deserialize, Serialize};

use super::geometry::ResizeTo;
use super::transforms::{CenterCrop, ColorJitter, RandomResizedCrop, Resize};
use crate::transform::{
    Compose, Normalize, RandomHorizontalFlip, ToFloat, Transform, TransformRng,
};

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

/// One transform of a configured pipeline, tagged by `type`.
///
/// ```
/// use kiln_data::vision::{compose, output_shape, TransformSpec};
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
}

/// A boxed transform as a `Transform` (for [`Compose::then`]).
struct Boxed(Box<dyn Transform>);

impl Transform for Boxed {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.0.apply(x, rng)
    }
}

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
        }
    }

    fn resize_to(
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
                let p = p.unwrap_or(0.5);
                if !(0.0..=1.0).contains(&p) {
                    return Err(Error::invalid_argument(
                        "p",
                        format!("random_horizontal_flip probability must lie in [0, 1], got {p}"),
                    ));
                }
                Box::new(RandomHorizontalFlip { p })
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
            TransformSpec::Normalize { mean, std } => {
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
                Box::new(Normalize {
                    mean: mean.clone(),
                    std: std.clone(),
                })
            }
            TransformSpec::ToTensor {} => Box::new(ToFloat),
        })
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
            TransformSpec::CenterCrop { size } | TransformSpec::RandomResizedCrop { size, .. } => {
                Some(size.height_width())
            }
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
}
