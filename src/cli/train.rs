//! `kiln train`: a run config trained on one backend, on one process or as
//! one rank of a data-parallel job ([`train_on`]), with its run directory,
//! checkpoints, metric sinks and summary on rank 0 ([`fit`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use kiln_c10d::ProcessGroup;
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::distributed::Rendezvous;
use kiln_core::strategy::DataParallel;
use kiln_train::{Checkpointer, EarlyStopping, RunDirectory, RunStart, Trainer, TrainingState};

use crate::args::{LrFind, LrFindArgs, RunOptions, TrainArgs};
use crate::config::{BackendKind, FrozenBatchNorm, PretrainedModel, RunConfig, StrategyName};
use crate::data::{load_data, loader, Split};
use crate::engines::{DataParallelEngine, Engines, TorchDdp};
use crate::model::resolve_model;
use crate::output::outln;
use crate::prelude::*;
use crate::resume::{
    check_resume_data, check_resume_not_complete, check_resume_position, data_identity,
    follower_resume, load_resume_checkpoint, reshard, resolve_resume,
};

pub(crate) fn train<E: Engines>(args: TrainArgs) -> Result<()> {
    let mut config = args.config()?;
    // Started by `kiln launch`, torchrun or srun: one rank of a data-parallel job.
    let rendezvous = Rendezvous::from_env()?;
    if let Some(r) = &rendezvous {
        if let Device::Cuda(_) = config.device {
            // One GPU per local rank, as torchrun users set with LOCAL_RANK.
            config.device = Device::Cuda(r.local_rank);
        }
    }
    let resume = RunOptions {
        from: args.resume,
        on_other_data: args.resume_on_other_data,
        lr_find: None,
        summary_only: None,
        profile: args.profile,
    };
    match config.backend {
        BackendKind::Torch => {
            train_on::<E, kiln_torch::TorchBackend, TorchDdp>(&config, &resume, rendezvous.as_ref())
        }
        BackendKind::Tensorflow => E::train_tensorflow(&config, &resume, rendezvous.as_ref()),
    }
}

/// `kiln tune lr`: the learning-rate range test on the config's data, model,
/// loss and optimizer, in its own directory.
pub(crate) fn tune_lr<E: Engines>(args: LrFindArgs) -> Result<()> {
    let mut config = args.train_args().config()?;
    if Rendezvous::from_env()?.is_some() {
        anyhow::bail!(
            "kiln tune lr runs in one process; it was started as one rank of a job \
             (RANK/WORLD_SIZE are set)"
        );
    }
    if args.early_stop_threshold.is_nan() || args.early_stop_threshold < 0.0 {
        anyhow::bail!(
            "--early-stop-threshold must be 0 (never stop early) or a positive factor, got {}",
            args.early_stop_threshold
        );
    }
    let settings = kiln_train::LrFinderConfig {
        min_lr: args.min_lr,
        max_lr: args.max_lr,
        num_training: args.num_training,
        mode: args.mode,
        early_stop_threshold: (args.early_stop_threshold > 0.0)
            .then_some(args.early_stop_threshold),
        ..kiln_train::LrFinderConfig::default()
    };
    settings.validate().context("kiln tune lr")?;
    if let Some(path) = &args.save_config {
        // Checked before anything runs: a new file (not even a dangling link,
        // which the write would follow), in a directory that exists.
        if std::fs::symlink_metadata(path).is_ok() {
            anyhow::bail!(
                "--save-config {}: the path exists{}; kiln never writes over a file it did not \
                 create (give a new path)",
                path.display(),
                if path.is_symlink() {
                    " (a symbolic link)"
                } else {
                    ""
                }
            );
        }
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if !parent.is_dir() {
            anyhow::bail!(
                "--save-config {}: its directory {} does not exist (create it first)",
                path.display(),
                parent.display()
            );
        }
    }
    // The results have their own directory, a new one (or empty), as a run's.
    config.output_dir = args.output.clone().unwrap_or_else(|| {
        let mut name = config.output_dir.clone().into_os_string();
        name.push("-lr-find");
        PathBuf::from(name)
    });
    let options = RunOptions {
        from: None,
        on_other_data: false,
        lr_find: Some(LrFind {
            settings,
            config_file: args.config.clone(),
            save_config: args.save_config.clone(),
            suggest_on_log_scale: args.suggestion == "log",
        }),
        summary_only: None,
        profile: None,
    };
    match config.backend {
        BackendKind::Torch => {
            train_on::<E, kiln_torch::TorchBackend, TorchDdp>(&config, &options, None)
        }
        BackendKind::Tensorflow => E::train_tensorflow(&config, &options, None),
    }
}

