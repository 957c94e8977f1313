//! The `kiln` command line, written once for the two executables that run it:
//! `kiln` (libtorch only: it references no TensorFlow symbol, so TensorFlow's
//! libraries are not even loaded) and `kiln-tensorflow` (both engines). Each
//! executable's `main` is [`run`] with its [`Engines`]; what only TensorFlow
//! can do is behind that trait, implemented on the TensorFlow C API in
//! `kiln-tensorflow` alone (generic code is instantiated only where it is used).
//! `kiln` decides from the command line and the config, before it reads
//! anything else, whether a command needs TensorFlow
//! (`engines::needs_tensorflow`), and runs it in
//! `kiln-tensorflow` at once when it does (`forward.rs`).
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
//! Modules: `cli` (the commands, `kiln train`), `engines` (the [`Engines`]
//! trait and the decision), `evaluate` (`eval`, `predict`), `export`,
//! `inspect`, `launch`, `forward` (running `kiln-tensorflow`), `config` (the
//! TOML), `data`, `resume`, `ranks`.

mod cli;
mod config;
mod data;
mod engines;
mod evaluate;
mod export;
mod forward;
mod inspect;
mod launch;
mod ranks;
mod resume;

pub use cli::{init_logging, run, train_on, CAPTURE_NAME, STDERR_FD_VAR, TENSORFLOW_LOG_TARGET};
pub use config::RunConfig;
pub use engines::{DataParallelEngine, Engines};
pub use evaluate::{eval_on, predict_on, CheckpointArgs, PredictArgs};
pub use export::{build_model, Source};
pub use resume::Resume;

/// The names the commands use from Kiln's crates (the facade's prelude,
/// without the facade, which depends on this crate).
mod prelude {
    pub(crate) use kiln_core::prelude::*;
    pub(crate) use kiln_data::prelude::*;
    pub(crate) use kiln_train::prelude::*;
}
