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

/// Names the signatures and tensors of a [`SavedModelModule`]; made by
/// [`SavedModelModule::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct SavedModelModuleBuilder {
    model: SavedModel,
    serve: Option<String>,
    train: Option<String>,
    input: Option<String>,
    target: Option<String>,
    output: Option<String>,
}

impl SavedModelModuleBuilder {
    /// The serving signature (forward, evaluation, prediction): `serve` by default,
    /// or `serving_default` when the SavedModel has no `serve`.
    pub fn serve(mut self, signature: impl Into<String>) -> Self {
        self.serve = Some(signature.into());
        self
    }

    /// The training signature, which takes the input and the target, applies its
    /// optimizer and returns `{"loss": loss}`: `train` by default.
    pub fn train(mut self, signature: impl Into<String>) -> Self {
        self.train = Some(signature.into());
        self
    }

    /// The name of the input in both signatures (`x`); by default the serving
    /// signature's only input.
    pub fn input(mut self, name: impl Into<String>) -> Self {
        self.input = Some(name.into());
        self
    }

    /// The name of the target in the training signature (`y`); by default its one
    /// input besides the input.
    pub fn target(mut self, name: impl Into<String>) -> Self {
        self.target = Some(name.into());
        self
    }

    /// The serving signature's output that is the module's output (`output_0`); by
    /// default its only output.
    pub fn output(mut self, name: impl Into<String>) -> Self {
        self.output = Some(name.into());
        self
    }

    /// Checks the signatures and names, finds the variables and adds the ops that
    /// read and write them to the graph.
    ///
    /// Fails with [`Error::InvalidArgument`] naming the setting (`serve`, `train`,
    /// `input`, `target`, `output`), what the SavedModel has instead and what was
    /// expected: a signature that does not exist, an input or output it does not
    /// have, a training signature that does not take exactly the input and the
    /// target or has no `loss` output. A loss that is not a float scalar is
    /// [`Error::ShapeMismatch`] or [`Error::DTypeMismatch`], as is an input whose
    /// dtype differs between the signatures. A SavedModel without a saver (whose
    /// variables Kiln cannot find) or with variables of a dtype Kiln cannot hold is
    /// [`Error::Unsupported`].
    pub fn build(self) -> Result<SavedModelModule> {
        let model = self.model;
        let serve = match self.serve {
            Some(name) => name,
            None if model.signatures.contains_key(DEFAULT_SERVE) => DEFAULT_SERVE.to_owned(),
            None if model.signatures.contains_key(FALLBACK_SERVE) => FALLBACK_SERVE.to_owned(),
            None => DEFAULT_SERVE.to_owned(),
        };
        let train = self.train.unwrap_or_else(|| DEFAULT_TRAIN.to_owned());
        let serve_sig = signature(&model, "serve", &serve, "serving")?;
        let train_sig = signature(&model, "train", &train, "training")?;

        let input_name = match self.input {
            Some(name) => name,
            None => only(serve_sig, "input", &serve_sig.info.inputs, "inputs")?,
        };
        let input = tensor(serve_sig, "input", &input_name, true)?;
        let output_name = match self.output {
            Some(name) => name,
            None => only(serve_sig, "output", &serve_sig.info.outputs, "outputs")?,
        };
        let output = tensor(serve_sig, "output", &output_name, false)?;

        let train_input = tensor(train_sig, "input", &input_name, true)?;
        let others: Vec<&str> = train_sig
            .info
            .inputs
            .iter()
            .map(|s| s.name.as_str())
            .filter(|name| *name != input_name)
            .collect();
        let target_name = match self.target {
            Some(name) => name,
            None => match others.as_slice() {
                [only] => (*only).to_owned(),
                _ => {
                    return Err(Error::invalid_argument(
                        "target",
                        format!(
                            "training signature `{train}` takes {}: expected exactly the \
                             input `{input_name}` and one target; name the target with \
                             .target(...)",
                            names_of(&train_sig.info.inputs)
                        ),
                    ))
                }
            },
        };
        if target_name == input_name {
            return Err(Error::invalid_argument(
                "target",
                format!("`{target_name}` is the input; the target must be another input"),
            ));
        }
        let train_target = tensor(train_sig, "target", &target_name, true)?;
        if train_sig.info.inputs.len() != 2 {
            return Err(Error::invalid_argument(
                "train",
                format!(
                    "training signature `{train}` takes {}: expected exactly the input \
                     `{input_name}` and the target `{target_name}`",
                    names_of(&train_sig.info.inputs)
                ),
            ));
        }
        if input.spec.dtype != train_input.spec.dtype {
            return Err(Error::invalid_argument(
                "input",
                format!(
                    "`{input_name}` is {} in serving signature `{serve}` but {} in training \
                     signature `{train}`; both must take the same input",
                    input.spec, train_input.spec
                ),
            ));
        }
        let loss = loss_output(train_sig)?;

        let (variables, learning_rate, optimizer_kind) = variables(&model, serve_sig, train_sig)?;
        let shared = Shared {
            serve,
            train,
            input,
            output,
            train_input,
            train_target,
            loss,
            variables,
            learning_rate,
            optimizer_kind,
            losses: Mutex::new(Vec::new()),
            model,
        };
        log::info!(
            "SavedModel {} as a module: serve `{}`, train `{}`; {} parameters, {} buffers, \
             {} optimizer variables{}",
            shared.model.dir().display(),
            shared.serve,
            shared.train,
            shared.count(VariableRole::Parameter),
            shared.count(VariableRole::Buffer),
            shared.count(VariableRole::Optimizer),
            match shared.optimizer_kind {
                Some(kind) => format!(" (optimizer `{kind}`)"),
                None => String::new(),
            }
        );
        Ok(SavedModelModule {
            shared: Arc::new(shared),
            mode: Mode::Train,
        })
    }
}

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