/// `kiln inspect CONFIG`: the summary of the model the config trains, on its
/// backend and data (pretrained weights, LoRA and freezing applied), down to
/// `depth` (`-1`: every layer); nothing is written.
pub(crate) fn summarize<E: Engines>(path: &Path, depth: i64) -> Result<()> {
    let config = RunConfig::load(path)?;
    let options = RunOptions {
        from: None,
        on_other_data: false,
        lr_find: None,
        summary_only: Some(depth),
        profile: None,
    };
    match config.backend {
        BackendKind::Torch => {
            train_on::<E, kiln_torch::TorchBackend, TorchDdp>(&config, &options, None)
        }
        BackendKind::Tensorflow => E::train_tensorflow(&config, &options, None),
    }
}

/// The depth a summary table lists down to: all for a negative one.
fn summary_depth(depth: i64) -> Option<usize> {
    usize::try_from(depth).ok()
}

/// The summary of `model`, built from `definition`, for one sample of `sample`.
fn model_summary<B: TrainBackend>(
    definition: &Layer,
    sample: &[usize],
    model: &B::Model,
) -> Result<kiln_core::model::ModelSummary> {
    let parameters: Vec<(String, usize)> = model
        .named_parameters()?
        .iter()
        .map(|(name, t)| (name.clone(), B::shape(t).numel()))
        .collect();
    let frozen = model.frozen_parameters()?;
    Ok(kiln_core::model::ModelSummary::new(
        definition,
        sample,
        &parameters,
        &frozen,
    )?)
}

/// The range test of `kiln tune lr`, its table, plot and suggestion.
fn find_lr_and_report<B: TrainBackend, M: Trainable<B>>(
    config: &RunConfig,
    request: &LrFind,
    mut model: M,
    train: &dyn kiln_data::DataLoader,
) -> Result<()> {
    let out = &config.output_dir;
    let mut run = UndoFailedStart(Some(RunDirectory::acquire(out, RunStart::New)?));
    let result = kiln_train::find_lr(
        &mut model,
        &config.optimizer,
        &config.param_groups,
        &config.loss,
        train,
        config.device,
        &request.settings,
    )?;
    let mut csv = String::from("step,lr,loss\n");
    for (i, (lr, loss)) in result.lrs.iter().zip(&result.losses).enumerate() {
        csv.push_str(&format!("{},{lr:e},{loss}\n", i + 1));
    }
    write_new_file(&out.join("lr_find.csv"), csv.as_bytes())?;
    let suggestion = if request.suggest_on_log_scale {
        result.suggestion_log()
    } else {
        result.suggestion()
    };
    let png = out.join("lr_find.png");
    let log_scale = request.settings.mode == kiln_train::LrSweep::Exponential;
    if let Err(e) = kiln_train::plot_lr_finder(&result, log_scale, suggestion, &png) {
        log::warn!("no plot: {}", e.display_chain());
    }
    outln!(
        "kiln: learning-rate range test, {} steps from {:e} to {:e}{}",
        result.lrs.len(),
        request.settings.min_lr,
        result
            .lrs
            .last()
            .copied()
            .unwrap_or(request.settings.min_lr),
        if result.stopped_early {
            " (stopped: the loss diverged)"
        } else {
            ""
        }
    );
    match suggestion {
        Some(lr) => outln!("kiln: suggested learning rate {lr:e}"),
        None => outln!(
            "kiln: no suggestion: fewer than 2 finite losses after the first 10 steps and \
             before the last (raise --num-training, or lower --max-lr)"
        ),
    }
    if let (Some(path), Some(lr)) = (&request.save_config, suggestion) {
        // The user's file with one value changed (their comments are lost: toml
        // writes the values back), never the file itself.
        let text = std::fs::read_to_string(&request.config_file)
            .with_context(|| format!("reading {}", request.config_file.display()))?;
        let mut document: toml::Value =
            toml::from_str(&text).with_context(|| format!("{}", request.config_file.display()))?;
        match document
            .get_mut("optimizer")
            .and_then(toml::Value::as_table_mut)
        {
            Some(table) => {
                table.insert("lr".to_owned(), toml::Value::Float(lr));
            }
            None => anyhow::bail!(
                "--save-config: {} has no [optimizer] table to put the rate in",
                request.config_file.display()
            ),
        }
        let written = toml::to_string(&document).context("--save-config")?;
        write_new_file(path, written.as_bytes())?;
        outln!("kiln: {} is the config with lr = {lr:e}", path.display());
    }
    outln!(
        "kiln: losses in {}, plot in {}",
        out.join("lr_find.csv").display(),
        png.display()
    );
    run.succeeded();
    Ok(())
}

