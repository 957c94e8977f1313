#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

//! `kiln_tf::SavedModelModule` under `kiln_train::Trainer`: the Keras 3 `mlp` export
//! of `tests/reference/saved_models.py` fine-tuned through its `train` signature
//! against Python calling the same signature on the same batches, its variables
//! saved for Python, exact resume from a Trainer checkpoint, and the typed errors;
//! and the same for the `mlp_bn` export, whose batch-norm moving statistics are
//! buffers that its `train` signature updates.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use common::{assert_close, read_json, run_reference, tensor, tensor_json};
use kiln_core::{
    backend::{Backend, TrainBackend, Trainable},
    loss::Loss,
    module::Module,
    optim::{AdamConfig, GradClip, Optimizer, OptimizerConfig, SgdConfig},
    schedule::{SchedulerConfig, StepLrConfig},
    state_dict::StateDict,
    Device, Error, HostTensor,
};
use kiln_data::{InMemoryDataset, SequentialLoader};
use kiln_tf::{SavedModel, SavedModelModule, TfBackend, VariableRole};
use kiln_train::{Callback, CheckpointPolicy, Checkpointer, Context, Flow, Trainer, TrainerConfig};
use serde_json::{json, Value};

const SCRIPT: &str = "saved_models.py";
const TOL: f64 = 1e-5;
const BATCH: usize = 16;
const EPOCHS: u64 = 2;
/// The learning rate the fixture's Adam was exported with.
const LR: f64 = 0.05;

type State = kiln_train::TrainingState<TfBackend, SavedModelModule>;

struct Fixture {
    python: PathBuf,
    dir: PathBuf,
    reference: Value,
}

impl Fixture {
    fn mlp(&self) -> PathBuf {
        self.dir.join("mlp")
    }

    /// The batch-norm model: Dense(16) -> BatchNormalization -> ReLU -> Dense(3).
    fn mlp_bn(&self) -> PathBuf {
        self.dir.join("mlp_bn")
    }

    /// The fixture's five training batches as one data set of 80 rows.
    fn data(&self) -> (HostTensor, HostTensor) {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for step in 0..5 {
            x.extend_from_slice(
                tensor(&self.reference["train_x"][step])
                    .as_slice::<f32>()
                    .unwrap(),
            );
            y.extend_from_slice(
                tensor(&self.reference["train_y"][step])
                    .as_slice::<i32>()
                    .unwrap(),
            );
        }
        let rows = y.len();
        (
            HostTensor::new(x, [rows, 8]).unwrap(),
            HostTensor::new(y, [rows]).unwrap(),
        )
    }

    /// The rows in order, `BATCH` at a time: what Python is given.
    fn loader(&self) -> SequentialLoader {
        let (x, y) = self.data();
        SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), BATCH).unwrap()
    }

    fn serve_input(&self) -> HostTensor {
        tensor(&self.reference["serve_input"])
    }

    /// Python calling the `train` signature on the loader's batches for `EPOCHS`
    /// epochs: (losses, serving output afterwards). Computed once.
    fn python_training(&self) -> &(Vec<f64>, HostTensor) {
        static RESULT: OnceLock<(Vec<f64>, HostTensor)> = OnceLock::new();
        RESULT.get_or_init(|| {
            let run = self.python_train(&self.mlp(), "saved-model-trainer-python-train");
            (run.losses, run.output)
        })
    }

    /// Python calling `model`'s `train` signature on the loader's batches for
    /// `EPOCHS` epochs, working in the scratch directory `scratch`.
    fn python_train(&self, model: &Path, scratch: &str) -> PythonRun {
        let work = common::scratch_dir(scratch);
        let (x, y) = self.data();
        let batches = work.join("batches.json");
        let spec = json!({
            "x": tensor_json(&x),
            "y": tensor_json(&y),
            "batch": BATCH,
            "epochs": EPOCHS,
            "serve_input": tensor_json(&self.serve_input()),
        });
        std::fs::write(&batches, spec.to_string()).unwrap();
        let out = work.join("out.json");
        run_reference(
            &self.python,
            SCRIPT,
            &[Path::new("train"), model, &batches, &out],
        );
        let result = read_json(&out);
        PythonRun {
            losses: result["losses"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect(),
            output: tensor(&result["trained_output"]),
            variables: result["variables"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(name, value)| (name.clone(), tensor(value)))
                .collect(),
        }
    }

    /// What Python's `tf.saved_model.load(dir)` serves on `serve_input`, and the
    /// optimizer's restored step count. Its files go next to `dir`, in the calling test's own scratch directory:
    /// tests run in parallel and must not share one.
    fn python_serve(&self, dir: &Path) -> (HostTensor, HostTensor, Option<i64>) {
        let work = dir
            .parent()
            .expect("a saved model inside a scratch directory");
        let input = work.join("input.json");
        std::fs::write(&input, tensor_json(&self.serve_input()).to_string()).unwrap();
        let out = work.join("out.json");
        run_reference(
            &self.python,
            SCRIPT,
            &[Path::new("serve"), dir, &input, &out],
        );
        let result = read_json(&out);
        (
            tensor(&result["serve"]),
            tensor(&result["serving_default"]),
            result["iterations"].as_i64(),
        )
    }
}

