//! [`SavedModelModule`]: a SavedModel with a training signature as a Kiln
//! [`Module`] and [`Trainable`] on [`TfBackend`], so that the `Trainer` fine-tunes
//! it: the Trainer drives the loop, metrics, callbacks and checkpoints, and the
//! signature computes the loss and applies its own optimizer.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use kiln_core::{
    backend::{Mode, StepPlan, Trainable},
    loss::Loss,
    module::Module,
    optim::{Optimizer, OptimizerConfig, ParamGroup},
    state_dict::StateDict,
    DType, Error, HostTensor, Result,
};
use tensorflow::{DataType, Operation, Output};

use super::{SavedModel, Signature, TensorSpec, LOSS_OUTPUT};
use crate::backend::TfBackend;
use crate::convert::TfTensor;
use crate::engine::{run_session, tf_dtype};
use crate::error::tf_error;

/// The serving signature used when none is named: the endpoint name of Keras's
/// `model.export` and the `ExportArchive` examples.
const DEFAULT_SERVE: &str = "serve";
/// The serving signature used when the SavedModel has no [`DEFAULT_SERVE`].
const FALLBACK_SERVE: &str = "serving_default";
/// The training signature used when none is named.
const DEFAULT_TRAIN: &str = "train";

/// The optimizer names Kiln's [`OptimizerConfig`] knows, which are also the name
/// prefixes of Keras 3's optimizer variables (`adam/iteration`).
const KNOWN_OPTIMIZERS: [&str; 5] = ["sgd", "adam", "adamw", "rmsprop", "adagrad"];

/// What a SavedModel variable is to the [`SavedModelModule`] wrapping it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum VariableRole {
    /// Trainable model state: in [`Module::named_parameters`].
    Parameter,
    /// Non-trainable model state (batch-norm statistics): in
    /// [`Module::named_buffers`].
    Buffer,
    /// The exported optimizer's state (step count, moments, learning rate): in the
    /// [`SignatureOptimizer`]'s state dict.
    Optimizer,
}

/// One SavedModel variable with the ops Kiln added to read and write it.
#[derive(Debug)]
struct Variable {
    name: String,
    role: VariableRole,
    dtype: DType,
    dims: Vec<usize>,
    /// The handle's current value.
    read: Output,
    /// The placeholder that [`write`](Self::write) assigns.
    feed: Output,
    /// `handle = feed`, and `mirror = feed` for a Keras mirror.
    write: Vec<Operation>,
}

/// A signature tensor resolved in the graph.
#[derive(Debug, Clone)]
struct BoundTensor {
    spec: TensorSpec,
    port: Output,
}

/// The loss the Trainer evaluates, built on the serving output.
#[derive(Debug)]
struct LossProgram {
    loss: Loss,
    target_dtype: DType,
    target_rank: usize,
    target: Output,
    value: Output,
}

/// What a module and its optimizer share: the session and the ops Kiln added.
#[derive(Debug)]
struct Shared {
    model: SavedModel,
    serve: String,
    train: String,
    input: BoundTensor,
    output: BoundTensor,
    train_input: BoundTensor,
    train_target: BoundTensor,
    loss: BoundTensor,
    variables: Vec<Variable>,
    /// Index in `variables` of the optimizer's learning rate, if it has one.
    learning_rate: Option<usize>,
    /// The exported optimizer's algorithm, when its variables name it.
    optimizer_kind: Option<&'static str>,
    losses: Mutex<Vec<LossProgram>>,
}