/// The run's model is its weight average, when it keeps one (as Lightning's
/// `WeightAveraging` leaves the averaged weights in the model at the end of
/// `fit`; SWA's with its batch-norm statistics recomputed): evaluated,
/// written to `model.safetensors` and the adapter.
fn use_average<B: TrainBackend, M: Trainable<B>>(
    trainer: &Trainer<B, M>,
    state: &mut TrainingState<B, M>,
    train: &dyn kiln_data::DataLoader,
) -> Result<()> {
    if trainer.apply_average(state, train)? {
        if let Some(averaging) = &state.averaging {
            log::info!(
                "the model is the {} weight average of {} updates",
                averaging.config().method().name().to_uppercase(),
                averaging.updates(),
            );
        }
    }
    Ok(())
}

/// Loads the weights of `[model] pretrained` into `model`: every tensor of the
/// checkpoint's model (a new head keeps its initial values).
fn load_pretrained<B: TrainBackend>(model: &mut B::Model, source: &PretrainedModel) -> Result<()> {
    let pretrained = source
        .open()
        .with_context(|| format!("config key `model.pretrained` ({})", source.dir.display()))?;
    let weights = pretrained
        .load_weights()
        .with_context(|| format!("config key `model.pretrained` ({})", source.dir.display()))?;
    let mut state = model.state_dict()?;
    let count = weights.len();
    for (name, tensor) in weights {
        state.insert(name, tensor);
    }
    model.load_state_dict(&state)?;
    log::info!(
        "loaded {count} pretrained tensors ({} model) from {}",
        pretrained.family(),
        source.dir.display()
    );
    Ok(())
}

/// What a training run has prepared before its model trains: the checks done,
/// the data loaded, the definition resolved.
struct Prepared<'a> {
    config: &'a RunConfig,
    resume: &'a RunOptions,
    rendezvous: Option<&'a Rendezvous>,
    started: Instant,
    /// Rank 0 of a data-parallel job, or a single process: writes the run directory.
    primary: bool,
    resume_from: Option<PathBuf>,
    definition: Layer,
    summary: Option<kiln_core::model::ModelSummary>,
    identity: serde_json::Value,
    train_loader: Box<dyn DataLoader>,
    val_loader: Option<Box<dyn DataLoader>>,
    examples: (usize, usize),
    misclassified: Option<kiln_train::MisclassifiedImages>,
}

