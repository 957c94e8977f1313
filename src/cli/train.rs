//! `kiln train`: a run config trained on one backend, on one process or as
//! one rank of a data-parallel job, with its run directory, checkpoints,
//! metric sinks and summary on rank 0. The run is prepared, put under its
//! strategy and assembled by `run/`; this file is the order of the steps and
//! what the run leaves at its end.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Result;
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::distributed::Rendezvous;
use kiln_train::{RunDirectory, RunStart, Trainer, TrainingState};

use crate::args::TrainArgs;
use crate::config::{PretrainedModel, RunConfig};
use crate::engines::WithTrainable;
use crate::engines::{run_on, BackendJob, Engines, StrategyEngine};
use crate::output::outln;
use crate::prelude::*;
use crate::resume::{
    check_resume_data, check_resume_not_complete, check_resume_position, follower_resume,
    load_resume_checkpoint, reshard, resolve_resume,
};
use crate::run::assemble::{self, checkpoints_dir};
use crate::run::directory::{toml_string, write_new_file, UndoFailedStart};
use crate::run::prepare::{check_backend_supports, prepare, Prepared};
use crate::run::strategy::under_strategy;

pub(crate) fn train<E: Engines>(args: TrainArgs) -> Result<()> {
    let mut config = args.config()?;
    // Started by `kiln launch`, torchrun or srun: one rank of a data-parallel job.
    let rendezvous = Rendezvous::from_env()?;
    if let Some(r) = &rendezvous {
        if let Device::Cuda(_) = config.device {
            // One GPU per local rank, as torchrun users set with LOCAL_RANK.
            config.device = Device::Cuda(r.local_rank);
        }
    }
    let job = Train {
        backend: config.backend,
        config,
        rendezvous,
        resume: args.resume,
        on_other_data: args.resume_on_other_data,
        profile: args.profile,
    };
    run_on::<E, _>(job.backend, job)
}

/// `kiln train`'s work on one backend.
struct Train {
    backend: crate::config::BackendKind,
    config: RunConfig,
    rendezvous: Option<Rendezvous>,
    /// `--resume`: a checkpoint file, or `auto`.
    resume: Option<String>,
    /// `--resume-on-other-data`.
    on_other_data: bool,
    /// `--profile`: the steps to profile (written into the run's `profile/`).
    profile: Option<kiln_train::ProfileConfig>,
}

impl BackendJob for Train {
    fn on_tensorflow(&self) -> &'static str {
        "training on the TensorFlow backend"
    }

    fn run<E: Engines, B: TrainBackend, P: StrategyEngine<B>>(self) -> Result<()> {
        let started = Instant::now();
        let config = &self.config;
        let rendezvous = self.rendezvous.as_ref();
        // Rank 0 of a data-parallel job (or a single process) writes the run
        // directory, logs, plots and checkpoints; the other ranks only train.
        let primary = rendezvous.is_none_or(Rendezvous::is_primary);
        check_backend_supports::<B>(config)?;
        // Everything that can be checked is checked before the first byte is written.
        let resume_from = if primary {
            resolve_resume(config, self.resume.as_deref())?
        } else {
            follower_resume(config, self.resume.as_deref())?
        };
        let shard = rendezvous.map(|r| (r.rank, r.world_size));
        let (prepared, model) = prepare::<E, B>(config, shard, resume_from.is_none())?;
        let fit = Fit {
            job: &self,
            started,
            primary,
            resume_from,
            prepared,
        };
        under_strategy::<B, P, _>(config, rendezvous, model, fit)
    }
}

/// The run on its model, once the model is under its strategy.
struct Fit<'a> {
    job: &'a Train,
    started: Instant,
    /// Rank 0 of a data-parallel job, or a single process: writes the run directory.
    primary: bool,
    resume_from: Option<PathBuf>,
    prepared: Prepared,
}

