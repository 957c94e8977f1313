//! Named tensors as a checkpoint writer reads them: in place where the backend
//! keeps them in host memory, instead of a [`StateDict`] of host copies.

use std::collections::btree_map;
use std::collections::BTreeMap;
use std::path::Path;

use crate::backend::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::state_dict::StateDict;
use crate::tensor::HostTensor;

pub use crate::safetensors::{WritableState, WritableTensor};

/// One tensor a checkpoint saves.
#[derive(Debug)]
pub enum StateTensor<B: Backend> {
    /// A value already in host memory (a step count, a hyperparameter, or
    /// state the backend only has as copies).
    Host(HostTensor),
    /// A handle to the backend's own tensor, read with
    /// [`Backend::with_host_bytes`] when the file is written: in place for a
    /// contiguous tensor in host memory, through a host copy otherwise.
    Backend(B::Tensor),
}

impl<B: Backend> WritableTensor for StateTensor<B> {
    fn dtype(&self) -> Result<DType> {
        match self {
            StateTensor::Host(t) => WritableTensor::dtype(t),
            StateTensor::Backend(t) => B::dtype(t),
        }
    }

    fn dims(&self) -> Vec<usize> {
        match self {
            StateTensor::Host(t) => WritableTensor::dims(t),
            StateTensor::Backend(t) => B::shape(t).dims().to_vec(),
        }
    }

    fn with_bytes(&self, write: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        match self {
            StateTensor::Host(t) => t.with_bytes(write),
            StateTensor::Backend(t) => B::with_host_bytes(t, |bytes| write(bytes))?,
        }
    }
}

/// The tensors of a module or optimizer, named as in its state dict, for a
/// checkpoint that reads them where they are instead of copying them to the
/// host first: what [`Module::state_tensors`](crate::module::Module::state_tensors)
/// and [`Optimizer::state_tensors`](crate::optim::Optimizer::state_tensors) return.
///
/// A 100M-parameter model's checkpoint written from its `StateTensors` costs
/// no 400 MB host copy of its weights. The tensors are handles: training the
/// model changes what a later write saves, so write it before the next step
/// (or take a [`StateDict`] with [`to_state_dict`](Self::to_state_dict)).
///
/// ```
/// use kiln_core::{backend::Backend, state_tensors::{StateTensor, StateTensors}, HostTensor, Result};
///
/// fn save_one<B: Backend>(weight: B::Tensor, path: &std::path::Path) -> Result<()> {
///     let mut state = StateTensors::<B>::new();
///     state.insert("fc.weight", StateTensor::Backend(weight))?;
///     state.insert("step", StateTensor::Host(HostTensor::scalar(3i64)))?;
///     state.save_safetensors(path, &Default::default())
/// }
/// ```
#[derive(Debug)]
pub struct StateTensors<B: Backend>(BTreeMap<String, StateTensor<B>>);

impl<B: Backend> Default for StateTensors<B> {
    fn default() -> Self {
        Self(BTreeMap::new())
    }
}

impl<B: Backend> StateTensors<B> {
    /// None yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Handles to a module's tensors (its parameters and buffers), each read in
    /// place when written; a name given twice is [`Error::InvalidArgument`].
    pub fn from_handles(tensors: impl IntoIterator<Item = (String, B::Tensor)>) -> Result<Self> {
        let mut state = Self::new();
        for (name, tensor) in tensors {
            state.insert(name, StateTensor::Backend(tensor))?;
        }
        Ok(state)
    }

    /// Adds a tensor; a name given twice is [`Error::InvalidArgument`] naming it.
    pub fn insert(&mut self, name: impl Into<String>, tensor: StateTensor<B>) -> Result<()> {
        match self.0.entry(name.into()) {
            btree_map::Entry::Occupied(e) => Err(Error::invalid_argument(
                e.key().as_str(),
                "appears more than once among the tensors to save",
            )),
            btree_map::Entry::Vacant(e) => {
                e.insert(tensor);
                Ok(())
            }
        }
    }

    /// Entries in sorted name order.
    pub fn iter(&self) -> btree_map::Iter<'_, String, StateTensor<B>> {
        self.0.iter()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Host copies of every tensor: what `state_dict()` returns.
    pub fn to_state_dict(&self) -> Result<StateDict> {
        self.0
            .iter()
            .map(|(name, tensor)| {
                let host = match tensor {
                    StateTensor::Host(t) => t.clone(),
                    StateTensor::Backend(t) => B::to_host(t)?,
                };
                Ok((name.clone(), host))
            })
            .collect()
    }

    /// Writes the tensors to `path` as a safetensors file, atomically, exactly
    /// as [`StateDict::save_safetensors`] writes their host copies, reading
    /// each tensor's bytes in place where it can.
    pub fn save_safetensors(
        &self,
        path: impl AsRef<Path>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<()> {
        crate::safetensors::save_entries(path.as_ref(), self.writable_tensors(), metadata)
    }
}

/// Where a tensor of a [`ShardState`] sits in the whole state: rows
/// `start..start + its own rows` of a tensor of `total` rows along dim 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RowSlice {
    /// The first row of the whole tensor this part holds.
    pub start: u64,
    /// The whole tensor's rows (its dim 0).
    pub total: u64,
}

