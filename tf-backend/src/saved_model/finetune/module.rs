//! [`SavedModelModule`]: a SavedModel with a training signature as a Kiln
//! [`Module`] and [`Trainable`] on [`TfBackend`], so that the `Trainer` fine-tunes
//! it: the Trainer drives the loop, metrics, callbacks and checkpoints, and the
//! signature computes the loss and applies its own optimizer.

use std::fmt;
use std::sync::Arc;

use kiln_core::{
    backend::{Mode, StepPlan, Trainable},
    loss::Loss,
    module::Module,
    optim::{OptimizerConfig, ParamGroup},
    state_dict::StateDict,
    Error, HostTensor, Result,
};

use super::checks::{check_feed, fetch_dtype};
use super::optimizer::SignatureOptimizer;
use super::shared::Shared;
use super::variable::VariableRole;
use crate::backend::TfBackend;
use crate::convert::TfTensor;
use crate::saved_model::load::{loss_not_scalar, SavedModel};

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
/// [`build`](super::SavedModelModuleBuilder::build) checks everything before returning.
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
    pub(super) shared: Arc<Shared>,
    pub(super) mode: Mode,
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

impl SavedModelModule {
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

    /// The SavedModel's graph with the ops Kiln added to train it.
    fn graph_def(&self) -> Result<Option<Vec<u8>>> {
        self.shared.model.running_graph_def().map(Some)
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
            _ => Err(loss_not_scalar(
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
