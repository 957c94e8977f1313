//! Batch-level MixUp and CutMix, as torchvision's `transforms.v2.MixUp` and
//! `transforms.v2.CutMix`: each batch is mixed with itself rolled by one
//! sample, and its class indices become mixed one-hot probabilities, which
//! cross-entropy takes as soft targets.

use std::sync::Arc;

use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;
use kiln_core::DType;

use kiln_data::{Batch, DataLoader, TransformRng};

/// A random function of a whole batch (inputs and targets).
pub trait BatchTransform: Send + Sync {
    /// Transforms `batch` with randomness from `rng`.
    fn apply(&self, batch: Batch, rng: &mut TransformRng) -> Result<Batch>;
}

/// A draw from Beta(`alpha`, `alpha`), from two Gamma(`alpha`) draws.
fn beta(alpha: f64, rng: &mut TransformRng) -> f64 {
    let x = gamma(alpha, rng);
    let y = gamma(alpha, rng);
    if x + y == 0.0 {
        // Both underflowed (tiny alpha): Beta's mass is at 0 and 1 alike.
        return if rng.next_f64() < 0.5 { 0.0 } else { 1.0 };
    }
    x / (x + y)
}

/// Gamma(`shape`, 1) by Marsaglia and Tsang's method (`shape` > 0).
fn gamma(shape: f64, rng: &mut TransformRng) -> f64 {
    if shape < 1.0 {
        // Gamma(a) = Gamma(a + 1) * U^(1/a).
        let u = 1.0 - rng.next_f64();
        return gamma(shape + 1.0, rng) * u.powf(1.0 / shape);
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let z = normal(rng);
        let v = (1.0 + c * z).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u = 1.0 - rng.next_f64();
        if u.ln() < 0.5 * z * z + d - d * v + d * v.ln() {
            return d * v;
        }
    }
}

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut TransformRng) -> f64 {
    let u = 1.0 - rng.next_f64();
    let v = rng.next_f64();
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

fn check_alpha(alpha: f64, what: &str) -> Result<()> {
    if alpha.is_finite() && alpha > 0.0 {
        Ok(())
    } else {
        Err(Error::invalid_argument(
            what,
            format!("alpha must be positive and finite, got {alpha}"),
        ))
    }
}

/// The targets as `float32` probabilities `[N, num_classes]`: class indices
/// `[N]` one-hot, probabilities (already mixed) as they are.
fn probabilities(targets: &HostTensor, num_classes: usize, what: &str) -> Result<Vec<f32>> {
    match (targets.dtype(), targets.dims()) {
        (DType::F32, [_, c]) if *c == num_classes => Ok(targets.as_slice::<f32>()?.to_vec()),
        (DType::I64, [n]) => {
            let mut out = vec![0f32; n * num_classes];
            for (i, &label) in targets.as_slice::<i64>()?.iter().enumerate() {
                let class = usize::try_from(label)
                    .ok()
                    .filter(|&c| c < num_classes)
                    .ok_or_else(|| {
                        Error::invalid_argument(
                            what,
                            format!(
                                "label {label} of sample {i} is not a class index in 0..{num_classes}"
                            ),
                        )
                    })?;
                out[i * num_classes + class] = 1.0;
            }
            Ok(out)
        }
        (dtype, dims) => Err(Error::invalid_argument(
            what,
            format!(
                "expected class indices (int64 [N]) or probabilities (float32 [N, {num_classes}]), got {dtype:?} {dims:?}"
            ),
        )),
    }
}

/// `v * lam + rolled(v) * (1 - lam)` over rows of `row` values, as
/// torchvision computes it in `float32`: `rolled.mul_(1 - lam).add_(v.mul(lam))`.
fn mix_rows(values: &[f32], row: usize, lam: f64) -> Vec<f32> {
    let n = values.len() / row.max(1);
    let (keep, take) = (lam as f32, (1.0 - lam) as f32);
    let mut out = Vec::with_capacity(values.len());
    for i in 0..n {
        let prev = (i + n - 1) % n;
        let own = &values[i * row..(i + 1) * row];
        let other = &values[prev * row..(prev + 1) * row];
        out.extend(own.iter().zip(other).map(|(&x, &r)| r * take + x * keep));
    }
    out
}

/// The mixed targets, `float32 [N, num_classes]`.
fn mix_targets(
    targets: &HostTensor,
    num_classes: usize,
    lam: f64,
    what: &str,
) -> Result<HostTensor> {
    let p = probabilities(targets, num_classes, what)?;
    let n = p.len() / num_classes;
    HostTensor::new(mix_rows(&p, num_classes, lam), [n, num_classes])
}

/// torchvision's `v2.MixUp(alpha, num_classes)`: `lam ~ Beta(alpha, alpha)`;
/// inputs (`float32`) and one-hot targets become `lam * x + (1 - lam) * x`
/// rolled by one sample.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::MixUp;
/// use kiln_data::Batch;
///
/// let batch = Batch {
///     inputs: HostTensor::new(vec![0.0f32, 1.0], [2, 1])?,
///     targets: HostTensor::new(vec![0i64, 1], [2])?,
/// };
/// let mixed = MixUp::new(1.0, 2)?.apply_params(batch, 0.75)?;
/// assert_eq!(mixed.inputs.as_slice::<f32>()?, &[0.25, 0.75]);
/// assert_eq!(mixed.targets.as_slice::<f32>()?, &[0.75, 0.25, 0.25, 0.75]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct MixUp {
    /// Beta's parameter (torchvision's default 1.0).
    pub alpha: f64,
    /// The number of classes of the one-hot targets.
    pub num_classes: usize,
}