/// One rank's part of a state that is sharded over the ranks of a job, as a
/// sharded checkpoint writes it: no rank gathers the whole.
///
/// Tensors are named as in the whole state. A name in [`rows`](Self::rows)
/// is a slice of rows of the whole tensor; any other is the whole tensor,
/// which exactly one rank holds. Put together over every rank, the parts are
/// the whole state (what [`Module::state_tensors`](crate::module::Module::state_tensors)
/// or [`Optimizer::state_tensors`](crate::optim::Optimizer::state_tensors)
/// gathers).
#[derive(Debug)]
pub struct ShardState<B: Backend> {
    /// The tensors this rank holds.
    pub tensors: StateTensors<B>,
    /// For each tensor that is a slice of a larger one, which rows.
    pub rows: BTreeMap<String, RowSlice>,
}

impl<B: Backend> Default for ShardState<B> {
    fn default() -> Self {
        Self {
            tensors: StateTensors::new(),
            rows: BTreeMap::new(),
        }
    }
}

impl<B: Backend> ShardState<B> {
    /// A part holding whole tensors only (on the rank that writes a
    /// replicated state).
    pub fn whole(tensors: StateTensors<B>) -> Self {
        Self {
            tensors,
            rows: BTreeMap::new(),
        }
    }
}

impl<B: Backend> From<StateDict> for StateTensors<B> {
    fn from(state: StateDict) -> Self {
        Self(
            state
                .into_inner()
                .into_iter()
                .map(|(name, t)| (name, StateTensor::Host(t)))
                .collect(),
        )
    }
}

impl<B: Backend> WritableState for StateTensors<B> {
    fn writable_tensors(&self) -> Vec<(&str, &dyn WritableTensor)> {
        self.0
            .iter()
            .map(|(name, t)| (name.as_str(), t as &dyn WritableTensor))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::RefBackend;

    fn scratch(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-core-stt-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        dir
    }

    fn sample() -> Result<StateDict> {
        let mut sd = StateDict::new();
        sd.insert(
            "a.weight",
            HostTensor::new(vec![1.5f32, -2.0, 0.25, 8.0], [2, 2])?,
        );
        sd.insert("a.bias", HostTensor::new(vec![1.0f64 / 3.0, -0.0], [2])?);
        sd.insert("steps", HostTensor::scalar(12i64));
        sd.insert("mask", HostTensor::new(vec![1u8, 0, 1], [3])?);
        Ok(sd)
    }

    #[test]
    fn writes_the_same_file_as_the_state_dict_of_its_host_copies() -> Result<()> {
        let dir = scratch("same");
        let sd = sample()?;
        // Mixed: backend handles and host values, as an optimizer's state is.
        let mut live = StateTensors::<RefBackend>::new();
        for (name, t) in sd.iter() {
            let tensor = if name == "steps" {
                StateTensor::Host(t.clone())
            } else {
                StateTensor::Backend(t.clone())
            };
            live.insert(name.clone(), tensor)?;
        }
        assert_eq!(live.len(), 4);
        assert_eq!(live.to_state_dict()?, sd);
        let meta = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
        sd.save_safetensors(dir.join("copies.safetensors"), &meta)?;
        live.save_safetensors(dir.join("live.safetensors"), &meta)?;
        let read = |name: &str| std::fs::read(dir.join(name)).expect("read back");
        assert_eq!(read("live.safetensors"), read("copies.safetensors"));
        assert_eq!(
            StateDict::load_safetensors(dir.join("live.safetensors"))?,
            (sd, meta)
        );
        std::fs::remove_dir_all(&dir).ok();
        Ok(())
    }

    #[test]
    fn a_name_given_twice_is_an_error_naming_it() -> Result<()> {
        let t = || HostTensor::scalar(1.0f32);
        let err = StateTensors::<RefBackend>::from_handles([
            ("fc.weight".to_owned(), t()),
            ("fc.weight".to_owned(), t()),
        ])
        .expect_err("duplicate");
        assert!(err.to_string().contains("fc.weight"), "{err}");
        Ok(())
    }

    /// A 4-element float32 tensor that hands over this many bytes (not its 16), or
    /// whose backend fails to hand any over (a failed device copy) for `None`.
    struct Broken(Option<usize>);

    impl WritableTensor for Broken {
        fn dtype(&self) -> Result<DType> {
            Ok(DType::F32)
        }
        fn dims(&self) -> Vec<usize> {
            vec![4]
        }
        fn with_bytes(&self, write: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
            match self.0 {
                Some(len) => write(&vec![0u8; len]),
                None => Err(Error::backend(
                    "test",
                    "copying a tensor to host memory",
                    "device lost",
                )),
            }
        }
    }

    #[test]
    fn a_failed_or_inconsistent_tensor_leaves_the_previous_file_as_it_was() -> Result<()> {
        let dir = scratch("fail");
        let path = dir.join("ckpt.safetensors");
        let sd = sample()?;
        sd.save_safetensors(&path, &BTreeMap::new())?;
        let before = std::fs::read(&path).expect("read");
        let good = HostTensor::scalar(1.0f32);
        for (bad, expect) in [
            (Broken(Some(12)), "12 bytes of data for a 16-byte"),
            (Broken(None), "device lost"),
        ] {
            let entries: Vec<(&str, &dyn WritableTensor)> = vec![("good", &good), ("bad", &bad)];
            let err = crate::safetensors::save_entries(&path, entries, &BTreeMap::new())
                .expect_err("refused");
            // The backend's message is the error's source: read the whole chain.
            let text = err.display_chain().to_string();
            assert!(text.contains(expect), "{text}");
            assert_eq!(std::fs::read(&path).expect("read"), before);
            // No temporary file is left behind.
            assert_eq!(std::fs::read_dir(&dir).expect("list").count(), 1);
        }
        std::fs::remove_dir_all(&dir).ok();
        Ok(())
    }
}