/// The optimizer of a [`SavedModelModule`]: the one its training signature
/// applies. [`step`](Optimizer::step) and [`zero_grad`](Optimizer::zero_grad) do
/// nothing (the signature has updated the variables in
/// [`train_step`](Trainable::train_step)); its state is the exported optimizer's
/// variables (step count, moments, learning rate), so a Trainer checkpoint
/// resumes exactly; its learning rate is the Keras optimizer's `learning_rate`
/// variable, which schedules set.
pub struct SignatureOptimizer {
    shared: Arc<Shared>,
    kind: Option<&'static str>,
}

impl fmt::Debug for SignatureOptimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SignatureOptimizer")
            .field("dir", &self.shared.model.dir())
            .field("train", &self.shared.train)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl Optimizer<TfBackend> for SignatureOptimizer {
    /// Nothing: the training signature applied the update.
    fn step(&mut self) -> Result<()> {
        Ok(())
    }

    /// Nothing: the gradients never leave the training signature.
    fn zero_grad(&mut self) -> Result<()> {
        Ok(())
    }

    /// The learning-rate variable's value; NaN when there is none or it cannot be
    /// read (logged).
    fn learning_rate(&self) -> f64 {
        let Some(var) = self.shared.learning_rate() else {
            return f64::NAN;
        };
        match self.shared.read(&[var]).and_then(|v| {
            v.first()
                .map(TfTensor::to_host)
                .transpose()?
                .ok_or_else(|| Error::backend("tensorflow", "reading the learning rate", "none"))
        }) {
            Ok(value) => value.to_f64_vec().first().copied().unwrap_or(f64::NAN),
            Err(e) => {
                log::error!("{}", e.display_chain());
                f64::NAN
            }
        }
    }

    /// Assigns the learning-rate variable; a failure, or an optimizer without
    /// one, is logged (use [`set_learning_rates`](Optimizer::set_learning_rates)
    /// for the error).
    fn set_learning_rate(&mut self, lr: f64) {
        if let Err(e) = self.shared.set_learning_rate(lr) {
            log::error!("{}", e.display_chain());
        }
    }

    /// Assigns the learning-rate variable: one rate (there is one group); an
    /// optimizer without a learning-rate variable is [`Error::Unsupported`].
    fn set_learning_rates(&mut self, lrs: &[f64]) -> Result<()> {
        match lrs {
            [lr] => self.shared.set_learning_rate(*lr),
            _ => Err(Error::invalid_argument(
                "lrs",
                format!(
                    "a SavedModel's optimizer has 1 parameter group, got {} learning rates",
                    lrs.len()
                ),
            )),
        }
    }

    fn kind(&self) -> Option<&'static str> {
        self.kind
    }

    /// The optimizer's variables by name (`adam/iteration`, ...), read in one run.
    fn state_dict(&self) -> Result<StateDict> {
        let shared = &self.shared;
        shared.state_dict(&shared.of_role(&[VariableRole::Optimizer]))
    }

    /// Writes every optimizer variable in one run, after checking every key, shape
    /// and dtype: on error nothing changes.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let shared = &self.shared;
        shared.load(
            &shared.of_role(&[VariableRole::Optimizer]),
            state,
            "optimizer",
        )
    }
}

