//! `kiln-tensorflow`: the `kiln` CLI with TensorFlow. Users run `kiln`, which runs
//! this executable (beside it) with the same arguments for the commands that need
//! TensorFlow; everything else, and the CLI itself, is the same code (`kiln-cli`,
//! `src/cli/`), run here with [`Tensorflow`] as its engines.
//!
//! TensorFlow's libraries load, and print their start-up lines, before `main`:
//! when `kiln` captured those (Kiln quiet), `main` first puts the real stderr back
//! and shows them only at debug level (see `stderr.rs` and `src/cli/forward.rs`).

mod stderr;

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use kiln::c10d::ProcessGroup;
use kiln::core::distributed::DistributedOptions;
use kiln::core::export::ExportOptions;
use kiln::core::strategy::DataParallel;
use kiln::prelude::*;
use kiln::tf::{GradientAllReduce, TfBackend, TfModel};
use kiln_cli::{BackendJob, Engines, Source, StrategyChoice, StrategyEngine, WithTrainable};

/// Both engines: the TensorFlow commands on the TensorFlow C API.
struct Tensorflow;

impl Engines for Tensorflow {
    const TENSORFLOW: bool = true;

    fn register_layers() -> Result<()> {
        #[cfg(feature = "ops")]
        kiln::fused_ops::register_layers()?;
        Ok(())
    }

    fn run_on_tensorflow<J: BackendJob>(job: J) -> Result<()> {
        job.run::<Self, TfBackend, Self>()
    }

    fn resolve_saved_model_shapes(model: &Layer, example: &[usize], dtype: DType) -> Result<Layer> {
        Ok(kiln::tf::resolve_saved_model_shapes(model, example, dtype)?)
    }

    fn export_saved_model(
        source: &Source,
        checkpoint: &Path,
        output: &Path,
        options: &ExportOptions,
    ) -> Result<()> {
        let model = kiln_cli::build_model::<TfBackend>(source, checkpoint)?;
        kiln::tf::SavedModelExport::new(&model, options).write(output)?;
        Ok(())
    }

    fn describe_saved_model(path: &Path) -> Result<String> {
        Ok(kiln::tf::SavedModel::load(path)?.describe().to_string())
    }
}

/// TensorFlow models train over c10d's Gloo group: data-parallel through a
/// host all-reduce of their gradients, or under ZeRO's stages. Full sharding
/// is refused (the config's validation already refuses it): TensorFlow's
/// variables live in its graph, whole.
impl StrategyEngine<TfBackend> for Tensorflow {
    fn run_under<T: WithTrainable<TfBackend>>(
        model: TfModel,
        group: &Arc<ProcessGroup>,
        choice: StrategyChoice<'_>,
        options: &DistributedOptions,
        then: T,
    ) -> Result<()> {
        match choice {
            StrategyChoice::DataParallel => {
                let sync = GradientAllReduce::new(&model, group.clone(), options)?;
                then.run(DataParallel::new(model, sync)?)
            }
            StrategyChoice::Zero(stage) => then.run(kiln::tf::zero_data_parallel(
                model,
                group.clone(),
                stage,
                options,
            )?),
            other => Err(kiln::core::Error::unsupported(format!(
                "{} on the TensorFlow backend; train with strategy = \"zero2\" or \"ddp\"",
                other.name()
            ))
            .into()),
        }
    }
}

fn main() {
    // Before anything else writes to stderr.
    let start = stderr::take_back();
    kiln_cli::init_logging();
    stderr::replay(start);
    kiln_cli::run::<Tensorflow>();
}
