//! A prepared model under the config's `[distributed]` strategy: alone in a
//! single process; on one rank of a job, joined to the ranks' process group
//! (after checking that they agree on what they run) and wrapped in DDP, ZeRO,
//! FSDP or post-local SGD.

use std::sync::Arc;

use anyhow::Result;
use kiln_c10d::ProcessGroup;
use kiln_core::backend::TrainBackend;
use kiln_core::distributed::Rendezvous;

use crate::config::{RunConfig, StrategyName};
use crate::engines::{StrategyChoice, StrategyEngine, WithTrainable};
use crate::output::outln;

/// Runs `then` on `model` under the config's strategy: the model itself in a
/// single process, or, as one rank of `rendezvous`'s job, inside DDP, ZeRO
/// or FSDP over the ranks' group, once every rank has shown that it runs
/// what the others do.
pub(crate) fn under_strategy<B, P, T>(
    config: &RunConfig,
    rendezvous: Option<&Rendezvous>,
    model: B::Model,
    then: T,
) -> Result<()>
where
    B: TrainBackend,
    P: StrategyEngine<B>,
    T: WithTrainable<B>,
{
    let Some(r) = rendezvous else {
        // One process: a strategy spreads a step over ranks, and there are none.
        if config.distributed.strategy != StrategyName::Ddp {
            log::warn!(
                "[distributed] strategy = \"{}\" applies to data-parallel runs (kiln launch, \
                 torchrun); this run is one process, so it trains unsharded",
                config.distributed.strategy.name()
            );
        }
        return then.run(model);
    };
    let primary = r.is_primary();
    let options = config.distributed.options(config.device);
    let group = Arc::new(ProcessGroup::join(r, &options)?);
    crate::ranks::check_ranks_agree(group.as_ref(), &then.what_ranks_share()?)?;
    if primary {
        outln!(
            "kiln: rank 0 of {} ({}, {} backend, {} strategy)",
            r.world_size,
            r.launcher,
            options.backend,
            config.distributed.strategy.name()
        );
    }
    let choice = match config.distributed.strategy {
        StrategyName::Ddp => StrategyChoice::DataParallel,
        StrategyName::Zero1 => StrategyChoice::Zero(kiln_c10d::ZeroStage::One),
        StrategyName::Zero2 => StrategyChoice::Zero(kiln_c10d::ZeroStage::Two),
        StrategyName::Fsdp => {
            let shard = &config.distributed.fsdp;
            if primary {
                outln!(
                    "kiln: fsdp units {:?} and the root; {}; {}",
                    shard.units,
                    if shard.reshard_after_forward {
                        "parameters freed after each unit's forward pass"
                    } else {
                        "parameters kept from each unit's forward to its backward pass"
                    },
                    if shard.prefetch {
                        "the next unit's gather prefetched"
                    } else {
                        "each unit gathered when it runs"
                    }
                );
            }
            StrategyChoice::FullShard(shard)
        }
        StrategyName::PostLocalSgd => {
            let local = &config.distributed.post_local_sgd;
            if primary {
                outln!(
                    "kiln: post-local SGD: gradients averaged for {} steps, then each rank \
                     steps alone and the parameters are averaged every {} steps",
                    local.warmup_steps,
                    local.period
                );
            }
            StrategyChoice::PostLocalSgd(local)
        }
    };
    P::run_under(model, &group, choice, &options, then)
}
