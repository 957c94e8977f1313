//! `kiln`: train, evaluate, predict and inspect from a TOML config.
//!
//! ```text
//! kiln train --config examples/configs/digits-cnn.toml [--epochs N] [--device cuda:0] ...
//! kiln eval --config CONFIG --checkpoint runs/digits-cnn/checkpoints/last.safetensors
//! kiln predict --config CONFIG --checkpoint CKPT --output predictions.csv
//! kiln inspect runs/digits-cnn/checkpoints/last.safetensors
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use kiln::core::{
    load_digits, train_test_split, BackendKind, Checkpoint, Checkpointer, DataLoader, DatasetKind,
    EarlyStopping, FloatPrecision, HostTensor, InMemoryDataset, Module, RunConfig, TrainBackend,
    Trainer, TrainingState,
};
use kiln::prelude::*;

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

#[derive(Subcommand)]
enum Command {
    /// Train a model described by a TOML config.
    Train(TrainArgs),
    /// Evaluate a checkpoint on the config's validation split.
    Eval(CheckpointArgs),
    /// Write a checkpoint's predictions for the validation split as CSV.
    Predict(PredictArgs),
    /// Show what is inside a checkpoint (a table of tensors) or a TensorFlow
    /// SavedModel directory (its signatures with input and output names, dtypes and shapes).
    Inspect {
        /// A checkpoint file, or a SavedModel directory.
        checkpoint: PathBuf,
    },
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
    /// Resume from a checkpoint file, or `auto` for `<output_dir>/checkpoints/last.safetensors`.
    #[arg(long)]
    resume: Option<String>,
    /// No progress bar (plain log lines only).
    #[arg(long)]
    no_progress: bool,
}

#[derive(Args)]
struct CheckpointArgs {
    /// The run config (TOML) that names the data.
    #[arg(long)]
    config: PathBuf,
    /// The checkpoint file.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Override `device`.
    #[arg(long)]
    device: Option<Device>,
}

#[derive(Args)]
struct PredictArgs {
    #[command(flatten)]
    common: CheckpointArgs,
    /// Where to write the predictions (CSV: index, predicted class, label, scores).
    #[arg(long)]
    output: PathBuf,
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_target(false)
        .init();
    if let Err(error) = run(Cli::parse()) {
        eprintln!("error: {error:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    // Configs can then use Kiln's fused ops as layers (`type = "custom", op = "kiln::swish"`).
    #[cfg(feature = "ops")]
    kiln::ops::register_layers()?;
    match cli.command {
        Command::Train(args) => train(args),
        Command::Eval(args) => eval(args),
        Command::Predict(args) => predict(args),
        Command::Inspect { checkpoint } => inspect(&checkpoint),
    }
}

/// The workspace's provisioned data directory, for the default digits path.
fn default_digits() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".kiln/data/digits.csv.gz")
}

/// Features and labels of the configured dataset, scaled and shaped, split into
/// training and validation sets.
struct Data {
    train: (HostTensor, HostTensor),
    val: (HostTensor, HostTensor),
}

fn load_data(config: &RunConfig) -> Result<Data> {
    let data = &config.data;
    let path = || {
        data.path
            .clone()
            .context("data.path is required for this dataset")
    };
    let (features, labels) = match data.dataset {
        DatasetKind::Digits => {
            let path = data.path.clone().unwrap_or_else(default_digits);
            load_digits(&path).with_context(|| {
                format!(
                    "loading the digits data set from {} (run `cargo xtask setup` to provision it)",
                    path.display()
                )
            })?
        }
        DatasetKind::Mnist => {
            // MNIST has its own test split: it is the validation set.
            let mnist = kiln::core::load_mnist(&path()?)?;
            let shape = |x: HostTensor| scale_and_shape(x, data);
            return Ok(Data {
                train: (shape(mnist.train_images)?, mnist.train_labels),
                val: (shape(mnist.test_images)?, mnist.test_labels),
            });
        }
        DatasetKind::Csv => {
            let options = kiln::core::CsvOptions {
                has_header: data.has_header,
                label_column: match &data.label_column {
                    None => kiln::core::LabelColumn::Last,
                    Some(c) => match c.parse::<usize>() {
                        Ok(index) => kiln::core::LabelColumn::Index(index),
                        Err(_) => kiln::core::LabelColumn::Name(c.clone()),
                    },
                },
                ..Default::default()
            };
            kiln::core::load_csv(&path()?, &options)?
        }
    };
    let features = scale_and_shape(features, data)?;
    let (train, val) = train_test_split(&features, &labels, data.val_fraction, config.seed)?;
    Ok(Data { train, val })
}

