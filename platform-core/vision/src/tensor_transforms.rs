//! Transforms on image tensors of every dtype: per-channel normalisation,
//! a zero-padded random crop, a random horizontal flip, and the scaling of
//! `uint8` pixels to `float32`.
//!
//! They take one image `[C, H, W]` or a batch `[N, C, H, W]` (random ones
//! draw separately for every image of a batch), as `torchvision.transforms`
//! do for tensors.

use kiln_core::dtype::{DType, Element};
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;
use kiln_data::{Transform, TransformRng};

/// Per-channel normalisation `(x - mean[c]) / std[c]`, as
/// `torchvision.transforms.Normalize` on a tensor `[..., C, H, W]`.
///
/// `mean` and `std` have one value per channel, or one value for all. For
/// `float32` input they are rounded to `f32` first and the arithmetic is
/// done in `f32`, as torchvision does; `float64` input is computed in `f64`.
/// Other dtypes are an [`Error::DTypeMismatch`] (convert with [`ToFloat`]
/// first); a standard deviation that is zero (after rounding) is an
/// [`Error::InvalidArgument`].
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_data::{Transform, TransformRng};
/// use kiln_vision::Normalize;
///
/// let n = Normalize { mean: vec![1.0, 2.0], std: vec![2.0, 0.5] };
/// let x = HostTensor::new(vec![3.0f32, 5.0, 2.0, 4.0], [2, 1, 2])?;
/// let y = n.apply(x, &mut TransformRng::new(0))?;
/// assert_eq!(y.as_slice::<f32>()?, &[1.0, 2.0, 0.0, 4.0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Normalize {
    /// Mean of each channel (or one for all).
    pub mean: Vec<f64>,
    /// Standard deviation of each channel (or one for all).
    pub std: Vec<f64>,
}

impl Normalize {
    /// The per-channel value of `values` (named `name`) for `channels` channels.
    fn per_channel(values: &[f64], name: &str, channels: usize) -> Result<Vec<f64>> {
        match values.len() {
            1 => Ok(vec![values[0]; channels]),
            n if n == channels => Ok(values.to_vec()),
            n => Err(Error::invalid_argument(
                name,
                format!("Normalize has {n} values for an input with {channels} channels; expected {channels} or 1"),
            )),
        }
    }
}

impl Transform for Normalize {
    fn apply(&self, mut x: HostTensor, _rng: &mut TransformRng) -> Result<HostTensor> {
        let dims = x.dims();
        if dims.len() < 3 {
            return Err(Error::ShapeMismatch {
                context: "Normalize".into(),
                expected: "[..., C, H, W]".into(),
                actual: x.shape().to_string(),
            });
        }
        let channels = dims[dims.len() - 3];
        let plane = dims[dims.len() - 2] * dims[dims.len() - 1];
        let mean = Normalize::per_channel(&self.mean, "mean", channels)?;
        let std = Normalize::per_channel(&self.std, "std", channels)?;
        match x.dtype() {
            DType::F32 => {
                let mean: Vec<f32> = mean.iter().map(|&m| m as f32).collect();
                let std: Vec<f32> = std.iter().map(|&s| s as f32).collect();
                check_std(&std.iter().map(|&s| f64::from(s)).collect::<Vec<_>>())?;
                normalize_in_place(x.as_mut_slice::<f32>()?, &mean, &std, plane);
            }
            DType::F64 => {
                check_std(&std)?;
                normalize_in_place(x.as_mut_slice::<f64>()?, &mean, &std, plane);
            }
            other => {
                return Err(Error::DTypeMismatch {
                    context: "Normalize needs a float tensor (use ToFloat first)".into(),
                    expected: DType::F32,
                    actual: other,
                })
            }
        }
        Ok(x)
    }
}

/// Rejects a zero standard deviation, which would divide by zero.
fn check_std(std: &[f64]) -> Result<()> {
    match std.iter().position(|&s| s == 0.0) {
        Some(c) => Err(Error::invalid_argument(
            "std",
            format!("Normalize: the standard deviation of channel {c} is zero"),
        )),
        None => Ok(()),
    }
}

/// `(v - mean[c]) / std[c]` for every value, where channels cycle every `plane` values.
fn normalize_in_place<T>(data: &mut [T], mean: &[T], std: &[T], plane: usize)
where
    T: Copy + std::ops::Sub<Output = T> + std::ops::Div<Output = T>,
{
    if plane == 0 {
        return;
    }
    let channels = mean.len();
    for (p, chunk) in data.chunks_mut(plane).enumerate() {
        let c = p % channels;
        let (m, s) = (mean[c], std[c]);
        for v in chunk {
            *v = (*v - m) / s;
        }
    }
}