impl<B: TrainBackend> WithTrainable<B> for Fit<'_> {
    fn what_ranks_share(&self) -> Result<serde_json::Value> {
        crate::ranks::what_ranks_share(
            &self.job.config,
            &self.prepared.definition,
            &self.prepared.identity,
            self.resume_from.as_deref(),
        )
    }

    /// The optimizer and schedule, the resume, one `Trainer` (rank 0's with
    /// the run's outputs: checkpoints, sinks), the final evaluation, and on
    /// rank 0 the weights, plots and summary.
    fn run<M: Trainable<B>>(self, model: M) -> Result<()> {
        let config = &self.job.config;
        let distributed = self.job.rendezvous.is_some();
        let mut state = assemble::training_state::<B, M>(config, model, distributed)?;
        if let Some(path) = &self.resume_from {
            self.resume(&mut state, path)?;
        }
        let trainer = assemble::trainer::<B, M>(
            config,
            self.prepared.misclassified.clone(),
            distributed,
            self.primary,
        )?;
        if self.primary {
            self.fit_and_save(trainer, state)
        } else {
            self.fit_beside_rank_0(trainer, state)
        }
    }
}

impl Fit<'_> {
    /// Restores `state` from the checkpoint at `path`, once it is shown to
    /// fit the config's model, the data and this job's number of ranks.
    fn resume<B: TrainBackend, M: Trainable<B>>(
        &self,
        state: &mut TrainingState<B, M>,
        path: &Path,
    ) -> Result<()> {
        let config = &self.job.config;
        let prepared = &self.prepared;
        let world_size = self
            .job
            .rendezvous
            .as_ref()
            .map_or(1, |r| r.world_size as u64);
        let batches = prepared.train_loader.num_batches();
        let mut checkpoint = load_resume_checkpoint(config, &prepared.definition, path)?;
        check_resume_data(
            &mut checkpoint,
            &prepared.identity,
            path,
            self.job.on_other_data,
        )?;
        // Before resharding: a position under another data order means
        // nothing for any number of ranks.
        checkpoint.check_data_order(path)?;
        reshard(&mut checkpoint, world_size, path)?;
        check_resume_position(&checkpoint, batches, path)?;
        check_resume_not_complete(config, &checkpoint, batches, path)?;
        Trainer::<B, M>::resume_from(state, &checkpoint, path)?;
        Ok(())
    }

    /// Another rank than rank 0: trains and joins rank 0's collectives (its
    /// final evaluation, the gathering of the weights it saves).
    fn fit_beside_rank_0<B: TrainBackend, M: Trainable<B>>(
        self,
        mut trainer: Trainer<B, M>,
        mut state: TrainingState<B, M>,
    ) -> Result<()> {
        let Prepared {
            train_loader,
            val_loader,
            ..
        } = self.prepared;
        trainer.fit(
            &mut state,
            train_loader.as_ref(),
            val_loader.as_ref().map(|v| v.as_ref()),
        )?;
        use_average(&trainer, &mut state, train_loader.as_ref())?;
        // Rank 0's final evaluation reduces over every rank.
        if let Some(val) = &val_loader {
            state.model.set_mode(Mode::Eval);
            trainer.evaluate(&mut state.model, val.as_ref())?;
        }
        if state.model.shards_parameters() {
            // Rank 0 gathers the whole weights to save them.
            drop(state.model.state_tensors()?);
        }
        Ok(())
    }

    /// Rank 0 (or the only process): the run directory taken, the trainer
    /// given its outputs, the run, and what it leaves.
    fn fit_and_save<B: TrainBackend, M: Trainable<B>>(
        self,
        mut trainer: Trainer<B, M>,
        mut state: TrainingState<B, M>,
    ) -> Result<()> {
        let config = &self.job.config;
        let out = &config.output_dir;
        // From here on the run writes, holding its directory's lock.
        let start = if self.resume_from.is_some() {
            RunStart::Resume
        } else {
            RunStart::New
        };
        if let Some(profile) = &self.job.profile {
            let profile = profile.clone().in_dir(out.join("profile"));
            // The window's files are checked before the run directory is written.
            profile.validate()?;
            trainer = trainer.with_profiler(profile);
        }
        let mut run = UndoFailedStart::new(RunDirectory::acquire(out, start)?);
        // The resolved config is the run's own file: a new run's directory was
        // empty; a run resumed into a directory without one records it too.
        let config_file = out.join("config.toml");
        if start == RunStart::New || !config_file.exists() {
            write_new_file(&config_file, toml_string(config)?.as_bytes())?;
        }
        self.announce::<B, M>(&state)?;
        let Prepared {
            definition,
            identity,
            train_loader,
            val_loader,
            ..
        } = self.prepared;
        let resumed = self.resume_from.is_some().then_some(state.step);
        trainer = assemble::with_outputs(trainer, config, &definition, identity, resumed)?;
        let history = trainer.fit(
            &mut state,
            train_loader.as_ref(),
            val_loader.as_ref().map(|v| v.as_ref()),
        )?;
        use_average(&trainer, &mut state, train_loader.as_ref())?;
        state.model.set_mode(Mode::Eval);
        let final_metrics = match &val_loader {
            Some(val) => trainer.evaluate(&mut state.model, val.as_ref())?,
            None => Vec::new(),
        };
        let weights = save_weights::<B, M>(config, &state)?;
        if config.logging.plots && !history.is_empty() {
            let png = out.join("curves.png");
            kiln_train::plot_curves(&history, &png, &kiln_train::PlotOptions::default())?;
            outln!("kiln: curves plotted to {}", png.display());
        }
        outln!(
            "kiln: done in {:.1}s, {} steps; {}",
            self.started.elapsed().as_secs_f64(),
            state.step,
            validation_summary(&final_metrics)
        );
        let skipped =
            train_loader.skipped_samples() + val_loader.as_ref().map_or(0, |v| v.skipped_samples());
        if skipped > 0 {
            outln!(
                "kiln: {skipped} images skipped because they could not be read or decoded \
                 (data.on_error = \"skip\"; each is named in a warning above)"
            );
        }
        let checkpoints = checkpoints_dir(config);
        match kiln_train::Checkpointer::latest(&checkpoints) {
            Ok(Some(_)) => outln!(
                "kiln: weights in {}, checkpoints in {}",
                weights.display(),
                checkpoints.display()
            ),
            // --max-steps (or a short run) can end before the first checkpoint is due.
            _ => outln!(
                "kiln: weights in {}; no checkpoint was written (the run ended before the first \
                 was due: see [checkpoint] every_n_steps / every_n_epochs)",
                weights.display()
            ),
        }
        run.succeeded();
        Ok(())
    }

    /// The run's first lines: the backend, device, precision and directory,
    /// the parameters and examples, and the model summary `[logging]` asks for.
    fn announce<B: TrainBackend, M: Trainable<B>>(
        &self,
        state: &TrainingState<B, M>,
    ) -> Result<()> {
        let config = &self.job.config;
        let (n_train, n_val) = self.prepared.examples;
        let trainable = state.model.num_trainable_parameters()?;
        let total = state.model.num_parameters()?;
        outln!(
            "kiln: {} on {} in {} ({}), {} parameters{}; {} training and {} validation examples",
            B::NAME,
            config.device,
            config.training.precision,
            config.output_dir.display(),
            total,
            if trainable < total {
                format!(" ({trainable} trainable)")
            } else {
                String::new()
            },
            n_train,
            n_val
        );
        // A summary that cannot be made does not stop the run.
        match (&self.prepared.summary, config.logging.summary_depth()) {
            (Ok(summary), Some(depth)) => outln!("{}", summary.table(depth)),
            (Err(e), _) => log::warn!("no model summary: {e:#}"),
            (Ok(_), None) => {}
        }
        Ok(())
    }
}