/// Divides by `data.scale` and reshapes each example to `data.input_shape`.
fn scale_and_shape(features: HostTensor, data: &kiln::core::DataConfig) -> Result<HostTensor> {
    let n = features.dims().first().copied().unwrap_or(0);
    let numel = features.numel();
    let scaled: Vec<f32> = features
        .to_dtype(DType::F32)
        .as_slice::<f32>()?
        .iter()
        .map(|v| (*v as f64 / data.scale) as f32)
        .collect();
    let mut shape = vec![n];
    match &data.input_shape {
        Some(dims) => shape.extend(dims),
        None => shape.push(numel / n.max(1)),
    }
    HostTensor::new(scaled, shape)
        .context("data.input_shape does not match the number of features per example")
}

fn loader(
    (x, y): (HostTensor, HostTensor),
    config: &RunConfig,
    shuffle: bool,
) -> Result<Box<dyn DataLoader>> {
    let data = &config.data;
    let mut loader = kiln::core::PrefetchLoader::new(InMemoryDataset::new(x, y)?, data.batch_size)?
        .num_workers(data.workers)
        .drop_last(shuffle && data.drop_last);
    if shuffle {
        loader = loader.shuffle(config.seed);
    }
    Ok(Box::new(loader))
}

fn load_config(path: &Path) -> Result<RunConfig> {
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
    match config.backend {
        BackendKind::Torch => {
            train_on::<kiln::torch::TorchBackend>(&config, args.resume.as_deref())
        }
        BackendKind::Tensorflow => train_on::<kiln::tf::TfBackend>(&config, args.resume.as_deref()),
    }
}

