//! The command line both executables share: `kiln` and `kiln-tensorflow` include
//! this module (and config, data, evaluate, export, inspect, launch) and differ only in their
//! [`TensorflowCommands`]: `kiln`'s asks for the sibling executable, so that the
//! `kiln` binary references no TensorFlow symbol and never loads TensorFlow;
//! `kiln-tensorflow`'s runs the command on the TensorFlow C API.
//!
//! ```text
//! kiln train --config examples/configs/digits-cnn.toml [--epochs N] [--device cuda:0] ...
//! kiln eval --config CONFIG --checkpoint runs/digits-cnn/checkpoints/last.safetensors
//! kiln predict --config CONFIG --checkpoint CKPT --output predictions.csv
//! kiln inspect runs/digits-cnn/checkpoints/last.safetensors
//! kiln export --checkpoint CKPT --format onnx|torchscript|savedmodel --output PATH
//! kiln predict --config CONFIG --checkpoint model.onnx --output predictions.csv
//! kiln launch --nproc-per-node 2 -- train --config CONFIG   # N workers, as torchrun
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::config::{BackendKind, FrozenBatchNorm, RunConfig};
use crate::evaluate::{CheckpointArgs, PredictArgs};
use crate::{evaluate, export, inspect, launch, Tensorflow};
use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use kiln::core::distributed::{Collectives, Rendezvous};
use kiln::core::{
    backend::{TrainBackend, Trainable},
    module::Module,
    precision::FloatPrecision,
};
use kiln::prelude::*;
use kiln::torch::distributed::ProcessGroup;
use kiln::train::{
    Checkpoint, Checkpointer, EarlyStopping, RunDirectory, RunStart, Trainer, TrainingState,
};

use crate::data::{load_data, loader, Split};

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Train neural networks from Rust on libtorch or TensorFlow"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model described by a TOML config.
    Train(TrainArgs),
    /// Evaluate a checkpoint on the config's validation split.
    Eval(CheckpointArgs),
    /// Write a checkpoint's predictions for the validation split as CSV.
    Predict(PredictArgs),
    /// Show what is inside a checkpoint (a table of tensors), a TorchScript
    /// file, an ONNX model (inputs, outputs, opsets, operators) or a TensorFlow
    /// SavedModel directory (its signatures with input and output names, dtypes and shapes).
    Inspect {
        /// A checkpoint, TorchScript or ONNX file, or a SavedModel directory.
        checkpoint: PathBuf,
    },
    /// Write a trained model as ONNX, TorchScript or a TensorFlow SavedModel.
    Export(export::ExportArgs),
    /// Start N worker processes on this node for data-parallel training, as
    /// `torchrun --standalone --nproc-per-node N --no-python` does: each runs
    /// `kiln ARGS` (or `--exec PROGRAM ARGS`) with RANK, WORLD_SIZE, MASTER_ADDR,
    /// MASTER_PORT and torchrun's other variables set.
    Launch(launch::LaunchArgs),
}

#[derive(Args)]
struct TrainArgs {
    /// The run config (TOML).
    #[arg(long)]
    config: PathBuf,
    /// Override `training.epochs`.
    #[arg(long)]
    epochs: Option<u64>,
    /// Override `training.max_steps`.
    #[arg(long)]
    max_steps: Option<u64>,
    /// Override `device` (cpu, cuda, cuda:N).
    #[arg(long)]
    device: Option<Device>,
    /// Override `seed`.
    #[arg(long)]
    seed: Option<u64>,
    /// Override `backend` (torch, tensorflow).
    #[arg(long, value_parser = parse_backend)]
    backend: Option<BackendKind>,
    /// Override `training.precision` (32-true, bf16-mixed, bf16-true).
    #[arg(long)]
    precision: Option<FloatPrecision>,
    /// Override `output_dir`.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Override the optimizer's learning rate.
    #[arg(long)]
    lr: Option<f64>,
    /// Override `data.batch_size`.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Override `data.workers`.
    #[arg(long)]
    workers: Option<usize>,
    /// Resume from a checkpoint file, or `auto` for the run in `output_dir`
    /// (`checkpoints/last.safetensors`, else its newest step checkpoint; a new
    /// run when the directory is absent or empty).
    #[arg(long)]
    resume: Option<String>,
    /// No progress bar (plain log lines only).
    #[arg(long)]
    no_progress: bool,
}