/// A TensorFlow SavedModel with a serving and a training signature, as a Kiln
/// [`Module`] and [`Trainable`] module on [`TfBackend`]: the `Trainer` (in
/// `kiln-train`) fine-tunes it with its loop, metrics, callbacks, schedules and
/// exact-resume checkpoints, while the training signature computes the loss and
/// applies the optimizer exported with it.
///
/// The name follows the trait it implements, as kiln-torch's `ScriptModule` does
/// for TorchScript: it is the SavedModel *as a module*; the training itself stays
/// the Trainer's.
///
/// ```no_run
/// use kiln_tf::{SavedModel, SavedModelModule};
///
/// // A Keras 3 export with endpoints `serve(x)` and `train(x, y) -> {"loss": ...}`
/// // (see `SavedModel`'s "Fine-tuning" section for the Python side).
/// let module = SavedModelModule::builder(SavedModel::load("exported/mlp")?)
///     .serve("serve")
///     .train("train")
///     .input("x")
///     .target("y")
///     .build()?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
///
/// Every name has a default ([`SavedModelModule::load`] takes them all): the
/// serving signature `serve` (or `serving_default` when there is no `serve`), the
/// training signature `train`, the serving signature's only input and only
/// output, and the training signature's input other than the input as the target.
/// [`build`](SavedModelModuleBuilder::build) checks everything before returning.
///
/// # Variables
///
/// The variables are the ones the SavedModel's saver writes (the inputs of its
/// save op), named by their variable names as Keras and TensorFlow give them
/// (Keras 3's `variable.path`: `mlp/hidden/kernel`, `adam/iteration`), which are the
/// handles' shared names with the `_1` that the export appends to the handles the
/// functions use taken off. Keras 3 exports keep a second handle per variable, the
/// one Python's loader binds the functions to (see [`SavedModel`]'s "Saving"): it is
/// not listed again, every write goes to both, and saving still copies the one the
/// signatures train into it.
///
/// Each variable has a [`VariableRole`]: those in the export's
/// `optimizer_variables` collection (`ExportArchive.add_variable_collection`) are
/// the optimizer's; of the rest, those the serving signature reads are the model's
/// (parameters, or buffers where the object graph marks them non-trainable); any
/// other saved variable is only used by the training signature and is counted as
/// optimizer state (a Keras dropout seed, when the optimizer's variables are not
/// exported as a collection). Every variable is in a Trainer checkpoint either way:
/// the model's in the module's state dict, the others in the optimizer's.
///
/// # Mode
///
/// [`Module::set_mode`] records the mode, but the signatures fix the behaviour:
/// the serving signature is traced with `training=False` and the training one with
/// `training=True` (dropout, batch-norm statistics) whatever the mode.
///
/// # Saving
///
/// [`saved_model`](Self::saved_model) gives the [`SavedModel`], whose
/// [`save_variables_to`](SavedModel::save_variables_to) writes a SavedModel that
/// Python's `tf.saved_model.load` reads with the trained variables.
pub struct SavedModelModule {
    shared: Arc<Shared>,
    mode: Mode,
}

impl fmt::Debug for SavedModelModule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SavedModelModule")
            .field("dir", &self.shared.model.dir())
            .field("serve", &self.shared.serve)
            .field("train", &self.shared.train)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

mod builder;
mod checks;
mod optimizer;

pub use builder::SavedModelModuleBuilder;
use checks::*;
pub use optimizer::SignatureOptimizer;

impl SavedModelModule {
    /// A builder over `model`, to name its signatures and tensors.
    pub fn builder(model: SavedModel) -> SavedModelModuleBuilder {
        SavedModelModuleBuilder {
            model,
            serve: None,
            train: None,
            input: None,
            target: None,
            output: None,
        }
    }

    /// Loads the SavedModel in `dir` and wraps it with every name at its default
    /// (see [`SavedModelModuleBuilder`]).
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        Self::builder(SavedModel::load(dir)?).build()
    }

    /// The wrapped SavedModel: its signatures, and
    /// [`save_variables_to`](SavedModel::save_variables_to) to write the trained
    /// variables as a SavedModel.
    pub fn saved_model(&self) -> &SavedModel {
        &self.shared.model
    }

    /// The names of the variables of `role`, in the module's order.
    pub fn variable_names(&self, role: VariableRole) -> Vec<&str> {
        self.shared
            .variables
            .iter()
            .filter(|v| v.role == role)
            .map(|v| v.name.as_str())
            .collect()
    }

    /// The exported optimizer's algorithm (`adam`), when its variable names say it
    /// and it is one Kiln's [`OptimizerConfig`] has.
    pub fn optimizer_kind(&self) -> Option<&'static str> {
        self.shared.optimizer_kind
    }
}

impl Shared {
    fn count(&self, role: VariableRole) -> usize {
        self.variables.iter().filter(|v| v.role == role).count()
    }

    fn of_role(&self, roles: &[VariableRole]) -> Vec<&Variable> {
        self.variables
            .iter()
            .filter(|v| roles.contains(&v.role))
            .collect()
    }

