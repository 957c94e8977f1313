//! [`TfShardedOptimizer`]: the optimizer of a ZeRO strategy on TensorFlow
//! ([`ZeroDataParallel`](crate::ZeroDataParallel)). Each parameter belongs to
//! one rank (PyTorch's `ZeroRedundancyOptimizer` partition, as on libtorch:
//! [`partition`]); a rank creates optimizer state variables for its own
//! parameters only, and updates only those; the owners then broadcast what
//! they updated, so that every rank holds the whole model again.
//!
//! Per micro-batch, on every rank:
//!
//! 1. the strategy's [`before_forward`](StepHooks::before_forward) (rank 0's
//!    buffers, as under data parallelism);
//! 2. one session run fetches the micro-batch's gradients and loss as one flat
//!    float32 vector ([`ProgramKind::FlatGradients`](crate::step::ProgramKind));
//! 3. ZeRO-1: as under DDP, a micro-batch that does not apply keeps its
//!    gradients on this rank (only the loss is averaged), and the one that
//!    applies averages the whole sum over the ranks;
//!    ZeRO-2: every micro-batch's gradients are reduce-scattered and this rank
//!    keeps, and accumulates, only the mean of the gradients it owns;
//! 4. on the micro-batch that applies: clipping from the norm over every
//!    rank's share (one all-reduce of one number), this rank's update in one
//!    session run (its share of the gradients is all that is fed), then one
//!    broadcast per rank of the parameters it updated.
//!
//! Gloo reduce-scatters host memory by all-reducing it and keeping one's
//! segment (c10d's `ProcessGroupGloo` does so on a clone of the input); the
//! fetched vector is TensorFlow's, used once, so it is all-reduced in place
//! and this rank copies its share out before it is freed.

use std::ops::Range;
use std::sync::Arc;

use kiln_core::{
    backend::StepPlan,
    distributed::{Collectives, ReduceOp},
    optim::{
        optimizer_state_key, read_optimizer_state, save_group_hypers, GradClip, Optimizer,
        OptimizerConfig, ParamGroup,
    },
    state_dict::StateDict,
    state_tensors::{ShardState, StateTensors},
    strategy::{partition, StepHooks, ZeroStage},
    DType, Error, HostTensor, Result,
};

use super::data_parallel::{elements, FlatUpdate};
use super::TfOptimizer;
use crate::backend::TfBackend;
use crate::convert::TfTensor;
use crate::engine::Var;
use crate::model::{lock, TfModel};

/// The context of the errors raised here.
const CONTEXT: &str = "a ZeRO step on TensorFlow";

/// This rank's share of a ZeRO-2 step's reduced gradients, summed over the
/// micro-batches so far.
#[derive(Debug)]
struct OwnedGradients {
    /// The gradients of this rank's parameters marked in `present`, flat.
    values: Vec<f32>,
    /// Which parameters (of all) have a gradient.
    present: Vec<bool>,
}

/// An optimizer whose state is sharded over the ranks of a ZeRO strategy on
/// TensorFlow: this rank's variables hold the state of the parameters it owns
/// only. Each micro-batch fetches the gradients as one flat vector; under
/// ZeRO-1 they are all-reduced as under DDP, under ZeRO-2 reduce-scattered
/// (this rank keeps the mean of its own share); the micro-batch that applies
/// clips over every rank's share, updates this rank's parameters in one
/// session run, and each owner broadcasts what it updated.
///
/// Its [`state_dict`](Optimizer::state_dict) is a collective
/// ([`Optimizer::state_is_collective`]): every rank gets the whole state, in
/// the layout one process's optimizer has, so checkpoints move between
/// strategies, numbers of ranks and backends;
/// [`load_state_dict`](Optimizer::load_state_dict) takes a whole state and
/// keeps this rank's share.
///
/// Built by [`Trainable::build_optimizer`](kiln_core::backend::Trainable::build_optimizer)
/// on a [`ZeroDataParallel`](crate::ZeroDataParallel).
pub struct TfShardedOptimizer {
    inner: TfOptimizer,
    group: Arc<dyn Collectives>,
    stage: ZeroStage,
    /// Each parameter's owner, in the optimizer's (the model's) order.
    owners: Vec<usize>,
    /// ZeRO-2: this rank's share of the reduced gradients not yet applied.
    owned_grads: Option<OwnedGradients>,
}

