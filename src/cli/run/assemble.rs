//! The training state and the trainer a config asks for: the optimizer and
//! schedule, the weight average, the metrics, callbacks and training tools,
//! and rank 0's outputs (checkpointer and metric sinks).

use std::path::Path;

use anyhow::{Context, Result};
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_train::{Checkpointer, EarlyStopping, Trainer, TrainingState};

use crate::config::{RunConfig, StrategyName};
use crate::prelude::*;

/// The state a run starts from: `model` with the config's optimizer,
/// schedule and weight average (`distributed`: the run is one rank of a job).
/// What the model cannot do that `[logging]` asks for is refused first.
pub(crate) fn training_state<B: TrainBackend, M: Trainable<B>>(
    config: &RunConfig,
    model: M,
    distributed: bool,
) -> Result<TrainingState<B, M>> {
    let optimizer = model.build_optimizer(&config.optimizer, &config.param_groups)?;
    let scheduler = match &config.schedule {
        Some(s) => Some(s.build(&optimizer.learning_rates())?),
        None => None,
    };
    if config.logging.grad_norms && !optimizer.keeps_gradients() {
        anyhow::bail!(
            "config key `logging.grad_norms`: the {} backend's optimizer keeps no gradients \
             after its step (a graph engine computes them inside it); histograms still show \
             the weights",
            B::NAME
        );
    }
    if config.logging.graph && model.graph_def()?.is_none() {
        anyhow::bail!(
            "config key `logging.graph`: the {} backend runs eagerly and keeps no dataflow \
             graph for TensorBoard's Graphs view (the tensorflow backend does)",
            B::NAME
        );
    }
    let mut state = TrainingState::<B, M>::new(model, optimizer, scheduler);
    if let Some(averaging) = config.training.averaging() {
        let sharded = config.distributed.strategy == StrategyName::Fsdp
            || config.distributed.sharded_checkpoints();
        if distributed && sharded {
            anyhow::bail!(
                "config key `training.{}`: weight averaging keeps whole tensors and checkpoints \
                 them whole, so it runs under ddp, or zero1/zero2 with [distributed] checkpoint \
                 = \"full\"; not under {} with {} checkpoints",
                averaging.method().name(),
                config.distributed.strategy.name(),
                if config.distributed.sharded_checkpoints() {
                    "sharded"
                } else {
                    "full"
                }
            );
        }
        // Before a resume restores the checkpoint's average into it.
        state = state.with_weight_averaging(averaging)?;
    }
    Ok(state)
}

/// The trainer of `[training]` with the config's metrics, early stopping and
/// training tools; as one rank of a job (`distributed`), with its
/// checkpoints sharded when `[distributed]` says so, and on the other ranks
/// than rank 0 (`!primary`) taking its turns at rank 0's checkpoints.
pub(crate) fn trainer<B: TrainBackend, M: Trainable<B>>(
    config: &RunConfig,
    misclassified: Option<kiln_train::MisclassifiedImages>,
    distributed: bool,
    primary: bool,
) -> Result<Trainer<B, M>> {
    let mut training = config.training.clone();
    training.seed = config.seed;
    training.device = config.device;
    let mut trainer = Trainer::<B, M>::new(training, config.loss.clone())?
        .with_step_views(config.logging.step_views());
    if let Some(view) = misclassified {
        trainer = trainer.with_misclassified_images(view);
    }
    for name in &config.logging.metrics {
        let make =
            kiln_train::metric_by_name(name).with_context(|| format!("unknown metric {name}"))?;
        trainer = trainer.with_metric(make);
    }
    if let Some(es) = &config.early_stopping {
        trainer = trainer.with_callback(EarlyStopping::from_config(es));
    }
    if distributed && config.distributed.sharded_checkpoints() {
        trainer = trainer.with_sharded_checkpoints(checkpoints_dir(config));
    }
    if !primary {
        // A sharded optimizer's state is gathered by every rank when rank 0
        // saves it; under sharded checkpoints each rank writes its part.
        trainer = trainer.with_checkpoint_turns(config.checkpoint.clone());
    }
    Ok(trainer)
}

/// Rank 0's outputs added to `trainer`: the checkpointer (recording
/// `definition`, the data's `identity` and the LoRA settings) and the metric
/// sinks `[logging]` names, continued from `step` when the run `resumed`.
pub(crate) fn with_outputs<B: TrainBackend, M: Trainable<B>>(
    mut trainer: Trainer<B, M>,
    config: &RunConfig,
    definition: &Layer,
    identity: serde_json::Value,
    resumed: Option<u64>,
) -> Result<Trainer<B, M>> {
    let out = &config.output_dir;
    trainer = trainer
        .with_checkpointer(
            Checkpointer::new(checkpoints_dir(config), config.checkpoint.clone())?,
            Some(definition.clone()),
        )
        .with_data_identity(identity)
        .with_lora(config.lora.clone());
    if config.logging.csv {
        trainer = trainer.with_sink(match resumed {
            Some(step) => kiln_train::CsvSink::resume(out, step)?,
            None => kiln_train::CsvSink::new(out)?,
        });
    }
    if config.logging.tensorboard {
        let dir = out.join("tensorboard");
        trainer = trainer.with_sink(match resumed {
            Some(step) => kiln_train::TensorBoardSink::resume(dir, step)?,
            None => kiln_train::TensorBoardSink::new(dir)?,
        });
    }
    if config.logging.progress {
        trainer = trainer.with_sink(kiln_train::ProgressSink::new());
    } else {
        trainer = trainer.with_sink(kiln_train::LogSink::new());
    }
    Ok(trainer)
}

/// Where the run's checkpoints go: `checkpoints/` in its directory.
pub(crate) fn checkpoints_dir(config: &RunConfig) -> std::path::PathBuf {
    Path::new(&config.output_dir).join("checkpoints")
}
