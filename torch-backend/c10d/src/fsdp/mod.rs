//! Fully sharded data parallelism (PyTorch's FSDP, `fully_shard`) on c10d:
//! between steps each rank holds only its shard of every parameter, of its
//! gradient and of its optimizer state. Each unit (a layer the user names,
//! and the root for the rest) gathers its whole parameters for its forward
//! pass and frees them after it, gathers them again for its backward pass,
//! and reduce-scatters their gradients into the shards. A model larger than
//! one device trains when one unit's whole parameters fit beside the shards.

use std::sync::Arc;

use kiln_core::backend::Trainable;
use kiln_core::distributed::{Collectives, DistributedOptions};
use kiln_core::module::Module;
use kiln_core::optim::{OptimizerConfig, ParamGroup};
use kiln_core::precision::FloatPrecision;
use kiln_core::state_dict::StateDict;
use kiln_core::state_tensors::{ShardState, StateTensor, StateTensors};
use kiln_core::strategy::{DataParallel, StepHooks, Strategy};
use kiln_core::{DType, Error, Result};
use kiln_torch::sharded_unit::UnitCollectives;
use kiln_torch::{kind_from_dtype, TorchBackend, TorchModel, TorchOptimizer};
use tch::{Kind, Tensor};

mod optimizer;
mod prefetch;
mod shards;

pub use optimizer::FsdpOptimizer;
pub use prefetch::PrefetchStats;
use prefetch::{GatherSchedule, Pass};
use shards::{ParamShard, UnitShards};

use crate::ddp::{
    broadcast_buffers, check_device_suits_group, norm_over_shards, start_mean,
    take_rank_zeros_model, PendingMean,
};
use crate::ProcessGroup;

/// How [`fully_shard`] cuts a model into units. With the `serde` feature it
/// reads as a config section, every key optional (the defaults below).
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default, deny_unknown_fields))]
pub struct FullShardOptions {
    /// Globs over layer paths (as `activation_checkpointing`'s): each
    /// matching layer is a unit; the root unit holds every other parameter.
    /// Empty: the whole model is one unit (no memory saved while it runs).
    pub units: Vec<String>,
    /// Free a unit's whole parameters after its forward pass and gather them
    /// again for its backward pass (`fully_shard`'s default, and ZeRO-3), or
    /// keep them until then (ZeRO-2's memory, one gather fewer per unit).
    pub reshard_after_forward: bool,
    /// The dtype the units gather their parameters in and compute with
    /// (FSDP's `MixedPrecisionPolicy(param_dtype=...)`): `bf16` halves the
    /// all-gathers, while the shards and the optimizer stay in float32. It
    /// needs a `bf16-mixed` model (autocast casts each op's inputs). `None`:
    /// the parameters' own.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub param_dtype: Option<DType>,
    /// The dtype gradients are reduce-scattered in (`reduce_dtype`); `None`:
    /// the parameters' own (float32 keeps the average exact to float32).
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub reduce_dtype: Option<DType>,
    /// Start the next unit's all-gather when a unit's gather returns, so that
    /// it runs while the unit computes (FSDP2's forward and backward
    /// prefetch; the order is the previous pass's). It holds two units'
    /// whole parameters at a time instead of one.
    pub prefetch: bool,
}

impl Default for FullShardOptions {
    fn default() -> Self {
        FullShardOptions {
            units: Vec::new(),
            reshard_after_forward: true,
            param_dtype: None,
            reduce_dtype: None,
            prefetch: true,
        }
    }
}

impl FullShardOptions {
    /// The gather and reduction dtypes as torch kinds; a dtype that is not
    /// floating-point, or `param_dtype` without autocast, is an error.
    fn kinds(&self, precision: FloatPrecision) -> Result<(Option<Kind>, Option<Kind>)> {
        let kind = |key: &str, dtype: Option<DType>| -> Result<Option<Kind>> {
            match dtype {
                None => Ok(None),
                Some(d) if d.is_float() => Ok(Some(kind_from_dtype(d)?)),
                Some(d) => Err(Error::invalid_argument(
                    key,
                    format!(
                        "must be a floating-point dtype (bf16, f16, f32), got {}",
                        d.name()
                    ),
                )),
            }
        };
        let param = kind("param_dtype", self.param_dtype)?;
        if let (Some(d), Some(_)) = (self.param_dtype, param) {
            if d != DType::F32 && precision.autocast_dtype().is_none() {
                return Err(Error::invalid_argument(
                    "param_dtype",
                    format!(
                        "gathering in {} needs a mixed-precision model (bf16-mixed: autocast \
                         casts each op's inputs), and it computes in {precision}",
                        d.name()
                    ),
                ));
            }
        }
        Ok((param, kind("reduce_dtype", self.reduce_dtype)?))
    }
}