impl std::fmt::Debug for TfShardedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TfShardedOptimizer")
            .field("stage", &self.stage)
            .field("rank", &self.group.rank())
            .field("owners", &self.owners)
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl TfShardedOptimizer {
    pub(crate) fn new(
        config: &OptimizerConfig,
        model: &TfModel,
        groups: &[ParamGroup],
        group: Arc<dyn Collectives>,
        stage: ZeroStage,
    ) -> Result<Self> {
        let sizes: Vec<i64> = model
            .vars
            .iter()
            .filter(|v| v.kind == kiln_core::model::ParamKind::Parameter)
            .map(|v| v.dims.iter().product::<usize>() as i64)
            .collect();
        let owners = partition(&sizes, group.world_size());
        let rank = group.rank();
        let inner = TfOptimizer::with_owned(config.clone(), model, groups, &|i| owners[i] == rank)?;
        let mine = owners.iter().filter(|&&o| o == rank).count();
        let held: i64 = sizes
            .iter()
            .zip(&owners)
            .filter(|(_, &o)| o == rank)
            .map(|(n, _)| n)
            .sum();
        log::info!(
            "{} on TensorFlow: rank {rank} of {} owns {mine} of {} parameters ({held} of {} \
             elements)",
            stage.name(),
            group.world_size(),
            sizes.len(),
            sizes.iter().sum::<i64>()
        );
        Ok(TfShardedOptimizer {
            inner,
            group,
            stage,
            owners,
            owned_grads: None,
        })
    }

    /// Each parameter's owner (a rank), in the model's order.
    pub fn owners(&self) -> &[usize] {
        &self.owners
    }

    /// This rank's optimizer: state for the parameters it owns only.
    pub fn shard(&self) -> &TfOptimizer {
        &self.inner
    }

    pub(crate) fn shard_mut(&mut self) -> &mut TfOptimizer {
        &mut self.inner
    }

    /// Whether this rank owns parameter `i`.
    fn owns(&self, i: usize) -> bool {
        self.owners.get(i) == Some(&self.group.rank())
    }

    /// Where this rank's parameters' gradients sit in a flat vector holding
    /// the gradients of the parameters marked in `present`, in order: the
    /// ranges, adjacent ones merged.
    fn element_ranges(&self, present: &[bool]) -> Vec<Range<usize>> {
        let mut ranges: Vec<Range<usize>> = Vec::new();
        let mut at = 0;
        for (i, slot) in self.inner.slots.iter().enumerate() {
            if !present.get(i).copied().unwrap_or(false) {
                continue;
            }
            let n: usize = slot.var.dims.iter().product();
            if self.owns(i) {
                match ranges.last_mut() {
                    Some(last) if last.end == at => last.end = at + n,
                    _ => ranges.push(at..at + n),
                }
            }
            at += n;
        }
        ranges
    }

    /// Applies the gradients accumulated by micro-batches that did not apply
    /// (ZeRO-1: averaged over the ranks first), clipped when `clip` is given.
    fn apply_pending(&mut self, clip: Option<&GradClip>) -> Result<()> {
        self.inner.pending = false;
        if let Some(mut local) = self.inner.local.take() {
            let ranges = self.element_ranges(&local.present);
            let data = elements(&mut local.flat)?;
            self.group.all_reduce_f32(data, ReduceOp::Mean)?;
            let mut share = gather_ranges(data, &ranges)?;
            let present = local.present;
            return self.apply_share(&mut share, &present, clip);
        }
        if let Some(mut grads) = self.owned_grads.take() {
            return self.apply_share(&mut grads.values, &grads.present, clip);
        }
        Ok(())
    }

    /// Clips `share` (this rank's part of the averaged gradients) over every
    /// rank's share, applies it to this rank's parameters in one session run,
    /// then gathers every rank's updated parameters.
    fn apply_share(
        &mut self,
        share: &mut [f32],
        present: &[bool],
        clip: Option<&GradClip>,
    ) -> Result<()> {
        if let Some(clip) = clip {
            clip_over_shards(self.group.as_ref(), share, clip)?;
        }
        let owned: Vec<bool> = present
            .iter()
            .enumerate()
            .map(|(i, &p)| p && self.owns(i))
            .collect();
        if owned.iter().any(|&p| p) {
            let mut tensor = TfTensor::F32(tensorflow::Tensor::new(&[share.len() as u64 + 1]));
            elements(&mut tensor)?[..share.len()].copy_from_slice(share);
            self.inner.apply_flat(tensor, &owned, None)?;
        } else {
            // Nothing of this rank's changes; its step count follows the others'.
            self.inner.step += 1;
        }
        self.gather_parameters(present)
    }

    /// Every rank's updated parameters (those with a gradient) to every rank:
    /// one broadcast from each rank that owns any.
    fn gather_parameters(&self, present: &[bool]) -> Result<()> {
        for root in 0..self.group.world_size() {
            let vars: Vec<&Var> = self
                .inner
                .slots
                .iter()
                .enumerate()
                .filter(|&(i, _)| {
                    self.owners[i] == root && present.get(i).copied().unwrap_or(false)
                })
                .map(|(_, slot)| &slot.var)
                .collect();
            if !vars.is_empty() {
                crate::distributed::broadcast_vars(
                    self.group.as_ref(),
                    &self.inner.graph,
                    &vars,
                    root,
                )?;
            }
        }
        Ok(())
    }

    /// The parameter a `state.<param>.<buffer>` key belongs to.
    fn param_of(key: &str) -> Option<&str> {
        key.strip_prefix("state.")?.rsplit_once('.').map(|(p, _)| p)
    }
}

