//! What the training tools add to the loop: the TensorBoard views of a
//! logged step and the model's graph, SWA's learning rates, and the weight
//! average at the end.

use super::Trainer;
use crate::learner::averaging::AveragingConfig;
use crate::learner::batch_norm::update_batch_norm;
use crate::learner::state::TrainingState;
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::error::Result;
use kiln_core::optim::Optimizer;
use kiln_core::tensor::HostTensor;
use kiln_data::DataLoader;

/// What `fit` gives its sinks beside each logged step's loss and learning
/// rate: the views TensorBoard users watch to tell a diverging run from a
/// healthy one (in a CLI config, `[logging]` keys of the same names).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepViews {
    /// Each parameter group's learning rate, as `lr/group_<i>` (Lightning's
    /// `LearningRateMonitor`), at every logged step.
    pub lr_per_group: bool,
    /// The L2 norm of the gradients, in total (`grad_norm/total`) and per
    /// parameter group (`grad_norm/group_<i>`), as the step applied them
    /// (unscaled and clipped), at every logged step. Needs an optimizer that
    /// keeps its gradients ([`Optimizer::keeps_gradients`]).
    pub grad_norms: bool,
    /// Histograms of every parameter (`weights/<name>`) and, where the
    /// optimizer keeps them, every gradient (`gradients/<name>`) after every
    /// this many optimizer steps (0: none).
    pub histograms_every: u64,
    /// The model's dataflow graph ([`Module::graph_def`]), once, after the run's
    /// first step (when the graph holds the training step). Needs an engine that
    /// keeps one (TensorFlow); `fit` refuses it before the first step otherwise.
    ///
    /// [`Module::graph_def`]: kiln_core::module::Module::graph_def
    pub graph: bool,
}

impl<B: TrainBackend, M: Trainable<B>> Trainer<B, M> {
    /// Gives the sinks the model's graph ([`StepViews::graph`]).
    pub(super) fn log_graph(&mut self, state: &TrainingState<B, M>) -> Result<()> {
        let Some(graph) = state.model.graph_def()? else {
            return Ok(());
        };
        for sink in &mut self.sinks {
            sink.log_graph(&graph)?;
        }
        Ok(())
    }

    /// Adds the [`StepViews`] of a logged step to its `row`.
    pub(super) fn views_row(
        &self,
        state: &TrainingState<B, M>,
        row: &mut Vec<(String, f64)>,
    ) -> Result<()> {
        if self.views.lr_per_group {
            let lrs = state.optimizer.learning_rates();
            if lrs.len() > 1 {
                for (i, lr) in lrs.into_iter().enumerate() {
                    row.push((format!("lr/group_{i}"), lr));
                }
            }
        }
        if self.views.grad_norms {
            let norms = state.optimizer.gradient_norms()?;
            let total = norms.iter().map(|n| n * n).sum::<f64>().sqrt();
            row.push(("grad_norm/total".to_owned(), total));
            if norms.len() > 1 {
                for (i, norm) in norms.into_iter().enumerate() {
                    row.push((format!("grad_norm/group_{i}"), norm));
                }
            }
        }
        Ok(())
    }

    /// The weights and (where the optimizer keeps them) gradients, as the
    /// histograms of a step.
    pub(super) fn histograms(state: &TrainingState<B, M>) -> Result<Vec<(String, HostTensor)>> {
        let mut out = Vec::new();
        for (name, tensor) in state.model.named_parameters()? {
            out.push((format!("weights/{name}"), B::to_host(&tensor)?));
        }
        if state.optimizer.keeps_gradients() {
            for (name, grad) in state.optimizer.gradients()?.into_inner() {
                out.push((format!("gradients/{name}"), grad));
            }
        }
        Ok(out)
    }

    /// Sets SWA's rates for its `k`-th epoch (0-based), recording the rates it
    /// anneals from at its first.
    pub(super) fn set_swa_rates(state: &mut TrainingState<B, M>, k: u64) -> Result<()> {
        let Some(averaging) = state.averaging.as_mut() else {
            return Ok(());
        };
        let AveragingConfig::Swa(swa) = averaging.config().clone() else {
            return Ok(());
        };
        let from = match averaging.swa_lrs_from() {
            Some(from) => from.to_vec(),
            None => {
                let from = state.optimizer.learning_rates();
                averaging.set_swa_lrs_from(from.clone());
                from
            }
        };
        let lrs = swa.lrs_at(k, &from)?;
        state.optimizer.set_learning_rates(&lrs)
    }

    /// Ends a run that keeps a weight average with the average in the model,
    /// as Lightning's `WeightAveraging` and `StochasticWeightAveraging` leave
    /// it after `fit`: the averaged weights replace the training weights, and
    /// for SWA with `update_bn` batch norm's running statistics are
    /// recomputed for them with one pass over `train`
    /// ([`update_batch_norm`]). Returns whether there was an average to apply
    /// (none, or one not yet updated, leaves the model as it is).
    pub fn apply_average(
        &self,
        state: &mut TrainingState<B, M>,
        train: &dyn DataLoader,
    ) -> Result<bool> {
        let Some(averaging) = state.averaging.as_ref().filter(|a| a.updates() > 0) else {
            return Ok(false);
        };
        let training = averaging.swap_into(&mut state.model)?;
        if let AveragingConfig::Swa(swa) = averaging.config() {
            if swa.update_bn {
                let epoch = state.epoch;
                if let Err(e) =
                    update_batch_norm::<B, M>(&mut state.model, train, epoch, self.config.device)
                {
                    state.model.load_state_dict(&training)?;
                    return Err(e);
                }
            }
        }
        Ok(true)
    }
}
