//! [`Shared`]: what a [`SavedModelModule`](super::SavedModelModule) and its
//! [`SignatureOptimizer`](super::SignatureOptimizer) share (the SavedModel, its
//! resolved tensors and variables) and the session runs both make: reading and
//! writing variables, serving, and the Trainer's loss on the serving output.

use std::collections::BTreeSet;
use std::sync::Mutex;

use kiln_core::{loss::Loss, state_dict::StateDict, DType, Error, HostTensor, Result};
use tensorflow::{DataType, Operation, Output};

use super::checks::{check_feed, fetch_dtype};
use super::variable::{BoundTensor, Variable, VariableRole};
use crate::convert::TfTensor;
use crate::engine::{run_session, tf_dtype};
use crate::saved_model::load::SavedModel;

/// The loss the Trainer evaluates, built on the serving output.
#[derive(Debug)]
pub(super) struct LossProgram {
    loss: Loss,
    target_dtype: DType,
    target_rank: usize,
    target: Output,
    value: Output,
}

/// What a module and its optimizer share: the session and the ops Kiln added.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) model: SavedModel,
    pub(super) serve: String,
    pub(super) train: String,
    pub(super) input: BoundTensor,
    pub(super) output: BoundTensor,
    pub(super) train_input: BoundTensor,
    pub(super) train_target: BoundTensor,
    pub(super) loss: BoundTensor,
    pub(super) variables: Vec<Variable>,
    /// Index in `variables` of the optimizer's learning rate, if it has one.
    pub(super) learning_rate: Option<usize>,
    /// The exported optimizer's algorithm, when its variables name it.
    pub(super) optimizer_kind: Option<&'static str>,
    pub(super) losses: Mutex<Vec<LossProgram>>,
}

impl Shared {
    pub(super) fn count(&self, role: VariableRole) -> usize {
        self.variables.iter().filter(|v| v.role == role).count()
    }

    pub(super) fn of_role(&self, roles: &[VariableRole]) -> Vec<&Variable> {
        self.variables
            .iter()
            .filter(|v| roles.contains(&v.role))
            .collect()
    }

    pub(super) fn run(
        &self,
        feeds: &[(&Output, &TfTensor)],
        fetches: &[(&Output, DataType)],
        targets: &[&Operation],
        context: &str,
    ) -> Result<Vec<TfTensor>> {
        run_session(self.model.session(), feeds, fetches, targets, context)
    }

    /// The current values of `vars`, in one run.
    pub(super) fn read(&self, vars: &[&Variable]) -> Result<Vec<TfTensor>> {
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
    pub(super) fn state_dict(&self, vars: &[&Variable]) -> Result<StateDict> {
        let values = self.read(vars)?;
        let mut state = StateDict::new();
        for (var, value) in vars.iter().zip(values) {
            state.insert(var.name.clone(), value.to_host()?);
        }
        Ok(state)
    }

    /// Writes `state` into `vars`: every key, shape and dtype is checked first, and
    /// all of them are written in one run, so nothing changes on error.
    pub(super) fn load(&self, vars: &[&Variable], state: &StateDict, what: &str) -> Result<()> {
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

    pub(super) fn write(
        &self,
        vars: &[&Variable],
        values: &[&HostTensor],
        what: &str,
    ) -> Result<()> {
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
    pub(super) fn serve(
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

    pub(super) fn learning_rate(&self) -> Option<&Variable> {
        self.learning_rate.and_then(|i| self.variables.get(i))
    }

    pub(super) fn set_learning_rate(&self, lr: f64) -> Result<()> {
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
    pub(super) fn loss_value(
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