/// The images of `x` as `(count, channels, height, width)`, for `[C, H, W]`
/// or `[N, C, H, W]`.
fn image_dims(x: &HostTensor, context: &str) -> Result<(usize, usize, usize, usize)> {
    match *x.dims() {
        [c, h, w] => Ok((1, c, h, w)),
        [n, c, h, w] => Ok((n, c, h, w)),
        _ => Err(Error::ShapeMismatch {
            context: context.into(),
            expected: "[C, H, W] or [N, C, H, W]".into(),
            actual: x.shape().to_string(),
        }),
    }
}

/// An operation on the elements of images, written once for every dtype.
trait ImageKernel {
    /// The output elements for input elements `src`.
    fn run<T: Element>(&self, src: &[T], rng: &mut TransformRng) -> Vec<T>;
}

/// Runs `kernel` on the elements of `x`, giving a tensor of shape `dims`.
fn run_kernel(
    x: &HostTensor,
    kernel: &impl ImageKernel,
    rng: &mut TransformRng,
    dims: Vec<usize>,
) -> Result<HostTensor> {
    match x.dtype() {
        DType::U8 => HostTensor::new(kernel.run(x.as_slice::<u8>()?, rng), dims),
        DType::I32 => HostTensor::new(kernel.run(x.as_slice::<i32>()?, rng), dims),
        DType::I64 => HostTensor::new(kernel.run(x.as_slice::<i64>()?, rng), dims),
        DType::F32 => HostTensor::new(kernel.run(x.as_slice::<f32>()?, rng), dims),
        DType::F64 => HostTensor::new(kernel.run(x.as_slice::<f64>()?, rng), dims),
        DType::BF16 => HostTensor::new(kernel.run(x.as_slice::<half::bf16>()?, rng), dims),
        DType::F16 => HostTensor::new(kernel.run(x.as_slice::<half::f16>()?, rng), dims),
        other => Err(kiln_core::Error::unsupported(format!(
            "image transform on {other} tensors"
        ))),
    }
}

/// A random `size` crop of each image after zero padding on every side
/// (`torchvision.transforms.RandomCrop(size, padding)` with `fill=0`).
///
/// The top-left corner is uniform over all positions where the crop fits in
/// the padded image; it is drawn from the generator (row first, then
/// column) for each image. Works for every dtype. A crop larger than the
/// padded image is an [`Error::InvalidArgument`].
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_data::{Transform, TransformRng};
/// use kiln_vision::RandomCrop;
///
/// let crop = RandomCrop { size: [2, 2], padding: 1 };
/// let x = HostTensor::new((1..=4).collect::<Vec<i32>>(), [1, 2, 2])?;
/// let y = crop.apply(x, &mut TransformRng::new(3))?;
/// assert_eq!(y.dims(), &[1, 2, 2]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RandomCrop {
    /// Output `[height, width]`.
    pub size: [usize; 2],
    /// Zeros added on each of the four sides before cropping.
    pub padding: usize,
}

/// One crop for each image, with the crop corners drawn as it goes.
struct CropKernel {
    images: usize,
    channels: usize,
    height: usize,
    width: usize,
    out_h: usize,
    out_w: usize,
    padding: usize,
}

impl ImageKernel for CropKernel {
    fn run<T: Element>(&self, src: &[T], rng: &mut TransformRng) -> Vec<T> {
        let (h, w, p) = (self.height, self.width, self.padding);
        let (oh, ow) = (self.out_h, self.out_w);
        let mut out = Vec::with_capacity(self.images * self.channels * oh * ow);
        for image in src.chunks(self.channels * h * w).take(self.images) {
            // Corner in padded coordinates; the caller checked oh <= h + 2p.
            let top = rng.below((h + 2 * p - oh + 1) as u64) as usize;
            let left = rng.below((w + 2 * p - ow + 1) as u64) as usize;
            for plane in image.chunks(h * w) {
                for y in top..top + oh {
                    let row = (y >= p && y - p < h).then(|| &plane[(y - p) * w..(y - p + 1) * w]);
                    for x in left..left + ow {
                        let v = match row {
                            Some(row) if x >= p && x - p < w => row[x - p],
                            _ => T::zeroed(),
                        };
                        out.push(v);
                    }
                }
            }
        }
        out
    }
}

