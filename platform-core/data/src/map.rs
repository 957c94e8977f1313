//! Datasets derived from other datasets.

use std::fmt;

use crate::transform::{Transform, TransformRng};
use crate::Dataset;
use kiln_core::error::Result;
use kiln_core::tensor::HostTensor;

/// A dataset whose samples are those of another passed through a function,
/// e.g. to one-hot encode targets or to turn samples into `(input, target)`
/// pairs. The function sees no randomness; see [`TransformedDataset`] for
/// random augmentation.
///
/// ```
/// use kiln_data::{one_hot, Dataset, InMemoryDataset, MapDataset};
/// use kiln_core::HostTensor;
///
/// let x = HostTensor::new(vec![0.0f32, 1.0, 2.0], [3, 1])?;
/// let y = HostTensor::new(vec![2i64, 0, 1], [3])?;
/// let ds = MapDataset::new(InMemoryDataset::new(x, y)?, |(x, y): (HostTensor, HostTensor)| {
///     let y = one_hot(&y.reshape([1])?, 3)?.reshape([3])?;
///     Ok((x, y))
/// });
/// assert_eq!(ds.get(0)?.1.as_slice::<f32>()?, &[0.0, 0.0, 1.0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone)]
pub struct MapDataset<D, F> {
    dataset: D,
    f: F,
}

impl<D, F> MapDataset<D, F> {
    /// Samples of `dataset` passed through `f`.
    pub fn new(dataset: D, f: F) -> Self {
        MapDataset { dataset, f }
    }

    /// The underlying dataset.
    pub fn inner(&self) -> &D {
        &self.dataset
    }
}

impl<D, F> fmt::Debug for MapDataset<D, F>
where
    D: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MapDataset")
            .field("dataset", &self.dataset)
            .finish_non_exhaustive()
    }
}

impl<D, F, U> Dataset for MapDataset<D, F>
where
    D: Dataset,
    F: Fn(D::Item) -> Result<U> + Send + Sync,
    U: Send,
{
    type Item = U;

    fn len(&self) -> usize {
        self.dataset.len()
    }

    fn get(&self, index: usize) -> Result<U> {
        (self.f)(self.dataset.get(index)?)
    }

    fn get_for_epoch(&self, index: usize, epoch: u64) -> Result<U> {
        (self.f)(self.dataset.get_for_epoch(index, epoch)?)
    }
}

/// A dataset of `(input, target)` samples whose inputs go through a
/// [`Transform`], with randomness seeded by `(seed, epoch, sample index)`.
///
/// Each sample gets its own [`TransformRng`], so an augmented sample depends
/// only on the seed, the epoch and its index: a
/// [`PrefetchLoader`](crate::PrefetchLoader) with any number of workers
/// produces the same batches, and every epoch sees different augmentations.
/// [`get`](Dataset::get) is epoch 0.
///
/// ```
/// use kiln_data::{Dataset, InMemoryDataset, TransformRng, TransformedDataset};
/// use kiln_core::{HostTensor, Result};
///
/// // Four 1x1x2 images [i, 10 + i], each flipped with probability 1/2.
/// let x = HostTensor::new(vec![0u8, 10, 1, 11, 2, 12, 3, 13], [4, 1, 1, 2])?;
/// let y = HostTensor::new(vec![0i64, 1, 2, 3], [4])?;
/// let flip = |x: HostTensor, rng: &mut TransformRng| -> Result<HostTensor> {
///     if rng.next_f64() < 0.5 {
///         let v: Vec<u8> = x.as_slice::<u8>()?.iter().rev().copied().collect();
///         return HostTensor::new(v, x.dims().to_vec());
///     }
///     Ok(x)
/// };
/// let ds = TransformedDataset::new(InMemoryDataset::new(x, y)?, flip, 9);
/// let (img, _) = ds.get_for_epoch(1, 3)?;
/// assert!(img.as_slice::<u8>()? == [1, 11] || img.as_slice::<u8>()? == [11, 1]);
/// assert_eq!(img, ds.get_for_epoch(1, 3)?.0);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct TransformedDataset<D, T> {
    dataset: D,
    transform: T,
    seed: u64,
}