fn train_on<B: TrainBackend>(config: &RunConfig, resume: Option<&str>) -> Result<()> {
    let started = Instant::now();
    let out = &config.output_dir;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join("config.toml"), toml_string(config)?)?;

    let data = load_data(config)?;
    let (n_train, n_val) = (data.train.1.dims()[0], data.val.1.dims()[0]);
    let train_loader = loader(data.train, config, true)?;
    let val_loader = loader(data.val, config, false)?;

    let mut training = config.training.clone();
    training.seed = config.seed;
    training.device = config.device;
    B::manual_seed(config.seed);
    let mut model = B::build_model(&config.model, config.device)?;
    B::set_precision(&mut model, config.training.precision)?;
    let optimizer = B::build_optimizer(&config.optimizer, &model, &config.param_groups)?;
    let scheduler = match &config.schedule {
        Some(s) => Some(s.build(&optimizer.learning_rates())?),
        None => None,
    };
    let mut state = TrainingState::<B>::new(model, optimizer, scheduler);

    let checkpoints = out.join("checkpoints");
    let resume_from = match resume {
        Some("auto") => {
            let last = Checkpointer::last_path(&checkpoints);
            last.exists().then_some(last)
        }
        Some(path) => Some(PathBuf::from(path)),
        None => None,
    };
    if let Some(path) = &resume_from {
        Trainer::<B>::resume(&mut state, path)?;
    }

    println!(
        "kiln: {} on {} in {} ({}), {} parameters; {} training and {} validation examples",
        B::NAME,
        config.device,
        config.training.precision,
        config.output_dir.display(),
        state.model.num_parameters(),
        n_train,
        n_val
    );

    let mut trainer = Trainer::<B>::new(training, config.loss.clone())?.with_checkpointer(
        Checkpointer::new(&checkpoints, config.checkpoint.clone())?,
        Some(config.model.clone()),
    );
    for name in &config.logging.metrics {
        let make =
            kiln::core::metric_by_name(name).with_context(|| format!("unknown metric {name}"))?;
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
            Some(_) => kiln::core::CsvSink::resume(out, state.step)?,
            None => kiln::core::CsvSink::new(out)?,
        });
    }
    if config.logging.tensorboard {
        let dir = out.join("tensorboard");
        trainer = trainer.with_sink(match &resume_from {
            Some(_) => kiln::core::TensorBoardSink::resume(dir, state.step)?,
            None => kiln::core::TensorBoardSink::new(dir)?,
        });
    }
    if config.logging.progress {
        trainer = trainer.with_sink(kiln::core::ProgressSink::new());
    } else {
        trainer = trainer.with_sink(kiln::core::LogSink::new());
    }

    let history = trainer.fit(&mut state, train_loader.as_ref(), Some(val_loader.as_ref()))?;
    state.model.set_mode(Mode::Eval);
    let final_metrics = trainer.evaluate(&mut state.model, val_loader.as_ref())?;
    let weights = out.join("model.safetensors");
    let mut metadata = std::collections::BTreeMap::new();
    metadata.insert("format".to_owned(), "pt".to_owned());
    state
        .model
        .state_tensors()?
        .save_safetensors(&weights, &metadata)?;
    if config.logging.plots && !history.is_empty() {
        let png = out.join("curves.png");
        kiln::core::plot_curves(&history, &png, &kiln::core::PlotOptions::default())?;
        println!("kiln: curves plotted to {}", png.display());
    }
    println!(
        "kiln: done in {:.1}s, {} steps; validation {}",
        started.elapsed().as_secs_f64(),
        state.step,
        final_metrics
            .iter()
            .map(|(k, v)| if k.contains("loss") {
                format!("{k} {v:.4}")
            } else {
                format!("{k} {:.2}%", 100.0 * v)
            })
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "kiln: weights in {}, checkpoints in {}",
        weights.display(),
        checkpoints.display()
    );
    Ok(())
}

fn toml_string(config: &RunConfig) -> Result<String> {
    toml::to_string_pretty(config).context("writing the resolved config")
}

/// Builds the checkpoint's model (from its recorded definition) and loads its weights.
fn restore<B: TrainBackend>(
    checkpoint: &Checkpoint,
    config: &RunConfig,
    device: Device,
) -> Result<B::Model> {
    let definition = checkpoint
        .model_definition
        .clone()
        .unwrap_or_else(|| config.model.clone());
    let mut model = B::build_model(&definition, device)?;
    B::set_precision(&mut model, config.training.precision)?;
    model.load_state_dict(&checkpoint.model)?;
    model.set_mode(Mode::Eval);
    Ok(model)
}

fn eval(args: CheckpointArgs) -> Result<()> {
    let config = load_config(&args.config)?;
    match config.backend {
        BackendKind::Torch => eval_on::<kiln::torch::TorchBackend>(&args, &config),
        BackendKind::Tensorflow => eval_on::<kiln::tf::TfBackend>(&args, &config),
    }
}

fn eval_on<B: TrainBackend>(args: &CheckpointArgs, config: &RunConfig) -> Result<()> {
    let device = args.device.unwrap_or(config.device);
    let checkpoint = Checkpoint::load(&args.checkpoint)?;
    let mut model = restore::<B>(&checkpoint, config, device)?;
    let val = loader(load_data(config)?.val, config, false)?;
    let mut training = config.training.clone();
    training.device = device;
    let mut trainer = Trainer::<B>::new(training, config.loss.clone())?;
    for name in &config.logging.metrics {
        trainer = trainer.with_metric(
            kiln::core::metric_by_name(name).with_context(|| format!("unknown metric {name}"))?,
        );
    }
    let metrics = trainer.evaluate(&mut model, val.as_ref())?;
    println!("{:<16} {:>12}", "metric", "value");
    for (name, value) in metrics {
        println!("{name:<16} {value:>12.6}");
    }
    Ok(())
}

