//! Sample transforms: the [`Transform`] trait and its seeded generator,
//! [`Compose`], and one-hot encoding of labels. The image transforms are
//! in `kiln-vision`.

use std::fmt;

use kiln_core::dtype::DType;
use kiln_core::error::{Error, Result};
use kiln_core::rng::{sample_seed, SplitMix64};
use kiln_core::tensor::HostTensor;

/// The random numbers a [`Transform`] draws from: SplitMix64, fully
/// determined by its seed.
///
/// [`TransformedDataset`](crate::TransformedDataset) gives every sample its
/// own generator, [`TransformRng::for_sample`]`(seed, epoch, index)`, so
/// augmentation does not depend on which thread loads which sample.
///
/// ```
/// use kiln_data::TransformRng;
///
/// let mut a = TransformRng::for_sample(1, 0, 17);
/// let mut b = TransformRng::for_sample(1, 0, 17);
/// assert_eq!(a.next_u64(), b.next_u64());
/// let u = a.next_f64();
/// assert!((0.0..1.0).contains(&u));
/// assert!(a.below(6) < 6);
/// ```
#[derive(Clone)]
pub struct TransformRng {
    inner: SplitMix64,
}

impl TransformRng {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        TransformRng {
            inner: SplitMix64::new(seed),
        }
    }

    /// The generator of sample `index` in epoch `epoch` under `seed`.
    pub fn for_sample(seed: u64, epoch: u64, index: usize) -> Self {
        // usize is at most 64 bits on every supported target.
        Self::new(sample_seed(seed, epoch, index as u64))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.inner.next_u64()
    }

    /// A uniform integer in `0..bound`, without modulo bias; 0 if `bound` is 0.
    pub fn below(&mut self, bound: u64) -> u64 {
        if bound == 0 {
            0
        } else {
            self.inner.below(bound)
        }
    }

    /// A uniform float in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

impl fmt::Debug for TransformRng {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransformRng").finish_non_exhaustive()
    }
}

/// A function of a sample's input tensor, possibly random.
///
/// Implemented by [`Compose`], by kiln-vision's image transforms (`Normalize`,
/// `ToFloat`, `RandomResizedCrop`, ...) and by every closure
/// `Fn(HostTensor, &mut TransformRng) -> Result<HostTensor> + Send + Sync`.
/// A transform draws all its randomness from `rng`, so it reproduces given
/// the generator's seed. Attach one to a dataset with
/// [`TransformedDataset`](crate::TransformedDataset).
pub trait Transform: Send + Sync {
    /// Transforms `x`.
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor>;
}

impl<F> Transform for F
where
    F: Fn(HostTensor, &mut TransformRng) -> Result<HostTensor> + Send + Sync,
{
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self(x, rng)
    }
}

/// Several transforms applied in order (`torchvision.transforms.Compose`),
/// sharing one generator.
///
/// ```
/// use kiln_data::{Compose, Transform, TransformRng};
/// use kiln_core::{HostTensor, Result};
///
/// let map = |f: fn(f32) -> f32| {
///     move |x: HostTensor, _: &mut TransformRng| -> Result<HostTensor> {
///         let x = x.to_dtype(kiln_core::DType::F32);
///         let v: Vec<f32> = x.as_slice::<f32>()?.iter().map(|&v| f(v)).collect();
///         HostTensor::new(v, x.dims().to_vec())
///     }
/// };
/// let t = Compose::new()
///     .then(map(|v| v / 255.0))
///     .then(map(|v| (v - 0.5) / 0.5));
/// let x = HostTensor::new(vec![0u8, 255], [1, 1, 2])?;
/// let y = t.apply(x, &mut TransformRng::new(0))?;
/// assert_eq!(y.as_slice::<f32>()?, &[-1.0, 1.0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Default)]
pub struct Compose {
    transforms: Vec<Box<dyn Transform>>,
}

impl Compose {
    /// No transform (the identity).
    pub fn new() -> Self {
        Compose::default()
    }

    /// Appends `transform`, applied after the ones before it.
    pub fn then(mut self, transform: impl Transform + 'static) -> Self {
        self.transforms.push(Box::new(transform));
        self
    }

    /// Number of transforms.
    pub fn len(&self) -> usize {
        self.transforms.len()
    }

    /// Whether there is no transform.
    pub fn is_empty(&self) -> bool {
        self.transforms.is_empty()
    }
}

