//! `kiln`: train, evaluate, predict, inspect and export from a TOML config
//! (the commands are in `cli.rs`).
//!
//! This executable runs everything on libtorch and never loads TensorFlow: it
//! references no TensorFlow symbol, so the linker leaves TensorFlow's libraries
//! out of it and `kiln --help` or a torch run starts without them. A command that
//! needs TensorFlow (the `tensorflow` backend, `export --format savedmodel`,
//! `inspect` of a SavedModel, a saved_model layer) runs in the sibling executable
//! `kiln-tensorflow` with the same arguments (see `forward.rs`).

mod cli;
mod config;
mod data;
mod evaluate;
mod export;
mod forward;
mod inspect;
mod launch;
mod ranks;
mod resume;

use std::path::Path;

use anyhow::Result;
use clap::Parser;
use kiln::core::distributed::Rendezvous;
use kiln::prelude::*;

use crate::cli::TensorflowCommands;
use crate::config::RunConfig;
use crate::evaluate::{CheckpointArgs, PredictArgs};
use crate::forward::NeedsTensorflow;
use crate::resume::Resume;

/// `kiln`'s TensorFlow commands: each one is refused with [`NeedsTensorflow`],
/// which `main` answers by running `kiln-tensorflow`.
pub(crate) struct Tensorflow;

impl TensorflowCommands for Tensorflow {
    fn register_layers() -> Result<()> {
        #[cfg(feature = "ops")]
        kiln::fused_ops::register_torch_layers();
        Ok(())
    }

    fn train(_: &RunConfig, _: &Resume, _: Option<&Rendezvous>) -> Result<()> {
        Err(NeedsTensorflow::new("training on the TensorFlow backend").into())
    }

    fn eval(_: &CheckpointArgs, _: &RunConfig) -> Result<()> {
        Err(NeedsTensorflow::new("evaluating on the TensorFlow backend").into())
    }

    fn predict(_: &PredictArgs, _: &RunConfig) -> Result<()> {
        Err(NeedsTensorflow::new("predicting on the TensorFlow backend").into())
    }

    fn resolve_saved_model_shapes(_: &Layer, _: &[usize], _: DType) -> Result<Layer> {
        Err(NeedsTensorflow::new("a saved_model layer").into())
    }

    fn export_saved_model(_: &export::Source, _: &export::SavedModelOptions<'_>) -> Result<()> {
        Err(NeedsTensorflow::new("exporting a SavedModel").into())
    }

    fn inspect_saved_model(_: &Path) -> Result<()> {
        Err(NeedsTensorflow::new("inspecting a SavedModel").into())
    }
}

fn main() {
    cli::init_logging();
    let Err(error) = cli::run(cli::Cli::parse()) else {
        return;
    };
    match error.downcast_ref::<NeedsTensorflow>() {
        // Returns only when kiln-tensorflow could not be run.
        Some(needs) => cli::exit_with(&forward::run_tensorflow(needs)),
        None => cli::exit_with(&error),
    }
}