    fn run(
        &self,
        feeds: &[(&Output, &TfTensor)],
        fetches: &[(&Output, DataType)],
        targets: &[&Operation],
        context: &str,
    ) -> Result<Vec<TfTensor>> {
        run_session(&self.model.session, feeds, fetches, targets, context)
    }

    /// The current values of `vars`, in one run.
    fn read(&self, vars: &[&Variable]) -> Result<Vec<TfTensor>> {
        if vars.is_empty() {
            return Ok(Vec::new());
        }
        let fetches = vars
            .iter()
            .map(|v| Ok((&v.read, tf_dtype(v.dtype)?)))
            .collect::<Result<Vec<_>>>()?;
        self.run(&[], &fetches, &[], "reading the SavedModel's variables")
    }

    /// Host copies of `vars` by name.
    fn state_dict(&self, vars: &[&Variable]) -> Result<StateDict> {
        let values = self.read(vars)?;
        let mut state = StateDict::new();
        for (var, value) in vars.iter().zip(values) {
            state.insert(var.name.clone(), value.to_host()?);
        }
        Ok(state)
    }

    /// Writes `state` into `vars`: every key, shape and dtype is checked first, and
    /// all of them are written in one run, so nothing changes on error.
    fn load(&self, vars: &[&Variable], state: &StateDict, what: &str) -> Result<()> {
        let mut values = Vec::with_capacity(vars.len());
        for var in vars {
            values.push(state.expect_entry(&var.name, var.dims.as_slice(), var.dtype)?);
        }
        let known: BTreeSet<&str> = vars.iter().map(|v| v.name.as_str()).collect();
        if let Some(extra) = state.keys().find(|k| !known.contains(k.as_str())) {
            return Err(Error::invalid_argument(
                extra.as_str(),
                format!(
                    "unexpected entry in the {what} state dict; the {} expected entries \
                     (the SavedModel {}'s {what} variables) do not include it",
                    vars.len(),
                    self.model.dir().display()
                ),
            ));
        }
        self.write(vars, &values, what)
    }

    fn write(&self, vars: &[&Variable], values: &[&HostTensor], what: &str) -> Result<()> {
        if vars.is_empty() {
            return Ok(());
        }
        let tensors = values
            .iter()
            .map(|h| TfTensor::from_host(h))
            .collect::<Result<Vec<_>>>()?;
        let feeds: Vec<(&Output, &TfTensor)> =
            vars.iter().map(|v| &v.feed).zip(tensors.iter()).collect();
        let targets: Vec<&Operation> = vars.iter().flat_map(|v| v.write.iter()).collect();
        self.run(
            &feeds,
            &[],
            &targets,
            &format!("writing the SavedModel's {what} variables"),
        )?;
        Ok(())
    }

    /// The serving output on `inputs`, and the values of `extra` fetched in the
    /// same run with `feeds`.
    fn serve(
        &self,
        inputs: &TfTensor,
        feeds: &[(&Output, &TfTensor)],
        extra: &[(&Output, DataType)],
    ) -> Result<Vec<TfTensor>> {
        check_feed(&self.serve, &self.input.spec, inputs)?;
        let out_dtype = fetch_dtype(&self.serve, &self.output.spec)?;
        let mut all_feeds = vec![(&self.input.port, inputs)];
        all_feeds.extend_from_slice(feeds);
        let mut fetches = vec![(&self.output.port, out_dtype)];
        fetches.extend_from_slice(extra);
        self.run(
            &all_feeds,
            &fetches,
            &[],
            &format!(
                "running serving signature `{}` of the SavedModel {}",
                self.serve,
                self.model.dir().display()
            ),
        )
    }

    fn learning_rate(&self) -> Option<&Variable> {
        self.learning_rate.and_then(|i| self.variables.get(i))
    }