impl fmt::Debug for Compose {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Compose")
            .field("transforms", &self.transforms.len())
            .finish()
    }
}

impl Transform for Compose {
    fn apply(&self, x: HostTensor, rng: &mut TransformRng) -> Result<HostTensor> {
        self.transforms.iter().try_fold(x, |x, t| t.apply(x, rng))
    }
}

/// One-hot encodes integer class labels: `[...]` of `uint8`, `int32` or
/// `int64` becomes `float32` `[..., classes]` with a 1 at each label
/// (`torch.nn.functional.one_hot(labels, classes).float()`).
///
/// A label outside `0..classes` is an [`Error::InvalidArgument`] naming its
/// position and value; float labels are an [`Error::DTypeMismatch`].
///
/// ```
/// use kiln_data::one_hot;
/// use kiln_core::HostTensor;
///
/// let y = one_hot(&HostTensor::new(vec![2i64, 0], [2])?, 3)?;
/// assert_eq!(y.dims(), &[2, 3]);
/// assert_eq!(y.as_slice::<f32>()?, &[0.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn one_hot(labels: &HostTensor, classes: usize) -> Result<HostTensor> {
    if classes == 0 {
        return Err(Error::invalid_argument(
            "classes",
            "one_hot needs at least 1 class, got 0",
        ));
    }
    let values: Vec<i64> = match labels.dtype() {
        DType::U8 | DType::I32 | DType::I64 => labels.to_dtype(DType::I64).into_vec::<i64>()?,
        other => {
            return Err(Error::DTypeMismatch {
                context: "one_hot needs integer class labels".into(),
                expected: DType::I64,
                actual: other,
            })
        }
    };
    let mut dims = labels.dims().to_vec();
    dims.push(classes);
    let total = values.len().checked_mul(classes).ok_or_else(|| {
        Error::invalid_argument("classes", "the one-hot tensor's size overflows usize")
    })?;
    let mut out = vec![0f32; total];
    for (position, &label) in values.iter().enumerate() {
        let class = usize::try_from(label).ok().filter(|&c| c < classes);
        let Some(class) = class else {
            return Err(Error::invalid_argument(
                "labels",
                format!(
                    "label {label} at position {position} is out of range for {classes} classes \
                     (expected 0..{classes})"
                ),
            ));
        };
        out[position * classes + class] = 1.0;
    }
    HostTensor::new(out, dims)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_helpers() {
        let mut r = TransformRng::new(5);
        let mut s = SplitMix64::new(5);
        assert_eq!(r.next_u64(), s.next_u64());
        // next_f64 uses the top 53 bits of the next output
        let bits = s.next_u64();
        assert_eq!(r.next_f64(), (bits >> 11) as f64 / 9_007_199_254_740_992.0);
        assert_eq!(r.below(0), 0);
        assert_eq!(r.below(1), 0);
        let mut a = TransformRng::for_sample(1, 2, 3);
        let mut b = TransformRng::new(sample_seed(1, 2, 3));
        assert_eq!(a.next_u64(), b.next_u64());
    }

    #[test]
    fn one_hot_by_hand() -> Result<()> {
        let y = one_hot(&HostTensor::new(vec![1u8, 0, 3, 1], [2, 2])?, 4)?;
        assert_eq!(y.dims(), &[2, 2, 4]);
        assert_eq!(
            y.as_slice::<f32>()?,
            &[
                0.0, 1.0, 0.0, 0.0, //
                1.0, 0.0, 0.0, 0.0, //
                0.0, 0.0, 0.0, 1.0, //
                0.0, 1.0, 0.0, 0.0,
            ]
        );
        let err = one_hot(&HostTensor::new(vec![0i64, 5], [2])?, 5).expect_err("5 of 5");
        assert_eq!(
            err.to_string(),
            "invalid argument `labels`: label 5 at position 1 is out of range for 5 classes \
             (expected 0..5)"
        );
        let err = one_hot(&HostTensor::new(vec![-1i32], [1])?, 5).expect_err("negative");
        assert!(err.to_string().contains("label -1 at position 0"), "{err}");
        assert!(matches!(
            one_hot(&HostTensor::new(vec![1.0f32], [1])?, 2),
            Err(Error::DTypeMismatch { .. })
        ));
        assert!(one_hot(&HostTensor::new(vec![0i64], [1])?, 0).is_err());
        Ok(())
    }
}
