//! Running one command with an executable's [`Engines`]: parsing the command
//! line, handing a command that needs TensorFlow to `kiln-tensorflow`, and the
//! dispatch to the commands' modules.

use anyhow::Result;
use clap::Parser;

use crate::args::{Cli, Command, TuneCommand};
use crate::engines::{needs_tensorflow, Engines};
#[cfg(not(feature = "text"))]
use crate::features::Feature;
use crate::features::{FeatureMissing, FEATURES_MISSING_EXIT_CODE};
use crate::forward::{self, NeedsTensorflow};
#[cfg(feature = "text")]
use crate::generate;
use crate::needs::missing_feature;
use crate::{consolidate, evaluate, export, inspect, launch, train, tune_lr};

/// Prints the error and exits as `kiln` does when a command fails.
fn exit_with(error: &anyhow::Error) -> ! {
    eprintln!("error: {error:#}");
    // Interrupted by a signal: exit as the shell reports a process it killed.
    let code = error
        .downcast_ref::<launch::Interrupted>()
        .map_or(1, launch::Interrupted::exit_code);
    let code = if error.downcast_ref::<forward::TensorflowMissing>().is_some() {
        forward::TENSORFLOW_MISSING_EXIT_CODE
    } else if error.downcast_ref::<FeatureMissing>().is_some() {
        FEATURES_MISSING_EXIT_CODE
    } else {
        code
    };
    std::process::exit(code);
}

/// Runs the command on this process's command line with engines `E`, and
/// exits as `kiln` does when it fails. `kiln` runs a command that needs
/// TensorFlow (decided before anything is read) in `kiln-tensorflow` instead.
pub fn run<E: Engines>() {
    let cli = Cli::parse();
    // The commands whose output is what they print refuse a closed stdout
    // before anything else (before `kiln-tensorflow` inherits it as /dev/null).
    let prints = match &cli.command {
        Command::Eval(_) => Some("kiln eval"),
        Command::Inspect { .. } => Some("kiln inspect"),
        Command::Generate(_) => Some("kiln generate"),
        _ => None,
    };
    if let Err(error) = prints.map_or(Ok(()), crate::output::check_stdout_open) {
        exit_with(&error);
    }
    if !E::TENSORFLOW {
        if let Some(needs) = needs_tensorflow(&cli.command) {
            // Returns only when kiln-tensorflow could not be run.
            exit_with(&forward::run_tensorflow(&needs));
        }
    }
    // `kiln-tensorflow` has every feature; `kiln` may lack some.
    if let Some(missing) = missing_feature(&cli.command) {
        exit_with(&missing.into());
    }
    let error = match run_command::<E>(cli.command) {
        Ok(()) => match crate::output::stdout_failure() {
            None => return,
            Some(why) => anyhow::anyhow!(
                "the command's output could not be written to stdout ({why}): it is lost"
            ),
        },
        Err(error) => error,
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
        Command::Train(args) => train::train::<E>(args),
        Command::Eval(args) => evaluate::eval::<E>(args),
        Command::Predict(args) => evaluate::predict::<E>(args),
        Command::Inspect { checkpoint, depth } => inspect::inspect::<E>(&checkpoint, depth),
        Command::Export(args) => export::export::<E>(args),
        Command::Consolidate(args) => consolidate::consolidate(&args),
        #[cfg(feature = "text")]
        Command::Generate(args) => generate::generate(args),
        #[cfg(not(feature = "text"))]
        Command::Generate(_) => Err(FeatureMissing::new(Feature::Text, "kiln generate").into()),
        Command::Launch(args) => launch::launch(args),
        Command::Tune(TuneCommand::Lr(args)) => tune_lr::tune_lr::<E>(args),
    }
}
