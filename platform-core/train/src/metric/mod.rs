//! Metrics computed on host copies of a model's outputs.
//!
//! Each metric accumulates over the batches given to [`Metric::update`] and
//! reports one number from [`Metric::compute`]; [`Metric::reset`] starts over
//! (the trainer resets its metrics at the start of every epoch). Outputs are
//! host copies of logits or predictions: the trainer copies them off the
//! device once per step, and every metric reads the same copy.
//!
//! Classification metrics take logits of shape `[N, C]` (any float dtype)
//! and class targets of shape `[N]` (`int64`, values in `0..C`); the
//! predicted class of a row is the index of its largest logit (the first one
//! on ties, like `torch.argmax`).

mod accuracy;
mod confusion;
mod f1;
mod loss;
mod mae;
mod precision;
mod recall;
mod top_k;

pub use accuracy::Accuracy;
pub use f1::F1;
pub use loss::LossMetric;
pub use mae::MeanAbsoluteError;
pub use precision::Precision;
pub use recall::Recall;
pub use top_k::TopKAccuracy;

use kiln_core::dtype::DType;
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// A quantity accumulated over batches and reported once per epoch or
/// logging interval.
///
/// ```
/// use kiln_train::{Accuracy, Metric};
/// use kiln_core::HostTensor;
///
/// let mut acc = Accuracy::new();
/// let logits = HostTensor::new(vec![0.1f32, 0.9, 0.8, 0.2, 0.3, 0.7], [3, 2])?;
/// let targets = HostTensor::new(vec![1i64, 0, 0], [3])?;
/// acc.update(&logits, &targets)?;
/// assert_eq!(acc.name(), "accuracy");
/// assert_eq!(acc.compute()?, 2.0 / 3.0);
/// acc.reset();
/// assert!(acc.compute().is_err());
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub trait Metric: Send {
    /// The name the value is logged under (`"accuracy"`, `"loss"`, ...).
    fn name(&self) -> &str;

    /// Adds one batch: `output` holds the model's outputs for the batch
    /// (logits, predictions or, for [`LossMetric`], the batch's loss) and
    /// `target` the matching targets.
    ///
    /// Fails with a typed error naming both shapes or dtypes when they do not
    /// fit together; the metric is then unchanged.
    fn update(&mut self, output: &HostTensor, target: &HostTensor) -> Result<()>;

    /// The value over every batch since the last [`reset`](Metric::reset).
    ///
    /// Fails when no sample has been seen, because the value is undefined.
    fn compute(&self) -> Result<f64>;

    /// Forgets every batch seen so far.
    fn reset(&mut self);

    /// The running state as numbers that add up over disjoint parts of the
    /// data (counts, sums, per-class counts), or `None` for a metric without
    /// such a form. Data-parallel evaluation sums every rank's state (the
    /// shorter ones padded with zeros) and [`load_state`](Metric::load_state)s
    /// the sum, so the value is the one over the whole split.
    fn state(&self) -> Option<Vec<f64>> {
        None
    }

    /// Replaces the running state with `state`, a sum of [`state`](Metric::state)s.
    ///
    /// Fails when the metric has no such state or `state` has the wrong form;
    /// the metric is then unchanged.
    fn load_state(&mut self, state: &[f64]) -> Result<()> {
        let _ = state;
        Err(Error::unsupported(format!(
            "reducing metric `{}` across ranks (it has no additive state)",
            self.name()
        )))
    }
}

/// The error of [`Metric::load_state`] for a state of the wrong length.
fn bad_state(metric: &str, expected: &str, len: usize) -> Error {
    Error::invalid_argument(
        metric,
        format!("a metric state must hold {expected}, got {len} numbers"),
    )
}

/// `[a, b]` from a state, or the error naming what was expected.
fn pair(metric: &str, state: &[f64]) -> Result<(f64, f64)> {
    match state {
        &[a, b] => Ok((a, b)),
        _ => Err(bad_state(metric, "2 numbers", state.len())),
    }
}

