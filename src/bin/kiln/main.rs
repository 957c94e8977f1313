//! `kiln`: train, evaluate, predict, inspect and export from a TOML config
//! (the command line is the `kiln-cli` crate, `src/cli/`).
//!
//! This executable runs everything on libtorch and never loads TensorFlow: it
//! references no TensorFlow symbol, so the linker leaves TensorFlow's libraries
//! out of it and `kiln --help` or a torch run starts without them. A command that
//! needs TensorFlow (the `tensorflow` backend, `export --format savedmodel`,
//! `inspect` of a SavedModel, a saved_model layer) runs in the sibling executable
//! `kiln-tensorflow` with the same arguments, decided before anything is read.

use anyhow::Result;

/// libtorch only: the TensorFlow methods keep [`kiln_cli::Engines`]' defaults,
/// which send the command to `kiln-tensorflow`.
struct Torch;

impl kiln_cli::Engines for Torch {
    const TENSORFLOW: bool = false;

    fn register_layers() -> Result<()> {
        #[cfg(feature = "ops")]
        kiln::fused_ops::register_torch_layers();
        Ok(())
    }
}

fn main() {
    kiln_cli::init_logging();
    kiln_cli::run::<Torch>();
}
