//! `kiln tune lr`: the learning-rate range test on the config's data, model,
//! loss and optimizer, with its table, plot and suggestion in a directory of
//! its own (and, with `--save-config`, the config with the suggested rate).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::distributed::Rendezvous;
use kiln_train::{RunDirectory, RunStart};

use crate::args::LrFindArgs;
use crate::config::RunConfig;
use crate::engines::{run_on, BackendJob, Engines, StrategyEngine};
use crate::output::outln;
use crate::run::directory::{write_new_file, UndoFailedStart};
use crate::run::prepare::{check_backend_supports, prepare};

/// `kiln tune lr`: the learning-rate range test on the config's data, model,
/// loss and optimizer, in its own directory.
pub(crate) fn tune_lr<E: Engines>(args: LrFindArgs) -> Result<()> {
    let mut config = args.train_args().config()?;
    if Rendezvous::from_env()?.is_some() {
        anyhow::bail!(
            "kiln tune lr runs in one process; it was started as one rank of a job \
             (RANK/WORLD_SIZE are set)"
        );
    }
    if args.early_stop_threshold.is_nan() || args.early_stop_threshold < 0.0 {
        anyhow::bail!(
            "--early-stop-threshold must be 0 (never stop early) or a positive factor, got {}",
            args.early_stop_threshold
        );
    }
    let settings = kiln_train::LrFinderConfig {
        min_lr: args.min_lr,
        max_lr: args.max_lr,
        num_training: args.num_training,
        mode: args.mode,
        early_stop_threshold: (args.early_stop_threshold > 0.0)
            .then_some(args.early_stop_threshold),
        ..kiln_train::LrFinderConfig::default()
    };
    settings.validate().context("kiln tune lr")?;
    if let Some(path) = &args.save_config {
        // Checked before anything runs: a new file (not even a dangling link,
        // which the write would follow), in a directory that exists.
        if std::fs::symlink_metadata(path).is_ok() {
            anyhow::bail!(
                "--save-config {}: the path exists{}; kiln never writes over a file it did not \
                 create (give a new path)",
                path.display(),
                if path.is_symlink() {
                    " (a symbolic link)"
                } else {
                    ""
                }
            );
        }
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if !parent.is_dir() {
            anyhow::bail!(
                "--save-config {}: its directory {} does not exist (create it first)",
                path.display(),
                parent.display()
            );
        }
    }
    // The results have their own directory, a new one (or empty), as a run's.
    config.output_dir = args.output.clone().unwrap_or_else(|| {
        let mut name = config.output_dir.clone().into_os_string();
        name.push("-lr-find");
        PathBuf::from(name)
    });
    let request = LrFind {
        settings,
        config_file: args.config.clone(),
        save_config: args.save_config.clone(),
        suggest_on_log_scale: args.suggestion == "log",
    };
    run_on::<E, _>(config.backend, TuneLr { config, request })
}

/// `kiln tune lr`'s request.
struct LrFind {
    /// The test's settings.
    settings: kiln_train::LrFinderConfig,
    /// The config file the run was read from (its copy gets the suggestion).
    config_file: PathBuf,
    /// Where `--save-config` writes the config with the suggested rate.
    save_config: Option<PathBuf>,
    /// Suggest by the slope against the rate's logarithm (`--suggestion log`).
    suggest_on_log_scale: bool,
}

/// `kiln tune lr`'s work on one backend: the config's model, prepared as
/// `kiln train` prepares it (pretrained weights, LoRA, freezing), in one process.
struct TuneLr {
    config: RunConfig,
    request: LrFind,
}

impl BackendJob for TuneLr {
    fn on_tensorflow(&self) -> &'static str {
        "the learning-rate finder on the TensorFlow backend"
    }

    fn run<E: Engines, B: TrainBackend, P: StrategyEngine<B>>(self) -> Result<()> {
        let config = &self.config;
        check_backend_supports::<B>(config)?;
        // The results' directory is new (or empty), as a new run's.
        RunDirectory::check(&config.output_dir, RunStart::New)?;
        let (prepared, model) = prepare::<E, B>(config, None, true)?;
        find_lr_and_report::<B, _>(config, &self.request, model, prepared.train_loader.as_ref())
    }
}

/// The range test of `kiln tune lr`, its table, plot and suggestion.
fn find_lr_and_report<B: TrainBackend, M: Trainable<B>>(
    config: &RunConfig,
    request: &LrFind,
    mut model: M,
    train: &dyn kiln_data::DataLoader,
) -> Result<()> {
    let out = &config.output_dir;
    let mut run = UndoFailedStart::new(RunDirectory::acquire(out, RunStart::New)?);
    let result = kiln_train::find_lr(
        &mut model,
        &config.optimizer,
        &config.param_groups,
        &config.loss,
        train,
        config.device,
        &request.settings,
    )?;
    let mut csv = String::from("step,lr,loss\n");
    for (i, (lr, loss)) in result.lrs.iter().zip(&result.losses).enumerate() {
        csv.push_str(&format!("{},{lr:e},{loss}\n", i + 1));
    }
    write_new_file(&out.join("lr_find.csv"), csv.as_bytes())?;
    let suggestion = if request.suggest_on_log_scale {
        result.suggestion_log()
    } else {
        result.suggestion()
    };
    let png = out.join("lr_find.png");
    let log_scale = request.settings.mode == kiln_train::LrSweep::Exponential;
    if let Err(e) = kiln_train::plot_lr_finder(&result, log_scale, suggestion, &png) {
        log::warn!("no plot: {}", e.display_chain());
    }
    outln!(
        "kiln: learning-rate range test, {} steps from {:e} to {:e}{}",
        result.lrs.len(),
        request.settings.min_lr,
        result
            .lrs
            .last()
            .copied()
            .unwrap_or(request.settings.min_lr),
        if result.stopped_early {
            " (stopped: the loss diverged)"
        } else {
            ""
        }
    );
    match suggestion {
        Some(lr) => outln!("kiln: suggested learning rate {lr:e}"),
        None => outln!(
            "kiln: no suggestion: fewer than 2 finite losses after the first 10 steps and \
             before the last (raise --num-training, or lower --max-lr)"
        ),
    }
    if let (Some(path), Some(lr)) = (&request.save_config, suggestion) {
        // The user's file with one value changed (their comments are lost: toml
        // writes the values back), never the file itself.
        let text = std::fs::read_to_string(&request.config_file)
            .with_context(|| format!("reading {}", request.config_file.display()))?;
        let mut document: toml::Value =
            toml::from_str(&text).with_context(|| format!("{}", request.config_file.display()))?;
        match document
            .get_mut("optimizer")
            .and_then(toml::Value::as_table_mut)
        {
            Some(table) => {
                table.insert("lr".to_owned(), toml::Value::Float(lr));
            }
            None => anyhow::bail!(
                "--save-config: {} has no [optimizer] table to put the rate in",
                request.config_file.display()
            ),
        }
        let written = toml::to_string(&document).context("--save-config")?;
        write_new_file(path, written.as_bytes())?;
        outln!("kiln: {} is the config with lr = {lr:e}", path.display());
    }
    outln!(
        "kiln: losses in {}, plot in {}",
        out.join("lr_find.csv").display(),
        png.display()
    );
    run.succeeded();
    Ok(())
}
