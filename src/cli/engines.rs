//! What differs between the two executables, and which of them runs a command.
//!
//! [`Engines`] is what only `kiln-tensorflow` can do; its methods' defaults are
//! `kiln`'s, which refuse with [`NeedsTensorflow`]. [`needs_tensorflow`] decides
//! from the command line and the config alone (no data, checkpoint or model
//! read) whether a command needs TensorFlow; `kiln` then runs it in
//! `kiln-tensorflow` at once. The refusals stay as a safety net: a command that
//! reached one anyway is run there too, after what it did in `kiln`.

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use kiln_c10d::{
    fully_shard, post_local_sgd, zero_data_parallel, DistributedDataParallel, FullShardOptions,
    PostLocalSgdOptions, ProcessGroup, ZeroStage,
};
use kiln_core::backend::Trainable;
use kiln_core::distributed::DistributedOptions;
use kiln_core::strategy::DataParallel;

use crate::args::{Command, ExportFormat, TuneCommand};
use crate::config::{BackendKind, RunConfig};
use crate::formats::{is_config, is_onnx};
use crate::forward::NeedsTensorflow;
use crate::prelude::*;
use kiln_core::export::ExportOptions;

/// The model, weights and input shape `kiln export` works from.
pub struct Source {
    /// The model's definition.
    pub definition: Layer,
    /// Its weights.
    pub state: StateDict,
    /// The input's shape, batch dimension first.
    pub input_shape: Vec<usize>,
}

/// The engines an executable runs: `kiln`'s implementation keeps the defaults
/// (every TensorFlow method refuses with a `NeedsTensorflow` error);
/// `kiln-tensorflow`'s runs them on the TensorFlow C API.
pub trait Engines {
    /// Whether this executable runs TensorFlow itself. When it does not, the
    /// commands that need TensorFlow run in `kiln-tensorflow` beside it.
    const TENSORFLOW: bool;

    /// Makes Kiln's fused C++ ops available as layers (`type = "custom"`) to the
    /// backends this executable runs.
    fn register_layers() -> Result<()>;

    /// Runs `job` on the TensorFlow backend (data-parallel through its
    /// host all-reduce and ZeRO).
    fn run_on_tensorflow<J: BackendJob>(job: J) -> Result<()> {
        Err(NeedsTensorflow::new(job.on_tensorflow()).into())
    }

    /// The model with each saved_model layer's output shape, from its signature.
    fn resolve_saved_model_shapes(
        _model: &Layer,
        _example: &[usize],
        _dtype: DType,
    ) -> Result<Layer> {
        Err(NeedsTensorflow::new("a saved_model layer").into())
    }

    /// `kiln export --format savedmodel`: the [`Source`] (its weights from
    /// `checkpoint`) as the SavedModel directory `output`.
    fn export_saved_model(
        _source: &Source,
        _checkpoint: &Path,
        _output: &Path,
        _options: &ExportOptions,
    ) -> Result<()> {
        Err(NeedsTensorflow::new("exporting a SavedModel").into())
    }

    /// What `kiln inspect` prints for a SavedModel directory.
    fn describe_saved_model(_path: &Path) -> Result<String> {
        Err(NeedsTensorflow::new("inspecting a SavedModel").into())
    }
}

/// A command's work on one backend, written once for both engines: `kiln`
/// runs it on libtorch (`run_on`), `kiln-tensorflow` on TensorFlow too
/// ([`Engines::run_on_tensorflow`]).
pub trait BackendJob {
    /// What the job does on TensorFlow, as a refusal in `kiln` names it
    /// (`"training on the TensorFlow backend"`).
    fn on_tensorflow(&self) -> &'static str;

    /// Runs the job on backend `B`, over ranks through `P`'s strategies, with `E`'s engines.
    fn run<E: Engines, B: TrainBackend, P: StrategyEngine<B>>(self) -> Result<()>;
}

/// Runs `job` on `backend`: libtorch here, TensorFlow through `E`.
pub(crate) fn run_on<E: Engines, J: BackendJob>(backend: BackendKind, job: J) -> Result<()> {
    match backend {
        BackendKind::Torch => job.run::<E, kiln_torch::TorchBackend, TorchStrategies>(),
        BackendKind::Tensorflow => E::run_on_tensorflow(job),
    }
}

/// What runs on the model once it is under its strategy (whose type each
/// strategy decides): the rest of a command, handed to
/// [`StrategyEngine::run_under`].
pub trait WithTrainable<B: TrainBackend> {
    /// What the ranks of a job must agree on before they run (the config, the
    /// model's definition, the data, where they resume from): a rank that
    /// would run other steps would wait on the others forever.
    fn what_ranks_share(&self) -> Result<serde_json::Value>;

    /// Runs on `model`.
    fn run<M: Trainable<B>>(self, model: M) -> Result<()>;
}

/// The strategy a config's `[distributed]` table chose for a job of
/// several ranks.
#[derive(Clone, Copy, Debug)]
pub enum StrategyChoice<'a> {
    /// `strategy = "ddp"`: data parallelism.
    DataParallel,
    /// `strategy = "zero1"` or `"zero2"`.
    Zero(ZeroStage),
    /// `strategy = "fsdp"`, with its `[distributed.fsdp]` options.
    FullShard(&'a FullShardOptions),
    /// `strategy = "post_local_sgd"`, with its `[distributed.post_local_sgd]`.
    PostLocalSgd(&'a PostLocalSgdOptions),
}

impl StrategyChoice<'_> {
    /// What the strategy is called in messages.
    pub fn name(&self) -> &'static str {
        match self {
            StrategyChoice::DataParallel => "DDP",
            StrategyChoice::Zero(stage) => stage.name(),
            StrategyChoice::FullShard(_) => "FSDP",
            StrategyChoice::PostLocalSgd(_) => "post-local SGD",
        }
    }
}