/// The elements of `data` in `ranges`, in order, as one vector.
fn gather_ranges(data: &[f32], ranges: &[Range<usize>]) -> Result<Vec<f32>> {
    let mut out = Vec::with_capacity(ranges.iter().map(ExactSizeIterator::len).sum());
    for r in ranges {
        let part = data.get(r.clone()).ok_or_else(|| Error::ShapeMismatch {
            context: "a ZeRO step's flat gradients".to_owned(),
            expected: format!("at least {} elements", r.end),
            actual: format!("{}", data.len()),
        })?;
        out.extend_from_slice(part);
    }
    Ok(out)
}

/// Clips this rank's share of the gradients as `torch.nn.utils.clip_grad_*_`
/// clips all of them: by value elementwise; by norm with the norm of every
/// rank's share (one all-reduce).
fn clip_over_shards(group: &dyn Collectives, share: &mut [f32], clip: &GradClip) -> Result<()> {
    match *clip {
        GradClip::Value { clip_value } => {
            let c = clip_value as f32;
            for g in share.iter_mut() {
                *g = g.clamp(-c, c);
            }
            Ok(())
        }
        GradClip::Norm {
            max_norm,
            norm_type,
        } => {
            let total = if norm_type.is_infinite() {
                let mut max = [share.iter().map(|g| f64::from(g.abs())).fold(0.0, f64::max)];
                group.all_reduce_f64(&mut max, ReduceOp::Max)?;
                max[0]
            } else {
                let mut sum = [if norm_type == 2.0 {
                    share.iter().map(|&g| f64::from(g) * f64::from(g)).sum()
                } else {
                    share
                        .iter()
                        .map(|&g| f64::from(g.abs()).powf(norm_type))
                        .sum::<f64>()
                }];
                group.all_reduce_f64(&mut sum, ReduceOp::Sum)?;
                sum[0].powf(1.0 / norm_type)
            };
            let coef = (max_norm / (total + 1e-6)).min(1.0) as f32;
            if coef < 1.0 {
                for g in share.iter_mut() {
                    *g *= coef;
                }
            }
            Ok(())
        }
    }
}

/// ZeRO's stages: ZeRO-1 reduces as data parallelism does and applies this
/// rank's share; ZeRO-2 averages every micro-batch's vector and keeps this
/// rank's share of it.
impl FlatUpdate for TfShardedOptimizer {
    const CONTEXT: &'static str = CONTEXT;