/// The log target of TensorFlow's own lines (`RUST_LOG=kiln=debug` shows them).
pub(crate) const TENSORFLOW_LOG_TARGET: &str = "kiln::tensorflow";

/// The name of the anonymous file (memfd) that captures TensorFlow's start-up lines.
pub(crate) const CAPTURE_NAME: &str = "kiln-tensorflow-start";

/// Set by `kiln` for `kiln-tensorflow` when it captures what TensorFlow prints
/// while its libraries load: `FD:DEV:INO`, the descriptor of the real stderr and
/// the device and inode it refers to (fd 2 is the capture, an anonymous file).
pub(crate) const STDERR_FD_VAR: &str = "KILN_TENSORFLOW_STDERR";

/// What only `kiln-tensorflow` runs: the commands and steps that use TensorFlow.
/// `kiln`'s implementation returns an error that names what needed TensorFlow
/// (its `main` then runs the sibling executable); `kiln-tensorflow`'s does the work.
/// Each executable's `crate::Tensorflow` implements it.
pub(crate) trait TensorflowCommands {
    /// Makes Kiln's fused C++ ops available as layers (`type = "custom"`) to the
    /// backends this executable runs.
    fn register_layers() -> Result<()>;
    /// `kiln train` on the TensorFlow backend.
    fn train(
        config: &RunConfig,
        resume: Option<&str>,
        rendezvous: Option<&Rendezvous>,
    ) -> Result<()>;
    /// `kiln eval` on the TensorFlow backend.
    fn eval(args: &CheckpointArgs, config: &RunConfig) -> Result<()>;
    /// `kiln predict` on the TensorFlow backend.
    fn predict(args: &PredictArgs, config: &RunConfig) -> Result<()>;
    /// The model with each saved_model layer's output shape, from its signature.
    fn resolve_saved_model_shapes(model: &Layer, example: &[usize], dtype: DType) -> Result<Layer>;
    /// `kiln export --format savedmodel`.
    fn export_saved_model(
        source: &export::Source,
        options: &export::SavedModelOptions<'_>,
    ) -> Result<()>;
    /// `kiln inspect` of a SavedModel directory.
    fn inspect_saved_model(path: &Path) -> Result<()>;
}

/// Kiln's log lines on stderr, at `RUST_LOG`'s level (default `info`).
pub(crate) fn init_logging() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_target(false)
        .init();
}

/// Prints the error and exits as `kiln` does when a command fails.
pub(crate) fn exit_with(error: &anyhow::Error) -> ! {
    eprintln!("error: {error:#}");
    // Interrupted by a signal: exit as the shell reports a process it killed.
    let code = error
        .downcast_ref::<launch::Interrupted>()
        .map_or(1, launch::Interrupted::exit_code);
    std::process::exit(code);
}

/// Runs one command.
pub(crate) fn run(cli: Cli) -> Result<()> {
    // Configs can then use Kiln's fused ops as layers (`type = "custom", op = "kiln::swish"`).
    // The launcher only starts processes: its workers register them.
    if !matches!(cli.command, Command::Launch(_)) {
        Tensorflow::register_layers()?;
    }
    match cli.command {
        Command::Train(args) => train(args),
        Command::Eval(args) => evaluate::eval(args),
        Command::Predict(args) => evaluate::predict(args),
        Command::Inspect { checkpoint } => inspect::inspect(&checkpoint),
        Command::Export(args) => export::export(args),
        Command::Launch(args) => launch::launch(args),
    }
}

pub(crate) fn load_config(path: &Path) -> Result<RunConfig> {
    Ok(RunConfig::load(path)?)
}

fn parse_backend(value: &str) -> std::result::Result<BackendKind, String> {
    match value {
        "torch" => Ok(BackendKind::Torch),
        "tensorflow" | "tf" => Ok(BackendKind::Tensorflow),
        other => Err(format!(
            "unknown backend `{other}`; expected `torch` or `tensorflow`"
        )),
    }
}