/// Writes the trained model's weights to `model.safetensors` (and, for LoRA
/// on a pretrained model, its adapter in PEFT's format); returns the weights' path.
fn save_weights<B: TrainBackend, M: Trainable<B>>(
    config: &RunConfig,
    state: &TrainingState<B, M>,
) -> Result<PathBuf> {
    let out = &config.output_dir;
    let weights = out.join("model.safetensors");
    let mut metadata = std::collections::BTreeMap::new();
    metadata.insert("format".to_owned(), "pt".to_owned());
    // Read once: under full sharding, a collective the other ranks join once.
    let final_state = state.model.state_tensors()?;
    final_state.save_safetensors(&weights, &metadata)?;
    if let (Some(lora), Some(source)) = (&config.lora, &config.pretrained) {
        save_adapter(
            lora,
            source,
            &final_state.to_state_dict()?,
            &out.join("adapter"),
        )?;
    }
    Ok(weights)
}

/// The final evaluation's line: losses to 4 places, the rest as percentages.
fn validation_summary(metrics: &[(String, f64)]) -> String {
    if metrics.is_empty() {
        return "no validation split".to_owned();
    }
    let values: Vec<String> = metrics
        .iter()
        .map(|(k, v)| {
            if k.contains("loss") {
                format!("{k} {v:.4}")
            } else {
                format!("{k} {:.2}%", 100.0 * v)
            }
        })
        .collect();
    format!("validation {}", values.join(", "))
}

