//! The command line as `clap` parses it: every command's arguments, and how
//! `kiln train`'s flags meet the config. A leaf: the commands import it, it
//! imports none of them.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::{BackendKind, RunConfig};
use crate::launch::LaunchArgs;
use crate::prelude::*;
use kiln_core::precision::FloatPrecision;

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Train neural networks from Rust on libtorch or TensorFlow"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
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
    /// file, an ONNX model (inputs, outputs, opsets, operators), a TensorFlow
    /// SavedModel directory (its signatures with input and output names, dtypes
    /// and shapes), or the model a run's config builds (its summary).
    Inspect {
        /// A checkpoint, TorchScript or ONNX file, a SavedModel directory, or
        /// a run's TOML config (its model summary, as `torchinfo` prints it:
        /// each layer's output shape, parameters and mult-adds for one sample
        /// of the config's data).
        checkpoint: PathBuf,
        /// For a config: the deepest layers listed (`-1`: all; deeper ones
        /// count in their parent's row).
        #[arg(long, allow_negative_numbers = true)]
        depth: Option<i64>,
    },
    /// Write a trained model as ONNX, TorchScript or a TensorFlow SavedModel.
    Export(ExportArgs),
    /// Put a run's checkpoint (a sharded one's every shard) together into
    /// one file: a Kiln checkpoint, or the model's weights alone.
    Consolidate(ConsolidateArgs),
    /// Generate text with a language model (a Hugging Face directory or a
    /// Kiln checkpoint) on libtorch, with a key/value cache.
    Generate(GenerateArgs),
    /// Start N worker processes on this node for data-parallel training, as
    /// `torchrun --standalone --nproc-per-node N --no-python` does: each runs
    /// `kiln ARGS` (or `--exec PROGRAM ARGS`) with RANK, WORLD_SIZE, MASTER_ADDR,
    /// MASTER_PORT and torchrun's other variables set.
    Launch(LaunchArgs),
    /// Tune a run before training it: `kiln tune lr` (the learning-rate range test).
    #[command(subcommand)]
    Tune(TuneCommand),
}

/// `kiln tune`'s tools.
#[derive(Subcommand)]
pub(crate) enum TuneCommand {
    /// The learning-rate range test of Lightning's `LearningRateFinder`: train
    /// for a number of steps while the learning rate grows, record the smoothed
    /// loss, and suggest the rate where it falls fastest. Nothing of the model
    /// is kept; the results go to their own directory.
    Lr(LrFindArgs),
}

/// `kiln tune lr`'s arguments.
#[derive(Args)]
pub(crate) struct LrFindArgs {
    /// The run config (TOML): its data, model, loss and optimizer are tested.
    #[arg(long)]
    pub(crate) config: PathBuf,
    /// Where the results go (`lr_find.csv`, `lr_find.png`); a new or empty
    /// directory [default: the config's `output_dir` with `-lr-find` appended].
    #[arg(long)]
    pub(crate) output: Option<PathBuf>,
    /// The first learning rate.
    #[arg(long, default_value_t = 1e-8)]
    pub(crate) min_lr: f64,
    /// The last learning rate.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) max_lr: f64,
    /// Optimizer steps, one learning rate each.
    #[arg(long, default_value_t = 100)]
    pub(crate) num_training: usize,
    /// How the rate grows: exponential or linear.
    #[arg(long, default_value = "exponential", value_parser = parse_sweep)]
    pub(crate) mode: kiln_train::LrSweep,
    /// Stop once the smoothed loss exceeds this many times the best one
    /// (0: never stop early).
    #[arg(long, default_value_t = 4.0, allow_negative_numbers = true)]
    pub(crate) early_stop_threshold: f64,
    /// How the rate is suggested: `lightning` (Lightning's rule, the steepest
    /// slope against the rate) or `log` (the steepest slope against its
    /// logarithm: the steepest stretch of the plotted curve).
    #[arg(long, default_value = "lightning", value_parser = ["lightning", "log"])]
    pub(crate) suggestion: String,
    /// Also write a copy of the config with the optimizer's `lr` set to the
    /// suggestion to this new file (never over an existing file).
    #[arg(long)]
    pub(crate) save_config: Option<PathBuf>,
    /// Override `device` (cpu, cuda, cuda:N).
    #[arg(long)]
    pub(crate) device: Option<Device>,
    /// Override `backend` (torch, tensorflow).
    #[arg(long, value_parser = parse_backend)]
    pub(crate) backend: Option<BackendKind>,
    /// Override `seed`.
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Override `training.precision`.
    #[arg(long)]
    pub(crate) precision: Option<FloatPrecision>,
    /// Override `data.batch_size`.
    #[arg(long)]
    pub(crate) batch_size: Option<usize>,
    /// Override `data.workers`.
    #[arg(long)]
    pub(crate) workers: Option<usize>,
}