/// What Python's `train` mode reports.
struct PythonRun {
    losses: Vec<f64>,
    /// The `serving_default` output on `serve_input` after training.
    output: HostTensor,
    /// The model's variables after training, by Keras name.
    variables: BTreeMap<String, HostTensor>,
}

fn fixture(test: &str) -> Option<&'static Fixture> {
    static FIXTURE: OnceLock<Option<Fixture>> = OnceLock::new();
    let fixture = FIXTURE.get_or_init(|| {
        let python = common::python("saved_model_trainer tests")?;
        let dir = common::scratch_dir("saved-model-trainer-fixtures");
        run_reference(&python, SCRIPT, &[Path::new("export"), &dir]);
        let reference = read_json(&dir.join("reference.json"));
        Some(Fixture {
            python,
            dir,
            reference,
        })
    });
    if fixture.is_none() {
        kiln_testkit::skip(
            test,
            "no project virtualenv to export the SavedModel fixtures",
        );
    }
    fixture.as_ref()
}

/// The `mlp` export as a module, every name given as a Keras user would.
fn module(fixture: &Fixture) -> SavedModelModule {
    module_at(&fixture.mlp())
}

fn module_at(dir: &Path) -> SavedModelModule {
    SavedModelModule::builder(SavedModel::load(dir).unwrap())
        .serve("serve")
        .train("train")
        .input("x")
        .target("y")
        .build()
        .unwrap()
}

fn adam() -> OptimizerConfig {
    OptimizerConfig::Adam(AdamConfig::new(LR))
}

fn config() -> TrainerConfig {
    TrainerConfig {
        epochs: EPOCHS,
        seed: 3,
        ..TrainerConfig::default()
    }
}

/// Records every step's loss.
#[derive(Clone, Default)]
struct Losses(Arc<Mutex<Vec<f64>>>);