/// `kiln train` on backend `B`, data-parallel through `P` when started as one
/// rank of a job.
pub fn train_on<E: Engines, B: TrainBackend, P: DataParallelEngine<B>>(
    config: &RunConfig,
    resume: &RunOptions,
    rendezvous: Option<&Rendezvous>,
) -> Result<()> {
    let started = Instant::now();
    // Rank 0 of a data-parallel job (or a single process) writes the run
    // directory, logs, plots and checkpoints; the other ranks only train.
    let primary = rendezvous.is_none_or(Rendezvous::is_primary);
    if !config.freeze.is_empty() && !B::CAN_FREEZE {
        anyhow::bail!(
            "config key `freeze`: freezing parameters is not supported on the {} backend",
            B::NAME
        );
    }

    if config.lora.is_some() && !B::CAN_LORA {
        anyhow::bail!(
            "config key `lora`: LoRA adapters are not supported on the {} backend",
            B::NAME
        );
    }

    // Everything that can be checked is checked before the first byte is written.
    let resume_from = if resume.summary_only.is_some() {
        None
    } else if primary {
        resolve_resume(config, resume.from.as_deref())?
    } else {
        follower_resume(config, resume.from.as_deref())?
    };
    let data = load_data::<E>(config)?;
    let misclassified = config.logging.misclassified_view(
        data.probe.dims(),
        data.val.is_some(),
        &config.loss,
        data.class_names.as_deref(),
    )?;
    // Finding a torchscript layer's output shape runs it once (drawing nothing).
    let definition = resolve_model::<E>(config, &data.probe, config.device)?;
    let sample = data.probe.dims().get(1..).unwrap_or_default().to_vec();
    let examples = (data.train.len(), data.val.as_ref().map_or(0, Split::len));
    let identity = data_identity(config, &data);
    let shard = rendezvous.map(|r| (r.rank, r.world_size));
    let train_loader = loader(data.train, config, true, shard)?;
    // Each rank validates on its share of the split (every sample once); the
    // trainer adds the ranks' metric states up, so every rank gets the values
    // over the whole split and early stopping and plateau schedules decide alike.
    let val_loader = data
        .val
        .map(|v| loader(v, config, false, shard))
        .transpose()?;

    B::manual_seed(config.seed);
    let mut model = B::build_model(&definition, config.device)?;
    // A fresh run starts from the pretrained weights (a resumed one from its checkpoint's).
    if let (Some(source), None) = (&config.pretrained, &resume_from) {
        load_pretrained::<B>(&mut model, source)?;
    }
    if let Some(lora) = &config.lora {
        let adapters = B::add_lora(&mut model, lora).context("config key `lora`")?;
        // The adapter is written in PEFT's format at the end of the run: a
        // target PEFT cannot hold (GPT-2's fused c_attn) is refused now.
        if let Some(source) = &config.pretrained {
            let modules: Vec<&str> = adapters
                .iter()
                .filter_map(|n| n.strip_suffix(&format!(".{}", kiln_core::lora::LORA_A)))
                .collect();
            source
                .open()?
                .check_adapter_modules(modules)
                .context("config key `lora.target_modules`")?;
        }
        log::info!(
            "LoRA: {} adapter tensors (r = {}, alpha = {}) on {}; the rest is frozen",
            adapters.len(),
            lora.r,
            lora.alpha,
            lora.target_modules.join(", ")
        );
    }
    B::set_precision(&mut model, config.training.precision)?;
    let patterns: Vec<&str> = config.freeze.iter().map(String::as_str).collect();
    let (frozen, pinned) = B::freeze(
        &mut model,
        &patterns,
        config.frozen_batch_norm == FrozenBatchNorm::Eval,
    )
    .context("config key `freeze`")?;
    if !frozen.is_empty() {
        log::info!(
            "frozen: {} parameters ({})",
            frozen.len(),
            frozen.join(", ")
        );
    }
    if !pinned.is_empty() {
        log::info!("batch norm kept in eval mode: {}", pinned.join(", "));
    }
    if !config.activation_checkpointing.is_empty() {
        let patterns: Vec<&str> = config
            .activation_checkpointing
            .iter()
            .map(String::as_str)
            .collect();
        let parts = B::checkpoint_activations(&mut model, &patterns)
            .context("config key `activation_checkpointing`")?;
        log::info!("activation checkpointing: {}", parts.join(", "));
    }
    let summary = model_summary::<B>(&definition, &sample, &model);
    if let Some(depth) = resume.summary_only {
        let summary = summary?;
        outln!(
            "{} on {}: the model of {}, for one sample of the training data",
            B::NAME,
            config.device,
            config.output_dir.display()
        );
        outln!("{}", summary.table(summary_depth(depth)));
        return Ok(());
    }
    // A summary that cannot be made does not stop the run.
    let summary = summary
        .map_err(|e| log::warn!("no model summary: {e:#}"))
        .ok();
    let prepared = Prepared {
        config,
        resume,
        rendezvous,
        started,
        primary,
        resume_from,
        definition,
        summary,
        identity,
        train_loader,
        val_loader,
        examples,
        misclassified,
    };
    let Some(r) = rendezvous else {
        // One process: a strategy spreads a step over ranks, and there are none.
        if config.distributed.strategy != StrategyName::Ddp {
            log::warn!(
                "[distributed] strategy = \"{}\" applies to data-parallel runs (kiln launch, \
                 torchrun); this run is one process, so it trains unsharded",
                config.distributed.strategy.name()
            );
        }
        return fit::<B, _>(prepared, model);
    };
    let options = config.distributed.options(config.device);
    let group = Arc::new(ProcessGroup::join(r, &options)?);
    // Ranks that would run different steps would wait on each other forever.
    crate::ranks::check_ranks_agree(
        group.as_ref(),
        &crate::ranks::what_ranks_share(
            config,
            &prepared.definition,
            &prepared.identity,
            prepared.resume_from.as_deref(),
        )?,
    )?;
    if primary {
        outln!(
            "kiln: rank 0 of {} ({}, {} backend, {} strategy)",
            r.world_size,
            r.launcher,
            options.backend,
            config.distributed.strategy.name()
        );
    }
    if config.distributed.strategy == StrategyName::Fsdp {
        let shard = config.distributed.fsdp.options();
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
        return fit::<B, _>(prepared, P::fully_shard(model, &group, &shard, &options)?);
    }
    match config.distributed.strategy.zero_stage() {
        Some(stage) => fit::<B, _>(prepared, P::zero(model, &group, stage, &options)?),
        None => {
            let sync = P::data_parallel(&model, &group, &options)?;
            fit::<B, _>(prepared, DataParallel::new(model, sync)?)
        }
    }
}

