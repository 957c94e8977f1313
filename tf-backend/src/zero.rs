//! ZeRO stages 1 and 2 on TensorFlow: [`ZeroDataParallel`], a [`TfModel`]
//! trained data-parallel whose optimizer ([`TfShardedOptimizer`]) keeps only
//! this rank's share of the optimizer state (ZeRO-1) and of the reduced
//! gradients (ZeRO-2), over the same process group as
//! [`data_parallel`](crate::data_parallel).
//!
//! Full sharding (FSDP) is not offered on TensorFlow: a Kiln TensorFlow model's
//! variables live whole in its graph, which each session run reads in place,
//! so a rank cannot hold a part of a parameter without rebuilding its graph
//! around gathers.

use std::sync::Arc;

use kiln_core::{
    backend::{Mode, StepLoss, StepPlan, Trainable},
    distributed::{Collectives, DistributedOptions},
    loss::Loss,
    module::Module,
    optim::{OptimizerConfig, ParamGroup},
    precision::FloatPrecision,
    state_dict::StateDict,
    state_tensors::StateTensors,
    strategy::{StepHooks, ZeroStage},
    HostTensor, Result,
};

use crate::backend::TfBackend;
use crate::convert::TfTensor;
use crate::distributed::GradientAllReduce;
use crate::model::TfModel;
use crate::optim::TfShardedOptimizer;

/// A [`TfModel`] trained under a ZeRO stage: every rank holds the whole model
/// and trains it on its share of each batch, as under
/// [`data_parallel`](crate::data_parallel) (rank 0's variables when built,
/// rank 0's buffers before each forward pass), but its optimizer keeps only
/// this rank's share of the state, and under ZeRO-2 only this rank's share of
/// the reduced gradients outlives a micro-batch. Losses and weights equal one
/// process's on the global batch.
///
/// Build it with [`zero_data_parallel`].
pub struct ZeroDataParallel {
    model: TfModel,
    sync: GradientAllReduce,
    group: Arc<dyn Collectives>,
    stage: ZeroStage,
}

/// `model` trained under ZeRO `stage` over `group`: every rank checks that it
/// has rank 0's variables and takes them now (as
/// [`data_parallel`](crate::data_parallel) does). Call it on every rank,
/// before building the optimizer, which is then this rank's share
/// ([`TfShardedOptimizer`]).
///
/// ```no_run
/// use std::sync::Arc;
/// use kiln_core::backend::{TrainBackend, Trainable};
/// use kiln_core::distributed::{Collectives, DistributedOptions};
/// use kiln_core::model::{Layer, LinearConfig};
/// use kiln_core::optim::{AdamConfig, OptimizerConfig};
/// use kiln_core::strategy::ZeroStage;
/// use kiln_core::Device;
/// use kiln_tf::TfBackend;
///
/// /// ZeRO-2 over `group` (kiln-c10d's Gloo group, joined by every rank).
/// fn sharded(group: Arc<dyn Collectives>) -> kiln_core::Result<()> {
///     let model = TfBackend::build_model(&Layer::Linear(LinearConfig::new(8, 2)), Device::Cpu)?;
///     let options = DistributedOptions::default();
///     let model = kiln_tf::zero_data_parallel(model, group, ZeroStage::Two, &options)?;
///     let _optimizer =
///         model.build_optimizer(&OptimizerConfig::Adam(AdamConfig::new(1e-3)), &[])?;
///     Ok(())
/// }
/// ```
pub fn zero_data_parallel(
    model: TfModel,
    group: Arc<dyn Collectives>,
    stage: ZeroStage,
    options: &DistributedOptions,
) -> Result<ZeroDataParallel> {
    let sync = GradientAllReduce::new(&model, Arc::clone(&group), options)?;
    Ok(ZeroDataParallel {
        model,
        sync,
        group,
        stage,
    })
}

impl std::fmt::Debug for ZeroDataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroDataParallel")
            .field("stage", &self.stage)
            .field("rank", &self.group.rank())
            .field("world_size", &self.group.world_size())
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