    fn optimizer(&self) -> &TfOptimizer {
        &self.inner
    }

    fn earlier(&self) -> Option<&[bool]> {
        match self.stage {
            ZeroStage::One => self.inner.local.as_ref().map(|l| &l.present[..]),
            ZeroStage::Two => self.owned_grads.as_ref().map(|g| &g.present[..]),
        }
    }

    fn reduce(
        &mut self,
        hooks: &mut dyn StepHooks<TfBackend>,
        data: &mut [f32],
        present: &[bool],
        apply: bool,
    ) -> Result<()> {
        let end = self.element_ranges(present).last().map_or(0, |r| r.end);
        if end >= data.len() {
            return Err(Error::ShapeMismatch {
                context: "a ZeRO step's flat gradients".to_owned(),
                expected: format!("at least {} elements", end + 1),
                actual: format!("{}", data.len()),
            });
        }
        match self.stage {
            ZeroStage::One => self.inner.reduce(hooks, data, present, apply),
            // The reduce-scatter (see the module docs): the whole vector,
            // loss included, averaged in place; this rank keeps its share.
            ZeroStage::Two => self.group.all_reduce_f32(data, ReduceOp::Mean),
        }
    }

    fn finish(
        &mut self,
        _hooks: &mut dyn StepHooks<TfBackend>,
        mut flat: TfTensor,
        present: Vec<bool>,
        plan: &StepPlan<'_>,
    ) -> Result<()> {
        let ranges = self.element_ranges(&present);
        match self.stage {
            ZeroStage::One if plan.apply => {
                let mut share = gather_ranges(elements(&mut flat)?, &ranges)?;
                drop(flat);
                self.inner.local = None;
                self.inner.pending = false;
                self.apply_share(&mut share, &present, plan.clip)
            }
            ZeroStage::One => self
                .inner
                .keep_local(flat, present, Some(Arc::clone(&self.group))),
            ZeroStage::Two => {
                let share = gather_ranges(elements(&mut flat)?, &ranges)?;
                drop(flat);
                match self.owned_grads.as_mut() {
                    Some(sum) => {
                        for (a, b) in sum.values.iter_mut().zip(&share) {
                            *a += *b;
                        }
                    }
                    None => {
                        self.owned_grads = Some(OwnedGradients {
                            values: share,
                            present,
                        });
                    }
                }
                if plan.apply {
                    self.apply_pending(plan.clip)
                } else {
                    self.inner.pending = true;
                    Ok(())
                }
            }
        }
    }
}

impl Optimizer<TfBackend> for TfShardedOptimizer {
    /// Applies the gradients accumulated by micro-batches that did not apply
    /// (a collective: every rank calls it), then gathers the parameters.
    fn step(&mut self) -> Result<()> {
        if !self.inner.pending {
            return Ok(());
        }
        self.apply_pending(None)
    }

    fn zero_grad(&mut self) -> Result<()> {
        self.inner.local = None;
        self.owned_grads = None;
        self.inner.pending = false;
        Ok(())
    }

