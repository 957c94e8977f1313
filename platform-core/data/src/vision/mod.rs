//! Image transforms with torchvision's semantics (`torchvision.transforms.v2`
//! on tensors), seeded per sample and epoch like every [`Transform`](crate::Transform).
//!
//! Images are [`HostTensor`]s `[C, H, W]` (or batches
//! `[N, C, H, W]`) of `uint8`, as a decoder gives them, or `float32` after
//! [`ToTensor`].
//!
//! * Functions: [`resize`] (bilinear, antialiased), [`crop`],
//!   [`center_crop`], [`resized_crop`], [`hflip`], [`adjust_brightness`],
//!   [`adjust_contrast`], [`adjust_saturation`], [`adjust_hue`], [`to_tensor`].
//! * Transforms: [`Resize`], [`CenterCrop`], [`RandomResizedCrop`],
//!   [`ColorJitter`], with [`RandomHorizontalFlip`](crate::RandomHorizontalFlip),
//!   [`Normalize`](crate::Normalize) and [`ToTensor`] (= [`ToFloat`](crate::ToFloat)).
//!   Random ones expose `get_params` (torchvision's sampling, with
//!   [`TransformRng`](crate::TransformRng) in place of torch's generator) so that
//!   a drawn box or jitter can be replayed.
//! * Configuration: [`TransformSpec`] (`{ type = "random_resized_crop", size = 64 }`),
//!   [`compose`] and [`output_shape`].
//!
//! # Agreement with torchvision
//!
//! `tests/vision_parity.rs` compares every function with torchvision 0.26 on
//! the same pixels (generated photo-like images of odd sizes; the reference
//! script is `tests/reference/vision_parity.py`). Largest absolute
//! differences allowed (and measured):
//!
//! | transform | `uint8` allowed (measured) | `float32` allowed (measured) |
//! |---|---|---|
//! | [`resize`], [`resized_crop`], [`RandomResizedCrop`] (replayed box) | 0 (0) | 1e-5 (1.8e-7) |
//! | [`crop`], [`center_crop`], [`hflip`] | 0 (0) | 0 (0) |
//! | [`adjust_brightness`], [`adjust_contrast`], [`adjust_saturation`], [`adjust_hue`] | 1 (0) | 1e-6 (1.5e-8) |
//! | [`ColorJitter`] (replayed parameters) | 1 (0) | 1e-6 (2.1e-7) |
//! | [`Normalize`](crate::Normalize) | - | 1e-6 (0) |
//! | [`to_tensor`] vs torchvision's `to_tensor` | 0 (0) | - |
//! | [`to_tensor`] vs v2's `ToDtype(float32, scale=True)` | 1e-7 (6e-8: it multiplies by 1/255) | - |
//!
//! The colour operations' `uint8` outputs truncate a `float32`; the
//! tolerance of 1 allows for a last-bit difference in PyTorch's summation or
//! fused multiply-add on another CPU.
//!
//! `uint8` resize matches PyTorch's fixed-point kernel, which torchvision uses
//! on CPUs with AVX2 (every x86-64 server of the last decade); without AVX2
//! torchvision resizes in float and rounds, which differs by up to 1.

mod affine;
mod augment;
mod autoaugment;
mod color;
mod geometry;
mod image;
mod ops;
mod pad;
mod pixel;
mod spec;
mod transforms;

pub use crate::transform::ToFloat as ToTensor;
pub use affine::{
    affine, inverse_affine_matrix, perspective, perspective_coefficients, rotate, AffineParams,
    Interpolation, RandomAffine, RandomPerspective, RandomRotation, ShearRange,
};
pub use augment::{
    erase, gaussian_blur, rgb_to_grayscale, EraseValue, ErasingParams, GaussianBlur, RandomErasing,
    RandomGrayscale,
};
pub use autoaugment::{
    augment_op, AugmentOp, AugmentStep, AutoAugment, AutoAugmentPolicy, RandAugment,
    TrivialAugmentWide,
};
pub use color::{adjust_brightness, adjust_contrast, adjust_hue, adjust_saturation};
pub use geometry::{center_crop, crop, hflip, resize, resized_crop, ResizeTo};
pub use ops::{adjust_sharpness, autocontrast, equalize, invert, posterize, solarize};
pub use pad::{pad, Pad, Padding, PaddingMode, RandomCrop, RandomCropParams};
pub use spec::{compose, output_shape, SizeSpec, TransformSpec};
pub use transforms::{
    CenterCrop, ColorJitter, CropBox, JitterOp, JitterParams, RandomResizedCrop, Resize,
};

use kiln_core::error::Result;
use kiln_core::tensor::HostTensor;

/// `uint8` pixels to `float32` in `[0, 1]`, dividing by 255 (torchvision's
/// `to_tensor` on an image already channels-first); `float32` passes through.
/// The same as the [`ToTensor`] transform.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_data::vision::to_tensor;
///
/// let y = to_tensor(&HostTensor::new(vec![0u8, 255], [1, 1, 2])?)?;
/// assert_eq!(y.as_slice::<f32>()?, &[0.0, 1.0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn to_tensor(img: &HostTensor) -> Result<HostTensor> {
    use crate::transform::{Transform, TransformRng};
    ToTensor.apply(img.clone(), &mut TransformRng::new(0))
}