impl ZeroDataParallel {
    /// The wrapped model.
    pub fn module(&self) -> &TfModel {
        &self.model
    }

    /// The stage it trains under.
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// The model, unwrapped.
    pub fn into_inner(self) -> TfModel {
        self.model
    }
}

impl Module<TfBackend> for ZeroDataParallel {
    fn forward(&self, input: &TfTensor) -> Result<TfTensor> {
        self.model.forward(input)
    }
    fn forward_many(&self, inputs: &[TfTensor]) -> Result<Vec<TfTensor>> {
        self.model.forward_many(inputs)
    }
    fn mode(&self) -> Mode {
        Module::<TfBackend>::mode(&self.model)
    }
    fn set_mode(&mut self, mode: Mode) {
        Module::<TfBackend>::set_mode(&mut self.model, mode);
    }
    fn named_parameters(&self) -> Result<Vec<(String, TfTensor)>> {
        self.model.named_parameters()
    }
    fn named_buffers(&self) -> Result<Vec<(String, TfTensor)>> {
        self.model.named_buffers()
    }
    fn running_stats(&self) -> Result<Vec<kiln_core::module::RunningStats>> {
        self.model.running_stats()
    }
    fn graph_def(&self) -> Result<Option<Vec<u8>>> {
        self.model.graph_def()
    }
    fn state_dict(&self) -> Result<StateDict> {
        Module::<TfBackend>::state_dict(&self.model)
    }
    fn state_tensors(&self) -> Result<StateTensors<TfBackend>> {
        Module::<TfBackend>::state_tensors(&self.model)
    }
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        Module::<TfBackend>::load_state_dict(&mut self.model, state)
    }
    fn num_parameters(&self) -> Result<usize> {
        Module::<TfBackend>::num_parameters(&self.model)
    }
}

impl Trainable<TfBackend> for ZeroDataParallel {
    type Optim = TfShardedOptimizer;

    /// This rank's share of the optimizer (state for the parameters it owns),
    /// groups resolved over every parameter.
    fn build_optimizer(
        &self,
        config: &OptimizerConfig,
        groups: &[ParamGroup],
    ) -> Result<TfShardedOptimizer> {
        TfShardedOptimizer::new(
            config,
            &self.model,
            groups,
            Arc::clone(&self.group),
            self.stage,
        )
    }

    fn num_trainable_parameters(&self) -> Result<usize> {
        self.model.num_trainable_parameters()
    }

    fn frozen_parameters(&self) -> Result<Vec<String>> {
        self.model.frozen_parameters()
    }

    fn precision(&self) -> FloatPrecision {
        self.model.precision()
    }

    fn kind(&self) -> String {
        format!("{} ({})", self.stage.name(), self.model.kind())
    }

    /// Two session runs (the gradients, then this rank's update) and the
    /// strategy's collectives; see [`TfShardedOptimizer`].
    fn train_step(
        &mut self,
        optimizer: &mut TfShardedOptimizer,
        inputs: &TfTensor,
        targets: &TfTensor,
        plan: &StepPlan<'_>,
    ) -> Result<f64> {
        optimizer.train_step(&self.model, &mut self.sync, inputs, targets, plan)
    }

    fn train_step_deferred(
        &mut self,
        optimizer: &mut TfShardedOptimizer,
        inputs: &TfTensor,
        targets: &TfTensor,
        plan: &StepPlan<'_>,
    ) -> Result<StepLoss<TfTensor>> {
        self.train_step(optimizer, inputs, targets, plan)
            .map(StepLoss::Host)
    }

    fn eval_step(
        &self,
        loss: &Loss,
        inputs: &TfTensor,
        targets: &TfTensor,
    ) -> Result<(f64, HostTensor)> {
        self.model.eval_step(loss, inputs, targets)
    }

    fn predict_step(&self, inputs: &TfTensor) -> Result<HostTensor> {
        self.model.predict_step(inputs)
    }

    fn sync_buffers(&mut self) -> Result<()> {
        self.sync.sync_buffers()
    }

    fn collectives(&self) -> Option<Arc<dyn Collectives>> {
        Some(Arc::clone(&self.group))
    }
}