fn parse_sweep(value: &str) -> std::result::Result<kiln_train::LrSweep, String> {
    match value {
        "exponential" => Ok(kiln_train::LrSweep::Exponential),
        "linear" => Ok(kiln_train::LrSweep::Linear),
        other => Err(format!(
            "unknown mode `{other}`; expected `exponential` or `linear`"
        )),
    }
}

impl LrFindArgs {
    /// The same config as `kiln train` with these flags would train.
    pub(crate) fn train_args(&self) -> TrainArgs {
        TrainArgs {
            config: self.config.clone(),
            epochs: None,
            max_steps: None,
            device: self.device,
            seed: self.seed,
            backend: self.backend,
            precision: self.precision,
            output: None,
            lr: None,
            batch_size: self.batch_size,
            workers: self.workers,
            resume: None,
            resume_on_other_data: false,
            no_progress: true,
            profile: None,
        }
    }
}

/// `kiln train`'s arguments.
#[derive(Args)]
pub(crate) struct TrainArgs {
    /// The run config (TOML).
    #[arg(long)]
    pub(crate) config: PathBuf,
    /// Override `training.epochs`.
    #[arg(long)]
    pub(crate) epochs: Option<u64>,
    /// Override `training.max_steps`.
    #[arg(long)]
    pub(crate) max_steps: Option<u64>,
    /// Override `device` (cpu, cuda, cuda:N).
    #[arg(long)]
    pub(crate) device: Option<Device>,
    /// Override `seed`.
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Override `backend` (torch, tensorflow).
    #[arg(long, value_parser = parse_backend)]
    pub(crate) backend: Option<BackendKind>,
    /// Override `training.precision` (32-true, bf16-mixed, bf16-true, 16-mixed, 16-true).
    #[arg(long)]
    pub(crate) precision: Option<FloatPrecision>,
    /// Override `output_dir`.
    #[arg(long)]
    pub(crate) output: Option<PathBuf>,
    /// Override the optimizer's learning rate.
    #[arg(long)]
    pub(crate) lr: Option<f64>,
    /// Override `data.batch_size`.
    #[arg(long)]
    pub(crate) batch_size: Option<usize>,
    /// Override `data.workers`.
    #[arg(long)]
    pub(crate) workers: Option<usize>,
    /// Resume from a checkpoint file, or `auto` for the run in `output_dir`
    /// (`checkpoints/last.safetensors`, else its newest step checkpoint; a new
    /// run when the directory is absent or empty).
    #[arg(long)]
    pub(crate) resume: Option<String>,
    /// With --resume: continue the checkpoint's run on data other than the data
    /// it recorded (another size or content), starting the epoch in progress
    /// again from its first batch. Without it such a resume is refused.
    #[arg(long, requires = "resume")]
    pub(crate) resume_on_other_data: bool,
    /// No progress bar (plain log lines only).
    #[arg(long)]
    pub(crate) no_progress: bool,
    /// Profile steps START..END (`steps=10..20`: steps 10 to 19, numbered from 1 as
    /// the logs number them) with the engine's profiler: a Chrome/Perfetto trace and
    /// the top operators by self time, with the data loader's wait, in the run's
    /// `profile/` directory.
    #[arg(long, value_parser = parse_profile, value_name = "steps=START..END")]
    pub(crate) profile: Option<kiln_train::ProfileConfig>,
}

fn parse_profile(text: &str) -> std::result::Result<kiln_train::ProfileConfig, String> {
    text.parse().map_err(|e: kiln_core::Error| e.to_string())
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
        let mut config = RunConfig::load_unvalidated(&self.config)?;
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
        set(&mut config.data.loader.batch_size, &self.batch_size);
        set(&mut config.data.loader.workers, &self.workers);
        if let Some(lr) = self.lr {
            config.optimizer = config.optimizer.clone().with_lr(lr);
        }
        if self.no_progress {
            config.logging.progress = false;
        }
    }
}