impl MixUp {
    /// MixUp with Beta(`alpha`, `alpha`) over `num_classes` classes.
    ///
    /// # Errors
    ///
    /// `alpha` not positive, or no class.
    pub fn new(alpha: f64, num_classes: usize) -> Result<Self> {
        check_alpha(alpha, "mixup")?;
        if num_classes == 0 {
            return Err(Error::invalid_argument(
                "mixup",
                "num_classes must be at least 1",
            ));
        }
        Ok(MixUp { alpha, num_classes })
    }

    /// The mixing weight `lam`, drawn as torchvision draws it (from Kiln's
    /// generator).
    pub fn get_params(&self, rng: &mut TransformRng) -> f64 {
        beta(self.alpha, rng)
    }

    /// Mixes `batch` with weight `lam`.
    ///
    /// # Errors
    ///
    /// Inputs that are not `float32` (MixUp comes after `to_tensor`), or
    /// targets that are not class indices below `num_classes`.
    pub fn apply_params(&self, batch: Batch, lam: f64) -> Result<Batch> {
        if batch.inputs.dtype() != DType::F32 {
            return Err(Error::invalid_argument(
                "mixup",
                format!(
                    "expected float32 inputs (put to_tensor before it), got {:?}",
                    batch.inputs.dtype()
                ),
            ));
        }
        let dims = batch.inputs.dims().to_vec();
        let n = dims.first().copied().unwrap_or(0);
        let row = batch.inputs.numel().checked_div(n).unwrap_or(0);
        let inputs = HostTensor::new(mix_rows(batch.inputs.as_slice::<f32>()?, row, lam), dims)?;
        let targets = mix_targets(&batch.targets, self.num_classes, lam, "mixup")?;
        Ok(Batch { inputs, targets })
    }
}

impl BatchTransform for MixUp {
    fn apply(&self, batch: Batch, rng: &mut TransformRng) -> Result<Batch> {
        let lam = self.get_params(rng);
        self.apply_params(batch, lam)
    }
}

/// A CutMix box, `x1..x2` by `y1..y2` (torchvision's `box`), and the weight
/// of the batch's own targets, the share of the image outside the box.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CutBox {
    /// Left column (inclusive).
    pub x1: usize,
    /// Top row (inclusive).
    pub y1: usize,
    /// Right column (exclusive).
    pub x2: usize,
    /// Bottom row (exclusive).
    pub y2: usize,
    /// `1 - box area / image area`.
    pub lam: f64,
}

/// torchvision's `v2.CutMix(alpha, num_classes)`: a box of area `1 - lam`
/// (`lam ~ Beta(alpha, alpha)`) centred at a uniform pixel and clipped to
/// the image is pasted from the batch rolled by one sample; the one-hot
/// targets mix by the box's share of the image.
#[derive(Clone, Debug, PartialEq)]
pub struct CutMix {
    /// Beta's parameter (torchvision's default 1.0).
    pub alpha: f64,
    /// The number of classes of the one-hot targets.
    pub num_classes: usize,
}

