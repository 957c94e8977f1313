//! `[distributed]`: data-parallel training, when a launcher started the run.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use kiln_c10d::{FullShardOptions, PostLocalSgdOptions};
use kiln_core::device::Device;
use kiln_core::distributed::{CommBackend, DistributedOptions};
use kiln_core::error::{Error, Result};

/// Data-parallel training (`[distributed]`): used when the run is started by a
/// launcher (`kiln launch`, `torchrun`, `srun`), ignored otherwise.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DistributedConfig {
    /// `"gloo"` (CPU), `"nccl"` (CUDA) or `"auto"` (by the device).
    #[serde(default)]
    pub backend: CommBackendName,
    /// Seconds the rendezvous and any collective wait for the other ranks.
    #[serde(default = "thirty_minutes")]
    pub timeout: f64,
    /// What each rank holds: `"ddp"` (everything), `"zero1"` (its share of
    /// the optimizer state), `"zero2"` (and of the reduced gradients) or
    /// `"fsdp"` (and of the parameters); or `"post_local_sgd"` (everything,
    /// synchronised by averaging the parameters periodically after a DDP
    /// warm-up).
    #[serde(default)]
    pub strategy: StrategyName,
    /// `[distributed.fsdp]`: how `strategy = "fsdp"` cuts the model into units.
    #[serde(default, skip_serializing_if = "is_default_fsdp")]
    pub fsdp: FullShardOptions,
    /// `[distributed.post_local_sgd]`: the warm-up and averaging period of
    /// `strategy = "post_local_sgd"`.
    #[serde(default, skip_serializing_if = "is_default_post_local_sgd")]
    pub post_local_sgd: PostLocalSgdOptions,
    /// How checkpoints are written: `"sharded"` (each rank its part, and an
    /// index; the default of the sharded strategies) or `"full"` (rank 0
    /// gathers and writes one file; DDP's only way).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointLayout>,
}

/// The `[distributed] checkpoint` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointLayout {
    /// Each rank writes its part of the state; rank 0 writes the index last.
    Sharded,
    /// Rank 0 gathers the whole state and writes one file.
    Full,
}

/// Whether `[distributed.fsdp]` is left as it is by default (and so is
/// written back out of the resolved config).
fn is_default_fsdp(fsdp: &FullShardOptions) -> bool {
    *fsdp == FullShardOptions::default()
}

/// Whether `[distributed.post_local_sgd]` is left as it is by default.
fn is_default_post_local_sgd(options: &PostLocalSgdOptions) -> bool {
    *options == PostLocalSgdOptions::default()
}

/// The `[distributed] strategy` names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StrategyName {
    /// `DistributedDataParallel`: every rank holds the whole model, its
    /// gradients and optimizer state.
    #[default]
    Ddp,
    /// ZeRO-1: the optimizer state sharded across the ranks.
    Zero1,
    /// ZeRO-2: the optimizer state and the reduced gradients sharded.
    Zero2,
    /// Full sharding (FSDP): parameters, gradients and optimizer state
    /// sharded, each unit's parameters gathered while it runs.
    Fsdp,
    /// Post-local SGD: DDP for a warm-up, then each rank's own steps with
    /// the parameters averaged over the ranks every `period` steps.
    #[serde(rename = "post_local_sgd")]
    PostLocalSgd,
}

impl StrategyName {
    /// The name as the config writes it.
    pub fn name(self) -> &'static str {
        match self {
            StrategyName::Ddp => "ddp",
            StrategyName::Zero1 => "zero1",
            StrategyName::Zero2 => "zero2",
            StrategyName::Fsdp => "fsdp",
            StrategyName::PostLocalSgd => "post_local_sgd",
        }
    }

    /// Whether every rank holds the whole state (DDP, post-local SGD): a
    /// checkpoint is then rank 0's, whole.
    pub fn replicates(self) -> bool {
        matches!(self, StrategyName::Ddp | StrategyName::PostLocalSgd)
    }
}

