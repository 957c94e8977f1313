//! The commands: parsing the command line, running one command with an
//! executable's [`Engines`], and `kiln train` (`train_on`, `fit`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::config::{BackendKind, FrozenBatchNorm, RunConfig};
use crate::engines::{needs_tensorflow, DataParallelEngine, Engines, TorchDdp};
use crate::evaluate::{CheckpointArgs, PredictArgs};
use crate::forward::{self, NeedsTensorflow};
use crate::prelude::*;
use crate::{evaluate, export, inspect, launch};
use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use kiln_c10d::ProcessGroup;
use kiln_core::distributed::Rendezvous;
use kiln_core::strategy::DataParallel;
use kiln_core::{
    backend::{TrainBackend, Trainable},
    precision::FloatPrecision,
};
use kiln_train::{Checkpointer, EarlyStopping, RunDirectory, RunStart, Trainer, TrainingState};

use crate::data::{load_data, loader, Split};
use crate::resume::{
    check_resume_data, check_resume_position, data_identity, follower_resume,
    load_resume_checkpoint, reshard, resolve_resume, Resume,
};

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Train neural networks from Rust on libtorch or TensorFlow"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// A command of `kiln`, as parsed.
#[derive(Subcommand)]
pub(crate) enum Command {
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

/// `kiln train`'s arguments.
#[derive(Args)]
pub(crate) struct TrainArgs {
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
    /// Override `training.precision` (32-true, bf16-mixed, bf16-true, 16-mixed, 16-true).
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
    /// With --resume: continue the checkpoint's run on data other than the data
    /// it recorded (another size or content), starting the epoch in progress
    /// again from its first batch. Without it such a resume is refused.
    #[arg(long, requires = "resume")]
    resume_on_other_data: bool,
    /// No progress bar (plain log lines only).
    #[arg(long)]
    no_progress: bool,
}

/// The log target of TensorFlow's own lines (`RUST_LOG=kiln=debug` shows them).
pub const TENSORFLOW_LOG_TARGET: &str = "kiln::tensorflow";

/// The name of the anonymous file (memfd) that captures TensorFlow's start-up lines.
pub const CAPTURE_NAME: &str = "kiln-tensorflow-start";

/// Set by `kiln` for `kiln-tensorflow` when it captures what TensorFlow prints
/// while its libraries load: `FD:DEV:INO`, the descriptor of the real stderr and
/// the device and inode it refers to (fd 2 is the capture, an anonymous file).
pub const STDERR_FD_VAR: &str = "KILN_TENSORFLOW_STDERR";

/// Writes a command's output to stdout. A reader that went away (`kiln inspect
/// CKPT | head -1`) ends the output, as it does for Unix tools: the rest is
/// dropped without a word, and the command finishes its work (a training run
/// goes on; its results are in the run directory).
pub(crate) fn write_out(text: std::fmt::Arguments<'_>) {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    static CLOSED: AtomicBool = AtomicBool::new(false);
    if CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut stdout = std::io::stdout().lock();
    if let Err(error) = stdout.write_fmt(text).and_then(|()| stdout.flush()) {
        CLOSED.store(true, Ordering::Relaxed);
        if error.kind() != std::io::ErrorKind::BrokenPipe {
            log::warn!("writing to stdout failed ({error}); the rest of the output is dropped");
        }
    }
}

/// `println!` for a command's output, through [`write_out`].
macro_rules! outln {
    () => {
        $crate::cli::write_out(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cli::write_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use outln;

/// `print!` for a command's output, through [`write_out`].
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::write_out(format_args!($($arg)*))
    };
}
pub(crate) use out;

/// Kiln's log lines on stderr, at `RUST_LOG`'s level (default `info`).
pub fn init_logging() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_target(false)
        .init();
}

/// Prints the error and exits as `kiln` does when a command fails.
fn exit_with(error: &anyhow::Error) -> ! {
    eprintln!("error: {error:#}");
    // Interrupted by a signal: exit as the shell reports a process it killed.
    let code = error
        .downcast_ref::<launch::Interrupted>()
        .map_or(1, launch::Interrupted::exit_code);
    std::process::exit(code);
}

/// Runs the command on this process's command line with engines `E`, and
/// exits as `kiln` does when it fails. `kiln` runs a command that needs
/// TensorFlow (decided before anything is read) in `kiln-tensorflow` instead.
pub fn run<E: Engines>() {
    let cli = Cli::parse();
    if !E::TENSORFLOW {
        if let Some(needs) = needs_tensorflow(&cli.command) {
            // Returns only when kiln-tensorflow could not be run.
            exit_with(&forward::run_tensorflow(&needs));
        }
    }
    let Err(error) = run_command::<E>(cli.command) else {
        return;
    };
    match error.downcast_ref::<NeedsTensorflow>() {
        // The safety net: a case `needs_tensorflow` did not foresee.
        Some(needs) if !E::TENSORFLOW => exit_with(&forward::run_tensorflow(needs)),
        _ => exit_with(&error),
    }
}

/// Runs one command.
fn run_command<E: Engines>(command: Command) -> Result<()> {
    // Configs can then use Kiln's fused ops as layers (`type = "custom", op = "kiln::swish"`).
    // The launcher only starts processes: its workers register them.
    if !matches!(command, Command::Launch(_)) {
        E::register_layers()?;
    }
    match command {
        Command::Train(args) => train::<E>(args),
        Command::Eval(args) => evaluate::eval::<E>(args),
        Command::Predict(args) => evaluate::predict::<E>(args),
        Command::Inspect { checkpoint } => inspect::inspect::<E>(&checkpoint),
        Command::Export(args) => export::export::<E>(args),
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

impl TrainArgs {
    /// The config with these flags applied, validated.
    pub(crate) fn config(&self) -> Result<RunConfig> {
        let mut config = load_config(&self.config)?;
        self.apply(&mut config);
        config
            .validate()
            .with_context(|| format!("config {}", self.config.display()))?;
        Ok(config)
    }

    /// Puts each flag given in place of the config's value: the one place
    /// where `kiln train`'s flags meet the config.
    fn apply(&self, config: &mut RunConfig) {
        fn set<T: Clone>(field: &mut T, flag: &Option<T>) {
            if let Some(value) = flag {
                *field = value.clone();
            }
        }
        set(&mut config.training.epochs, &self.epochs);
        set(&mut config.training.max_steps, &self.max_steps.map(Some));
        set(&mut config.device, &self.device);
        set(&mut config.seed, &self.seed);
        set(&mut config.backend, &self.backend);
        set(&mut config.training.precision, &self.precision);
        set(&mut config.output_dir, &self.output);
        set(&mut config.data.batch_size, &self.batch_size);
        set(&mut config.data.workers, &self.workers);
        if let Some(lr) = self.lr {
            config.optimizer = config.optimizer.clone().with_lr(lr);
        }
        if self.no_progress {
            config.logging.progress = false;
        }
    }
}

fn train<E: Engines>(args: TrainArgs) -> Result<()> {
    let mut config = args.config()?;
    // Started by `kiln launch`, torchrun or srun: one rank of a data-parallel job.
    let rendezvous = Rendezvous::from_env()?;
    if let Some(r) = &rendezvous {
        if let Device::Cuda(_) = config.device {
            // One GPU per local rank, as torchrun users set with LOCAL_RANK.
            config.device = Device::Cuda(r.local_rank);
        }
    }
    let resume = Resume {
        from: args.resume,
        on_other_data: args.resume_on_other_data,
    };
    match config.backend {
        BackendKind::Torch => {
            train_on::<E, kiln_torch::TorchBackend, TorchDdp>(&config, &resume, rendezvous.as_ref())
        }
        BackendKind::Tensorflow => E::train_tensorflow(&config, &resume, rendezvous.as_ref()),
    }
}

/// What a training run has prepared before its model trains: the checks done,
/// the data loaded, the definition resolved.
struct Prepared<'a> {
    config: &'a RunConfig,
    resume: &'a Resume,
    rendezvous: Option<&'a Rendezvous>,
    started: Instant,
    /// Rank 0 of a data-parallel job, or a single process: writes the run directory.
    primary: bool,
    resume_from: Option<PathBuf>,
    definition: Layer,
    identity: serde_json::Value,
    train_loader: Box<dyn DataLoader>,
    val_loader: Option<Box<dyn DataLoader>>,
    examples: (usize, usize),
}

/// `kiln train` on backend `B`, data-parallel through `P` when started as one
/// rank of a job.
pub fn train_on<E: Engines, B: TrainBackend, P: DataParallelEngine<B>>(
    config: &RunConfig,
    resume: &Resume,
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

    // Everything that can be checked is checked before the first byte is written.
    let resume_from = if primary {
        resolve_resume(config, resume.from.as_deref())?
    } else {
        follower_resume(config, resume.from.as_deref())?
    };
    let data = load_data::<E>(config)?;
    // Finding a torchscript layer's output shape runs it once (drawing nothing).
    let definition = resolve_model::<E>(config, &data.probe, config.device)?;
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
    let prepared = Prepared {
        config,
        resume,
        rendezvous,
        started,
        primary,
        resume_from,
        definition,
        identity,
        train_loader,
        val_loader,
        examples,
    };
    let Some(r) = rendezvous else {
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
            "kiln: rank 0 of {} ({}, {} backend)",
            r.world_size,
            r.launcher,
            options.backend
        );
    }
    let sync = P::data_parallel(&model, &group, &options)?;
    fit::<B, _>(prepared, DataParallel::new(model, sync)?)
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
        identity,
        train_loader,
        val_loader,
        examples: (n_train, n_val),
    } = prepared;
    let out = &config.output_dir;
    let optimizer = model.build_optimizer(&config.optimizer, &config.param_groups)?;
    let scheduler = match &config.schedule {
        Some(s) => Some(s.build(&optimizer.learning_rates())?),
        None => None,
    };
    let mut state = TrainingState::<B, M>::new(model, optimizer, scheduler);
    let world_size = rendezvous.map_or(1, |r| r.world_size as u64);
    if let Some(path) = &resume_from {
        let mut checkpoint = load_resume_checkpoint(config, &definition, path)?;
        check_resume_data(&mut checkpoint, &identity, path, resume.on_other_data)?;
        // Before resharding: a position under another data order means
        // nothing for any number of ranks.
        checkpoint.check_data_order(path)?;
        reshard(&mut checkpoint, world_size, path)?;
        check_resume_position(&checkpoint, train_loader.num_batches(), path)?;
        Trainer::<B, M>::resume_from(&mut state, &checkpoint, path)?;
    }