impl CutMix {
    /// CutMix with Beta(`alpha`, `alpha`) over `num_classes` classes.
    ///
    /// # Errors
    ///
    /// `alpha` not positive, or no class.
    pub fn new(alpha: f64, num_classes: usize) -> Result<Self> {
        check_alpha(alpha, "cutmix")?;
        if num_classes == 0 {
            return Err(Error::invalid_argument(
                "cutmix",
                "num_classes must be at least 1",
            ));
        }
        Ok(CutMix { alpha, num_classes })
    }

    /// The box for images of `height` x `width`, drawn as torchvision's
    /// `CutMix.make_params` draws it (from Kiln's generator).
    pub fn get_params(&self, height: usize, width: usize, rng: &mut TransformRng) -> CutBox {
        let lam = beta(self.alpha, rng);
        let rx = rng.below(width as u64) as i64;
        let ry = rng.below(height as u64) as i64;
        let r = 0.5 * (1.0 - lam).sqrt();
        let (rw, rh) = ((r * width as f64) as i64, (r * height as f64) as i64);
        let x1 = (rx - rw).max(0) as usize;
        let y1 = (ry - rh).max(0) as usize;
        let x2 = ((rx + rw) as usize).min(width);
        let y2 = ((ry + rh) as usize).min(height);
        let area = (x2 - x1) * (y2 - y1);
        let lam = 1.0 - area as f64 / (width * height) as f64;
        CutBox {
            x1,
            y1,
            x2,
            y2,
            lam,
        }
    }

    /// Pastes `cut` from the rolled batch into `batch` (inputs `[N, C, H, W]`
    /// of any dtype) and mixes the targets by `cut.lam`.
    ///
    /// # Errors
    ///
    /// Inputs that are not `[N, C, H, W]`, a box outside them, or targets
    /// that are not class indices below `num_classes`.
    pub fn apply_params(&self, batch: Batch, cut: CutBox) -> Result<Batch> {
        let dims = batch.inputs.dims().to_vec();
        let [n, c, h, w] = dims[..] else {
            return Err(Error::invalid_argument(
                "cutmix",
                format!("expected images [N, C, H, W], got {dims:?}"),
            ));
        };
        if cut.x1 > cut.x2 || cut.x2 > w || cut.y1 > cut.y2 || cut.y2 > h {
            return Err(Error::invalid_argument(
                "cutmix",
                format!("the box {cut:?} is not inside images of {h}x{w}"),
            ));
        }
        let size = batch.inputs.dtype().size_in_bytes();
        let src = batch.inputs.as_bytes();
        let mut out = src.to_vec();
        let plane = h * w * size;
        let image = c * plane;
        for i in 0..n {
            let prev = (i + n - 1) % n;
            for ch in 0..c {
                for y in cut.y1..cut.y2 {
                    let at = ch * plane + (y * w + cut.x1) * size;
                    let len = (cut.x2 - cut.x1) * size;
                    out[i * image + at..i * image + at + len]
                        .copy_from_slice(&src[prev * image + at..prev * image + at + len]);
                }
            }
        }
        let inputs = HostTensor::from_bytes(batch.inputs.dtype(), dims, &out)?;
        let targets = mix_targets(&batch.targets, self.num_classes, cut.lam, "cutmix")?;
        Ok(Batch { inputs, targets })
    }
}

impl BatchTransform for CutMix {
    fn apply(&self, batch: Batch, rng: &mut TransformRng) -> Result<Batch> {
        let dims = batch.inputs.dims();
        let (h, w) = match dims {
            [_, _, h, w] => (*h, *w),
            _ => {
                return Err(Error::invalid_argument(
                    "cutmix",
                    format!("expected images [N, C, H, W], got {dims:?}"),
                ))
            }
        };
        let cut = self.get_params(h, w, rng);
        self.apply_params(batch, cut)
    }
}