/// How backend `B`'s models train over the ranks of a job: one match arm
/// per strategy the backend has, each putting the model inside the one
/// [`DataParallel`](kiln_core::strategy::DataParallel) wrapper with that
/// strategy (DDP's `c10d::Reducer`, ZeRO or FSDP on libtorch; a host
/// all-reduce of the gradients, or ZeRO, on TensorFlow), and refusing the
/// others.
pub trait StrategyEngine<B: TrainBackend> {
    /// Runs `then` on `model` under `choice` over `group` (rank 0's weights
    /// on every rank first).
    fn run_under<T: WithTrainable<B>>(
        model: B::Model,
        group: &Arc<ProcessGroup>,
        choice: StrategyChoice<'_>,
        options: &DistributedOptions,
        then: T,
    ) -> Result<()>;
}

/// libtorch's strategies: DDP's reducer, ZeRO's stages, FSDP.
pub(crate) struct TorchStrategies;

impl StrategyEngine<kiln_torch::TorchBackend> for TorchStrategies {
    fn run_under<T: WithTrainable<kiln_torch::TorchBackend>>(
        model: kiln_torch::TorchModel,
        group: &Arc<ProcessGroup>,
        choice: StrategyChoice<'_>,
        options: &DistributedOptions,
        then: T,
    ) -> Result<()> {
        let group = Arc::clone(group);
        match choice {
            StrategyChoice::DataParallel => {
                let ddp = DistributedDataParallel::of(group, &model, options)?;
                then.run(DataParallel::new(model, ddp)?)
            }
            StrategyChoice::Zero(stage) => {
                then.run(zero_data_parallel(model, group, stage, options)?)
            }
            StrategyChoice::FullShard(shard) => then.run(
                fully_shard(model, group, shard, options)
                    .map_err(|e| anyhow::Error::new(e).context("config key `distributed.fsdp`"))?,
            ),
            StrategyChoice::PostLocalSgd(local) => {
                then.run(post_local_sgd(model, group, local, options)?)
            }
        }
    }
}

/// What in `command` needs TensorFlow, decided from the command line and its
/// config (read and validated, with the command's flags applied), before any
/// data, checkpoint or model is read:
///
/// | command | needs TensorFlow when |
/// |---|---|
/// | `train` | the backend (after `--backend`) is `tensorflow` |
/// | `eval` | the backend is `tensorflow`, or the model has a saved_model layer |
/// | `predict` | as `eval`, unless the model is ONNX (ONNX Runtime runs it) |
/// | `inspect` | the path is a directory (a SavedModel) |
/// | `export` | `--format savedmodel`, or `--config`'s model has a saved_model layer whose output shape the data fixes (no `--input-shape`) |
/// | `launch` | never: each worker decides for itself |
///
/// A config that cannot be read or is invalid needs nothing: the command
/// itself reports it, in `kiln`.
pub(crate) fn needs_tensorflow(command: &Command) -> Option<NeedsTensorflow> {
    let needs = NeedsTensorflow::new;
    let uses_tensorflow = |config: &RunConfig, what| {
        if config.backend == BackendKind::Tensorflow {
            Some(needs(what))
        } else if has_saved_model_layer(config) {
            Some(needs("a saved_model layer"))
        } else {
            None
        }
    };
    match command {
        Command::Train(args) => {
            let config = args.config().ok()?;
            uses_tensorflow(&config, "training on the TensorFlow backend")
        }
        Command::Eval(args) => {
            let config = RunConfig::load(&args.config).ok()?;
            uses_tensorflow(&config, "evaluating on the TensorFlow backend")
        }
        Command::Predict(args) => {
            if is_onnx(&args.common.checkpoint) {
                return None;
            }
            let config = RunConfig::load(&args.common.config).ok()?;
            uses_tensorflow(&config, "predicting on the TensorFlow backend")
        }
        Command::Inspect { checkpoint, .. } if is_config(checkpoint) => {
            let config = RunConfig::load(checkpoint).ok()?;
            uses_tensorflow(&config, "summarising a model on the TensorFlow backend")
        }
        Command::Inspect { checkpoint, .. } => checkpoint
            .is_dir()
            .then(|| needs("inspecting a SavedModel")),
        Command::Export(args) => {
            if args.format == ExportFormat::Savedmodel {
                return Some(needs("exporting a SavedModel"));
            }
            if args.input_shape.is_some() {
                return None;
            }
            let config = RunConfig::load(args.config.as_deref()?).ok()?;
            has_saved_model_layer(&config).then(|| needs("a saved_model layer"))
        }
        Command::Tune(TuneCommand::Lr(args)) => {
            let config = args.train_args().config().ok()?;
            uses_tensorflow(
                &config,
                "the learning-rate finder on the TensorFlow backend",
            )
        }
        Command::Launch(_) | Command::Generate(_) | Command::Consolidate(_) => None,
    }
}

fn has_saved_model_layer(config: &RunConfig) -> bool {
    !config.model.saved_model_layers().is_empty()
}