/// The error of [`Metric::compute`] before any sample was seen.
fn no_samples(metric: &str) -> Error {
    Error::invalid_argument(
        metric,
        "no samples were seen since the last reset, so the value is undefined",
    )
}

/// The index of the largest score of `row`, the first one on ties; NaN never
/// wins unless the whole row is NaN.
pub(crate) fn argmax(row: &[f64]) -> usize {
    let mut best = 0;
    for (c, &v) in row.iter().enumerate() {
        if v > row[best] || (row[best].is_nan() && !v.is_nan()) {
            best = c;
        }
    }
    best
}

/// Logits and targets of one classification batch, checked.
struct ClassBatch<'a> {
    /// Row-major logits, converted to `f64` (an order-preserving conversion).
    logits: Vec<f64>,
    /// Number of classes `C`.
    classes: usize,
    /// One class index in `0..C` per row.
    targets: std::borrow::Cow<'a, [i64]>,
}

impl ClassBatch<'_> {
    /// Number of rows `N`.
    fn rows(&self) -> usize {
        self.targets.len()
    }

    /// The logits of row `i`.
    fn row(&self, i: usize) -> &[f64] {
        &self.logits[i * self.classes..(i + 1) * self.classes]
    }

    /// The index of the largest logit of row `i` ([`argmax`]).
    fn argmax(&self, i: usize) -> usize {
        argmax(self.row(i))
    }

    /// The target class of row `i` (checked to be in `0..C`).
    fn target(&self, i: usize) -> usize {
        usize::try_from(self.targets[i]).unwrap_or(0)
    }
}

/// Checks that `output` is float logits `[N, C]` with `C >= 1` and `target`
/// int64 classes `[N]` in `0..C`; rows whose target is -100 are left out.
fn class_batch<'a>(
    metric: &str,
    output: &HostTensor,
    target: &'a HostTensor,
) -> Result<ClassBatch<'a>> {
    if !output.dtype().is_float() {
        return Err(Error::DTypeMismatch {
            context: format!(
                "{metric}: logits of shape {} (targets {} of shape {})",
                output.shape(),
                target.dtype(),
                target.shape()
            ),
            expected: DType::F32,
            actual: output.dtype(),
        });
    }
    if target.dtype() != DType::I64 {
        return Err(Error::DTypeMismatch {
            context: format!(
                "{metric}: class targets of shape {} (logits {} of shape {})",
                target.shape(),
                output.dtype(),
                output.shape()
            ),
            expected: DType::I64,
            actual: target.dtype(),
        });
    }
    let (rows, classes) = match output.dims() {
        &[rows, classes] if classes > 0 => (rows, classes),
        _ => {
            return Err(Error::ShapeMismatch {
                context: format!("{metric}: logits (targets of shape {})", target.shape()),
                expected: "[N, C] with C >= 1".into(),
                actual: output.shape().to_string(),
            })
        }
    };
    if target.dims() != [rows] {
        return Err(Error::ShapeMismatch {
            context: format!(
                "{metric}: class targets for logits of shape {}",
                output.shape()
            ),
            expected: format!("[{rows}]"),
            actual: target.shape().to_string(),
        });
    }
    let all = target.as_slice::<i64>()?;
    // Rows whose target is PyTorch's default `ignore_index` (-100: padding, a
    // prompt token, the last position of a text) are not counted, as the loss
    // leaves them out.
    if all.contains(&IGNORED_TARGET) {
        let logits = output.to_f64_vec();
        let (mut kept, mut targets) = (Vec::new(), Vec::new());
        for (row, &t) in all.iter().enumerate() {
            if t != IGNORED_TARGET {
                kept.extend_from_slice(&logits[row * classes..(row + 1) * classes]);
                targets.push(t);
            }
        }
        let kept = HostTensor::new(kept, [targets.len(), classes])?;
        let targets = HostTensor::new(targets, [kept.dims()[0]])?;
        let batch = class_batch(metric, &kept, &targets)?;
        return Ok(ClassBatch {
            logits: batch.logits,
            classes,
            targets: std::borrow::Cow::Owned(batch.targets.into_owned()),
        });
    }
    let targets = all;
    if let Some((row, &t)) = targets
        .iter()
        .enumerate()
        .find(|&(_, &t)| usize::try_from(t).map_or(true, |t| t >= classes))
    {
        return Err(Error::invalid_argument(
            "target",
            format!(
                "{metric}: class {t} of row {row} is out of range for logits of shape {} \
                 ({classes} classes, expected 0..{classes})",
                output.shape()
            ),
        ));
    }
    Ok(ClassBatch {
        logits: output.to_f64_vec(),
        classes,
        targets: std::borrow::Cow::Borrowed(targets),
    })
}

