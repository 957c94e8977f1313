//! Named tensors of a module or optimizer, as saved in checkpoints.

use std::collections::btree_map;
use std::collections::BTreeMap;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::Shape;
use crate::tensor::HostTensor;

/// Host copies of named tensors, keyed by PyTorch-style dotted names
/// (`"layers.0.weight"`), iterated in sorted key order.
///
/// ```
/// use kiln_core::{state_dict::StateDict, DType, HostTensor};
///
/// let mut sd = StateDict::new();
/// sd.insert("fc.bias", HostTensor::zeros(DType::F32, [10])?);
/// let bias = sd.expect_entry("fc.bias", [10], DType::F32)?;
/// assert_eq!(bias.numel(), 10);
/// assert!(sd.expect_entry("fc.weight", [10, 64], DType::F32).is_err());
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StateDict(BTreeMap<String, HostTensor>);

impl StateDict {
    /// An empty state dict.
    pub fn new() -> Self {
        StateDict(BTreeMap::new())
    }

    /// Inserts an entry, returning the tensor it replaced.
    pub fn insert(&mut self, key: impl Into<String>, tensor: HostTensor) -> Option<HostTensor> {
        self.0.insert(key.into(), tensor)
    }

    /// The entry for `key`, if any.
    pub fn get(&self, key: &str) -> Option<&HostTensor> {
        self.0.get(key)
    }

    /// Removes and returns the entry for `key`.
    pub fn remove(&mut self, key: &str) -> Option<HostTensor> {
        self.0.remove(key)
    }

    /// Whether there is an entry for `key`.
    pub fn contains_key(&self, key: &str) -> bool {
        self.0.contains_key(key)
    }