fn train(args: TrainArgs) -> Result<()> {
    let mut config = load_config(&args.config)?;
    if let Some(v) = args.epochs {
        config.training.epochs = v;
    }
    if let Some(v) = args.max_steps {
        config.training.max_steps = Some(v);
    }
    if let Some(v) = args.device {
        config.device = v;
    }
    if let Some(v) = args.seed {
        config.seed = v;
    }
    if let Some(v) = args.backend {
        config.backend = v;
    }
    if let Some(v) = args.precision {
        config.training.precision = v;
    }
    if let Some(v) = args.output {
        config.output_dir = v;
    }
    if let Some(v) = args.lr {
        config.optimizer = config.optimizer.with_lr(v);
    }
    if let Some(v) = args.batch_size {
        config.data.batch_size = v;
    }
    if let Some(v) = args.workers {
        config.data.workers = v;
    }
    if args.no_progress {
        config.logging.progress = false;
    }
    config
        .validate()
        .with_context(|| format!("config {}", args.config.display()))?;
    // Started by `kiln launch`, torchrun or srun: one rank of a data-parallel job.
    let rendezvous = Rendezvous::from_env()?;
    if let Some(r) = &rendezvous {
        if let Device::Cuda(_) = config.device {
            // One GPU per local rank, as torchrun users set with LOCAL_RANK.
            config.device = Device::Cuda(r.local_rank);
        }
    }
    let resume = args.resume.as_deref();
    match config.backend {
        BackendKind::Torch => {
            train_on::<kiln::torch::TorchBackend>(&config, resume, rendezvous.as_ref())
        }
        BackendKind::Tensorflow => Tensorflow::train(&config, resume, rendezvous.as_ref()),
    }
}

/// Where a rank other than 0 resumes from: the checkpoint rank 0 resumes from
/// (the run directory must be visible to every rank, as in PyTorch); rank 0
/// alone checks and writes the directory.
fn follower_resume(config: &RunConfig, resume: Option<&str>) -> Result<Option<PathBuf>> {
    Ok(match resume {
        None => None,
        Some("auto") => Checkpointer::latest(&config.output_dir.join("checkpoints"))?,
        Some(path) => Some(PathBuf::from(path)),
    })
}

/// Where a training run starts: afresh, or from a checkpoint.
fn resolve_resume(config: &RunConfig, resume: Option<&str>) -> Result<Option<PathBuf>> {
    let out = &config.output_dir;
    match resume {
        None => {
            RunDirectory::check(out, RunStart::New)?;
            Ok(None)
        }
        Some("auto") => {
            RunDirectory::check(out, RunStart::Resume)?;
            if let Some(path) = Checkpointer::latest(&out.join("checkpoints"))? {
                return Ok(Some(path));
            }
            // Nothing to resume: a new run, but only where it destroys nothing.
            if RunDirectory::check(out, RunStart::New).is_err() {
                anyhow::bail!(
                    "output directory {}: --resume auto found no checkpoint to resume from \
                     (neither checkpoints/last.safetensors nor checkpoints/step-*.safetensors), \
                     and the directory is not empty, so a new run there would write over what \
                     it holds; start the run elsewhere with --output DIR",
                    out.display()
                );
            }
            log::info!(
                "--resume auto: no run in {} yet; starting a new one",
                out.display()
            );
            Ok(None)
        }
        Some(path) => {
            RunDirectory::check(out, RunStart::Resume)?;
            Ok(Some(PathBuf::from(path)))
        }
    }
}

/// Reads the checkpoint to resume from and checks it against the config: the
/// same model definition and seed.
fn load_resume_checkpoint(config: &RunConfig, model: &Layer, path: &Path) -> Result<Checkpoint> {
    let checkpoint = Checkpoint::load(path)?;
    checkpoint.check_definition(model, path)?;
    if checkpoint.seed != config.seed {
        anyhow::bail!(
            "checkpoint {}: the run it continues used seed {}, this one seed {}; data order \
             and dropout derive from the seed, so another one would not continue that run \
             (pass --seed {} to resume it)",
            path.display(),
            checkpoint.seed,
            config.seed,
            checkpoint.seed
        );
    }
    Ok(checkpoint)
}

