//! Splitting a dataset into training and test parts.

use kiln_core::error::{Error, Result};
use kiln_core::rng::permutation;
use kiln_core::tensor::HostTensor;

/// Training `(features, labels)` and test `(features, labels)`.
pub type Split = ((HostTensor, HostTensor), (HostTensor, HostTensor));

/// Shuffles the rows of `features` `[N, ...]` and `labels` `[N, ...]` with a
/// permutation determined by `seed`, and splits them into
/// `((train_x, train_y), (test_x, test_y))`.
///
/// The test part has `ceil(N * test_fraction)` rows, as in scikit-learn's
/// `train_test_split`; `test_fraction` must lie strictly between 0 and 1 and
/// both parts must be non-empty.
///
/// ```
/// use kiln_data::train_test_split;
/// use kiln_core::HostTensor;
///
/// let x = HostTensor::new((0..20).map(|v| v as f32).collect(), [10, 2])?;
/// let y = HostTensor::new((0..10).collect::<Vec<i64>>(), [10])?;
/// let ((train_x, train_y), (test_x, test_y)) = train_test_split(&x, &y, 0.25, 0)?;
/// assert_eq!(train_x.dims(), &[7, 2]);
/// assert_eq!(train_y.dims(), &[7]);
/// assert_eq!(test_x.dims(), &[3, 2]);
/// assert_eq!(test_y.dims(), &[3]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn train_test_split(
    features: &HostTensor,
    labels: &HostTensor,
    test_fraction: f64,
    seed: u64,
) -> Result<Split> {
    let n = features.dims().first().copied().ok_or_else(|| {
        Error::invalid_argument("features", "expected shape [N, ...], got a scalar")
    })?;
    if labels.dims().first() != Some(&n) {
        return Err(Error::ShapeMismatch {
            context: format!(
                "train_test_split: labels need one row per feature row (features {})",
                features.shape()
            ),
            expected: format!("[{n}, ...]"),
            actual: labels.shape().to_string(),
        });
    }
    let (train, test) = split_indices(n, test_fraction, seed)?;
    Ok((
        (features.select_rows(&train)?, labels.select_rows(&train)?),
        (features.select_rows(&test)?, labels.select_rows(&test)?),
    ))
}

/// The indices [`train_test_split`] puts in each part of `n` samples:
/// `(train, test)`, for datasets read from files (hold out a validation split
/// with [`Subset`](crate::Subset)s, without reading a sample).
///
/// ```
/// let (train, test) = kiln_data::split_indices(10, 0.25, 0)?;
/// assert_eq!((train.len(), test.len()), (7, 3));
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn split_indices(n: usize, test_fraction: f64, seed: u64) -> Result<(Vec<usize>, Vec<usize>)> {
    if !(test_fraction > 0.0 && test_fraction < 1.0) {
        return Err(Error::invalid_argument(
            "test_fraction",
            format!("expected a value strictly between 0 and 1, got {test_fraction}"),
        ));
    }
    // n is far below 2^53 for any tensor that fits in memory, so this is exact
    // up to the rounding of the product; the result is at most n.
    let n_test = ((n as f64) * test_fraction).ceil() as usize;
    if n_test == 0 || n_test >= n {
        return Err(Error::invalid_argument(
            "test_fraction",
            format!(
                "{test_fraction} of {n} samples leaves {n_test} for testing and {} for training; \
                 both parts must be non-empty",
                n.saturating_sub(n_test)
            ),
        ));
    }
    let order = permutation(n, seed);
    let (test, train) = order.split_at(n_test);
    log::debug!(
        "train_test_split: {} training and {} test samples (seed {seed})",
        train.len(),
        test.len()
    );
    Ok((train.to_vec(), test.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::dtype::DType;

    /// Ten samples: features row `[i, -i]`, label `i`.
    fn ten() -> Result<(HostTensor, HostTensor)> {
        let x = (0..10).flat_map(|i| [i as f32, -(i as f32)]).collect();
        Ok((
            HostTensor::new(x, [10, 2])?,
            HostTensor::new((0..10).collect::<Vec<i64>>(), [10])?,
        ))
    }

    #[test]
    fn split_partitions_rows_and_keeps_pairs() -> Result<()> {
        let (x, y) = ten()?;
        let ((tx, ty), (vx, vy)) = train_test_split(&x, &y, 0.3, 17)?;
        assert_eq!((tx.dims(), ty.dims()), (&[7, 2][..], &[7][..]));
        assert_eq!((vx.dims(), vy.dims()), (&[3, 2][..], &[3][..]));

        for (fx, fy) in [(&tx, &ty), (&vx, &vy)] {
            for (row, &label) in fx.as_slice::<f32>()?.chunks(2).zip(fy.as_slice::<i64>()?) {
                assert_eq!(row, &[label as f32, -(label as f32)]);
            }
        }
        let mut all: Vec<i64> = ty.as_slice::<i64>()?.to_vec();
        all.extend_from_slice(vy.as_slice::<i64>()?);
        all.sort_unstable();
        assert_eq!(all, (0..10).collect::<Vec<i64>>());
        Ok(())
    }

    #[test]
    fn split_is_deterministic_per_seed() -> Result<()> {
        let (x, y) = ten()?;
        let a = train_test_split(&x, &y, 0.5, 1)?;
        assert_eq!(a, train_test_split(&x, &y, 0.5, 1)?);
        assert_ne!(a.1 .1, train_test_split(&x, &y, 0.5, 2)?.1 .1);
        Ok(())
    }

    #[test]
    fn test_size_rounds_up_like_scikit_learn() -> Result<()> {
        let (x, y) = ten()?;
        // ceil(10 * 0.25) = 3, ceil(10 * 0.01) = 1
        assert_eq!(train_test_split(&x, &y, 0.25, 0)?.1 .1.numel(), 3);
        assert_eq!(train_test_split(&x, &y, 0.01, 0)?.1 .1.numel(), 1);
        Ok(())
    }

    #[test]
    fn invalid_inputs_are_rejected() -> Result<()> {
        let (x, y) = ten()?;
        for bad in [0.0, 1.0, -0.5, 1.5, f64::NAN] {
            let err = train_test_split(&x, &y, bad, 0).expect_err("bad fraction");
            assert!(
                matches!(err, Error::InvalidArgument { ref name, .. } if name == "test_fraction"),
                "{bad}: {err}"
            );
        }
        // 0.95 of 10 leaves no training sample
        let err = train_test_split(&x, &y, 0.95, 0).expect_err("empty train");
        assert!(
            err.to_string()
                .contains("leaves 10 for testing and 0 for training"),
            "{err}"
        );

        let short = HostTensor::zeros(DType::I64, [9])?;
        let err = train_test_split(&x, &short, 0.5, 0).expect_err("9 labels");
        assert!(
            err.to_string()
                .ends_with("expected shape [10, ...], got [9]"),
            "{err}"
        );
        let err = train_test_split(&HostTensor::scalar(1.0f32), &y, 0.5, 0).expect_err("scalar");
        assert!(matches!(err, Error::InvalidArgument { ref name, .. } if name == "features"));
        Ok(())
    }
}