    let mut training = config.training.clone();
    training.seed = config.seed;
    training.device = config.device;
    let mut trainer = Trainer::<B, M>::new(training, config.loss.clone())?;
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
    if !primary {
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

    // Rank 0's outputs: checkpoints and metric sinks.
    let checkpoints = out.join("checkpoints");
    trainer = trainer
        .with_checkpointer(
            Checkpointer::new(&checkpoints, config.checkpoint.clone())?,
            Some(definition.clone()),
        )
        .with_data_identity(identity);
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
    outln!(
        "kiln: weights in {}, checkpoints in {}",
        weights.display(),
        checkpoints.display()
    );
    run.succeeded();
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

/// The config's model with the output shape of each torchscript layer (torch)
/// and saved_model layer (TensorFlow) found, by running it once on an example
/// of `inputs` (a batch of the data) or from its signature.
pub(crate) fn resolve_model<E: Engines>(
    config: &RunConfig,
    inputs: &HostTensor,
    device: Device,
) -> Result<Layer> {
    let example = inputs.dims().get(1..).unwrap_or_default();
    let mut model = config.model.clone();
    if !model.torchscript_layers().is_empty() {
        model = kiln_torch::resolve_torchscript_shapes(&model, example, inputs.dtype(), device)?;
    }
    if !model.saved_model_layers().is_empty() {
        model = E::resolve_saved_model_shapes(&model, example, inputs.dtype())?;
    }
    Ok(model)
}

/// Checks, before anything is read or written, that `command` (`predict`,
/// `export`) may write its output at `output`: its directory exists, and
/// nothing is there unless `overwrite` (a link whose target is missing is named
/// as such).
pub(crate) fn check_output(output: &Path, overwrite: bool, command: &str) -> Result<()> {
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        anyhow::bail!(
            "--output {}: the directory {} does not exist; {command} writes into an existing \
             directory: create it first, or choose another --output",
            output.display(),
            parent.display()
        );
    }
    if overwrite {
        return Ok(());
    }
    let Ok(meta) = std::fs::symlink_metadata(output) else {
        return Ok(());
    };
    if meta.file_type().is_symlink() && !output.exists() {
        let target = std::fs::read_link(output).unwrap_or_default();
        anyhow::bail!(
            "--output {} is a symbolic link to {}, which does not exist; {command} never \
             writes through or over a link unless told to: pass --overwrite to replace the \
             link, or choose another --output",
            output.display(),
            target.display()
        );
    }
    anyhow::bail!(
        "{} exists; {command} never writes over a file unless told to: pass --overwrite to \
         replace it, or choose another --output",
        output.display()
    )
}

fn toml_string(config: &RunConfig) -> Result<String> {
    toml::to_string_pretty(config).context("writing the resolved config")
}