pub(crate) fn train_on<B: TrainBackend>(
    config: &RunConfig,
    resume: Option<&str>,
    rendezvous: Option<&Rendezvous>,
) -> Result<()> {
    let started = Instant::now();
    let out = &config.output_dir;
    // Rank 0 of a data-parallel job (or a single process) writes the run
    // directory, logs, plots and checkpoints; the other ranks only train.
    let primary = rendezvous.is_none_or(Rendezvous::is_primary);

    // Everything that can be checked is checked before the first byte is written.
    let resume_from = if primary {
        resolve_resume(config, resume)?
    } else {
        follower_resume(config, resume)?
    };
    let data = load_data(config)?;
    // Finding a torchscript layer's output shape runs it once (drawing nothing).
    let definition = resolve_model(config, &data.probe, config.device)?;
    let (n_train, n_val) = (data.train.len(), data.val.as_ref().map_or(0, Split::len));
    let shard = rendezvous.map(|r| (r.rank, r.world_size));
    let train_loader = loader(data.train, config, true, shard)?;
    // Each rank validates on its share of the split (every sample once); the
    // trainer adds the ranks' metric states up, so every rank gets the values
    // over the whole split and early stopping and plateau schedules decide alike.
    let val_loader = data
        .val
        .map(|v| loader(v, config, false, shard))
        .transpose()?;

    let mut training = config.training.clone();
    training.seed = config.seed;
    training.device = config.device;
    B::manual_seed(config.seed);
    let mut model = B::build_model(&definition, config.device)?;
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
    let mut group: Option<Arc<dyn Collectives>> = None;
    if let Some(r) = rendezvous {
        let options = config.distributed.options(config.device);
        let joined: Arc<dyn Collectives> = Arc::new(ProcessGroup::join(r, &options)?);
        if primary {
            println!(
                "kiln: rank 0 of {} ({}, {} backend)",
                r.world_size, r.launcher, options.backend
            );
        }
        B::distribute(&mut model, joined.clone(), &options)?;
        group = Some(joined);
    }
    let optimizer = B::build_optimizer(&config.optimizer, &model, &config.param_groups)?;
    let scheduler = match &config.schedule {
        Some(s) => Some(s.build(&optimizer.learning_rates())?),
        None => None,
    };
    let mut state = TrainingState::<B>::new(model, optimizer, scheduler);
    let world_size = rendezvous.map_or(1, |r| r.world_size as u64);
    if let Some(path) = &resume_from {
        let mut checkpoint = load_resume_checkpoint(config, &definition, path)?;
        reshard(&mut checkpoint, world_size, path)?;
        Trainer::<B>::resume_from(&mut state, &checkpoint, path)?;
    }

    let with_group = |trainer: Trainer<B>| match &group {
        Some(g) => trainer.with_group(g.clone()),
        None => trainer,
    };
    if !primary {
        let mut trainer = with_group(Trainer::<B>::new(training, config.loss.clone())?);
        for name in &config.logging.metrics {
            trainer = trainer.with_metric(
                kiln::train::metric_by_name(name)
                    .with_context(|| format!("unknown metric {name}"))?,
            );
        }
        if let Some(es) = &config.early_stopping {
            trainer = trainer.with_callback(EarlyStopping::new(
                es.monitor.clone(),
                es.mode,
                es.patience,
                es.min_delta,
            ));
        }
        trainer.fit(
            &mut state,
            train_loader.as_ref(),
            val_loader.as_ref().map(|v| v.as_ref()),
        )?;
        // Rank 0's final evaluation reduces over every rank.
        if let Some(val) = &val_loader {
            state.model.set_mode(Mode::Eval);
            trainer.evaluate(&mut state.model, val.as_ref())?;
        }
        return Ok(());
    }

    // From here on the run writes, holding its directory's lock.
    let start = if resume_from.is_some() {
        RunStart::Resume
    } else {
        RunStart::New
    };
    let _run = RunDirectory::acquire(out, start)?;
    if start == RunStart::New {
        // A new run's directory was empty: the resolved config is the run's own file.
        std::fs::write(out.join("config.toml"), toml_string(config)?)
            .with_context(|| format!("writing {}", out.join("config.toml").display()))?;
    }

    let trainable = state.model.num_trainable_parameters()?;
    let total = state.model.num_parameters()?;
    println!(
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

    let checkpoints = out.join("checkpoints");
    let mut trainer = with_group(Trainer::<B>::new(training, config.loss.clone())?)
        .with_checkpointer(
            Checkpointer::new(&checkpoints, config.checkpoint.clone())?,
            Some(definition.clone()),
        );
    for name in &config.logging.metrics {
        let make =
            kiln::train::metric_by_name(name).with_context(|| format!("unknown metric {name}"))?;
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
    if config.logging.csv {
        trainer = trainer.with_sink(match &resume_from {
            Some(_) => kiln::train::CsvSink::resume(out, state.step)?,
            None => kiln::train::CsvSink::new(out)?,
        });
    }
    if config.logging.tensorboard {
        let dir = out.join("tensorboard");
        trainer = trainer.with_sink(match &resume_from {
            Some(_) => kiln::train::TensorBoardSink::resume(dir, state.step)?,
            None => kiln::train::TensorBoardSink::new(dir)?,
        });
    }
    if config.logging.progress {
        trainer = trainer.with_sink(kiln::train::ProgressSink::new());
    } else {
        trainer = trainer.with_sink(kiln::train::LogSink::new());
    }

    let history = trainer.fit(
        &mut state,
        train_loader.as_ref(),
        val_loader.as_ref().map(|v| v.as_ref()),
    )?;
    state.model.set_mode(Mode::Eval);
    let final_metrics = match &val_loader {
        Some(val) => trainer.evaluate(&mut state.model, val.as_ref())?,
        None => Vec::new(),
    };
    let weights = out.join("model.safetensors");
    let mut metadata = std::collections::BTreeMap::new();
    metadata.insert("format".to_owned(), "pt".to_owned());
    state
        .model
        .state_tensors()?
        .save_safetensors(&weights, &metadata)?;
    if config.logging.plots && !history.is_empty() {
        let png = out.join("curves.png");
        kiln::train::plot_curves(&history, &png, &kiln::train::PlotOptions::default())?;
        println!("kiln: curves plotted to {}", png.display());
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
    println!(
        "kiln: done in {:.1}s, {} steps; {summary}",
        started.elapsed().as_secs_f64(),
        state.step,
    );
    let skipped =
        train_loader.skipped_samples() + val_loader.as_ref().map_or(0, |v| v.skipped_samples());
    if skipped > 0 {
        println!(
            "kiln: {skipped} images skipped because they could not be read or decoded \
             (data.on_error = \"skip\"; each is named in a warning above)"
        );
    }
    println!(
        "kiln: weights in {}, checkpoints in {}",
        weights.display(),
        checkpoints.display()
    );
    Ok(())
}

/// Moves a checkpoint's position in its epoch to `world_size` ranks: each rank
/// counts its own batches, so the same global position is `batch_in_epoch *
/// old / new` batches per rank (with the same batch size), which must be whole.
/// Every rank then takes its share of the rest of the epoch's global order.
fn reshard(checkpoint: &mut Checkpoint, world_size: u64, path: &Path) -> Result<()> {
    let old = checkpoint.world_size.max(1);
    if old == world_size {
        return Ok(());
    }
    let consumed = checkpoint.batch_in_epoch * old;
    if !consumed.is_multiple_of(world_size) {
        anyhow::bail!(
            "checkpoint {}: written by {old} ranks after {} batches each of epoch {}, which is \
             not a whole number of batches for {world_size} ranks; resume with {old} ranks, or \
             from a checkpoint written at the end of an epoch",
            path.display(),
            checkpoint.batch_in_epoch,
            checkpoint.epoch
        );
    }
    log::info!(
        "resuming a run of {old} ranks on {world_size}: epoch {} continues at batch {} of each rank",
        checkpoint.epoch,
        consumed / world_size
    );
    checkpoint.batch_in_epoch = consumed / world_size;
    checkpoint.world_size = world_size;
    Ok(())
}

/// The config's model with the output shape of each torchscript layer (torch)
/// and saved_model layer (TensorFlow) found, by running it once on an example
/// of `inputs` (a batch of the data) or from its signature.
pub(crate) fn resolve_model(
    config: &RunConfig,
    inputs: &HostTensor,
    device: Device,
) -> Result<Layer> {
    let example = inputs.dims().get(1..).unwrap_or_default();
    let mut model = config.model.clone();
    if !model.torchscript_layers().is_empty() {
        model = kiln::torch::resolve_torchscript_shapes(&model, example, inputs.dtype(), device)?;
    }
    if !model.saved_model_layers().is_empty() {
        model = Tensorflow::resolve_saved_model_shapes(&model, example, inputs.dtype())?;
    }
    Ok(model)
}

fn toml_string(config: &RunConfig) -> Result<String> {
    toml::to_string_pretty(config).context("writing the resolved config")
}