    fn set_learning_rate(&self, lr: f64) -> Result<()> {
        let Some(var) = self.learning_rate() else {
            return Err(Error::unsupported(format!(
                "setting the learning rate of the SavedModel {}'s training signature: its \
                 optimizer has no learning-rate variable (a Keras optimizer exported with a \
                 LearningRateSchedule computes the rate inside the signature, and a \
                 signature without a Keras optimizer applies whatever it applies); \
                 schedule the rate in Python, or export a Keras optimizer with a float \
                 learning rate",
                self.model.dir().display()
            )));
        };
        let value = match var.dtype {
            DType::F64 => HostTensor::scalar(lr),
            _ => HostTensor::scalar(lr as f32),
        };
        self.write(&[var], &[&value], "learning-rate")
    }

    /// The loss program for `loss` on targets like `target`, built on first use.
    fn loss_value(
        &self,
        loss: &Loss,
        inputs: &TfTensor,
        targets: &TfTensor,
    ) -> Result<(f64, HostTensor)> {
        let (dtype, rank) = (targets.dtype(), targets.shape().dims().len());
        let mut programs = self.losses.lock().map_err(|_| {
            Error::backend(
                "tensorflow",
                "evaluating a SavedModel",
                "a thread panicked while building its loss",
            )
        })?;
        let index = match programs
            .iter()
            .position(|p| p.loss == *loss && p.target_dtype == dtype && p.target_rank == rank)
        {
            Some(index) => index,
            None => {
                programs.push(self.build_loss(loss, dtype, targets.shape().dims())?);
                programs.len() - 1
            }
        };
        let program = &programs[index];
        let fetched = self.serve(
            inputs,
            &[(&program.target, targets)],
            &[(&program.value, DataType::Float)],
        )?;
        let [output, value] = fetched.as_slice() else {
            return Err(Error::backend(
                "tensorflow",
                "evaluating a SavedModel",
                "missing outputs",
            ));
        };
        let value = value.to_host()?;
        match value.to_f64_vec().as_slice() {
            [v] => Ok((*v, output.to_host()?)),
            _ => Err(Error::ShapeMismatch {
                context: format!("loss {} on the serving output", loss.torch_name()),
                expected: "a single number (a `mean` or `sum` reduction)".to_owned(),
                actual: value.shape().to_string(),
            }),
        }
    }

    fn build_loss(&self, loss: &Loss, dtype: DType, dims: &[usize]) -> Result<LossProgram> {
        let output_dims: Vec<i64> = match &self.output.spec.shape {
            Some(dims) => dims.iter().map(|d| d.map_or(-1, |d| d as i64)).collect(),
            None => {
                return Err(Error::unsupported(format!(
                    "evaluating a loss on output `{}` of serving signature `{}`: its rank is \
                     unknown, and Kiln builds losses on outputs of a known rank",
                    self.output.spec.name, self.serve
                )))
            }
        };
        if self.output.spec.dtype.kiln() != Some(DType::F32) {
            return Err(Error::DTypeMismatch {
                context: format!(
                    "output `{}` of serving signature `{}`, for the Trainer's loss",
                    self.output.spec.name, self.serve
                ),
                expected: DType::F32,
                actual: self.output.spec.dtype.kiln().unwrap_or(DType::F64),
            });
        }
        // The batch dimension is left open; the others are the targets'.
        let target_dims: Vec<i64> = dims
            .iter()
            .enumerate()
            .map(|(i, &d)| if i == 0 { -1 } else { d as i64 })
            .collect();
        let mut b = self.model.graph()?;
        let target = b.placeholder(tf_dtype(dtype)?, Some(&target_dims))?;
        // Class indices arrive as the training signature takes them (Keras uses
        // int32); Kiln's class losses take int64, a lossless widening.
        let index_loss = matches!(loss, Loss::CrossEntropy(_) | Loss::Nll(_));
        let (loss_target, loss_dtype) = if index_loss && dtype == DType::I32 {
            (
                b.cast(&target, DataType::Int32, DataType::Int64)?,
                DType::I64,
            )
        } else {
            (target.clone(), dtype)
        };
        let value = crate::loss::build_loss(
            &mut b,
            loss,
            &self.output.port,
            &output_dims,
            &loss_target,
            loss_dtype,
            &target_dims,
        )?;
        Ok(LossProgram {
            loss: loss.clone(),
            target_dtype: dtype,
            target_rank: dims.len(),
            target,
            value,
        })
    }
}