/// The target class metrics leave out: PyTorch's default `ignore_index`.
const IGNORED_TARGET: i64 = -100;

/// A factory for the validation metric called `name` in a config: `accuracy`,
/// `topK_accuracy` (`top5_accuracy`, any K >= 1), `precision`, `recall`, `f1`
/// (macro averages) or `mae`; `None` for any other name.
pub fn metric_by_name(name: &str) -> Option<Box<dyn Fn() -> Box<dyn Metric> + Send>> {
    fn factory<M: Metric + Clone + 'static>(proto: M) -> Box<dyn Fn() -> Box<dyn Metric> + Send> {
        Box::new(move || Box::new(proto.clone()))
    }
    Some(match name {
        "accuracy" => factory(Accuracy::new()),
        "precision" => factory(Precision::new()),
        "recall" => factory(Recall::new()),
        "f1" => factory(F1::new()),
        "mae" => factory(MeanAbsoluteError::new()),
        other => {
            let k = other
                .strip_prefix("top")?
                .strip_suffix("_accuracy")?
                .parse()
                .ok()?;
            factory(TopKAccuracy::new(k).ok()?)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_batch_checks_shapes_dtypes_and_ranges() -> Result<()> {
        let logits = HostTensor::new(vec![0.0f32; 6], [3, 2])?;
        let targets = HostTensor::new(vec![0i64, 1, 1], [3])?;
        assert_eq!(class_batch("m", &logits, &targets)?.rows(), 3);

        let err = class_batch("m", &logits, &targets.to_dtype(DType::I32))
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("m: class targets of shape [3] (logits float32 of shape [3, 2]): expected dtype int64, got int32")
        );
        let err = class_batch("m", &logits.to_dtype(DType::I64), &targets)
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("m: logits of shape [3, 2] (targets int64 of shape [3]): expected dtype float32, got int64")
        );
        let short = HostTensor::new(vec![0i64, 1], [2])?;
        let err = class_batch("m", &logits, &short)
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("m: class targets for logits of shape [3, 2]: expected shape [3], got [2]")
        );
        let flat = HostTensor::new(vec![0.0f64; 3], [3])?;
        let err = class_batch("m", &flat, &targets)
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("m: logits (targets of shape [3]): expected shape [N, C] with C >= 1, got [3]")
        );
        for bad in [2i64, -1] {
            let t = HostTensor::new(vec![0i64, bad, 1], [3])?;
            let err = class_batch("m", &logits, &t).err().map(|e| e.to_string());
            assert_eq!(
                err,
                Some(format!(
                    "invalid argument `target`: m: class {bad} of row 1 is out of range for \
                     logits of shape [3, 2] (2 classes, expected 0..2)"
                ))
            );
        }
        Ok(())
    }

    #[test]
    fn argmax_takes_the_first_maximum_and_skips_nan() -> Result<()> {
        let logits = HostTensor::new(
            vec![
                1.0f64,
                3.0,
                3.0,
                f64::NAN,
                0.0,
                -1.0,
                f64::NAN,
                f64::NAN,
                f64::NAN,
            ],
            [3, 3],
        )?;
        let targets = HostTensor::new(vec![0i64, 0, 0], [3])?;
        let batch = class_batch("m", &logits, &targets)?;
        assert_eq!(
            (0..3).map(|i| batch.argmax(i)).collect::<Vec<_>>(),
            [1, 1, 0]
        );
        Ok(())
    }
}