impl Transform for RandomCrop {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        let (n, c, h, w) = image_dims(&x, "RandomCrop")?;
        let [oh, ow] = self.size;
        let padded = |d: usize| d.checked_add(self.padding.saturating_mul(2));
        let (Some(ph), Some(pw)) = (padded(h), padded(w)) else {
            return Err(Error::invalid_argument("padding", "overflows usize"));
        };
        if oh == 0 || ow == 0 || oh > ph || ow > pw {
            return Err(Error::invalid_argument(
                "size",
                format!(
                    "RandomCrop of [{oh}, {ow}] does not fit images of [{h}, {w}] \
                     padded by {} to [{ph}, {pw}]",
                    self.padding
                ),
            ));
        }
        let kernel = CropKernel {
            images: n,
            channels: c,
            height: h,
            width: w,
            out_h: oh,
            out_w: ow,
            padding: self.padding,
        };
        let mut dims = x.dims().to_vec();
        let rank = dims.len();
        dims[rank - 2] = oh;
        dims[rank - 1] = ow;
        if c == 0 || h == 0 || w == 0 {
            return HostTensor::zeros(x.dtype(), dims);
        }
        run_kernel(&x, &kernel, rng, dims)
    }
}

/// Mirrors each image left to right with probability `p`
/// (`torchvision.transforms.RandomHorizontalFlip(p)`).
///
/// For each image one value `u` is drawn uniformly from `[0, 1)`; the image
/// is flipped when `u < p`. `p` must lie in `[0, 1]`. Works for every dtype.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_data::{Transform, TransformRng};
/// use kiln_vision::RandomHorizontalFlip;
///
/// let x = HostTensor::new(vec![1u8, 2, 3], [1, 1, 3])?;
/// let y = RandomHorizontalFlip { p: 1.0 }.apply(x, &mut TransformRng::new(0))?;
/// assert_eq!(y.as_slice::<u8>()?, &[3, 2, 1]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RandomHorizontalFlip {
    /// Probability of flipping an image.
    pub p: f64,
}

impl Default for RandomHorizontalFlip {
    /// `p = 0.5`, torchvision's default.
    fn default() -> Self {
        RandomHorizontalFlip { p: 0.5 }
    }
}

/// Flips each image whose draw falls below `p`.
struct FlipKernel {
    images: usize,
    image_len: usize,
    width: usize,
    p: f64,
}

impl ImageKernel for FlipKernel {
    fn run<T: Element>(&self, src: &[T], rng: &mut TransformRng) -> Vec<T> {
        let mut out = src.to_vec();
        for image in out.chunks_mut(self.image_len).take(self.images) {
            if rng.next_f64() < self.p {
                for row in image.chunks_mut(self.width) {
                    row.reverse();
                }
            }
        }
        out
    }
}

impl Transform for RandomHorizontalFlip {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        if !(0.0..=1.0).contains(&self.p) {
            return Err(Error::invalid_argument(
                "p",
                format!(
                    "RandomHorizontalFlip probability must lie in [0, 1], got {}",
                    self.p
                ),
            ));
        }
        let (n, c, h, w) = image_dims(&x, "RandomHorizontalFlip")?;
        if c == 0 || h == 0 || w == 0 {
            return Ok(x);
        }
        let kernel = FlipKernel {
            images: n,
            image_len: c * h * w,
            width: w,
            p: self.p,
        };
        run_kernel(&x, &kernel, rng, x.dims().to_vec())
    }
}

/// Converts `uint8` pixels to `float32` in `[0, 1]` by dividing by 255
/// (`torchvision.transforms.ToTensor`'s scaling, or
/// `ConvertImageDtype(torch.float32)`). `float32` input passes through
/// unchanged; other dtypes are an [`Error::DTypeMismatch`].
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_data::{Transform, TransformRng};
/// use kiln_vision::ToFloat;
///
/// let x = HostTensor::new(vec![0u8, 51, 255], [3])?;
/// let y = ToFloat.apply(x, &mut TransformRng::new(0))?;
/// assert_eq!(y.as_slice::<f32>()?, &[0.0, 0.2, 1.0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ToFloat;

