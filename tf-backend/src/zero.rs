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
    backend::{StepLoss, StepPlan, Trainable, UpdatePlan},
    distributed::{Collectives, DistributedOptions},
    objective::{Objective, ObjectiveBatch, ObjectiveStep},
    optim::{OptimizerConfig, ParamGroup},
    strategy::{DataParallel, StepHooks, Strategy, ZeroStage},
    Result,
};

use crate::backend::TfBackend;
use crate::convert::TfTensor;
use crate::distributed::GradientAllReduce;
use crate::model::TfModel;
use crate::optim::{hooked_step, TfOptimizer, TfShardedOptimizer};

/// ZeRO stage 1 or 2 on TensorFlow, as a [`Strategy`]: every rank holds the
/// whole model and trains it on its share of each batch, as under
/// [`data_parallel`](crate::data_parallel) (rank 0's variables when built,
/// rank 0's buffers before each forward pass), but its optimizer
/// ([`TfShardedOptimizer`]) keeps only this rank's share of the state, and
/// under ZeRO-2 only this rank's share of the reduced gradients outlives a
/// micro-batch. Losses and weights equal one process's on the global batch.
///
/// Build the wrapped model with [`zero_data_parallel`].
pub struct ZeroRedundancy {
    sync: GradientAllReduce,
    group: Arc<dyn Collectives>,
    stage: ZeroStage,
}

/// A [`TfModel`] trained under a ZeRO stage.
pub type ZeroDataParallel = DataParallel<TfModel, ZeroRedundancy>;

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
    DataParallel::new(model, ZeroRedundancy { sync, group, stage })
}

impl std::fmt::Debug for ZeroRedundancy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroRedundancy")
            .field("stage", &self.stage)
            .field("rank", &self.group.rank())
            .field("world_size", &self.group.world_size())
            .finish_non_exhaustive()
    }
}

impl ZeroRedundancy {
    /// The stage it trains under.
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }
}

impl Strategy<TfBackend, TfModel> for ZeroRedundancy {
    type Optim = TfShardedOptimizer;

    fn name(&self) -> &str {
        self.stage.name()
    }

    /// This rank's share of the optimizer (state for the parameters it owns),
    /// groups resolved over every parameter.
    fn build_optimizer(
        &self,
        model: &TfModel,
        config: &OptimizerConfig,
        groups: &[ParamGroup],
    ) -> Result<TfShardedOptimizer> {
        TfShardedOptimizer::new(config, model, groups, Arc::clone(&self.group), self.stage)
    }

    /// What its own step uses: this rank's optimizer and the data-parallel
    /// hooks (the sharded update is the [`TfShardedOptimizer`]'s).
    fn step_parts<'a>(
        &'a mut self,
        optimizer: &'a mut TfShardedOptimizer,
    ) -> (&'a mut TfOptimizer, &'a mut dyn StepHooks<TfBackend>) {
        (optimizer.shard_mut(), &mut self.sync)
    }

    /// Two session runs (the gradients, then this rank's update) and the
    /// strategy's collectives; see [`TfShardedOptimizer`]. The loss is read
    /// back: the collectives need it.
    fn train_step(
        &mut self,
        model: &mut TfModel,
        optimizer: &mut TfShardedOptimizer,
        inputs: &TfTensor,
        targets: &TfTensor,
        plan: &StepPlan<'_>,
        _deferred: bool,
    ) -> Result<StepLoss<TfTensor>> {
        hooked_step(optimizer, model, &mut self.sync, inputs, targets, plan)
            .map(|(loss, _)| StepLoss::Host(loss))
    }

    /// A supervised loss, as the step computes; any other objective is refused.
    fn train_objective_step(
        &mut self,
        model: &mut TfModel,
        optimizer: &mut TfShardedOptimizer,
        objective: &dyn Objective<TfBackend>,
        batch: &ObjectiveBatch<'_, TfTensor>,
        plan: &UpdatePlan<'_>,
        _deferred: bool,
    ) -> Result<ObjectiveStep<TfTensor>> {
        let kind = format!("{} ({})", self.stage.name(), model.kind());
        crate::train::with_metrics(objective, &kind, plan, |plan| {
            hooked_step(
                optimizer,
                model,
                &mut self.sync,
                batch.inputs,
                batch.targets,
                plan,
            )
        })
    }

    fn runs_any_objective(&self, _model: &TfModel) -> bool {
        false
    }

    fn sync_buffers(&mut self) -> Result<()> {
        StepHooks::sync_buffers(&mut self.sync)
    }

    fn collectives(&self) -> Option<Arc<dyn Collectives>> {
        Some(Arc::clone(&self.group))
    }
}