/// Full sharding (FSDP) as a [`Strategy`] over a [`TorchModel`]: between
/// steps each rank holds its shard of every parameter, gradient and optimizer
/// state; each unit gathers its whole parameters while it runs and
/// reduce-scatters their gradients into the shards. Losses and weights equal
/// one process's on the global batch.
///
/// Every forward pass is a collective, in training and in evaluation
/// ([`Trainable::shards_parameters`]), and so are
/// [`state_dict`](Module::state_dict) and
/// [`state_tensors`](Module::state_tensors), which gather the whole
/// parameters: every rank calls them at the same point. A checkpoint holds the
/// whole model and optimizer state, as one process's, and so resumes on any
/// number of ranks under any strategy.
///
/// Build the wrapped model with [`fully_shard`].
#[derive(Debug)]
pub struct FullShard {
    params: Vec<Arc<ParamShard>>,
    units: Vec<String>,
    hooks: FsdpHooks,
}

/// A [`TorchModel`] trained fully sharded over a process group.
pub type FullyShardedDataParallel = DataParallel<TorchModel, FullShard>;

impl FullShard {
    /// How often the units' gathers were prefetched and used, or dropped.
    pub fn prefetch_stats(&self) -> PrefetchStats {
        self.hooks.schedule.stats()
    }
}

/// Full sharding's part of each training step besides the units' own
/// collectives: buffers from rank 0, the loss averaged, the gradient norm
/// taken over every rank's shards.
struct FsdpHooks {
    group: Arc<ProcessGroup>,
    buffers: Vec<Tensor>,
    broadcast_buffers: bool,
    pending_loss: Option<PendingMean>,
    /// The units' gathers and the one prefetched.
    schedule: Arc<GatherSchedule>,
}

impl std::fmt::Debug for FsdpHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpHooks")
            .field("rank", &self.group.rank())
            .field("broadcast_buffers", &self.broadcast_buffers)
            .finish_non_exhaustive()
    }
}

/// `model` trained fully sharded over `group`: rank 0's parameters and
/// buffers are every rank's first, then each parameter is cut into this
/// rank's shard of its rows, and the units of `shard` gather and reduce them.
/// Call it on every rank, after setting precision, freezing, adding adapters
/// and activation checkpointing, before building the optimizer.
///
/// A unit pattern that matches no layer, tied weights in two units, a unit
/// of parameters of two dtypes and a torchscript layer are errors before
/// anything changes.
///
/// ```no_run
/// use kiln_c10d::{fully_shard, FullShardOptions, ProcessGroup};
/// use kiln_core::distributed::{DistributedOptions, Rendezvous};
/// use kiln_core::{backend::Trainable, model::{Layer, LinearConfig}, optim::{AdamConfig, OptimizerConfig}, Device};
/// use std::sync::Arc;
///
/// let rendezvous = Rendezvous::from_env()?.expect("started by a launcher");
/// let options = DistributedOptions::default();
/// let group = Arc::new(ProcessGroup::join(&rendezvous, &options)?);
/// let spec = Layer::sequential([LinearConfig::new(4, 8).into(), LinearConfig::new(8, 2).into()]);
/// let model = kiln_torch::TorchModel::new(&spec, Device::Cpu)?;
/// // Each linear layer is a unit; the root unit is empty here.
/// let shard = FullShardOptions { units: vec!["*".into()], ..FullShardOptions::default() };
/// let model = fully_shard(model, group, &shard, &options)?;
/// let optimizer = model.build_optimizer(&OptimizerConfig::Adam(AdamConfig::new(1e-3)), &[])?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn fully_shard(
    mut model: TorchModel,
    group: Arc<ProcessGroup>,
    shard: &FullShardOptions,
    options: &DistributedOptions,
) -> Result<FullyShardedDataParallel> {
    let patterns: Vec<&str> = shard.units.iter().map(String::as_str).collect();
    // Every check that can fail alike on every rank comes before a collective.
    let kinds = shard.kinds(model.precision())?;
    let plan = model.plan_shard_units(&patterns)?;
    let params = model.named_parameters()?;
    let buffers = model.named_buffers()?;
    check_device_suits_group(&group, &params)?;
    let world = group.world_size();
    let layout: Vec<Arc<ParamShard>> = params
        .iter()
        .map(|(name, t)| Arc::new(ParamShard::plan(name, t, world)))
        .collect();
    let units = plan
        .iter()
        .enumerate()
        .map(|(index, unit)| {
            let members = unit
                .names
                .iter()
                .map(|n| {
                    layout
                        .iter()
                        .find(|p| &p.name == n)
                        .map(Arc::clone)
                        .ok_or_else(|| {
                            Error::invalid_argument("units", format!("no parameter `{n}`"))
                        })
                })
                .collect::<Result<Vec<_>>>()?;
            let path = if unit.path.is_empty() {
                "the root"
            } else {
                &unit.path
            };
            UnitShards::new(Arc::clone(&group), index, path, members, kinds).map(Arc::new)
        })
        .collect::<Result<Vec<_>>>()?;
    take_rank_zeros_model(&group, "FSDP", &params, &buffers)?;
    // This rank's shards, cut from rank 0's whole parameters.
    let cut: Vec<Tensor> = layout
        .iter()
        .map(|p| p.cut(&p.param, group.rank()))
        .collect::<Result<_>>()?;
    let collectives: Vec<Arc<dyn UnitCollectives>> = units
        .iter()
        .map(|u| Arc::clone(u) as Arc<dyn UnitCollectives>)
        .collect();
    let schedule = GatherSchedule::new(units, shard.prefetch);
    model.shard_units(&plan, collectives, shard.reshard_after_forward)?;
    for (p, shard) in layout.iter().zip(&cut) {
        // The model's own tensor now holds the shard: the whole is freed.
        let mut param = p.param.shallow_clone();
        tch::no_grad(|| param.set_data(shard));
    }
    let held: i64 = layout.iter().map(|p| p.shard_numel()).sum();
    let whole: i64 = layout.iter().map(|p| p.rows * p.row_numel).sum();
    log::info!(
        "FSDP: rank {} of {world} holds {held} of {whole} parameter elements, in {} units ({})",
        group.rank(),
        plan.len(),
        plan.iter()
            .map(|u| if u.path.is_empty() { "root" } else { &u.path })
            .collect::<Vec<_>>()
            .join(", ")
    );
    let strategy = FullShard {
        params: layout,
        units: plan.into_iter().map(|u| u.path).collect(),
        hooks: FsdpHooks {
            group,
            buffers: buffers.iter().map(|(_, t)| t.shallow_clone()).collect(),
            broadcast_buffers: options.broadcast_buffers,
            pending_loss: None,
            schedule,
        },
    };
    DataParallel::new(model, strategy)
}