// ----- validation -----

fn signature<'a>(
    model: &'a SavedModel,
    setting: &str,
    name: &str,
    what: &str,
) -> Result<&'a Signature> {
    model.signatures.get(name).ok_or_else(|| {
        Error::invalid_argument(
            setting,
            format!(
                "the SavedModel {} has no {what} signature `{name}`; its signatures: {}; \
                 name the {what} signature with .{setting}(...)",
                model.dir().display(),
                if model.signatures.is_empty() {
                    "(none)".to_owned()
                } else {
                    model
                        .signatures
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ),
        )
    })
}

fn names_of(specs: &[TensorSpec]) -> String {
    if specs.is_empty() {
        return "nothing".to_owned();
    }
    specs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The name of the one input or output of `sig`.
fn only(sig: &Signature, setting: &str, specs: &[TensorSpec], what: &str) -> Result<String> {
    match specs {
        [only] => Ok(only.name.clone()),
        _ => Err(Error::invalid_argument(
            setting,
            format!(
                "serving signature `{}` has {} {what} ({}); name the one to use with \
                 .{setting}(...)",
                sig.info.name,
                specs.len(),
                names_of(specs)
            ),
        )),
    }
}

/// The input (or output) `name` of `sig`.
fn tensor(sig: &Signature, setting: &str, name: &str, input: bool) -> Result<BoundTensor> {
    let (specs, ports, what) = if input {
        (&sig.info.inputs, &sig.inputs, "input")
    } else {
        (&sig.info.outputs, &sig.outputs, "output")
    };
    let found = specs.iter().zip(ports).find(|(spec, _)| spec.name == name);
    match found {
        Some((spec, port)) => Ok(BoundTensor {
            spec: spec.clone(),
            port: Output {
                operation: port.operation.clone(),
                index: port.index,
            },
        }),
        None => Err(Error::invalid_argument(
            setting,
            format!(
                "signature `{}` has no {what} `{name}`; its {what}s: {}",
                sig.info.name,
                names_of(specs)
            ),
        )),
    }
}

/// The training signature's `loss` output, checked to be a float scalar.
fn loss_output(sig: &Signature) -> Result<BoundTensor> {
    let name = &sig.info.name;
    let loss = tensor(sig, "train", LOSS_OUTPUT, false).map_err(|_| {
        Error::invalid_argument(
            "train",
            format!(
                "training signature `{name}` has no output `{LOSS_OUTPUT}` (its outputs: {}); \
                 return {{\"{LOSS_OUTPUT}\": loss}} from the exported function",
                names_of(&sig.info.outputs)
            ),
        )
    })?;
    if let Some(dims) = &loss.spec.shape {
        if dims.iter().any(|d| *d != Some(1)) {
            return Err(super::loss_not_scalar(
                name,
                LOSS_OUTPUT,
                &loss.spec.shape_string(),
            ));
        }
    }
    match loss.spec.dtype.kiln() {
        Some(DType::F32 | DType::F64) => Ok(loss),
        Some(other) => Err(Error::DTypeMismatch {
            context: format!("the loss `{LOSS_OUTPUT}` of training signature `{name}`"),
            expected: DType::F32,
            actual: other,
        }),
        None => Err(Error::unsupported(format!(
            "the loss `{LOSS_OUTPUT}` of training signature `{name}` has dtype {}; expected \
             a float32 or float64 scalar",
            loss.spec.dtype
        ))),
    }
}

/// Checks a fed tensor's dtype and shape against `spec` (before anything runs).
fn check_feed(signature: &str, spec: &TensorSpec, tensor: &TfTensor) -> Result<()> {
    let context = format!("signature `{signature}` input `{}`", spec.name);
    match spec.dtype.kiln() {
        Some(dtype) if dtype == tensor.dtype() => {}
        Some(dtype) => {
            return Err(Error::DTypeMismatch {
                context,
                expected: dtype,
                actual: tensor.dtype(),
            })
        }
        None => {
            return Err(Error::unsupported(format!(
                "{context} has dtype {}, which Kiln cannot feed",
                spec.dtype
            )))
        }
    }
    let shape = tensor.shape();
    if !spec.accepts(shape.dims()) {
        return Err(Error::ShapeMismatch {
            context,
            expected: spec.shape_string(),
            actual: shape.to_string(),
        });
    }
    Ok(())
}

/// The TensorFlow dtype to fetch an output of `spec` as.
fn fetch_dtype(signature: &str, spec: &TensorSpec) -> Result<DataType> {
    match spec.dtype.kiln() {
        Some(dtype) => tf_dtype(dtype),
        None => Err(Error::unsupported(format!(
            "signature `{signature}` output `{}` has dtype {}, which Kiln cannot fetch",
            spec.name, spec.dtype
        ))),
    }
}

// ----- variables -----

fn is(op: &Operation, ty: &str) -> bool {
    op.op_type().is_ok_and(|t| t == ty)
}

/// A handle's variable name: its `shared_name`, or the op's name without one.
fn shared_name(op: &Operation) -> String {
    match op.get_attr_string("shared_name") {
        Ok(name) if !name.is_empty() => name,
        _ => op.name().unwrap_or_default(),
    }
}

/// The `VarHandleOp`s that `roots` depend on, in depth-first order of the
/// inputs (the order the functions capture them in: a model's definition order).
fn reachable_handles(roots: &[Operation]) -> Vec<Operation> {
    let mut seen = BTreeSet::new();
    let mut found = Vec::new();
    let mut stack: Vec<Operation> = roots.iter().rev().cloned().collect();
    while let Some(op) = stack.pop() {
        let Ok(name) = op.name() else { continue };
        if !seen.insert(name) {
            continue;
        }
        if is(&op, "VarHandleOp") {
            found.push(op.clone());
        }
        for i in (0..op.num_inputs()).rev() {
            stack.push(op.input(i).0);
        }
        for control in op.control_inputs().into_iter().rev() {
            stack.push(control);
        }
    }
    found
}

/// The readable name of each handle (see [`SavedModelModule`]'s "Variables"): the
/// shared name, less a `_<n>` suffix where the graph also holds a handle of the
/// bare name that is not saved (Keras's traced copy), unless names would collide.
fn variable_names(handles: &[Operation], graph_handles: &BTreeSet<String>) -> Vec<String> {
    let raw: Vec<String> = handles.iter().map(shared_name).collect();
    let saved: BTreeSet<&str> = raw.iter().map(String::as_str).collect();
    let cleaned: Vec<String> = raw
        .iter()
        .map(|name| {
            let bare = name.rsplit_once('_').and_then(|(bare, n)| {
                (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).then_some(bare)
            });
            match bare {
                Some(bare) if graph_handles.contains(bare) && !saved.contains(bare) => {
                    bare.to_owned()
                }
                _ => name.clone(),
            }
        })
        .collect();
    let mut counts = BTreeMap::new();
    for name in &cleaned {
        *counts.entry(name.as_str()).or_insert(0usize) += 1;
    }
    cleaned
        .iter()
        .zip(&raw)
        .map(|(clean, raw)| {
            if counts.get(clean.as_str()) == Some(&1) {
                clean.clone()
            } else {
                raw.clone()
            }
        })
        .collect()
}

type Found = (Vec<Variable>, Option<usize>, Option<&'static str>);

/// Finds the saved variables, classifies them and adds their read and write ops.
fn variables(model: &SavedModel, serve: &Signature, train: &Signature) -> Result<Found> {
    let saver = model.saver()?;
    let dir = model.dir().display().to_string();
    let mut mirror_of = BTreeMap::new();
    for assign in &saver.mirrors {
        let (mirror, read) = (assign.input(0).0, assign.input(1).0);
        if let (Ok(source), Ok(_)) = (read.input(0).0.name(), mirror.name()) {
            mirror_of.insert(source, mirror);
        }
    }
    let mirrors: BTreeSet<String> = mirror_of.values().filter_map(|m| m.name().ok()).collect();
    let save_op = &saver.save.operation;
    let saved: BTreeSet<String> = (0..save_op.num_inputs())
        .map(|i| save_op.input(i).0)
        .filter(|op| is(op, "VarHandleOp"))
        .filter_map(|op| op.name().ok())
        .filter(|name| !mirrors.contains(name))
        .collect();
    let outputs = |sig: &Signature| -> Vec<Operation> {
        sig.outputs.iter().map(|p| p.operation.clone()).collect()
    };
    let served: BTreeSet<String> = reachable_handles(&outputs(serve))
        .iter()
        .filter_map(|op| op.name().ok())
        .collect();
    let mut roots = outputs(serve);
    roots.extend(outputs(train));
    roots.push(save_op.clone());
    let handles: Vec<Operation> = reachable_handles(&roots)
        .into_iter()
        .filter(|op| op.name().is_ok_and(|n| saved.contains(&n)))
        .collect();

    let mut b = model.graph()?;
    let graph_handles: BTreeSet<String> = b
        .graph
        .operation_iter()
        .filter(|op| is(op, "VarHandleOp"))
        .map(|op| shared_name(&op))
        .collect();
    let names = variable_names(&handles, &graph_handles);

    // Read every variable once: its dtype and shape as restored.
    let mut reads = Vec::with_capacity(handles.len());
    for (handle, name) in handles.iter().zip(&names) {
        let data_type = handle
            .get_attr_type("dtype")
            .map_err(|s| tf_error(&format!("reading the dtype of variable `{name}`"), s))?;
        let dtype = super::TensorDType::from_tf(data_type);
        let Some(dtype) = dtype.kiln() else {
            return Err(Error::unsupported(format!(
                "variable `{name}` of the SavedModel {dir} has dtype {dtype}, which Kiln \
                 cannot hold (Kiln tensors are u8, i32, i64, f32 or f64)"
            )));
        };
        let handle_out = Output {
            operation: handle.clone(),
            index: 0,
        };
        reads.push((
            b.read(&handle_out, data_type)?,
            dtype,
            data_type,
            handle_out,
        ));
    }
    let fetches: Vec<(&Output, DataType)> = reads.iter().map(|r| (&r.0, r.2)).collect();
    let values = if fetches.is_empty() {
        Vec::new()
    } else {
        run_session(
            &model.session,
            &[],
            &fetches,
            &[],
            &format!("reading the variables of the SavedModel {dir}"),
        )?
    };

    let objects = &model.objects;
    let mut variables = Vec::with_capacity(handles.len());
    for (((handle, name), (read, dtype, data_type, handle_out)), value) in
        handles.iter().zip(names).zip(reads).zip(values)
    {
        let dims = value.shape().dims().to_vec();
        let idims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let feed = b.placeholder(data_type, Some(&idims))?;
        let mut write = vec![b.assign(&handle_out, &feed, data_type, &[])?];
        let handle_name = handle.name().unwrap_or_default();
        if let Some(mirror) = mirror_of.get(&handle_name) {
            let mirror = Output {
                operation: mirror.clone(),
                index: 0,
            };
            write.push(b.assign(&mirror, &feed, data_type, &[])?);
        }
        let role = if objects.optimizer_variables.contains(&name) {
            VariableRole::Optimizer
        } else if served.contains(&handle_name) {
            match objects.trainable.get(&name) {
                Some(Some(false)) => VariableRole::Buffer,
                _ => VariableRole::Parameter,
            }
        } else {
            VariableRole::Optimizer
        };
        variables.push(Variable {
            name,
            role,
            dtype,
            dims,
            read,
            feed,
            write,
        });
    }
    drop(b);

    let optimizer: Vec<&Variable> = variables
        .iter()
        .filter(|v| v.role == VariableRole::Optimizer)
        .collect();
    let rates: Vec<usize> = variables
        .iter()
        .enumerate()
        .filter(|(_, v)| {
            v.role == VariableRole::Optimizer
                && v.dims.is_empty()
                && matches!(v.dtype, DType::F32 | DType::F64)
                && v.name.rsplit('/').next() == Some("learning_rate")
        })
        .map(|(i, _)| i)
        .collect();
    let learning_rate = match rates.as_slice() {
        [only] => Some(*only),
        _ => None,
    };
    let prefixes: BTreeSet<&str> = optimizer
        .iter()
        .filter_map(|v| v.name.split_once('/').map(|(p, _)| p))
        .collect();
    let kind = match prefixes.iter().collect::<Vec<_>>().as_slice() {
        [prefix] => KNOWN_OPTIMIZERS.iter().copied().find(|k| k == *prefix),
        _ => None,
    };
    Ok((variables, learning_rate, kind))
}