impl<D, T> TransformedDataset<D, T> {
    /// `dataset` with `transform` applied to every input, seeded with `seed`.
    pub fn new(dataset: D, transform: T, seed: u64) -> Self {
        TransformedDataset {
            dataset,
            transform,
            seed,
        }
    }

    /// The underlying dataset.
    pub fn inner(&self) -> &D {
        &self.dataset
    }

    /// The transform.
    pub fn transform(&self) -> &T {
        &self.transform
    }

    /// The seed of the transform's randomness.
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

impl<D, T> Dataset for TransformedDataset<D, T>
where
    D: Dataset<Item = (HostTensor, HostTensor)>,
    T: Transform,
{
    type Item = (HostTensor, HostTensor);

    fn len(&self) -> usize {
        self.dataset.len()
    }

    fn get(&self, index: usize) -> Result<Self::Item> {
        self.get_for_epoch(index, 0)
    }

    fn get_for_epoch(&self, index: usize, epoch: u64) -> Result<Self::Item> {
        let (input, target) = self.dataset.get_for_epoch(index, epoch)?;
        let mut rng = TransformRng::for_sample(self.seed, epoch, index);
        Ok((self.transform.apply(input, &mut rng)?, target))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::InMemoryDataset;
    use kiln_core::error::Error;

    /// Inputs are the sample index; the transform adds a random value in 0..1000.
    fn noisy() -> Result<TransformedDataset<InMemoryDataset, impl Transform>> {
        let x = HostTensor::new((0..6).map(|i| i as i64).collect(), [6, 1])?;
        let y = HostTensor::new((0..6).map(|i| i as i64).collect(), [6])?;
        let add_noise = |x: HostTensor, rng: &mut TransformRng| -> Result<HostTensor> {
            let noise = rng.below(1000) as i64;
            let v: Vec<i64> = x
                .as_slice::<i64>()?
                .iter()
                .map(|&v| v + 1000 * noise)
                .collect();
            HostTensor::new(v, x.dims().to_vec())
        };
        Ok(TransformedDataset::new(
            InMemoryDataset::new(x, y)?,
            add_noise,
            5,
        ))
    }

    #[test]
    fn randomness_depends_on_seed_epoch_and_index() -> Result<()> {
        let ds = noisy()?;
        let value = |i: usize, e: u64| -> Result<i64> { ds.get_for_epoch(i, e)?.0.item::<i64>() };
        // The sample's own value survives; the noise is the expected draw.
        for (i, e) in [(0, 0), (3, 0), (3, 7)] {
            let mut rng = TransformRng::for_sample(5, e, i);
            let expected = i as i64 + 1000 * rng.below(1000) as i64;
            assert_eq!(value(i, e)?, expected);
        }
        assert_eq!(ds.get(2)?.0, ds.get_for_epoch(2, 0)?.0);
        // Over 6 samples and 3 epochs, draws differ (18 values in 0..1000).
        let mut draws: Vec<i64> = Vec::new();
        for e in 0..3 {
            for i in 0..6 {
                draws.push(value(i, e)? / 1000);
            }
        }
        draws.sort_unstable();
        draws.dedup();
        assert!(draws.len() >= 15, "{draws:?}");
        assert_eq!(ds.get(1)?.1.item::<i64>()?, 1);
        assert_eq!(ds.len(), 6);
        assert_eq!(ds.seed(), 5);
        Ok(())
    }

    #[test]
    fn map_dataset_applies_the_function_and_forwards_errors() -> Result<()> {
        let ds = MapDataset::new(noisy()?, |(x, y): (HostTensor, HostTensor)| {
            let label = y.item::<i64>()?;
            if label == 4 {
                return Err(Error::unsupported("label 4"));
            }
            Ok((x.item::<i64>()? % 1000, label * 2))
        });
        assert_eq!(ds.len(), 6);
        assert_eq!(ds.get_for_epoch(3, 9)?, (3, 6));
        assert_eq!(
            ds.get(4).expect_err("4").to_string(),
            "unsupported: label 4"
        );
        assert!(ds.get(6).is_err());
        assert_eq!(ds.inner().len(), 6);
        Ok(())
    }
}
