//! The optimizer of a ZeRO strategy: this rank's share of the state, and the
//! collective that gathers the whole of it for a checkpoint.

use std::collections::BTreeSet;
use std::sync::Arc;

use kiln_core::distributed::Collectives;
use kiln_core::optim::{Optimizer, OptimizerConfig, ParamGroup};
use kiln_core::state_dict::StateDict;
use kiln_core::state_tensors::{ShardState, StateTensor, StateTensors};
use kiln_core::{DType, Error, Result};
use kiln_torch::{device_from_tch, from_tch, kind_from_dtype, to_tch, torch_error};
use kiln_torch::{TorchBackend, TorchOptimizer};
use tch::Tensor;

use super::Shards;

/// The buffer size of the broadcasts that gather a sharded optimizer state.
const GATHER_BUCKET_BYTES: usize = 64 * 1024 * 1024;

/// An optimizer whose state is sharded over the ranks of a ZeRO strategy:
/// this rank's [`TorchOptimizer`] holds the state of the parameters it owns
/// only.
///
/// Its [`state_dict`](Optimizer::state_dict) is a collective (see
/// [`Optimizer::state_is_collective`]): every rank calls it at the same point,
/// and every rank gets the whole state, in the layout a single process's
/// optimizer has, one rank's share at a time. So a checkpoint of a sharded run
/// resumes under DDP, on one process, or under ZeRO on another number of
/// ranks, and the other way round: [`load_state_dict`](Optimizer::load_state_dict)
/// takes a whole state and keeps this rank's share.
#[derive(Debug)]
pub struct ShardedOptimizer {
    pub(super) inner: TorchOptimizer,
    shards: Arc<Shards>,
    /// Sets every trainable parameter's gradient to none.
    grad_reset: tch::COptimizer,
}

impl ShardedOptimizer {
    pub(super) fn new(
        config: &OptimizerConfig,
        groups: &[ParamGroup],
        shards: Arc<Shards>,
    ) -> Result<Self> {
        let params: Vec<(String, Tensor)> = shards
            .names
            .iter()
            .cloned()
            .zip(shards.params.iter().map(Tensor::shallow_clone))
            .collect();
        let owned: BTreeSet<String> = shards
            .owned_names()
            .into_iter()
            .map(str::to_owned)
            .collect();
        let inner =
            TorchOptimizer::new_shard(config.clone(), params, groups, |name| owned.contains(name))?;
        let mut grad_reset = tch::COptimizer::sgd(0.0, 0.0, 0.0, 0.0, false)
            .map_err(|e| torch_error("creating the gradient reset", e))?;
        for p in shards.params.iter() {
            grad_reset
                .add_parameters(p, 0)
                .map_err(|e| torch_error("creating the gradient reset", e))?;
        }
        Ok(ShardedOptimizer {
            inner,
            shards,
            grad_reset,
        })
    }

    /// This rank's optimizer: the parameters it owns.
    pub fn shard(&self) -> &TorchOptimizer {
        &self.inner
    }

    /// The parameter a `state.<param>.<buffer>` key belongs to.
    fn param_of(key: &str) -> Option<&str> {
        key.strip_prefix("state.")?.rsplit_once('.').map(|(p, _)| p)
    }
}

/// One entry of a rank's share of the optimizer state, as announced to the
/// others before its tensors are broadcast: `key`, dtype, whether it is a host
/// value, shape.
fn describe(key: &str, dtype: DType, host: bool, shape: &[i64]) -> String {
    let dims: Vec<String> = shape.iter().map(i64::to_string).collect();
    format!(
        "{key}\t{}\t{}\t{}",
        dtype.name(),
        u8::from(host),
        dims.join(",")
    )
}

fn parse_description(line: &str) -> Result<(String, DType, bool, Vec<i64>)> {
    let bad = || Error::distributed("ShardedOptimizer", format!("bad state entry {line:?}"));
    let mut parts = line.split('\t');
    let key = parts.next().ok_or_else(bad)?.to_owned();
    let dtype: DType = parts.next().ok_or_else(bad)?.parse()?;
    let host = parts.next().ok_or_else(bad)? == "1";
    let dims = parts.next().ok_or_else(bad)?;
    let shape = if dims.is_empty() {
        Vec::new()
    } else {
        dims.split(',')
            .map(|d| d.parse::<i64>().map_err(|_| bad()))
            .collect::<Result<_>>()?
    };
    Ok((key, dtype, host, shape))
}

impl Optimizer<TorchBackend> for ShardedOptimizer {
    /// This rank's update, then every rank's updated parameters gathered. The
    /// gradients must already be reduced: train through
    /// [`Trainable::train_step`](kiln_core::backend::Trainable::train_step), which does both.
    fn step(&mut self) -> Result<()> {
        self.inner.step()?;
        self.shards.gather_parameters()
    }

    fn zero_grad(&mut self) -> Result<()> {
        self.inner.zero_grad()?;
        self.grad_reset
            .zero_grad()
            .map_err(|e| torch_error("zero_grad", e))
    }

    fn learning_rate(&self) -> f64 {
        self.inner.learning_rate()
    }

    fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        self.inner.set_learning_rate(lr)
    }

    fn kind(&self) -> Option<&'static str> {
        Optimizer::kind(&self.inner)
    }

    fn config(&self) -> Option<&OptimizerConfig> {
        Optimizer::config(&self.inner)
    }

    fn learning_rates(&self) -> Vec<f64> {
        self.inner.learning_rates()
    }

    fn set_learning_rates(&mut self, lrs: &[f64]) -> Result<()> {
        self.inner.set_learning_rates(lrs)
    }

    fn state_is_collective(&self) -> bool {
        true
    }

    fn state_dict(&self) -> Result<StateDict> {
        self.state_tensors()?.to_state_dict()
    }

    /// The whole state, on every rank: each rank in turn announces its
    /// share's entries and broadcasts their tensors. A collective.
    fn state_tensors(&self) -> Result<StateTensors<TorchBackend>> {
        let group = &self.shards.group;
        let device = device_from_tch(self.shards.params[0].device())?;
        let fail = |e| torch_error("gathering the optimizer state", e);
        let on = kiln_torch::device_to_tch(device)?;
        let own = self.inner.state_tensors()?;
        let mut whole = StateTensors::<TorchBackend>::from(StateDict::new());
        let mut mine: Vec<(String, bool, Tensor)> = Vec::new();
        for (key, tensor) in own.iter() {
            match (Self::param_of(key), tensor) {
                (Some(_), StateTensor::Host(h)) => {
                    mine.push((key.clone(), true, to_tch(h, device)?));
                }
                (Some(_), StateTensor::Backend(t)) => {
                    mine.push((key.clone(), false, t.f_contiguous().map_err(fail)?));
                }
                // Group hyperparameters and the loss scale: the same on every rank.
                (None, StateTensor::Host(h)) => {
                    whole.insert(key.clone(), StateTensor::Host(h.clone()))?
                }
                (None, StateTensor::Backend(t)) => {
                    whole.insert(key.clone(), StateTensor::Backend(t.shallow_clone()))?
                }
            }
        }
        for root in 0..group.world_size() {
            let mut announced = if root == group.rank() {
                let lines: Vec<String> = mine
                    .iter()
                    .map(|(key, host, t)| {
                        Ok(describe(
                            key,
                            kiln_torch::dtype_from_kind(t.kind())?,
                            *host,
                            &t.size(),
                        ))
                    })
                    .collect::<Result<_>>()?;
                lines.join("\n").into_bytes()
            } else {
                Vec::new()
            };
            group.broadcast_bytes(&mut announced, root)?;
            let text = String::from_utf8(announced).map_err(|_| {
                Error::distributed("ShardedOptimizer", "a rank announced a non-UTF-8 state")
            })?;
            let entries: Vec<(String, DType, bool, Vec<i64>)> =
                text.lines().map(parse_description).collect::<Result<_>>()?;
            let tensors: Vec<Tensor> = if root == group.rank() {
                mine.iter().map(|(_, _, t)| t.shallow_clone()).collect()
            } else {
                entries
                    .iter()
                    .map(|(_, dtype, _, shape)| {
                        Tensor::f_zeros(shape.as_slice(), (kind_from_dtype(*dtype)?, on))
                            .map_err(fail)
                    })
                    .collect::<Result<_>>()?
            };
            let refs: Vec<&Tensor> = tensors.iter().collect();
            tch::no_grad(|| group.broadcast_coalesced(&refs, GATHER_BUCKET_BYTES, root))?;
            for ((key, _, host, _), tensor) in entries.into_iter().zip(tensors) {
                let value = if host {
                    StateTensor::Host(from_tch(&tensor)?)
                } else {
                    StateTensor::Backend(tensor)
                };
                whole.insert(key, value)?;
            }
        }
        Ok(whole)
    }

    /// The state of the parameters this rank owns; rank 0 also holds the
    /// group hyperparameters and loss scale, which are the same on every
    /// rank. Not a collective.
    fn shard_state_tensors(&self) -> Result<Option<ShardState<TorchBackend>>> {
        let rank = self.shards.group.rank();
        let mut part = ShardState::default();
        for (key, tensor) in self.inner.state_tensors()?.iter() {
            if Self::param_of(key).is_none() && rank != 0 {
                continue;
            }
            let value = match tensor {
                StateTensor::Host(h) => StateTensor::Host(h.clone()),
                StateTensor::Backend(t) => StateTensor::Backend(t.shallow_clone()),
            };
            part.tensors.insert(key.clone(), value)?;
        }
        Ok(Some(part))
    }

    /// Keeps this rank's share of `state` (a whole optimizer state, of any
    /// strategy or number of ranks): every other parameter's entries are
    /// left out, and this rank's optimizer checks and loads the rest.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let owned = self.shards.owned_names();
        let all: BTreeSet<&str> = self.shards.names.iter().map(String::as_str).collect();
        let mut share = StateDict::new();
        for (key, value) in state.iter() {
            match Self::param_of(key) {
                Some(p) if all.contains(p) && !owned.contains(p) => {}
                _ => {
                    share.insert(key.clone(), value.clone());
                }
            }
        }
        self.inner.load_state_dict(&share)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_entries_round_trip() -> Result<()> {
        let line = describe("state.0.weight.exp_avg", DType::F32, false, &[3, 4]);
        assert_eq!(
            parse_description(&line)?,
            (
                "state.0.weight.exp_avg".to_owned(),
                DType::F32,
                false,
                vec![3, 4]
            )
        );
        let line = describe("state.0.bias.step", DType::I64, true, &[]);
        assert_eq!(
            parse_description(&line)?,
            ("state.0.bias.step".to_owned(), DType::I64, true, vec![])
        );
        assert_eq!(ShardedOptimizer::param_of("state.a.b.exp_avg"), Some("a.b"));
        assert_eq!(ShardedOptimizer::param_of("group.0.lr"), None);
        Ok(())
    }
}
