//! `kiln-tensorflow`: the `kiln` CLI with TensorFlow. Users run `kiln`, which runs
//! this executable (beside it) with the same arguments for the commands that need
//! TensorFlow; everything else, and the CLI itself, is the same code (`../kiln/`).
//!
//! TensorFlow's libraries load, and print their start-up lines, before `main`:
//! when `kiln` captured those (Kiln quiet), `main` first puts the real stderr back
//! and shows them only at debug level (see `stderr.rs` and `../kiln/forward.rs`).

#[path = "../kiln/cli.rs"]
mod cli;
#[path = "../kiln/config.rs"]
mod config;
#[path = "../kiln/data.rs"]
mod data;
#[path = "../kiln/evaluate.rs"]
mod evaluate;
#[path = "../kiln/export.rs"]
mod export;
#[path = "../kiln/inspect.rs"]
mod inspect;
#[path = "../kiln/launch.rs"]
mod launch;
#[path = "../kiln/ranks.rs"]
mod ranks;
#[path = "../kiln/resume.rs"]
mod resume;
mod stderr;

use std::path::Path;

use anyhow::Result;
use clap::Parser;
use kiln::core::distributed::Rendezvous;
use kiln::prelude::*;
use kiln::tf::TfBackend;

use crate::cli::{out, ParallelBackend, TensorflowCommands};
use crate::config::RunConfig;
use crate::evaluate::{CheckpointArgs, PredictArgs};
use crate::resume::Resume;

/// TensorFlow models train data-parallel over c10d's Gloo group through a host
/// all-reduce of their gradients.
impl ParallelBackend for TfBackend {
    type Sync = kiln::tf::GradientAllReduce;

    fn data_parallel(
        model: &kiln::tf::TfModel,
        group: &std::sync::Arc<kiln::c10d::ProcessGroup>,
        options: &kiln::core::distributed::DistributedOptions,
    ) -> Result<kiln::tf::GradientAllReduce> {
        Ok(kiln::tf::GradientAllReduce::new(
            model,
            group.clone(),
            options,
        )?)
    }
}

/// The TensorFlow commands, on the TensorFlow C API.
pub(crate) struct Tensorflow;

impl TensorflowCommands for Tensorflow {
    fn register_layers() -> Result<()> {
        #[cfg(feature = "ops")]
        kiln::fused_ops::register_layers()?;
        Ok(())
    }

    fn train(config: &RunConfig, resume: &Resume, rendezvous: Option<&Rendezvous>) -> Result<()> {
        cli::train_on::<TfBackend>(config, resume, rendezvous)
    }

    fn eval(args: &CheckpointArgs, config: &RunConfig) -> Result<()> {
        evaluate::eval_on::<TfBackend>(args, config)
    }

    fn predict(args: &PredictArgs, config: &RunConfig) -> Result<()> {
        evaluate::predict_on::<TfBackend>(args, config)
    }

    fn resolve_saved_model_shapes(model: &Layer, example: &[usize], dtype: DType) -> Result<Layer> {
        Ok(kiln::tf::resolve_saved_model_shapes(model, example, dtype)?)
    }

    fn export_saved_model(
        source: &export::Source,
        options: &export::SavedModelOptions<'_>,
    ) -> Result<()> {
        let model = export::build::<TfBackend>(source, options.checkpoint)?;
        kiln::tf::SavedModelExport::new(&model, &source.input_shape)
            .input_name(options.input_name)
            .output_name(options.output_name)
            .overwrite(options.overwrite)
            .write(options.output)?;
        Ok(())
    }

    fn inspect_saved_model(path: &Path) -> Result<()> {
        let model = kiln::tf::SavedModel::load(path)?;
        out!("{}", model.describe());
        Ok(())
    }
}

fn main() {
    // Before anything else writes to stderr.
    let start = stderr::take_back();
    cli::init_logging();
    stderr::replay(start);
    if let Err(error) = cli::run(cli::Cli::parse()) {
        cli::exit_with(&error);
    }
}