impl Transform for ToFloat {
    fn apply(&self, x: HostTensor, _rng: &mut TransformRng) -> Result<HostTensor> {
        match x.dtype() {
            DType::U8 => {
                let dims = x.dims().to_vec();
                let values: Vec<f32> = x
                    .as_slice::<u8>()?
                    .iter()
                    .map(|&v| f32::from(v) / 255.0)
                    .collect();
                HostTensor::new(values, dims)
            }
            DType::F32 => Ok(x),
            other => Err(Error::DTypeMismatch {
                context: "ToFloat scales uint8 images".into(),
                expected: DType::U8,
                actual: other,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_data::Compose;

    fn rng() -> TransformRng {
        TransformRng::new(11)
    }

    #[test]
    fn normalize_by_hand() -> Result<()> {
        // two channels of 1x2, mean (1, -1), std (2, 4)
        let n = Normalize {
            mean: vec![1.0, -1.0],
            std: vec![2.0, 4.0],
        };
        let x = HostTensor::new(vec![3.0f64, 0.0, 7.0, -5.0], [2, 1, 2])?;
        let y = n.apply(x, &mut rng())?;
        assert_eq!(y.as_slice::<f64>()?, &[1.0, -0.5, 2.0, -1.0]);
        // a batch of two images cycles the channels
        let x = HostTensor::new(
            vec![3.0f32, 0.0, 7.0, -5.0, 1.0, 1.0, -1.0, -1.0],
            [2, 2, 1, 2],
        )?;
        let y = n.apply(x, &mut rng())?;
        assert_eq!(
            y.as_slice::<f32>()?,
            &[1.0, -0.5, 2.0, -1.0, 0.0, 0.0, 0.0, 0.0]
        );
        // one value for every channel
        let one = Normalize {
            mean: vec![1.0],
            std: vec![0.5],
        };
        let y = one.apply(HostTensor::new(vec![2.0f32, 0.0], [2, 1, 1])?, &mut rng())?;
        assert_eq!(y.as_slice::<f32>()?, &[2.0, -2.0]);
        Ok(())
    }

    #[test]
    fn normalize_rejects_bad_input() -> Result<()> {
        let n = Normalize {
            mean: vec![0.0, 0.0],
            std: vec![1.0, 1.0],
        };
        let err = n
            .apply(HostTensor::zeros(DType::F32, [3, 2, 2])?, &mut rng())
            .expect_err("3 channels");
        assert_eq!(
            err.to_string(),
            "invalid argument `mean`: Normalize has 2 values for an input with 3 channels; \
             expected 3 or 1"
        );
        let err = n
            .apply(HostTensor::zeros(DType::F32, [2, 4])?, &mut rng())
            .expect_err("rank 2");
        assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
        let err = n
            .apply(HostTensor::zeros(DType::U8, [2, 1, 1])?, &mut rng())
            .expect_err("u8");
        assert!(
            matches!(
                err,
                Error::DTypeMismatch {
                    actual: DType::U8,
                    ..
                }
            ),
            "{err}"
        );
        let zero = Normalize {
            mean: vec![0.0],
            // rounds to 0 in f32
            std: vec![1e-50],
        };
        let err = zero
            .apply(HostTensor::zeros(DType::F32, [1, 1, 1])?, &mut rng())
            .expect_err("zero std");
        assert_eq!(
            err.to_string(),
            "invalid argument `std`: Normalize: the standard deviation of channel 0 is zero"
        );
        // in f64 the same std is fine
        assert!(zero
            .apply(HostTensor::zeros(DType::F64, [1, 1, 1])?, &mut rng())
            .is_ok());
        Ok(())
    }

    #[test]
    fn to_float_scales_u8_only() -> Result<()> {
        let y = ToFloat.apply(HostTensor::new(vec![0u8, 1, 128, 255], [2, 2])?, &mut rng())?;
        assert_eq!(y.dims(), &[2, 2]);
        assert_eq!(
            y.as_slice::<f32>()?,
            &[0.0, 1.0 / 255.0, 128.0 / 255.0, 1.0]
        );
        let f = HostTensor::new(vec![3.5f32], [1])?;
        assert_eq!(ToFloat.apply(f.clone(), &mut rng())?, f);
        let err = ToFloat
            .apply(HostTensor::new(vec![1i64], [1])?, &mut rng())
            .expect_err("i64");
        assert_eq!(
            err.to_string(),
            "ToFloat scales uint8 images: expected dtype uint8, got int64"
        );
        Ok(())
    }

    #[test]
    fn compose_runs_in_order() -> Result<()> {
        let double = |x: HostTensor, _: &mut TransformRng| -> Result<HostTensor> {
            let v: Vec<f32> = x.as_slice::<f32>()?.iter().map(|v| v * 2.0).collect();
            HostTensor::new(v, x.dims().to_vec())
        };
        let t = Compose::new().then(ToFloat).then(double).then(Normalize {
            mean: vec![1.0],
            std: vec![1.0],
        });
        assert_eq!(t.len(), 3);
        assert!(!t.is_empty());
        let y = t.apply(HostTensor::new(vec![0u8, 255], [1, 1, 2])?, &mut rng())?;
        // (2 * v / 255) - 1
        assert_eq!(y.as_slice::<f32>()?, &[-1.0, 1.0]);
        let id = Compose::new();
        assert!(id.is_empty());
        let x = HostTensor::new(vec![4u8], [1])?;
        assert_eq!(id.apply(x.clone(), &mut rng())?, x);
        Ok(())
    }
}