/// `kiln eval`'s arguments (and `kiln predict`'s, but its output).
#[derive(Args)]
pub struct CheckpointArgs {
    /// The run config (TOML) that names the data.
    #[arg(long)]
    pub(crate) config: PathBuf,
    /// The checkpoint file, or a Hugging Face model directory whose weights
    /// fit the config's model (`[model] pretrained` naming it); `predict` also
    /// takes an ONNX model, `*.onnx`.
    #[arg(long)]
    pub(crate) checkpoint: PathBuf,
    /// Override `device`.
    #[arg(long)]
    pub(crate) device: Option<Device>,
}

/// `kiln predict`'s arguments.
#[derive(Args)]
pub struct PredictArgs {
    #[command(flatten)]
    pub(crate) common: CheckpointArgs,
    /// Where to write the predictions (CSV: index, predicted class, label, scores).
    #[arg(long)]
    pub(crate) output: PathBuf,
    /// Replace `--output` if it exists (it is never written over otherwise).
    #[arg(long)]
    pub(crate) overwrite: bool,
}

/// The formats `kiln export` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum ExportFormat {
    /// An ONNX model of standard operators (IR 10, opset 21), for ONNX Runtime.
    Onnx,
    /// A TorchScript file, for `torch.jit.load`, libtorch and TorchServe.
    Torchscript,
    /// A TensorFlow SavedModel directory with a `serving_default` signature.
    Savedmodel,
}

impl From<ExportFormat> for kiln_core::export::ExportFormat {
    fn from(format: ExportFormat) -> Self {
        match format {
            ExportFormat::Onnx => Self::Onnx,
            ExportFormat::Torchscript => Self::TorchScript,
            ExportFormat::Savedmodel => Self::SavedModel,
        }
    }
}

#[derive(Args)]
pub(crate) struct ExportArgs {
    /// A Kiln checkpoint (`checkpoints/last.safetensors`), or a run's
    /// `model.safetensors` together with --config.
    #[arg(long)]
    pub(crate) checkpoint: PathBuf,
    /// The run config: its model is the definition exported (the checkpoint
    /// must have been trained with it) and its data gives the input shape.
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// What to write.
    #[arg(long, value_enum)]
    pub(crate) format: ExportFormat,
    /// The file (onnx, torchscript) or directory (savedmodel) to create.
    #[arg(long)]
    pub(crate) output: PathBuf,
    /// The shape of one input sample, without the batch dimension (`1,8,8`).
    /// Default: the config's data, else the first layer's input (Linear).
    #[arg(long, value_parser = parse_shape)]
    pub(crate) input_shape: Option<SampleShape>,
    /// A fixed batch size instead of a dynamic batch dimension (onnx).
    #[arg(long)]
    pub(crate) batch_size: Option<usize>,
    /// The input's name in the exported model (onnx, savedmodel; default `input`).
    #[arg(long)]
    pub(crate) input_name: Option<String>,
    /// The output's name in the exported model (onnx, savedmodel; default `output`).
    #[arg(long)]
    pub(crate) output_name: Option<String>,
    /// Replace `--output` if it exists (it is never written over otherwise).
    #[arg(long)]
    pub(crate) overwrite: bool,
}

/// `kiln consolidate`'s arguments.
#[derive(Args)]
pub(crate) struct ConsolidateArgs {
    /// A run directory (its newest checkpoint, `checkpoints/last.safetensors`,
    /// is read) or a checkpoint file (a sharded checkpoint's index,
    /// `step-<n>.safetensors`).
    pub(crate) run: PathBuf,
    /// The file to create: a Kiln checkpoint of the whole state (model,
    /// optimizer, where training stood), which `kiln eval`, `kiln export`,
    /// `kiln train --resume` and Python's `safetensors` read.
    #[arg(long)]
    pub(crate) output: PathBuf,
    /// Write the model's weights alone, under PyTorch names, as a run's
    /// `model.safetensors` (for `safetensors.torch.load_file` and
    /// `kiln export --config`).
    #[arg(long)]
    pub(crate) weights_only: bool,
    /// Replace `--output` if it exists (it is never written over otherwise).
    #[arg(long)]
    pub(crate) overwrite: bool,
}