impl FullShard {
    /// The units' layer paths, in the order they were planned (`""`: the root).
    pub fn units(&self) -> &[String] {
        &self.units
    }

    /// Parameter elements this rank holds (its shards, padding included).
    pub fn shard_elements(&self) -> i64 {
        self.params.iter().map(|p| p.shard_numel()).sum()
    }

    /// The whole parameters, gathered from every rank's shards (a collective).
    fn gather_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.params
            .iter()
            .map(|p| Ok((p.name.clone(), p.gather_whole(&self.hooks.group, &p.param)?)))
            .collect()
    }
}

impl StepHooks<TorchBackend> for FsdpHooks {
    fn name(&self) -> &str {
        "FSDP"
    }

    fn agrees_on_loss(&self) -> bool {
        true
    }

    fn before_forward(&mut self, _sync: bool) -> Result<()> {
        self.pending_loss = None;
        self.schedule.begin(Pass::Train)?;
        if self.broadcast_buffers {
            broadcast_buffers(&self.group, &self.buffers)?;
        }
        Ok(())
    }

    fn before_backward(&mut self, local_loss: f64, _scaled: &Tensor, _sync: bool) -> Result<()> {
        self.pending_loss = Some(start_mean(&self.group, local_loss)?);
        Ok(())
    }

    fn agreed_loss(&mut self, local_loss: f64) -> Result<f64> {
        match self.pending_loss.take() {
            Some(pending) => pending.value(),
            None => start_mean(&self.group, local_loss)?.value(),
        }
    }

    /// The `norm_type`-norm of the ranks' shard norms (the largest for the
    /// infinity norm): padding rows have zero gradients.
    fn global_grad_norm(&mut self, local: f64, norm_type: f64) -> Result<f64> {
        norm_over_shards(&self.group, local, norm_type)
    }

    /// The shards changed: a gather started before the step is dropped.
    fn after_update(&mut self) -> Result<()> {
        self.schedule.cancel()
    }

    fn sync_buffers(&mut self) -> Result<()> {
        broadcast_buffers(&self.group, &self.buffers)
    }

    fn collectives(&self) -> Option<Arc<dyn Collectives>> {
        Some(Arc::clone(&self.group) as Arc<dyn Collectives>)
    }
}

impl Strategy<TorchBackend, TorchModel> for FullShard {
    type Optim = FsdpOptimizer;

    fn name(&self) -> &str {
        "FSDP"
    }