/// The run's model is its weight average, when it keeps one (as Lightning's
/// `WeightAveraging` leaves the averaged weights in the model at the end of
/// `fit`; SWA's with its batch-norm statistics recomputed): evaluated,
/// written to `model.safetensors` and the adapter.
fn use_average<B: TrainBackend, M: Trainable<B>>(
    trainer: &Trainer<B, M>,
    state: &mut TrainingState<B, M>,
    train: &dyn kiln_data::DataLoader,
) -> Result<()> {
    if trainer.apply_average(state, train)? {
        if let Some(averaging) = &state.averaging {
            log::info!(
                "the model is the {} weight average of {} updates",
                averaging.config().method().name().to_uppercase(),
                averaging.updates(),
            );
        }
    }
    Ok(())
}

/// Without the `text` feature a pretrained model is refused as needing it.
#[cfg(not(feature = "text"))]
fn save_adapter(
    _: &kiln_core::lora::LoraConfig,
    _: &PretrainedModel,
    _: &StateDict,
    _: &Path,
) -> Result<()> {
    let missing = crate::features::Feature::Text;
    Err(crate::features::FeatureMissing::new(missing, "a Hugging Face model").into())
}

/// Writes the trained LoRA adapters of a pretrained model to `dir` in PEFT's
/// format (`PeftModel.from_pretrained(base, dir)` loads them). A resumed run
/// replaces the adapter its directory holds (written beside it, then moved
/// into place); a `dir` holding anything else is left alone with an error.
#[cfg(feature = "text")]
fn save_adapter(
    lora: &kiln_core::lora::LoraConfig,
    source: &PretrainedModel,
    weights: &StateDict,
    dir: &Path,
) -> Result<()> {
    use anyhow::Context;
    use kiln_hf::{ADAPTER_CONFIG, ADAPTER_WEIGHTS};
    let pretrained = source.open()?;
    if !dir.exists() {
        pretrained
            .save_adapter(lora, weights, dir)
            .context("saving the LoRA adapters in PEFT's format")?;
    } else {
        let ours = std::fs::read_dir(dir)?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<std::io::Result<Vec<_>>>()?
            .iter()
            .all(|n| n == ADAPTER_CONFIG || n == ADAPTER_WEIGHTS);
        if !ours {
            anyhow::bail!(
                "{} holds files Kiln did not write: the LoRA adapters are not saved there (the \
                 checkpoints hold them)",
                dir.display()
            );
        }
        let fresh = dir.with_extension("new");
        if fresh.exists() {
            std::fs::remove_dir_all(&fresh)?;
        }
        pretrained
            .save_adapter(lora, weights, &fresh)
            .context("saving the LoRA adapters in PEFT's format")?;
        std::fs::remove_dir_all(dir)?;
        std::fs::rename(&fresh, dir)?;
    }
    outln!(
        "kiln: LoRA adapters in {} (PEFT's format: PeftModel.from_pretrained reads them)",
        dir.display()
    );
    Ok(())
}
