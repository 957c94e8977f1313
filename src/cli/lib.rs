//! The `kiln` command line, written once for the two executables that run it:
//! `kiln` (libtorch only: it references no TensorFlow symbol, so TensorFlow's
//! libraries are not even loaded) and `kiln-tensorflow` (both engines). Each
//! executable's `main` is [`run`] with its [`Engines`]; what only TensorFlow
//! can do is behind that trait, implemented on the TensorFlow C API in
//! `kiln-tensorflow` alone (generic code is instantiated only where it is used).
//! `kiln` decides from the command line and the config, before it reads
//! anything else, whether a command needs TensorFlow
//! (`engines::needs_tensorflow`), and runs it in
//! `kiln-tensorflow` at once when it does (`forward.rs`); likewise whether it
//! needs an optional feature (`text`, `onnx`, `ops`) the executable was built
//! without (`needs.rs`), and then exits with [`FEATURES_MISSING_EXIT_CODE`].
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
//!
//! Modules, leaves first (none imports a module after it): `features` (what
//! the executable was built with), `config` (the TOML), `args` (the command
//! line), `output` (what commands print, the output check), `formats` (what a
//! checkpoint path holds), `launch`, `needs` (the features a command needs),
//! `forward` (running `kiln-tensorflow`), `engines` (the [`Engines`] trait,
//! the [`BackendJob`] a command runs on one backend, and the decision),
//! `model`, `data`, `resume`, `ranks`, `run` (what the training commands
//! share: the model and data prepared, the strategy, the trainer assembled,
//! the run directory), then the commands, one file each: `train`, `tune_lr`,
//! `evaluate` (`eval`, `predict`), `export`, `inspect`, `generate`,
//! `consolidate`, and `cli`, which dispatches to them.

mod args;
mod cli;
mod config;
mod consolidate;
mod data;
mod engines;
mod evaluate;
mod export;
mod features;
mod formats;
mod forward;
#[cfg(feature = "text")]
mod generate;
mod inspect;
mod launch;
mod model;
mod needs;
mod output;
mod ranks;
mod resume;
mod run;
mod train;
mod tune_lr;

pub use cli::run;
pub use config::RunConfig;
pub use engines::{BackendJob, Engines, Source, StrategyChoice, StrategyEngine, WithTrainable};
pub use features::{FeatureMissing, FEATURES_MISSING_EXIT_CODE};
pub use forward::TENSORFLOW_MISSING_EXIT_CODE;
pub use model::build_model;
pub use output::{init_logging, CAPTURE_NAME, STDERR_FD_VAR, TENSORFLOW_LOG_TARGET};

/// The names the commands use from Kiln's crates (the facade's prelude,
/// without the facade, which depends on this crate).
mod prelude {
    pub(crate) use kiln_core::prelude::*;
    pub(crate) use kiln_data::prelude::*;
    pub(crate) use kiln_train::prelude::*;
}