/// The `[distributed] backend` names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CommBackendName {
    /// Gloo on CPU, NCCL on CUDA.
    #[default]
    Auto,
    /// Gloo.
    Gloo,
    /// NCCL.
    Nccl,
}

fn thirty_minutes() -> f64 {
    1800.0
}

impl Default for DistributedConfig {
    fn default() -> Self {
        Self {
            backend: CommBackendName::Auto,
            timeout: thirty_minutes(),
            strategy: StrategyName::Ddp,
            fsdp: FullShardOptions::default(),
            post_local_sgd: PostLocalSgdOptions::default(),
            checkpoint: None,
        }
    }
}

impl DistributedConfig {
    /// The options of the process group and of DDP on `device` (DDP's
    /// defaults for the rest: buffers broadcast, 25 MiB buckets, no
    /// unused-parameter search).
    pub fn options(&self, device: Device) -> DistributedOptions {
        let backend = match (self.backend, device.is_cuda()) {
            (CommBackendName::Gloo, _) | (CommBackendName::Auto, false) => CommBackend::Gloo,
            (CommBackendName::Nccl, _) | (CommBackendName::Auto, true) => CommBackend::Nccl,
        };
        DistributedOptions {
            backend,
            timeout: Duration::from_secs_f64(self.timeout),
            ..DistributedOptions::default()
        }
    }

    /// Whether checkpoints are sharded: as the config says, else for every
    /// strategy that shards the state.
    pub fn sharded_checkpoints(&self) -> bool {
        match self.checkpoint {
            Some(layout) => layout == CheckpointLayout::Sharded,
            None => !self.strategy.replicates(),
        }
    }

    pub(super) fn validate(&self, device: Device) -> Result<()> {
        if !(self.timeout.is_finite() && self.timeout > 0.0 && self.timeout < 1e9) {
            return Err(Error::invalid_argument(
                "distributed.timeout",
                format!("must be a positive number of seconds, got {}", self.timeout),
            ));
        }
        if self.strategy != StrategyName::Fsdp && !is_default_fsdp(&self.fsdp) {
            return Err(Error::invalid_argument(
                "distributed.fsdp",
                format!(
                    "is read by strategy = \"fsdp\" only, and the strategy is \"{}\"",
                    self.strategy.name()
                ),
            ));
        }
        if self.strategy != StrategyName::PostLocalSgd
            && !is_default_post_local_sgd(&self.post_local_sgd)
        {
            return Err(Error::invalid_argument(
                "distributed.post_local_sgd",
                format!(
                    "is read by strategy = \"post_local_sgd\" only, and the strategy is \"{}\"",
                    self.strategy.name()
                ),
            ));
        }
        self.post_local_sgd.validate().map_err(|_| {
            Error::invalid_argument(
                "distributed.post_local_sgd.period",
                "must be at least 1 (the parameters are averaged every `period` steps)",
            )
        })?;
        if self.strategy.replicates() && self.checkpoint == Some(CheckpointLayout::Sharded) {
            return Err(Error::invalid_argument(
                "distributed.checkpoint",
                format!(
                    "\"sharded\" writes each rank's part of a sharded state, but strategy = \
                     \"{}\" holds the whole state on every rank: use a sharded strategy \
                     (zero1, zero2, fsdp) or leave it out",
                    self.strategy.name()
                ),
            ));
        }
        match (self.backend, device.is_cuda()) {
            (CommBackendName::Nccl, false) => Err(Error::invalid_argument(
                "distributed.backend",
                format!("\"nccl\" reduces CUDA tensors, but the device is {device}; use \"gloo\""),
            )),
            (CommBackendName::Gloo, true) => Err(Error::invalid_argument(
                "distributed.backend",
                format!("\"gloo\" reduces CPU tensors, but the device is {device}; use \"nccl\""),
            )),
            _ => Ok(()),
        }
    }
}
