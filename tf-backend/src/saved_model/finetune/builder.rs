//! [`SavedModelModuleBuilder`]: naming and checking a SavedModel's signatures
//! and tensors before it trains.

use std::path::Path;
use std::sync::{Arc, Mutex};

use kiln_core::{backend::Mode, Error, Result};

use super::checks::{loss_output, names_of, only, signature, tensor, variables};
use super::module::SavedModelModule;
use super::shared::Shared;
use super::variable::VariableRole;
use crate::saved_model::load::SavedModel;

/// The serving signature used when none is named: the endpoint name of Keras's
/// `model.export` and the `ExportArchive` examples.
const DEFAULT_SERVE: &str = "serve";
/// The serving signature used when the SavedModel has no [`DEFAULT_SERVE`].
const FALLBACK_SERVE: &str = "serving_default";
/// The training signature used when none is named.
const DEFAULT_TRAIN: &str = "train";

/// Names the signatures and tensors of a [`SavedModelModule`]; made by
/// [`SavedModelModule::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct SavedModelModuleBuilder {
    pub(super) model: SavedModel,
    pub(super) serve: Option<String>,
    pub(super) train: Option<String>,
    pub(super) input: Option<String>,
    pub(super) target: Option<String>,
    pub(super) output: Option<String>,
}

/// Building a [`SavedModelModule`]: here, beside the builder, so that the
/// module's file does not import its builder back.
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
            None if model.resolved_signatures().contains_key(DEFAULT_SERVE) => {
                DEFAULT_SERVE.to_owned()
            }
            None if model.resolved_signatures().contains_key(FALLBACK_SERVE) => {
                FALLBACK_SERVE.to_owned()
            }
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