/// `--input-shape`: one sample's dimensions.
#[derive(Clone, Debug)]
pub(crate) struct SampleShape(pub(crate) Vec<usize>);

fn parse_shape(text: &str) -> std::result::Result<SampleShape, String> {
    text.split(',')
        .map(|d| match d.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "`{text}`: expected positive sizes separated by commas, such as `1,8,8`"
            )),
        })
        .collect::<std::result::Result<_, _>>()
        .map(SampleShape)
}

/// `kiln generate`'s arguments.
#[derive(Args)]
pub(crate) struct GenerateArgs {
    /// A Hugging Face model directory (config.json and safetensors weights), a
    /// model named as on the Hub (`Qwen/Qwen3-0.6B`, from the local Hugging
    /// Face cache), or a Kiln checkpoint (`checkpoints/last.safetensors`) of a
    /// language model.
    #[arg(long)]
    pub(crate) model: String,
    /// The branch, tag or commit of a Hub model (default `main`).
    #[arg(long)]
    pub(crate) revision: Option<String>,
    /// A prompt (repeat for a batch; prompts of different lengths are padded on the left).
    #[arg(long, required_unless_present_any = ["prompt_ids", "messages"])]
    pub(crate) prompt: Vec<String>,
    /// A prompt as comma-separated token ids, without a tokenizer (repeatable).
    #[arg(long, conflicts_with = "prompt")]
    pub(crate) prompt_ids: Vec<String>,
    /// Chat: each prompt is a user's message, rendered through the model's chat
    /// template with its assistant header after it (`add_generation_prompt`);
    /// generation stops at the end of the assistant's turn and the reply alone
    /// is printed.
    #[arg(long, conflicts_with = "prompt_ids")]
    pub(crate) chat: bool,
    /// A system message before each prompt's conversation (with --chat).
    #[arg(long, requires = "chat")]
    pub(crate) system: Option<String>,
    /// A conversation to answer, as a JSON file: a list of messages
    /// (`{"role": "user", "content": "..."}`, ...), rendered through the chat
    /// template as --chat renders a prompt.
    #[arg(long, conflicts_with_all = ["prompt", "prompt_ids"])]
    pub(crate) messages: Option<PathBuf>,
    /// A variable of the chat template, `NAME=VALUE` with VALUE in JSON
    /// (`enable_thinking=false`; a bare word is a string). Repeatable.
    #[arg(long = "chat-var", value_name = "NAME=VALUE")]
    pub(crate) chat_vars: Vec<String>,
    /// A Jinja chat template file to render with instead of the model's.
    #[arg(long)]
    pub(crate) chat_template: Option<PathBuf>,
    /// The directory of `tokenizer.json` (default: the model directory).
    #[arg(long)]
    pub(crate) tokenizer: Option<PathBuf>,
    /// A PEFT LoRA adapter directory (`adapter_config.json`,
    /// `adapter_model.safetensors`) for the model directory, merged in first.
    #[arg(long)]
    pub(crate) adapter: Option<PathBuf>,
    /// New tokens per prompt at most.
    #[arg(long, default_value_t = 64)]
    pub(crate) max_new_tokens: usize,
    /// Sample with this temperature instead of decoding greedily (default:
    /// the model's `generation_config.json`, which may sample).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) temperature: Option<f64>,
    /// Decode greedily even where the model's `generation_config.json` samples.
    #[arg(long, conflicts_with_all = ["temperature", "top_k", "top_p"])]
    pub(crate) greedy: bool,
    /// Sample from the k most likely tokens.
    #[arg(long)]
    pub(crate) top_k: Option<usize>,
    /// Sample from the most likely tokens holding this probability.
    #[arg(long)]
    pub(crate) top_p: Option<f64>,
    /// The sampling seed.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// A token id that ends a sequence (repeatable; default the model's
    /// `eos_token_id`).
    #[arg(long)]
    pub(crate) stop: Vec<i64>,
    /// Rerun the whole sequence every step instead of caching keys and values.
    #[arg(long)]
    pub(crate) no_cache: bool,
    /// The device (cpu, cuda, cuda:N).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: Device,
}