impl Module<TfBackend> for SavedModelModule {
    /// The serving signature's output, as one session run.
    fn forward(&self, input: &TfTensor) -> Result<TfTensor> {
        let mut out = self.shared.serve(input, &[], &[])?;
        out.pop().ok_or_else(|| {
            Error::backend(
                "tensorflow",
                format!("running serving signature `{}`", self.shared.serve),
                "missing output",
            )
        })
    }

    fn mode(&self) -> Mode {
        self.mode
    }

    /// Records the mode; the signatures fix their own training behaviour (see
    /// [`SavedModelModule`]'s "Mode").
    fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    /// The trainable model variables' current values (copies), in one run.
    fn named_parameters(&self) -> Result<Vec<(String, TfTensor)>> {
        named(&self.shared, VariableRole::Parameter)
    }

    /// The non-trainable model variables' current values (copies), in one run.
    fn named_buffers(&self) -> Result<Vec<(String, TfTensor)>> {
        named(&self.shared, VariableRole::Buffer)
    }

    /// Parameters and buffers, read in one run.
    fn state_dict(&self) -> Result<StateDict> {
        let shared = &self.shared;
        shared.state_dict(&shared.of_role(&[VariableRole::Parameter, VariableRole::Buffer]))
    }

    /// Writes every parameter and buffer (and their Keras mirrors) in one run,
    /// after checking every key, shape and dtype: on error nothing changes.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let shared = &self.shared;
        let vars = shared.of_role(&[VariableRole::Parameter, VariableRole::Buffer]);
        shared.load(&vars, state, "model")
    }
}

fn named(shared: &Shared, role: VariableRole) -> Result<Vec<(String, TfTensor)>> {
    let vars = shared.of_role(&[role]);
    let values = shared.read(&vars)?;
    Ok(vars.iter().map(|v| v.name.clone()).zip(values).collect())
}

impl Trainable<TfBackend> for SavedModelModule {
    type Optim = SignatureOptimizer;

    /// Its `train` signature computes and applies the gradients in one session
    /// run, so no strategy can take part in it ([`Trainable::takes_step_hooks`]
    /// is `false`): to train a SavedModel data-parallel, use it as a
    /// `saved_model` layer of a model, whose gradients Kiln computes.
    fn kind(&self) -> String {
        "a SavedModel trained through its `train` signature (which computes and applies \
         the gradients in one native call; to train it data-parallel, use it as a \
         `saved_model` layer of a model, whose gradients Kiln computes)"
            .to_owned()
    }

    /// The optimizer is the one exported with the training signature; `config`
    /// is checked against it and gives it its learning rate:
    ///
    /// - its `type` must be the exported optimizer's when the optimizer's
    ///   variables name it (Keras 3: `adam/iteration` is `adam`), otherwise
    ///   [`Error::InvalidArgument`] at `optimizer.type`; when they do not, any type
    ///   is accepted (and logged);
    /// - its `lr` is assigned to the optimizer's learning-rate variable, so a
    ///   config and a schedule set the rate as for any Kiln optimizer (an
    ///   optimizer without such a variable keeps its own, logged);
    /// - its other hyperparameters (betas, eps, weight decay) are the exported
    ///   optimizer's, fixed in the signature: the config's are not used.
    ///
    /// Parameter groups are [`Error::Unsupported`]: the signature applies one
    /// update rule to every variable it trains.
    fn build_optimizer(
        &self,
        config: &OptimizerConfig,
        groups: &[ParamGroup],
    ) -> Result<SignatureOptimizer> {
        config.validate()?;
        let shared = &self.shared;
        if let Some(group) = groups.first() {
            return Err(Error::unsupported(format!(
                "parameter groups (group `{}`) with the SavedModel {}'s training signature \
                 `{}`: it applies its own optimizer to every variable it trains, with one \
                 learning rate and weight decay",
                group.name,
                shared.model.dir().display(),
                shared.train
            )));
        }
        match shared.optimizer_kind {
            Some(kind) if kind != config.kind() => {
                return Err(Error::invalid_argument(
                    "optimizer.type",
                    format!(
                        "the SavedModel {}'s training signature `{}` applies `{kind}` (its \
                         optimizer variables are `{kind}/...`), the config asks for `{}`; \
                         configure `{kind}`, or export the model with the optimizer you want",
                        shared.model.dir().display(),
                        shared.train,
                        config.kind()
                    ),
                ))
            }
            Some(_) => {}
            None => log::warn!(
                "the SavedModel {}'s training signature applies its own optimizer, whose \
                 algorithm Kiln cannot tell from its variables: the config's `{}` is not \
                 checked against it",
                shared.model.dir().display(),
                config.kind()
            ),
        }
        if shared.learning_rate.is_some() {
            shared.set_learning_rate(config.lr())?;
        } else {
            log::warn!(
                "the SavedModel {}'s optimizer has no learning-rate variable: the config's \
                 lr {} is not applied",
                shared.model.dir().display(),
                config.lr()
            );
        }
        log::info!(
            "training the SavedModel {} through signature `{}`: the exported optimizer's \
             hyperparameters besides the learning rate are used, not the config's",
            shared.model.dir().display(),
            shared.train
        );
        Ok(SignatureOptimizer {
            shared: Arc::clone(shared),
            kind: shared.optimizer_kind,
        })
    }