    /// An optimizer over this rank's shards, groups resolved by the whole
    /// model's names. `16-mixed` loss scaling is refused: each rank would
    /// decide to skip a step from its own shards' gradients.
    fn build_optimizer(
        &self,
        model: &TorchModel,
        config: &OptimizerConfig,
        groups: &[ParamGroup],
    ) -> Result<FsdpOptimizer> {
        if model.precision().scales_loss() {
            return Err(Error::unsupported(format!(
                "FSDP with {} (its loss scaling skips steps by each rank's own gradients); \
                 use bf16-mixed",
                model.precision()
            )));
        }
        let inner = model.build_optimizer(config, groups)?;
        Ok(FsdpOptimizer::new(
            inner,
            Arc::clone(&self.hooks.group),
            &self.params,
            Arc::clone(&self.hooks.schedule),
        ))
    }

    fn step_parts<'a>(
        &'a mut self,
        optimizer: &'a mut FsdpOptimizer,
    ) -> (&'a mut TorchOptimizer, &'a mut dyn StepHooks<TorchBackend>) {
        (&mut optimizer.inner, &mut self.hooks)
    }

    /// Every forward pass is a collective: the units gather their parameters.
    fn before_inference(&self) -> Result<()> {
        self.hooks.schedule.begin(Pass::Eval)
    }

    fn sync_buffers(&mut self) -> Result<()> {
        StepHooks::sync_buffers(&mut self.hooks)
    }

    fn collectives(&self) -> Option<Arc<dyn Collectives>> {
        StepHooks::collectives(&self.hooks)
    }

    /// The whole model: a collective.
    fn state_dict(&self, model: &TorchModel) -> Result<StateDict> {
        self.state_tensors(model)?.to_state_dict()
    }

    /// The whole parameters, gathered (a collective), and the buffers.
    fn state_tensors(&self, model: &TorchModel) -> Result<StateTensors<TorchBackend>> {
        let mut out = StateTensors::<TorchBackend>::from(StateDict::new());
        for (name, t) in self.gather_parameters()? {
            out.insert(name, StateTensor::Backend(t))?;
        }
        for (name, t) in model.named_buffers()? {
            out.insert(name, StateTensor::Backend(t))?;
        }
        Ok(out)
    }

    /// A whole model's state (of any strategy or number of ranks): this
    /// rank's rows of each parameter are kept. Not a collective; nothing
    /// changes on error.
    fn load_state_dict(&mut self, model: &mut TorchModel, state: &StateDict) -> Result<()> {
        self.hooks.schedule.cancel()?;
        let rank = self.hooks.group.rank();
        let mut share = StateDict::new();
        for (key, value) in state.iter() {
            let value = match self.params.iter().find(|p| &p.name == key) {
                Some(p) => p.cut_host(key, value, rank)?,
                None => value.clone(),
            };
            share.insert(key.clone(), value);
        }
        model.load_state_dict(&share)
    }

    /// The whole model's parameter elements.
    fn num_parameters(&self, _model: &TorchModel) -> Result<usize> {
        Ok(self
            .params
            .iter()
            .map(|p| (p.rows * p.row_numel) as usize)
            .sum())
    }

    /// The whole model's trainable elements.
    fn num_trainable_parameters(&self, _model: &TorchModel) -> Result<usize> {
        Ok(self
            .params
            .iter()
            .filter(|p| p.trained)
            .map(|p| (p.rows * p.row_numel) as usize)
            .sum())
    }

    /// The whole model's names of the parameters that do not train.
    fn frozen_parameters(&self, _model: &TorchModel) -> Result<Vec<String>> {
        Ok(self
            .params
            .iter()
            .filter(|p| !p.trained)
            .map(|p| p.name.clone())
            .collect())
    }

    fn shards_parameters(&self) -> bool {
        true
    }

    /// This rank's rows of each parameter (its padding left out); rank 0
    /// also holds the buffers, which are the same on every rank. Not a
    /// collective.
    fn shard_state_tensors(&self, model: &TorchModel) -> Result<Option<ShardState<TorchBackend>>> {
        let rank = self.hooks.group.rank();
        let mut part = ShardState::default();
        for p in &self.params {
            if let Some((rows, slice)) = p.local_rows(&p.param.detach(), rank)? {
                part.tensors
                    .insert(p.name.clone(), StateTensor::Backend(rows))?;
                if let Some(slice) = slice {
                    part.rows.insert(p.name.clone(), slice);
                }
            }
        }
        if rank == 0 {
            for (name, t) in model.named_buffers()? {
                part.tensors.insert(name, StateTensor::Backend(t))?;
            }
        }
        Ok(Some(part))
    }
}