/// Trains `model` (a single process's, or one rank's inside its strategy) as
/// `prepared` says: the optimizer and schedule, the resume, one `Trainer` (rank
/// 0's with the run's outputs: checkpoints, sinks), the final evaluation, and on
/// rank 0 the weights, plots and summary.
fn fit<B: TrainBackend, M: Trainable<B>>(prepared: Prepared<'_>, model: M) -> Result<()> {
    let Prepared {
        config,
        resume,
        rendezvous,
        started,
        primary,
        resume_from,
        definition,
        summary,
        identity,
        train_loader,
        val_loader,
        examples: (n_train, n_val),
        misclassified,
    } = prepared;
    let out = &config.output_dir;
    if let Some(request) = &resume.lr_find {
        return find_lr_and_report::<B, M>(config, request, model, train_loader.as_ref());
    }
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
        if rendezvous.is_some()
            && (config.distributed.strategy == StrategyName::Fsdp
                || config.distributed.sharded_checkpoints())
        {
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
    let world_size = rendezvous.map_or(1, |r| r.world_size as u64);
    if let Some(path) = &resume_from {
        let mut checkpoint = load_resume_checkpoint(config, &definition, path)?;
        check_resume_data(&mut checkpoint, &identity, path, resume.on_other_data)?;
        // Before resharding: a position under another data order means
        // nothing for any number of ranks.
        checkpoint.check_data_order(path)?;
        reshard(&mut checkpoint, world_size, path)?;
        check_resume_position(&checkpoint, train_loader.num_batches(), path)?;
        check_resume_not_complete(config, &checkpoint, train_loader.num_batches(), path)?;
        Trainer::<B, M>::resume_from(&mut state, &checkpoint, path)?;
    }

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
        trainer = trainer.with_callback(EarlyStopping::new(
            es.monitor.clone(),
            es.mode,
            es.patience,
            es.min_delta,
        ));
    }
    let checkpoints = out.join("checkpoints");
    if rendezvous.is_some() && config.distributed.sharded_checkpoints() {
        trainer = trainer.with_sharded_checkpoints(&checkpoints);
    }
    if !primary {
        // A sharded optimizer's state is gathered by every rank when rank 0
        // saves it; under sharded checkpoints each rank writes its part.
        trainer = trainer.with_checkpoint_turns(config.checkpoint.clone());
        trainer.fit(
            &mut state,
            train_loader.as_ref(),
            val_loader.as_ref().map(|v| v.as_ref()),
        )?;
        use_average(&trainer, &mut state, train_loader.as_ref())?;
        // Rank 0's final evaluation reduces over every rank.
        if let Some(val) = &val_loader {
            state.model.set_mode(Mode::Eval);
            trainer.evaluate(&mut state.model, val.as_ref())?;
        }
        if state.model.shards_parameters() {
            // Rank 0 gathers the whole weights to save them.
            drop(state.model.state_tensors()?);
        }
        return Ok(());
    }

    // From here on the run writes, holding its directory's lock.
    let start = if resume_from.is_some() {
        RunStart::Resume
    } else {
        RunStart::New
    };
    if let Some(profile) = &resume.profile {
        let profile = profile.clone().in_dir(out.join("profile"));
        // The window's files are checked before the run directory is written.
        profile.validate()?;
        trainer = trainer.with_profiler(profile);
    }
    let mut run = UndoFailedStart(Some(RunDirectory::acquire(out, start)?));
    // The resolved config is the run's own file: a new run's directory was
    // empty; a run resumed into a directory without one records it too.
    let config_file = out.join("config.toml");
    if start == RunStart::New || !config_file.exists() {
        write_new_file(&config_file, toml_string(config)?.as_bytes())?;
    }

    let trainable = state.model.num_trainable_parameters()?;
    let total = state.model.num_parameters()?;
    outln!(
        "kiln: {} on {} in {} ({}), {} parameters{}; {} training and {} validation examples",
        B::NAME,
        config.device,
        config.training.precision,
        config.output_dir.display(),
        total,
        if trainable < total {
            format!(" ({trainable} trainable)")
        } else {
            String::new()
        },
        n_train,
        n_val
    );
    if let (Some(depth), Some(summary)) = (config.logging.summary_depth(), &summary) {
        outln!("{}", summary.table(depth));
    }

    // Rank 0's outputs: checkpoints and metric sinks.
    trainer = trainer
        .with_checkpointer(
            Checkpointer::new(&checkpoints, config.checkpoint.clone())?,
            Some(definition.clone()),
        )
        .with_data_identity(identity)
        .with_lora(config.lora.clone());
    if config.logging.csv {
        trainer = trainer.with_sink(match &resume_from {
            Some(_) => kiln_train::CsvSink::resume(out, state.step)?,
            None => kiln_train::CsvSink::new(out)?,
        });
    }
    if config.logging.tensorboard {
        let dir = out.join("tensorboard");
        trainer = trainer.with_sink(match &resume_from {
            Some(_) => kiln_train::TensorBoardSink::resume(dir, state.step)?,
            None => kiln_train::TensorBoardSink::new(dir)?,
        });
    }
    if config.logging.progress {
        trainer = trainer.with_sink(kiln_train::ProgressSink::new());
    } else {
        trainer = trainer.with_sink(kiln_train::LogSink::new());
    }

    let history = trainer.fit(
        &mut state,
        train_loader.as_ref(),
        val_loader.as_ref().map(|v| v.as_ref()),
    )?;
    use_average(&trainer, &mut state, train_loader.as_ref())?;
    state.model.set_mode(Mode::Eval);
    let final_metrics = match &val_loader {
        Some(val) => trainer.evaluate(&mut state.model, val.as_ref())?,
        None => Vec::new(),
    };
    let weights = out.join("model.safetensors");
    let mut metadata = std::collections::BTreeMap::new();
    metadata.insert("format".to_owned(), "pt".to_owned());
    // Read once: under full sharding, a collective the other ranks join once.
    let final_state = state.model.state_tensors()?;
    final_state.save_safetensors(&weights, &metadata)?;
    if let (Some(lora), Some(source)) = (&config.lora, &config.pretrained) {
        save_adapter(
            lora,
            source,
            &final_state.to_state_dict()?,
            &out.join("adapter"),
        )?;
    }
    if config.logging.plots && !history.is_empty() {
        let png = out.join("curves.png");
        kiln_train::plot_curves(&history, &png, &kiln_train::PlotOptions::default())?;
        outln!("kiln: curves plotted to {}", png.display());
    }
    let summary = if final_metrics.is_empty() {
        "no validation split".to_owned()
    } else {
        format!(
            "validation {}",
            final_metrics
                .iter()
                .map(|(k, v)| if k.contains("loss") {
                    format!("{k} {v:.4}")
                } else {
                    format!("{k} {:.2}%", 100.0 * v)
                })
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    outln!(
        "kiln: done in {:.1}s, {} steps; {summary}",
        started.elapsed().as_secs_f64(),
        state.step,
    );
    let skipped =
        train_loader.skipped_samples() + val_loader.as_ref().map_or(0, |v| v.skipped_samples());
    if skipped > 0 {
        outln!(
            "kiln: {skipped} images skipped because they could not be read or decoded \
             (data.on_error = \"skip\"; each is named in a warning above)"
        );
    }
    match kiln_train::Checkpointer::latest(&checkpoints) {
        Ok(Some(_)) => outln!(
            "kiln: weights in {}, checkpoints in {}",
            weights.display(),
            checkpoints.display()
        ),
        // --max-steps (or a short run) can end before the first checkpoint is due.
        _ => outln!(
            "kiln: weights in {}; no checkpoint was written (the run ended before the first \
             was due: see [checkpoint] every_n_steps / every_n_epochs)",
            weights.display()
        ),
    }
    run.succeeded();
    Ok(())
}

/// Writes the trained LoRA adapters of a pretrained model to `dir` in PEFT's
/// format (`PeftModel.from_pretrained(base, dir)` loads them). A resumed run
/// replaces the adapter its directory holds (written beside it, then moved
/// into place); a `dir` holding anything else is left alone with an error.
fn save_adapter(
    lora: &kiln_core::lora::LoraConfig,
    source: &PretrainedModel,
    weights: &StateDict,
    dir: &Path,
) -> Result<()> {
    use kiln_hf::{ADAPTER_CONFIG, ADAPTER_WEIGHTS};
    let pretrained = source.open()?;
    if !dir.exists() {
        pretrained
            .save_adapter(lora, weights, dir)
            .context("saving the LoRA adapters in PEFT's format")?;
    } else {
        let ours = std::fs::read_dir(dir)?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<std::io::Result<Vec<_>>>()?
            .iter()
            .all(|n| n == ADAPTER_CONFIG || n == ADAPTER_WEIGHTS);
        if !ours {
            anyhow::bail!(
                "{} holds files Kiln did not write: the LoRA adapters are not saved there (the \
                 checkpoints hold them)",
                dir.display()
            );
        }
        let fresh = dir.with_extension("new");
        if fresh.exists() {
            std::fs::remove_dir_all(&fresh)?;
        }
        pretrained
            .save_adapter(lora, weights, &fresh)
            .context("saving the LoRA adapters in PEFT's format")?;
        std::fs::remove_dir_all(dir)?;
        std::fs::rename(&fresh, dir)?;
    }
    outln!(
        "kiln: LoRA adapters in {} (PEFT's format: PeftModel.from_pretrained reads them)",
        dir.display()
    );
    Ok(())
}

/// Holds a run's directory; when the run fails before its first checkpoint,
/// removes what it wrote there ([`RunDirectory::discard_failed_start`]), so
/// that the same command can run again once the cause is fixed.
struct UndoFailedStart(Option<RunDirectory>);

impl UndoFailedStart {
    /// The run finished: its directory stays as it is.
    fn succeeded(&mut self) {
        self.0.take();
    }
}

impl Drop for UndoFailedStart {
    fn drop(&mut self) {
        let Some(run) = self.0.take() else {
            return;
        };
        let dir = run.path().to_path_buf();
        match run.discard_failed_start() {
            Ok(removed) if !removed.is_empty() => log::info!(
                "the run failed before its first checkpoint: removed what it wrote in {} ({}), \
                 so that it can start there again",
                dir.display(),
                removed.join(", ")
            ),
            Ok(_) => {}
            Err(error) => log::warn!(
                "the run failed before its first checkpoint, and removing what it wrote in {} \
                 failed too: {error}",
                dir.display()
            ),
        }
    }
}

/// Writes `bytes` to a new file at `path`, refusing to replace one.
fn write_new_file(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .and_then(|mut file| file.write_all(bytes))
        .with_context(|| format!("writing {}", path.display()))
}

fn toml_string(config: &RunConfig) -> Result<String> {
    toml::to_string_pretty(config).context("writing the resolved config")
}
