//! Fine-tuning a TensorFlow SavedModel through its training signature with the
//! `Trainer`, on the UCI digits.
//!
//! ```text
//! .kiln/venv/bin/python examples/savedmodel/export.py exported
//! cargo run --release --example savedmodel_finetune -- exported runs/savedmodel
//! ```
//!
//! 1. `export.py` writes a Keras 3 model, trained on the digits 0-4 only, with a
//!    `serve` signature (the logits) and a `train` signature (loss and one Adam
//!    step, computed by TensorFlow inside the export), and the optimizer's
//!    variables.
//! 2. `SavedModelModule` makes the export a module the `Trainer` trains: the
//!    Trainer runs the loop, the validation (its loss and accuracy, on the `serve`
//!    signature) and the checkpoints (in the run directory), and the `train`
//!    signature does each step with the exported optimizer, its learning rate set
//!    from Kiln's config.
//! 3. The fine-tuned model is written with `save_variables_to` as a new SavedModel
//!    `<run>/finetuned` that Python's `tf.saved_model.load` reads; the original
//!    directory is left as it is.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use kiln::core::optim::AdamConfig;
use kiln::data::load_digits;
use kiln::prelude::*;
use kiln::tf::{SavedModel, SavedModelModule, VariableRole};
use kiln::train::{CheckpointPolicy, CsvSink, LogSink, RunDirectory, RunStart};

const SEED: u64 = 0;
const EPOCHS: u64 = 5;
/// The learning rate Kiln gives the exported Adam (its `adam/learning_rate`).
const LEARNING_RATE: f64 = 1e-2;

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let mut args = std::env::args_os().skip(1).map(PathBuf::from);
    let (Some(exported), Some(out), None) = (args.next(), args.next(), args.next()) else {
        bail!(
            "usage: savedmodel_finetune EXPORTED_DIR OUT_DIR (make EXPORTED_DIR with \
             `python examples/savedmodel/export.py EXPORTED_DIR`; OUT_DIR: a new or empty \
             directory)"
        );
    };
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join(".kiln/data/digits.csv.gz");
    run(&exported, &out, &data)?;
    Ok(())
}

/// What [`run`] did.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The exported model's validation accuracy before fine-tuning.
    pub before: f64,
    /// The validation accuracy after fine-tuning.
    pub after: f64,
    /// The fine-tuned SavedModel, `<out>/finetuned`.
    pub finetuned: PathBuf,
}

/// Fine-tunes the SavedModel in `exported` on the digits at `data`, writing
/// checkpoints, `epochs.csv` and the fine-tuned copy into the run directory `out`.
pub fn run(exported: &Path, out: &Path, data: &Path) -> Result<Outcome> {
    let ((train_x, train_y), (val_x, val_y)) = digits(data)?;
    let train = SequentialLoader::new(InMemoryDataset::new(train_x, train_y)?, 64)?.shuffle(SEED);
    let val = SequentialLoader::new(InMemoryDataset::new(val_x, val_y)?, 256)?;
    // A new run directory, locked while the run lasts.
    let run_dir = RunDirectory::acquire(out, RunStart::New)?;

    // The export as a module: every name given as the Python side set it (they are
    // also the defaults); `build` checks them against the signatures.
    let saved = SavedModel::load(exported)
        .with_context(|| format!("loading the SavedModel {}", exported.display()))?;
    let module = SavedModelModule::builder(saved)
        .serve("serve")
        .train("train")
        .input("x")
        .target("y")
        .build()?;
    println!(
        "{}: {} parameters in {}; optimizer `{}` with {} variables",
        exported.display(),
        module.num_parameters()?,
        module.variable_names(VariableRole::Parameter).join(", "),
        module.optimizer_kind().unwrap_or("?"),
        module.variable_names(VariableRole::Optimizer).len()
    );
    // The config's type must be the exported optimizer's; its lr is assigned to
    // the exported learning-rate variable (its other settings are the export's).
    let optimizer =
        module.build_optimizer(&OptimizerConfig::Adam(AdamConfig::new(LEARNING_RATE)), &[])?;
    let mut state = TrainingState::new(module, optimizer, None);

    let config = TrainerConfig {
        epochs: EPOCHS,
        seed: SEED,
        ..TrainerConfig::default()
    };
    let policy = CheckpointPolicy {
        every_n_epochs: Some(1),
        keep_last: 2,
        ..CheckpointPolicy::default()
    };
    let mut trainer = Trainer::<TfBackend, SavedModelModule>::new(config, Loss::cross_entropy())?
        .with_metric(|| Box::new(Accuracy::new()))
        .with_checkpointer(
            Checkpointer::new(run_dir.path().join("checkpoints"), policy)?,
            None, // no Kiln layer definition: the model is the SavedModel
        )
        .with_sink(CsvSink::new(run_dir.path())?)
        .with_sink(LogSink::new());

    let before = accuracy(&trainer.evaluate(&mut state.model, &val)?)?;
    println!("before: validation accuracy {:.2}%", 100.0 * before);
    trainer.fit(&mut state, &train, Some(&val))?;
    let after = accuracy(&trainer.evaluate(&mut state.model, &val)?)?;
    println!(
        "after {EPOCHS} epochs: validation accuracy {:.2}%",
        100.0 * after
    );

    // A new SavedModel with the fine-tuned variables (it must not exist yet); the
    // exported directory is not written.
    let finetuned = run_dir.path().join("finetuned");
    state.model.saved_model().save_variables_to(&finetuned)?;
    println!(
        "saved the fine-tuned model to {} (Python: tf.saved_model.load)",
        finetuned.display()
    );
    Ok(Outcome {
        before,
        after,
        finetuned,
    })
}

/// The digits as `[N, 64]` pixels scaled to 0..1 (as `export.py` trained on) and
/// `[N]` labels, a fifth held out for validation.
pub fn digits(path: &Path) -> Result<((HostTensor, HostTensor), (HostTensor, HostTensor))> {
    let (pixels, labels) = load_digits(path).with_context(|| {
        format!(
            "loading the digits from {} (run `cargo xtask setup` to provision them)",
            path.display()
        )
    })?;
    let scaled: Vec<f32> = pixels.as_slice::<f32>()?.iter().map(|p| p / 16.0).collect();
    let pixels = HostTensor::new(scaled, pixels.dims().to_vec())?;
    Ok(train_test_split(&pixels, &labels, 0.2, SEED)?)
}

/// The `accuracy` of [`Trainer::evaluate`]'s metrics.
fn accuracy(metrics: &[(String, f64)]) -> Result<f64> {
    metrics
        .iter()
        .find(|(name, _)| name == "accuracy")
        .map(|(_, value)| *value)
        .context("the trainer reports accuracy")
}