/// MixUp or CutMix, one of them (with equal chances) for each batch: the
/// `RandomChoice([MixUp(...), CutMix(...)])` of torchvision's classification
/// recipe (`--mixup-alpha`, `--cutmix-alpha`).
#[derive(Clone, Debug, PartialEq)]
pub struct MixUpOrCutMix {
    /// The MixUp half.
    pub mixup: MixUp,
    /// The CutMix half.
    pub cutmix: CutMix,
}

impl BatchTransform for MixUpOrCutMix {
    fn apply(&self, batch: Batch, rng: &mut TransformRng) -> Result<Batch> {
        if rng.below(2) == 0 {
            self.mixup.apply(batch, rng)
        } else {
            self.cutmix.apply(batch, rng)
        }
    }
}

/// A loader whose batches go through a [`BatchTransform`], batch `b` of
/// epoch `e` with the generator `TransformRng::for_sample(seed, e, b)`: the
/// same batches on every run, and on a run resumed mid-epoch.
pub struct BatchTransformed<L> {
    inner: L,
    transform: Arc<dyn BatchTransform>,
    seed: u64,
}

impl<L: DataLoader> BatchTransformed<L> {
    /// `inner`'s batches through `transform`, seeded by `seed`.
    pub fn new(inner: L, transform: Arc<dyn BatchTransform>, seed: u64) -> Self {
        BatchTransformed {
            inner,
            transform,
            seed,
        }
    }
}

impl<L: DataLoader> DataLoader for BatchTransformed<L> {
    fn num_batches(&self) -> usize {
        self.inner.num_batches()
    }

    fn batches(&self, epoch: u64) -> Box<dyn Iterator<Item = Result<Batch>> + Send + '_> {
        self.batches_from(epoch, 0)
    }

    fn batches_from(
        &self,
        epoch: u64,
        first: usize,
    ) -> Box<dyn Iterator<Item = Result<Batch>> + Send + '_> {
        let transform = Arc::clone(&self.transform);
        let seed = self.seed;
        Box::new(
            self.inner
                .batches_from(epoch, first)
                .enumerate()
                .map(move |(i, batch)| {
                    let mut rng = TransformRng::for_sample(seed, epoch, first + i);
                    transform.apply(batch?, &mut rng)
                }),
        )
    }

    fn skipped_samples(&self) -> u64 {
        self.inner.skipped_samples()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beta_draws_have_the_right_mean_and_variance() {
        for alpha in [0.2, 1.0, 3.0] {
            let mut rng = TransformRng::new(7);
            let n = 20000;
            let draws: Vec<f64> = (0..n).map(|_| beta(alpha, &mut rng)).collect();
            assert!(draws.iter().all(|x| (0.0..=1.0).contains(x)));
            let mean = draws.iter().sum::<f64>() / n as f64;
            let var = draws.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
            // Beta(a, a): mean 1/2, variance 1 / (4 (2a + 1)).
            let expected = 1.0 / (4.0 * (2.0 * alpha + 1.0));
            assert!((mean - 0.5).abs() < 0.01, "alpha {alpha}: mean {mean}");
            assert!(
                (var - expected).abs() < 0.01,
                "alpha {alpha}: var {var} vs {expected}"
            );
        }
    }

    #[test]
    fn bad_arguments_are_errors_naming_them() {
        assert!(MixUp::new(0.0, 3)
            .unwrap_err()
            .to_string()
            .contains("alpha"));
        assert!(CutMix::new(f64::NAN, 3)
            .unwrap_err()
            .to_string()
            .contains("alpha"));
        let batch = Batch {
            inputs: HostTensor::new(vec![0u8; 8], [2, 1, 2, 2]).unwrap(),
            targets: HostTensor::new(vec![0i64, 5], [2]).unwrap(),
        };
        let err = MixUp::new(1.0, 3)
            .unwrap()
            .apply_params(batch.clone(), 0.5)
            .unwrap_err();
        assert!(err.to_string().contains("to_tensor"), "{err}");
        let cut = CutBox {
            x1: 0,
            y1: 0,
            x2: 1,
            y2: 1,
            lam: 0.75,
        };
        let err = CutMix::new(1.0, 3)
            .unwrap()
            .apply_params(batch, cut)
            .unwrap_err();
        assert!(err.to_string().contains("label 5"), "{err}");
    }
}