    /// Runs the training signature on the batch and returns its `loss`: the
    /// signature computes its own loss (`plan.loss` is the Trainer's, used by
    /// [`eval_step`](Trainable::eval_step)) and applies the optimizer in the same
    /// run, whatever the mode.
    ///
    /// Gradient accumulation (`plan.scale` other than 1, or a micro-batch that
    /// does not apply) and gradient clipping are [`Error::Unsupported`], checked
    /// before anything runs: the signature applies its update itself. A non-finite
    /// loss has been applied (see [`Trainable::train_step`]'s contract).
    fn train_step(
        &mut self,
        _optimizer: &mut SignatureOptimizer,
        inputs: &TfTensor,
        targets: &TfTensor,
        plan: &StepPlan<'_>,
    ) -> Result<f64> {
        let shared = &self.shared;
        if plan.scale != 1.0 || !plan.apply {
            return Err(Error::unsupported(format!(
                "gradient accumulation (loss scale {}) with the SavedModel {}'s training \
                 signature `{}`: it applies its update in the run that computes the \
                 gradients; train with accumulate = 1, or accumulate inside the exported \
                 function",
                plan.scale,
                shared.model.dir().display(),
                shared.train
            )));
        }
        if let Some(clip) = plan.clip {
            return Err(Error::unsupported(format!(
                "gradient clipping ({clip:?}) with the SavedModel {}'s training signature \
                 `{}`: its gradients never leave the signature; clip in the exported \
                 optimizer (Keras: `clipnorm` / `clipvalue`)",
                shared.model.dir().display(),
                shared.train
            )));
        }
        check_feed(&shared.train, &shared.train_input.spec, inputs)?;
        check_feed(&shared.train, &shared.train_target.spec, targets)?;
        let dtype = fetch_dtype(&shared.train, &shared.loss.spec)?;
        let fetched = shared.run(
            &[
                (&shared.train_input.port, inputs),
                (&shared.train_target.port, targets),
            ],
            &[(&shared.loss.port, dtype)],
            &[],
            &format!(
                "running training signature `{}` of the SavedModel {}",
                shared.train,
                shared.model.dir().display()
            ),
        )?;
        let loss = match fetched.first() {
            Some(loss) => loss.to_host()?,
            None => {
                return Err(Error::backend(
                    "tensorflow",
                    format!("running training signature `{}`", shared.train),
                    "the loss was not fetched",
                ))
            }
        };
        match loss.to_f64_vec().as_slice() {
            [value] => Ok(*value),
            _ => Err(super::loss_not_scalar(
                &shared.train,
                &shared.loss.spec.name,
                &loss.shape().to_string(),
            )),
        }
    }

    /// The serving output and the Trainer's `loss` on it, as one session run (the
    /// loss is built into the graph on first use). Class-index targets may be int32,
    /// as Keras signatures take them.
    fn eval_step(
        &self,
        loss: &Loss,
        inputs: &TfTensor,
        targets: &TfTensor,
    ) -> Result<(f64, HostTensor)> {
        self.shared.loss_value(loss, inputs, targets)
    }

    /// The serving output, as one session run.
    fn predict_step(&self, inputs: &TfTensor) -> Result<HostTensor> {
        self.forward(inputs)?.to_host()
    }
}