    fn kind(&self) -> Option<&'static str> {
        Optimizer::kind(&self.inner)
    }

    fn config(&self) -> Option<&OptimizerConfig> {
        Optimizer::config(&self.inner)
    }

    fn learning_rate(&self) -> f64 {
        self.inner.learning_rate()
    }

    fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        self.inner.set_learning_rate(lr)
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

    /// The whole state, on every rank: step counts (equal on every rank),
    /// group hyperparameters, and each rank's buffers in one broadcast from
    /// it (every rank knows their names and shapes). A collective.
    fn state_dict(&self) -> Result<StateDict> {
        let inner = &self.inner;
        let mut out = StateDict::new();
        for slot in &inner.slots {
            out.insert(
                optimizer_state_key(&slot.name, "step"),
                HostTensor::scalar(inner.step as i64),
            );
        }
        save_group_hypers(&inner.groups, &mut out);
        if inner.step == 0 {
            // No buffer exists yet, as in one process (PyTorch's lazy state).
            return Ok(out);
        }
        let buffers = inner.config.state_buffers();
        for root in 0..self.group.world_size() {
            let theirs: Vec<usize> = (0..inner.slots.len())
                .filter(|&i| self.owners[i] == root)
                .collect();
            let entries: Vec<(String, &[usize])> = theirs
                .iter()
                .flat_map(|&i| {
                    let slot = &inner.slots[i];
                    buffers.iter().map(move |b| {
                        (
                            optimizer_state_key(&slot.name, b.name),
                            slot.var.dims.as_slice(),
                        )
                    })
                })
                .collect();
            let total: usize = entries
                .iter()
                .map(|(_, d)| d.iter().product::<usize>())
                .sum();
            if total == 0 {
                continue;
            }
            let mut words = Vec::with_capacity(total);
            if root == self.group.rank() {
                let vars: Vec<Var> = theirs
                    .iter()
                    .flat_map(|&i| inner.slots[i].state.iter().map(|(_, v)| v.clone()))
                    .collect();
                for value in lock(&inner.graph)?.engine.read_vars(&vars)? {
                    words.extend_from_slice(value.to_dtype(DType::F32).as_slice::<f32>()?);
                }
                if words.len() != total {
                    return Err(Error::distributed(
                        "TfShardedOptimizer",
                        format!("read {} state elements of {total}", words.len()),
                    ));
                }
            } else {
                words.resize(total, 0.0);
            }
            self.group.broadcast_f32(&mut words, root)?;
            let mut at = 0;
            for (key, dims) in entries {
                let n: usize = dims.iter().product();
                out.insert(
                    key,
                    HostTensor::from_slice(&words[at..at + n], dims.to_vec())?,
                );
                at += n;
            }
        }
        Ok(out)
    }

    fn state_tensors(&self) -> Result<StateTensors<TfBackend>> {
        Ok(StateTensors::from(self.state_dict()?))
    }

    /// The state of the parameters this rank owns; rank 0 also holds the
    /// group hyperparameters, the same on every rank. Not a collective.
    fn shard_state_tensors(&self) -> Result<Option<ShardState<TfBackend>>> {
        let rank = self.group.rank();
        let mut own = self.inner.state_dict()?;
        if rank != 0 {
            let shared: Vec<String> = own
                .iter()
                .filter(|(k, _)| Self::param_of(k).is_none())
                .map(|(k, _)| k.clone())
                .collect();
            for key in shared {
                own.remove(&key);
            }
        }
        Ok(Some(ShardState {
            tensors: StateTensors::from(own),
            ..ShardState::default()
        }))
    }

    /// Checks the whole of `state` (a whole optimizer state, of any strategy
    /// or number of ranks) as one process's optimizer would, then keeps this
    /// rank's share: every rank accepts or refuses it alike.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let inner = &self.inner;
        let params: Vec<(&str, &[usize])> = inner
            .slots
            .iter()
            .map(|s| (s.name.as_str(), s.var.dims.as_slice()))
            .collect();
        let whole = read_optimizer_state(&inner.config, &params, state)?;
        let step = whole.first().map_or(0, |p| p.step);
        if let Some((name, other)) = params
            .iter()
            .zip(&whole)
            .find(|(_, p)| p.step != step)
            .map(|((n, _), p)| (n, p.step))
        {
            return Err(Error::unsupported(format!(
                "optimizer state with different step counts per parameter ({name} has \
                 {other}, others {step}) on TensorFlow"
            )));
        }
        drop(whole);
        let mut share = StateDict::new();
        for (key, value) in state.iter() {
            let other = Self::param_of(key).is_some_and(|p| {
                inner
                    .slots
                    .iter()
                    .enumerate()
                    .any(|(i, s)| s.name == p && !self.owns(i))
            });
            if !other {
                share.insert(key.clone(), value.clone());
            }
        }
        self.inner.load_state_dict(&share)?;
        // A rank that owns nothing reads no step count from its share.
        self.inner.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_keys_name_their_parameter() {
        assert_eq!(
            TfShardedOptimizer::param_of("state.0.weight.exp_avg"),
            Some("0.weight")
        );
        assert_eq!(TfShardedOptimizer::param_of("group.0.lr"), None);
    }
}