    /// Entries in sorted key order.
    pub fn iter(&self) -> btree_map::Iter<'_, String, HostTensor> {
        self.0.iter()
    }

    /// Keys in sorted order.
    pub fn keys(&self) -> btree_map::Keys<'_, String, HostTensor> {
        self.0.keys()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The underlying map.
    pub fn into_inner(self) -> BTreeMap<String, HostTensor> {
        self.0
    }

    /// The entry for `key`, checked to have `shape` and `dtype`.
    ///
    /// Fails with [`Error::MissingKey`], or with a shape or dtype mismatch
    /// whose message names the key and both shapes or dtypes.
    pub fn expect_entry(
        &self,
        key: &str,
        shape: impl Into<Shape>,
        dtype: DType,
    ) -> Result<&HostTensor> {
        let tensor = self.0.get(key).ok_or_else(|| Error::MissingKey {
            key: key.to_owned(),
            available: self.0.len(),
        })?;
        let shape = shape.into();
        if *tensor.shape() != shape {
            return Err(Error::ShapeMismatch {
                context: format!("state dict entry `{key}`"),
                expected: shape.to_string(),
                actual: tensor.shape().to_string(),
            });
        }
        if tensor.dtype() != dtype {
            return Err(Error::DTypeMismatch {
                context: format!("state dict entry `{key}`"),
                expected: dtype,
                actual: tensor.dtype(),
            });
        }
        Ok(tensor)
    }

    /// Checks that every entry of `self` that `expected` also has is of the
    /// same dtype: loading never casts (an `int32` tensor is no `float32`
    /// weight). Keys and shapes are left to the loader's own checks.
    pub fn check_dtypes(&self, expected: &StateDict) -> Result<()> {
        for (key, tensor) in self.iter() {
            if let Some(want) = expected.get(key) {
                if tensor.dtype() != want.dtype() {
                    return Err(Error::DTypeMismatch {
                        context: format!("state dict entry `{key}`"),
                        expected: want.dtype(),
                        actual: tensor.dtype(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Checks that `self` has exactly the keys of `expected`, each with the
    /// same shape and dtype (a strict `load_state_dict` precondition).
    ///
    /// Reports the first problem in key order: a missing key, a mismatched
    /// entry, or an entry `expected` does not have.
    pub fn check_compatible(&self, expected: &StateDict) -> Result<()> {
        for (key, want) in expected.iter() {
            self.expect_entry(key, want.shape(), want.dtype())?;
        }
        if let Some(extra) = self.keys().find(|k| !expected.contains_key(k)) {
            return Err(Error::invalid_argument(
                extra.as_str(),
                format!(
                    "unexpected entry in state dict; the {} expected entries do not include it",
                    expected.len()
                ),
            ));
        }
        Ok(())
    }
}

impl FromIterator<(String, HostTensor)> for StateDict {
    fn from_iter<I: IntoIterator<Item = (String, HostTensor)>>(iter: I) -> Self {
        StateDict(iter.into_iter().collect())
    }
}

impl Extend<(String, HostTensor)> for StateDict {
    fn extend<I: IntoIterator<Item = (String, HostTensor)>>(&mut self, iter: I) {
        self.0.extend(iter);
    }
}

impl IntoIterator for StateDict {
    type Item = (String, HostTensor);
    type IntoIter = btree_map::IntoIter<String, HostTensor>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<'a> IntoIterator for &'a StateDict {
    type Item = (&'a String, &'a HostTensor);
    type IntoIter = btree_map::Iter<'a, String, HostTensor>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl From<BTreeMap<String, HostTensor>> for StateDict {
    fn from(map: BTreeMap<String, HostTensor>) -> Self {
        StateDict(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Result<StateDict> {
        Ok([
            (
                "fc.weight".to_string(),
                HostTensor::new(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3])?,
            ),
            (
                "fc.bias".to_string(),
                HostTensor::new(vec![0.5f32, -0.5], [2])?,
            ),
            ("step".to_string(), HostTensor::scalar(7i64)),
        ]
        .into_iter()
        .collect())
    }

    #[test]
    fn map_operations() -> Result<()> {
        let mut sd = sample()?;
        assert_eq!(sd.len(), 3);
        assert!(!sd.is_empty());
        // sorted key order
        let keys: Vec<&str> = sd.keys().map(String::as_str).collect();
        assert_eq!(keys, ["fc.bias", "fc.weight", "step"]);
        let numels: Vec<usize> = sd.iter().map(|(_, t)| t.numel()).collect();
        assert_eq!(numels, [2, 6, 1]);
        assert_eq!(sd.get("step"), Some(&HostTensor::scalar(7i64)));
        assert!(sd.get("nope").is_none());

        let old = sd.insert("step", HostTensor::scalar(8i64));
        assert_eq!(old, Some(HostTensor::scalar(7i64)));
        assert_eq!(sd.remove("step"), Some(HostTensor::scalar(8i64)));
        assert!(!sd.contains_key("step"));
        assert_eq!(sd.len(), 2);

        let map = sd.clone().into_inner();
        assert_eq!(map.len(), 2);
        assert_eq!(StateDict::from(map), sd);
        let names: Vec<String> = sd.into_iter().map(|(k, _)| k).collect();
        assert_eq!(names, ["fc.bias", "fc.weight"]);
        assert!(StateDict::new().is_empty());
        Ok(())
    }

    #[test]
    fn expect_entry_checks_key_shape_and_dtype() -> Result<()> {
        let sd = sample()?;
        let w = sd.expect_entry("fc.weight", [2, 3], DType::F32)?;
        assert_eq!(w.as_slice::<f32>()?[5], 6.0);

        let err = sd
            .expect_entry("fc.wieght", [2, 3], DType::F32)
            .expect_err("typo");
        assert_eq!(
            err.to_string(),
            "state dict has no entry `fc.wieght` (3 entries present)"
        );

        let err = sd
            .expect_entry("fc.weight", [3, 2], DType::F32)
            .expect_err("shape");
        assert_eq!(
            err.to_string(),
            "state dict entry `fc.weight`: expected shape [3, 2], got [2, 3]"
        );

        let err = sd.expect_entry("step", (), DType::I32).expect_err("dtype");
        assert_eq!(
            err.to_string(),
            "state dict entry `step`: expected dtype int32, got int64"
        );
        Ok(())
    }

    #[test]
    fn check_compatible_is_strict() -> Result<()> {
        let sd = sample()?;
        sd.check_compatible(&sd.clone())?;

        let mut fewer = sd.clone();
        fewer.remove("step");
        // `fewer` lacks an entry the full dict expects
        let err = fewer.check_compatible(&sd).expect_err("missing");
        assert!(matches!(err, Error::MissingKey { ref key, available: 2 } if key == "step"));
        // the full dict has an entry `fewer` does not expect
        let err = sd.check_compatible(&fewer).expect_err("unexpected");
        assert_eq!(
            err.to_string(),
            "invalid argument `step`: unexpected entry in state dict; \
             the 2 expected entries do not include it"
        );

        let mut reshaped = sd.clone();
        reshaped.insert("fc.bias", HostTensor::new(vec![0.0f32; 3], [3])?);
        let err = reshaped.check_compatible(&sd).expect_err("shape");
        assert_eq!(
            err.to_string(),
            "state dict entry `fc.bias`: expected shape [2], got [3]"
        );
        Ok(())
    }
}