fn predict(args: PredictArgs) -> Result<()> {
    let config = load_config(&args.common.config)?;
    match config.backend {
        BackendKind::Torch => predict_on::<kiln::torch::TorchBackend>(&args, &config),
        BackendKind::Tensorflow => predict_on::<kiln::tf::TfBackend>(&args, &config),
    }
}

fn predict_on<B: TrainBackend>(args: &PredictArgs, config: &RunConfig) -> Result<()> {
    let common = &args.common;
    let device = common.device.unwrap_or(config.device);
    let checkpoint = Checkpoint::load(&common.checkpoint)?;
    let mut model = restore::<B>(&checkpoint, config, device)?;
    let (x, y) = load_data(config)?.val;
    let labels = y.as_slice::<i64>()?.to_vec();
    let val = loader((x, y), config, false)?;
    let mut training = config.training.clone();
    training.device = device;
    let outputs =
        Trainer::<B>::new(training, config.loss.clone())?.predict(&mut model, val.as_ref())?;
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(&args.output)
            .with_context(|| format!("creating {}", args.output.display()))?,
    );
    let mut index = 0usize;
    for batch in outputs {
        let classes = batch.dims().get(1).copied().unwrap_or(1);
        if index == 0 {
            let scores: Vec<String> = (0..classes).map(|c| format!("score_{c}")).collect();
            writeln!(file, "index,predicted,label,{}", scores.join(","))?;
        }
        for row in batch.to_f64_vec().chunks(classes) {
            let predicted = row
                .iter()
                .enumerate()
                .fold((0, f64::NEG_INFINITY), |best, (i, v)| {
                    if *v > best.1 {
                        (i, *v)
                    } else {
                        best
                    }
                })
                .0;
            let scores: Vec<String> = row.iter().map(|v| format!("{v}")).collect();
            writeln!(
                file,
                "{index},{predicted},{},{}",
                labels[index],
                scores.join(",")
            )?;
            index += 1;
        }
    }
    file.flush()?;
    println!(
        "kiln: {index} predictions written to {}",
        args.output.display()
    );
    Ok(())
}

fn inspect(path: &Path) -> Result<()> {
    if path.is_dir() {
        let model = kiln::tf::SavedModel::load(path)?;
        print!("{}", model.describe());
        return Ok(());
    }
    let checkpoint = Checkpoint::load(path)?;
    println!("checkpoint  {}", path.display());
    println!("backend     {}", checkpoint.backend);
    println!(
        "position    step {}, epoch {}, batch {} of the epoch",
        checkpoint.step, checkpoint.epoch, checkpoint.batch_in_epoch
    );
    println!("seed        {}", checkpoint.seed);
    if let Some(def) = &checkpoint.model_definition {
        println!("model       {}", serde_json::to_string(def)?);
    }
    if let Some(s) = &checkpoint.scheduler {
        println!("schedule    {s}");
    }
    for (k, v) in &checkpoint.metrics {
        println!("metric      {k} = {v}");
    }
    println!();
    println!(
        "{:<40} {:<8} {:<16} {:>10}",
        "tensor", "dtype", "shape", "elements"
    );
    let mut params = 0usize;
    for (section, dict) in [
        ("model", &checkpoint.model),
        ("optimizer", &checkpoint.optimizer),
    ] {
        for (name, t) in dict.iter() {
            if section == "model" {
                params += t.numel();
            }
            println!(
                "{:<40} {:<8} {:<16} {:>10}",
                format!("{section}.{name}"),
                t.dtype().to_string(),
                t.shape().to_string(),
                t.numel()
            );
        }
    }
    println!(
        "\n{} model values, {} optimizer tensors",
        params,
        checkpoint.optimizer.len()
    );
    Ok(())
}
