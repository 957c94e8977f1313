//! Image transforms with torchvision's semantics (`torchvision.transforms.v2`
//! on tensors), seeded per sample and epoch like every [`Transform`](kiln_data::Transform).
//!
//! Images are [`HostTensor`]s `[C, H, W]` (or batches
//! `[N, C, H, W]`) of `uint8`, as a decoder gives them, or `float32` after
//! [`ToTensor`].
//!
//! * Functions: [`resize`] (bilinear, antialiased), [`crop`],
//!   [`center_crop`], [`resized_crop`], [`hflip`], [`pad`], [`adjust_brightness`],
//!   [`adjust_contrast`], [`adjust_saturation`], [`adjust_hue`],
//!   [`adjust_sharpness`], [`rgb_to_grayscale`], [`gaussian_blur`],
//!   [`erase`], [`posterize`], [`solarize`], [`autocontrast`], [`equalize`],
//!   [`invert`], [`affine`], [`rotate`], [`perspective`] (with
//!   [`perspective_coefficients`]), [`augment_op`], [`to_tensor`].
//! * Transforms: [`Resize`], [`CenterCrop`], [`RandomResizedCrop`],
//!   [`ColorJitter`], [`Pad`], [`RandomCrop`], [`RandomGrayscale`],
//!   [`GaussianBlur`], [`RandomErasing`], [`RandomRotation`], [`RandomAffine`],
//!   [`RandomPerspective`], [`AutoAugment`], [`RandAugment`],
//!   [`TrivialAugmentWide`], with [`RandomHorizontalFlip`](crate::RandomHorizontalFlip),
//!   [`Normalize`](crate::Normalize) and [`ToTensor`] (= [`ToFloat`](crate::ToFloat)).
//!   Random ones expose `get_params` (torchvision's sampling, with
//!   [`TransformRng`](kiln_data::TransformRng) in place of torch's generator) so that
//!   a drawn box, angle, jitter or list of operations can be replayed.
//! * Configuration: [`TransformSpec`] (`{ type = "random_resized_crop", size = 64 }`,
//!   one `type` per transform, named after torchvision's class in snake case:
//!   `random_affine`, `trivial_augment_wide`, ...), [`compose`] and
//!   [`output_shape`].
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
//!
//! `tests/vision_augment.rs` compares the augmentations the same way
//! (`tests/reference/vision_augment.py`; images 3x37x53, 1x29x31, 3x32x32
//! and a batch of two; the random transforms' draws replayed through
//! torchvision's own classes). Largest absolute differences allowed (and
//! measured on an AVX-512 CPU; for float32 the share of elements that
//! differ):
//!
//! | transform | `uint8` allowed (measured) | `float32` allowed (measured) |
//! |---|---|---|
//! | [`pad`], [`Pad`], [`RandomCrop`] (every padding mode) | 0 (0) | 0 (0) |
//! | [`rgb_to_grayscale`], [`RandomGrayscale`], [`erase`], [`RandomErasing`] | 0 (0) | 0 (0) |
//! | [`affine`], [`rotate`], [`perspective`] and their random transforms, nearest and bilinear, every fill | 0 with MKL's AVX2 kernels; on AVX-512: bilinear 1 (1, 0.2%), nearest any in 0.1% (0.02%) | 0 with MKL's AVX2 kernels; on AVX-512: bilinear 3e-5 (1.1e-5), nearest any in 0.1% (0.02%) |
//! | [`gaussian_blur`], [`GaussianBlur`] | 1 (0) | 1e-6 (2.4e-7, 25%) |
//! | [`posterize`], [`solarize`], [`autocontrast`], [`equalize`], [`invert`], shears, translations, rotations of [`augment_op`] | 0 (0) | 0 (0) |
//! | [`adjust_sharpness`] | 0 (0) | 1e-6 (1.2e-7, 1% of one-channel images; RGB 0) |
//! | [`AutoAugment`], [`RandAugment`], [`TrivialAugmentWide`] (replayed operations) | as the warps | as the warps (AVX2: 1.2e-7, 1-4%) |
//!
//! The warps reproduce torchvision's arithmetic operation for operation: the
//! inverse affine matrix in `f64`, the sampling grid in `float32`, then
//! `grid_sample(align_corners=False)` with the fused multiply-adds PyTorch's
//! vectorised CPU kernel is compiled to (unnormalising the coordinates and
//! summing the four corners), and `uint8` rounded half to even, as
//! `_apply_grid_transform` does (it rounds, it does not truncate). A
//! fill (`Some`) samples a mask alongside and blends as torchvision does, so
//! bilinear borders differ from `fill = None` (zeros, no mask), as they do
//! there. torchvision's sampling grid is a matrix product, whose last bits
//! depend on the CPU's BLAS kernel: with MKL's AVX2 kernels every element
//! equals torchvision's; with its AVX-512 ones a grid coordinate may differ by
//! an ulp, which moves a bilinear output by ~1e-6 and sends a nearest sample
//! sitting on a pixel boundary to its neighbour (the tests allow both, and
//! are exact under `MKL_ENABLE_INSTRUCTIONS=AVX2`).
//!
//! The Gaussian kernel is `softmax(-(x / sigma)^2)` in `float32`; PyTorch's
//! softmax uses a fast exponential whose last bits Kiln does not reproduce,
//! so a kernel weight may differ by an ulp, a `float32` output by ~2e-7 and a
//! `uint8` output (rounded half to even) by 1 where the exact value lies
//! within ~1e-5 of a half (none in the tests). The convolutions (blur and
//! sharpness) sum in PyTorch's row-major fused order, which matches exactly
//! for three-channel images; the one-channel sharpness and contrast (whose
//! mean PyTorch sums in another order) differ in the last bit of `float32`.

mod affine;
mod augment;
mod autoaugment;
mod basic;
mod color;
mod geometry;
mod image;
mod mix;
mod ops;
mod pad;
mod pixel;
mod resize_u8;
mod spec;
mod taps;

pub use crate::ToFloat as ToTensor;
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
pub use basic::{
    CenterCrop, ColorJitter, CropBox, JitterOp, JitterParams, RandomResizedCrop, Resize,
};
pub use color::{adjust_brightness, adjust_contrast, adjust_hue, adjust_saturation};
pub use geometry::{center_crop, crop, hflip, resize, resized_crop, ResizeTo};
pub use mix::{BatchTransform, BatchTransformed, CutBox, CutMix, MixUp, MixUpOrCutMix};
pub use ops::{adjust_sharpness, autocontrast, equalize, invert, posterize, solarize};
pub use pad::{pad, Pad, Padding, PaddingMode, RandomCrop, RandomCropParams};
pub use spec::{compose, output_shape, SizeSpec, TransformSpec};

use kiln_core::error::Result;
use kiln_core::tensor::HostTensor;

/// `uint8` pixels to `float32` in `[0, 1]`, dividing by 255 (torchvision's
/// `to_tensor` on an image already channels-first); `float32` passes through.
/// The same as the [`ToTensor`] transform.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::to_tensor;
///
/// let y = to_tensor(&HostTensor::new(vec![0u8, 255], [1, 1, 2])?)?;
/// assert_eq!(y.as_slice::<f32>()?, &[0.0, 1.0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn to_tensor(img: &HostTensor) -> Result<HostTensor> {
    use kiln_data::{Transform, TransformRng};
    ToTensor.apply(img.clone(), &mut TransformRng::new(0))
}