impl Losses {
    fn take(&self) -> Vec<f64> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl<B: TrainBackend, M: Trainable<B>> Callback<B, M> for Losses {
    fn on_step_end(&mut self, _cx: &mut Context<'_, B, M>, loss: f64) -> kiln_core::Result<Flow> {
        self.0.lock().unwrap().push(loss);
        Ok(Flow::Continue)
    }
}

fn fresh_state(fixture: &Fixture, schedule: bool) -> State {
    fresh_state_at(&fixture.mlp(), schedule)
}

fn fresh_state_at(dir: &Path, schedule: bool) -> State {
    let module = module_at(dir);
    let optimizer = module.build_optimizer(&adam(), &[]).unwrap();
    let scheduler = schedule.then(|| {
        SchedulerConfig::StepLr(StepLrConfig {
            step_size: 4,
            gamma: 0.5,
        })
        .build(&[LR])
        .unwrap()
    });
    State::new(module, optimizer, scheduler)
}

fn max_difference(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// A SavedModel trained through its `train` signature computes and applies its
/// gradients in one native call, so no strategy can take part: `DataParallel`
/// refuses it up front (the typed query `takes_step_hooks`), saying what to do.
#[test]
fn data_parallel_refuses_a_train_signature_naming_the_way() {
    let Some(fixture) = fixture("data_parallel_refuses_a_train_signature_naming_the_way") else {
        return;
    };
    let module = SavedModelModule::load(fixture.mlp()).unwrap();
    assert!(!module.takes_step_hooks());
    let err = kiln_core::strategy::DataParallel::new(module, kiln_core::strategy::NoHooks)
        .err()
        .map(|e| e.to_string())
        .expect("refused");
    assert!(err.contains("`train` signature"), "{err}");
    assert!(err.contains("`saved_model` layer"), "{err}");
}

#[test]
fn the_module_is_send_and_names_the_keras_variables() {
    fn check<T: Send>() {}
    check::<SavedModelModule>();
    check::<kiln_tf::SignatureOptimizer>();
    let Some(fixture) = fixture("the_module_is_send_and_names_the_keras_variables") else {
        return;
    };
    // Every default: `serve`, `train`, `x`, `y`, `output_0`.
    let module = SavedModelModule::load(fixture.mlp()).unwrap();
    assert_eq!(
        module.variable_names(VariableRole::Parameter),
        [
            "mlp/hidden/kernel",
            "mlp/hidden/bias",
            "mlp/logits/kernel",
            "mlp/logits/bias"
        ]
    );
    assert!(module.variable_names(VariableRole::Buffer).is_empty());
    let mut optimizer = module.variable_names(VariableRole::Optimizer);
    optimizer.sort_unstable();
    assert_eq!(
        optimizer,
        [
            "adam/iteration",
            "adam/learning_rate",
            "adam/mlp_hidden_bias_momentum",
            "adam/mlp_hidden_bias_velocity",
            "adam/mlp_hidden_kernel_momentum",
            "adam/mlp_hidden_kernel_velocity",
            "adam/mlp_logits_bias_momentum",
            "adam/mlp_logits_bias_velocity",
            "adam/mlp_logits_kernel_momentum",
            "adam/mlp_logits_kernel_velocity",
        ]
    );
    assert_eq!(module.optimizer_kind(), Some("adam"));
    let params = Module::<TfBackend>::named_parameters(&module).unwrap();
    let dims: Vec<Vec<usize>> = params
        .iter()
        .map(|(_, t)| TfBackend::shape(t).dims().to_vec())
        .collect();
    assert_eq!(dims, [vec![8, 16], vec![16], vec![16, 3], vec![3]]);
    assert_eq!(Module::<TfBackend>::num_parameters(&module).unwrap(), 195);

    // The graph the session runs (TensorBoard's Graphs view): a GraphDef that
    // TensorFlow imports, holding the export's variables.
    let graph_def = Module::<TfBackend>::graph_def(&module)
        .unwrap()
        .expect("a SavedModel has a graph");
    let mut imported = tensorflow::Graph::new();
    imported
        .import_graph_def(&graph_def, &tensorflow::ImportGraphDefOptions::new())
        .unwrap();
    let variables = imported
        .operation_iter()
        .filter(|op| op.op_type().is_ok_and(|t| t == "VarHandleOp"))
        .count();
    assert!(variables >= 4, "{variables} variables in the graph");

    // The serving output is the export's, and predictions go through `serve`.
    let x = TfBackend::from_host(&fixture.serve_input(), Device::Cpu).unwrap();
    let output = module.predict_step(&x).unwrap();
    assert_close(
        "serve output",
        &output,
        &tensor(&fixture.reference["serve_output"]),
        TOL,
    );
}

/// (a) The Trainer's per-step losses are Python's calls of the same signature on
/// the same batches, and the trained model serves what Python's does.
#[test]
fn trainer_losses_match_python_calling_the_train_signature() {
    let Some(fixture) = fixture("trainer_losses_match_python_calling_the_train_signature") else {
        return;
    };
    let (python_losses, python_output) = fixture.python_training();
    let losses = Losses::default();
    let mut state = fresh_state(fixture, false);
    let history = Trainer::<TfBackend, SavedModelModule>::new(config(), Loss::cross_entropy())
        .unwrap()
        .with_callback(losses.clone())
        .fit(&mut state, &fixture.loader(), Some(&fixture.loader()))
        .unwrap();
    let losses = losses.take();
    assert_eq!(state.step, 10);
    assert_eq!(losses.len(), python_losses.len());
    let worst = max_difference(&losses, python_losses);
    eprintln!(
        "{} Trainer steps against Python's train signature: max loss difference {worst:e}",
        losses.len()
    );
    assert!(
        worst <= TOL,
        "losses {losses:?} vs Python {python_losses:?}"
    );
    // The first step's loss is the export's before any update: the fixture's own.
    assert!((losses[0] - fixture.reference["losses"][0].as_f64().unwrap()).abs() <= TOL);

    let x = TfBackend::from_host(&fixture.serve_input(), Device::Cpu).unwrap();
    let output = state.model.predict_step(&x).unwrap();
    assert_close("trained serve output", &output, python_output, TOL);
    assert_eq!(state.optimizer.learning_rate() as f32, LR as f32);
    let iterations = state.optimizer.state_dict().unwrap();
    assert_eq!(
        iterations.get("adam/iteration").unwrap().to_f64_vec(),
        [10.0]
    );

    // The epoch records have the validation loss, the Trainer's cross-entropy
    // on the serving output (int32 class indices, as the signature takes them).
    let val_loss = history.last("val_loss").unwrap();
    let (inputs, labels) = fixture.data();
    let tx = TfBackend::from_host(&inputs, Device::Cpu).unwrap();
    let ty = TfBackend::from_host(&labels, Device::Cpu).unwrap();
    let (value, out) = state
        .model
        .eval_step(&Loss::cross_entropy(), &tx, &ty)
        .unwrap();
    let expected = cross_entropy(&out, &labels);
    assert!((value - expected).abs() <= TOL, "{value} vs {expected}");
    assert!(
        (val_loss - expected).abs() <= TOL,
        "{val_loss} vs {expected}"
    );
}

/// Mean softmax cross-entropy of `[N, C]` logits, in f64.
fn cross_entropy(logits: &HostTensor, labels: &HostTensor) -> f64 {
    let classes = logits.dims()[1];
    let values = logits.to_f64_vec();
    let labels = labels.to_f64_vec();
    let total: f64 = values
        .chunks(classes)
        .zip(&labels)
        .map(|(row, &label)| {
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let log_sum = row.iter().map(|v| (v - max).exp()).sum::<f64>().ln() + max;
            log_sum - row[label as usize]
        })
        .sum();
    total / labels.len() as f64
}

/// (b) The trained variables, saved with `save_variables_to`, load in Python and
/// serve the trained outputs; the optimizer's step count travels with them.
#[test]
fn trained_variables_load_in_python() {
    let Some(fixture) = fixture("trained_variables_load_in_python") else {
        return;
    };
    let (_, python_output) = fixture.python_training();
    let mut state = fresh_state(fixture, false);
    Trainer::<TfBackend, SavedModelModule>::new(config(), Loss::cross_entropy())
        .unwrap()
        .fit(&mut state, &fixture.loader(), None)
        .unwrap();
    let x = TfBackend::from_host(&fixture.serve_input(), Device::Cpu).unwrap();
    let ours = state.model.predict_step(&x).unwrap();

    let dest = common::scratch_dir("saved-model-trainer-export").join("trained");
    state.model.saved_model().save_variables_to(&dest).unwrap();
    let (serve, serving_default, iterations) = fixture.python_serve(&dest);
    assert_close("Python serve() of the saved variables", &serve, &ours, TOL);
    assert_close(
        "Python serving_default of the saved variables",
        &serving_default,
        &ours,
        TOL,
    );
    assert_close("against Python's own training", &ours, python_output, TOL);
    assert_eq!(iterations, Some(10));

    // And Kiln loads the written SavedModel back with the same state.
    let reloaded = SavedModelModule::load(&dest).unwrap();
    assert_eq!(
        Module::<TfBackend>::state_dict(&reloaded).unwrap(),
        Module::<TfBackend>::state_dict(&state.model).unwrap()
    );
}

/// (c) A Trainer checkpoint mid-training, resumed in a fresh module loaded from
/// the original export (with a step schedule on the learning-rate variable), ends
/// bitwise where the uninterrupted run does, with the same losses.
#[test]
fn checkpoint_and_resume_is_bitwise() {
    let Some(fixture) = fixture("checkpoint_and_resume_is_bitwise") else {
        return;
    };
    let dir = common::scratch_dir("saved-model-trainer-checkpoints");
    let config = TrainerConfig {
        schedule_interval: kiln_train::ScheduleInterval::Step,
        ..config()
    };
    let policy = CheckpointPolicy {
        every_n_steps: Some(3),
        every_n_epochs: None,
        keep_last: 5,
        ..CheckpointPolicy::default()
    };
    let losses = Losses::default();
    let mut full = fresh_state(fixture, true);
    Trainer::<TfBackend, SavedModelModule>::new(config.clone(), Loss::cross_entropy())
        .unwrap()
        .with_callback(losses.clone())
        .with_checkpointer(Checkpointer::new(&dir, policy).unwrap(), None)
        .fit(&mut full, &fixture.loader(), None)
        .unwrap();
    let full_losses = losses.take();
    assert_eq!(full.step, 10);
    // The schedule halved the rate after steps 4 and 8.
    assert_eq!(full.optimizer.learning_rate() as f32, (LR / 4.0) as f32);

    let mut resumed = fresh_state(fixture, true);
    let checkpoint = Trainer::<TfBackend, SavedModelModule>::resume(
        &mut resumed,
        &dir.join("step-00000006.safetensors"),
    )
    .unwrap();
    assert_eq!(
        (checkpoint.step, checkpoint.epoch, checkpoint.batch_in_epoch),
        (6, 1, 1)
    );
    assert_eq!(checkpoint.optimizer_kind.as_deref(), Some("adam"));
    assert_eq!(
        resumed
            .optimizer
            .state_dict()
            .unwrap()
            .get("adam/iteration")
            .unwrap()
            .to_f64_vec(),
        [6.0]
    );
    Trainer::<TfBackend, SavedModelModule>::new(config, Loss::cross_entropy())
        .unwrap()
        .with_callback(losses.clone())
        .fit(&mut resumed, &fixture.loader(), None)
        .unwrap();
    let resumed_losses = losses.take();
    assert_eq!(resumed.step, 10);
    assert_eq!(resumed_losses, full_losses[6..], "losses after the resume");
    assert_eq!(
        Module::<TfBackend>::state_dict(&resumed.model).unwrap(),
        Module::<TfBackend>::state_dict(&full.model).unwrap()
    );
    assert_eq!(
        resumed.optimizer.state_dict().unwrap(),
        full.optimizer.state_dict().unwrap()
    );
}

fn expect_invalid(err: Error, name: &str, says: &[&str]) {
    let text = err.to_string() + &err.display_chain().to_string();
    match &err {
        Error::InvalidArgument { name: got, .. } => assert_eq!(got, name, "{text}"),
        other => panic!("expected InvalidArgument at `{name}`, got {other:?}"),
    }
    for part in says {
        assert!(text.contains(part), "`{part}` not in: {text}");
    }
}

/// (d) Wrong names, unsupported training options and mismatched state are typed
/// errors that say what was expected, and a rejected state changes nothing.
#[test]
fn errors_are_typed_and_change_nothing() {
    let Some(fixture) = fixture("errors_are_typed_and_change_nothing") else {
        return;
    };
    let load = || SavedModel::load(fixture.mlp()).unwrap();
    let err = SavedModelModule::builder(load())
        .serve("predict")
        .build()
        .unwrap_err();
    expect_invalid(
        err,
        "serve",
        &["`predict`", "serve, serving_default, train"],
    );
    let err = SavedModelModule::builder(load())
        .train("fit")
        .build()
        .unwrap_err();
    expect_invalid(err, "train", &["training signature `fit`"]);
    let err = SavedModelModule::builder(load())
        .input("features")
        .build()
        .unwrap_err();
    expect_invalid(err, "input", &["no input `features`", "x: f32[?, 8]"]);
    let err = SavedModelModule::builder(load())
        .target("labels")
        .build()
        .unwrap_err();
    expect_invalid(err, "target", &["no input `labels`", "y: i32[?]"]);
    let err = SavedModelModule::builder(load())
        .output("probabilities")
        .build()
        .unwrap_err();
    expect_invalid(err, "output", &["no output `probabilities`", "output_0"]);
    // The serving signature as the training one: no target, no loss.
    let err = SavedModelModule::builder(load())
        .train("serve")
        .build()
        .unwrap_err();
    expect_invalid(err, "target", &["x: f32[?, 8]", "one target"]);

    let mut module = module(fixture);
    let err = module
        .build_optimizer(&OptimizerConfig::Sgd(SgdConfig::new(0.1)), &[])
        .unwrap_err();
    expect_invalid(err, "optimizer.type", &["applies `adam`", "asks for `sgd`"]);
    let mut optimizer = module.build_optimizer(&adam(), &[]).unwrap();
    let before = Module::<TfBackend>::state_dict(&module).unwrap();
    let optimizer_before = optimizer.state_dict().unwrap();

    // Accumulation and clipping are refused before anything runs.
    let (_, y) = fixture.data();
    for (name, config) in [
        (
            "gradient accumulation",
            TrainerConfig {
                accumulate: 2,
                ..config()
            },
        ),
        (
            "gradient clipping",
            TrainerConfig {
                clip: Some(GradClip::norm(1.0)),
                ..config()
            },
        ),
    ] {
        let mut state = fresh_state(fixture, false);
        let err = Trainer::<TfBackend, SavedModelModule>::new(config, Loss::cross_entropy())
            .unwrap()
            .fit(&mut state, &fixture.loader(), None)
            .unwrap_err();
        assert!(
            matches!(&err, Error::Unsupported { .. }) && err.to_string().contains(name),
            "{err:?}"
        );
        assert_eq!(state.step, 0);
        assert_eq!(
            state
                .optimizer
                .state_dict()
                .unwrap()
                .get("adam/iteration")
                .unwrap()
                .to_f64_vec(),
            [0.0]
        );
    }
    // A batch the signature does not take.
    let wrong = TfBackend::from_host(
        &HostTensor::new(vec![0f32; 4 * 5], [4, 5]).unwrap(),
        Device::Cpu,
    )
    .unwrap();
    let ty = TfBackend::from_host(&y, Device::Cpu).unwrap();
    let plan = kiln_core::backend::StepPlan {
        loss: &Loss::cross_entropy(),
        scale: 1.0,
        apply: true,
        clip: None,
    };
    let err = module
        .train_step(&mut optimizer, &wrong, &ty, &plan)
        .unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");

    // A state dict with one mis-shaped entry, one missing, one extra: nothing is written.
    let mut shaped = before.clone();
    shaped.insert(
        "mlp/logits/bias",
        HostTensor::new(vec![1f32; 4], [4]).unwrap(),
    );
    let mut zeroed = shaped.clone();
    zeroed.insert(
        "mlp/hidden/kernel",
        HostTensor::new(vec![0f32; 8 * 16], [8, 16]).unwrap(),
    );
    let err = Module::<TfBackend>::load_state_dict(&mut module, &zeroed).unwrap_err();
    assert!(
        matches!(&err, Error::ShapeMismatch { context, .. } if context.contains("mlp/logits/bias")),
        "{err:?}"
    );
    let mut missing = before.clone();
    missing.remove("mlp/hidden/bias");
    missing.insert(
        "mlp/hidden/kernel",
        HostTensor::new(vec![0f32; 8 * 16], [8, 16]).unwrap(),
    );
    let err = Module::<TfBackend>::load_state_dict(&mut module, &missing).unwrap_err();
    assert!(
        matches!(&err, Error::MissingKey { key, .. } if key == "mlp/hidden/bias"),
        "{err:?}"
    );
    let mut extra = before.clone();
    extra.insert(
        "mlp/hidden/gamma",
        HostTensor::new(vec![0f32; 16], [16]).unwrap(),
    );
    let err = Module::<TfBackend>::load_state_dict(&mut module, &extra).unwrap_err();
    expect_invalid(err, "mlp/hidden/gamma", &["unexpected entry"]);
    let mut typed = optimizer_before.clone();
    typed.insert("adam/iteration", HostTensor::scalar(3.0f32));
    typed.insert("adam/learning_rate", HostTensor::scalar(1.0f32));
    let err = optimizer.load_state_dict(&typed).unwrap_err();
    assert!(matches!(err, Error::DTypeMismatch { .. }), "{err:?}");
    assert_eq!(Module::<TfBackend>::state_dict(&module).unwrap(), before);
    assert_eq!(optimizer.state_dict().unwrap(), optimizer_before);

    // A matching state loads, into the handle the signatures use and its Keras
    // mirror: the serving output and Python (after saving) see it.
    let mut halved = StateDict::new();
    for (name, value) in before.iter() {
        let v: Vec<f32> = value
            .as_slice::<f32>()
            .unwrap()
            .iter()
            .map(|x| x / 2.0)
            .collect();
        halved.insert(name.clone(), HostTensor::new(v, value.shape()).unwrap());
    }
    Module::<TfBackend>::load_state_dict(&mut module, &halved).unwrap();
    assert_eq!(Module::<TfBackend>::state_dict(&module).unwrap(), halved);
    let sx = TfBackend::from_host(&fixture.serve_input(), Device::Cpu).unwrap();
    let ours = module.predict_step(&sx).unwrap();
    let dest = common::scratch_dir("saved-model-trainer-halved").join("halved");
    module.saved_model().save_variables_to(&dest).unwrap();
    let (serve, _, _) = fixture.python_serve(&dest);
    assert_close("Python serve() after load_state_dict", &serve, &ours, TOL);

    // Schedules set the learning-rate variable: one rate, as there is one group.
    optimizer.set_learning_rates(&[0.01]).unwrap();
    assert_eq!(optimizer.learning_rate() as f32, 0.01f32);
    let err = optimizer.set_learning_rates(&[0.01, 0.02]).unwrap_err();
    expect_invalid(err, "lrs", &["1 parameter group"]);
}

const BN_PARAMETERS: [&str; 6] = [
    "mlp_bn/hidden/kernel",
    "mlp_bn/hidden/bias",
    "mlp_bn/bn/gamma",
    "mlp_bn/bn/beta",
    "mlp_bn/logits/kernel",
    "mlp_bn/logits/bias",
];
const BN_BUFFERS: [&str; 2] = ["mlp_bn/bn/moving_mean", "mlp_bn/bn/moving_variance"];

/// The batch-norm model's buffers (moving mean, moving variance), in order.
fn buffers(module: &SavedModelModule) -> Vec<HostTensor> {
    Module::<TfBackend>::named_buffers(module)
        .unwrap()
        .iter()
        .map(|(_, t)| t.to_host().unwrap())
        .collect()
}

/// (e) Batch norm's moving statistics, the non-trainable model variables, are
/// buffers; its gamma and beta are parameters with the kernels and biases.
#[test]
fn batch_norm_statistics_are_buffers() {
    let Some(fixture) = fixture("batch_norm_statistics_are_buffers") else {
        return;
    };
    let module = module_at(&fixture.mlp_bn());
    let mut parameters = module.variable_names(VariableRole::Parameter);
    parameters.sort_unstable();
    let mut expected = BN_PARAMETERS.to_vec();
    expected.sort_unstable();
    assert_eq!(parameters, expected);
    let mut buffer_names = module.variable_names(VariableRole::Buffer);
    buffer_names.sort_unstable();
    assert_eq!(buffer_names, BN_BUFFERS);
    let optimizer = module.variable_names(VariableRole::Optimizer);
    assert_eq!(
        optimizer.len(),
        2 + 2 * BN_PARAMETERS.len(),
        "{optimizer:?}"
    );
    assert!(
        optimizer.iter().all(|n| n.starts_with("adam/")),
        "{optimizer:?}"
    );
    assert!(
        !optimizer.iter().any(|n| n.contains("moving")),
        "{optimizer:?}"
    );
    assert_eq!(module.optimizer_kind(), Some("adam"));

    // Keras's initial statistics: mean 0, variance 1, over the 16 hidden units.
    let names: Vec<String> = Module::<TfBackend>::named_buffers(&module)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, BN_BUFFERS);
    let initial = buffers(&module);
    assert_eq!(initial[0].to_f64_vec(), vec![0.0; 16]);
    assert_eq!(initial[1].to_f64_vec(), vec![1.0; 16]);
    // 8*16 + 16 + 16 + 16 + 16*3 + 3 trainable values.
    assert_eq!(Module::<TfBackend>::num_parameters(&module).unwrap(), 227);
    let state = Module::<TfBackend>::state_dict(&module).unwrap();
    let mut keys: Vec<&str> = state.iter().map(|(k, _)| k.as_str()).collect();
    keys.sort_unstable();
    let mut all: Vec<&str> = BN_PARAMETERS.iter().chain(&BN_BUFFERS).copied().collect();
    all.sort_unstable();
    assert_eq!(keys, all);
}

/// (f) The batch-norm model through the Trainer: its losses are Python's calls
/// of the same `train` signature on the same batches, the moving statistics are
/// updated (as Python's are), and the variables saved with `save_variables_to`
/// serve in Python what Kiln's eval-mode forward gives.
#[test]
fn batch_norm_trainer_matches_python_and_saves_the_statistics() {
    let Some(fixture) = fixture("batch_norm_trainer_matches_python_and_saves_the_statistics")
    else {
        return;
    };
    let python = fixture.python_train(&fixture.mlp_bn(), "saved-model-trainer-python-train-bn");
    let losses = Losses::default();
    let mut state = fresh_state_at(&fixture.mlp_bn(), false);
    let initial = buffers(&state.model);
    Trainer::<TfBackend, SavedModelModule>::new(config(), Loss::cross_entropy())
        .unwrap()
        .with_callback(losses.clone())
        .fit(&mut state, &fixture.loader(), Some(&fixture.loader()))
        .unwrap();
    let losses = losses.take();
    assert_eq!(state.step, 10);
    assert_eq!(losses.len(), python.losses.len());
    let worst = max_difference(&losses, &python.losses);
    eprintln!(
        "batch norm: {} Trainer steps against Python's train signature: max loss \
         difference {worst:e}",
        losses.len()
    );
    assert!(
        worst <= TOL,
        "losses {losses:?} vs Python {:?}",
        python.losses
    );

    // The moving statistics moved, to where Python's did; validation (serving,
    // training=False) did not move them further.
    let trained = buffers(&state.model);
    for (name, (before, after)) in BN_BUFFERS.iter().zip(initial.iter().zip(&trained)) {
        let change = max_difference(&before.to_f64_vec(), &after.to_f64_vec());
        eprintln!("batch norm: {name} changed by up to {change:e} in training");
        assert!(change > 1e-3, "{name} did not change: {after:?}");
        assert_close(name, after, &python.variables[*name], TOL);
    }
    let state_dict = Module::<TfBackend>::state_dict(&state.model).unwrap();
    for name in BN_PARAMETERS.iter().chain(&BN_BUFFERS) {
        assert_close(
            name,
            state_dict.get(name).unwrap(),
            &python.variables[*name],
            TOL,
        );
    }
    assert_eq!(
        python.variables.len(),
        BN_PARAMETERS.len() + BN_BUFFERS.len()
    );

    let x = TfBackend::from_host(&fixture.serve_input(), Device::Cpu).unwrap();
    let mut model = state.model;
    Module::<TfBackend>::set_mode(&mut model, kiln_core::backend::Mode::Eval);
    let ours = Module::<TfBackend>::forward(&model, &x)
        .unwrap()
        .to_host()
        .unwrap();
    assert_close(
        "trained serve output (batch norm)",
        &ours,
        &python.output,
        TOL,
    );

    let dest = common::scratch_dir("saved-model-trainer-export-bn").join("trained");
    model.saved_model().save_variables_to(&dest).unwrap();
    let (serve, serving_default, iterations) = fixture.python_serve(&dest);
    let worst = max_difference(&serve.to_f64_vec(), &ours.to_f64_vec());
    eprintln!(
        "batch norm: Python serve() of the saved variables vs Kiln: max difference {worst:e}"
    );
    assert_close(
        "Python serve() of the saved variables (batch norm)",
        &serve,
        &ours,
        TOL,
    );
    assert_close(
        "Python serving_default of the saved variables (batch norm)",
        &serving_default,
        &ours,
        TOL,
    );
    assert_eq!(iterations, Some(10));
    let reloaded = SavedModelModule::load(&dest).unwrap();
    assert_eq!(
        Module::<TfBackend>::state_dict(&reloaded).unwrap(),
        state_dict
    );
}

/// (g) A checkpoint of the batch-norm model mid-training, resumed in a fresh
/// module, ends bitwise where the uninterrupted run does, buffers included.
#[test]
fn batch_norm_checkpoint_and_resume_is_bitwise() {
    let Some(fixture) = fixture("batch_norm_checkpoint_and_resume_is_bitwise") else {
        return;
    };
    let dir = common::scratch_dir("saved-model-trainer-checkpoints-bn");
    let policy = CheckpointPolicy {
        every_n_steps: Some(3),
        every_n_epochs: None,
        keep_last: 5,
        ..CheckpointPolicy::default()
    };
    let losses = Losses::default();
    let mut full = fresh_state_at(&fixture.mlp_bn(), false);
    let initial = buffers(&full.model);
    Trainer::<TfBackend, SavedModelModule>::new(config(), Loss::cross_entropy())
        .unwrap()
        .with_callback(losses.clone())
        .with_checkpointer(Checkpointer::new(&dir, policy).unwrap(), None)
        .fit(&mut full, &fixture.loader(), None)
        .unwrap();
    let full_losses = losses.take();
    assert_eq!(full.step, 10);
    assert_ne!(buffers(&full.model), initial);

    let mut resumed = fresh_state_at(&fixture.mlp_bn(), false);
    let checkpoint = Trainer::<TfBackend, SavedModelModule>::resume(
        &mut resumed,
        &dir.join("step-00000006.safetensors"),
    )
    .unwrap();
    assert_eq!(checkpoint.step, 6);
    // The checkpoint's statistics are in the fresh module: moved from the initial ones.
    let at_six = buffers(&resumed.model);
    assert_ne!(at_six, initial);
    assert_ne!(at_six, buffers(&full.model));
    Trainer::<TfBackend, SavedModelModule>::new(config(), Loss::cross_entropy())
        .unwrap()
        .with_callback(losses.clone())
        .fit(&mut resumed, &fixture.loader(), None)
        .unwrap();
    let resumed_losses = losses.take();
    assert_eq!(resumed.step, 10);
    assert_eq!(resumed_losses, full_losses[6..], "losses after the resume");
    assert_eq!(
        Module::<TfBackend>::state_dict(&resumed.model).unwrap(),
        Module::<TfBackend>::state_dict(&full.model).unwrap()
    );
    assert_eq!(buffers(&resumed.model), buffers(&full.model));
    // And the serving output, which reads the statistics, is the same bitwise.
    let x = TfBackend::from_host(&fixture.serve_input(), Device::Cpu).unwrap();
    assert_eq!(
        resumed.model.predict_step(&x).unwrap(),
        full.model.predict_step(&x).unwrap()
    );
    assert_eq!(
        resumed.optimizer.state_dict().unwrap(),
        full.optimizer.state_dict().unwrap()
    );
}
