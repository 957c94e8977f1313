//! The TensorBoard views of a logged step (each group's learning rate, the
//! gradients' norms, histograms) and the model's graph, as a callback.

use crate::learner::callback::{Callback, Context, FitInfo, Flow};
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::error::{Error, Result};
use kiln_core::optim::Optimizer;
use kiln_core::tensor::HostTensor;

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

/// The callback that logs a run's [`StepViews`]
/// ([`Trainer::with_step_views`](crate::Trainer::with_step_views) registers it).
#[derive(Debug)]
pub struct StepViewLogger {
    views: StepViews,
    graph_logged: bool,
}

impl StepViewLogger {
    /// Logs `views`.
    pub fn new(views: StepViews) -> Self {
        Self {
            views,
            graph_logged: false,
        }
    }
}

impl<B: TrainBackend, M: Trainable<B>> Callback<B, M> for StepViewLogger {
    /// Refuses, before the first step, views this engine or optimizer cannot give.
    fn on_fit_start(&mut self, cx: &mut Context<'_, B, M>, _run: &FitInfo<'_>) -> Result<()> {
        if self.views.graph && cx.state.model.graph_def()?.is_none() {
            return Err(Error::invalid_argument(
                "logging.graph",
                format!(
                    "the {} engine runs eagerly and keeps no dataflow graph for TensorBoard's \
                     Graphs view (TensorFlow does)",
                    B::NAME
                ),
            ));
        }
        if self.views.grad_norms && !cx.state.optimizer.keeps_gradients() {
            return Err(Error::invalid_argument(
                "logging.grad_norms",
                format!(
                    "the {} optimizer keeps no gradients after its step (a graph engine \
                     computes them inside it), so their norms cannot be logged",
                    B::NAME
                ),
            ));
        }
        Ok(())
    }

    /// Adds each group's learning rate and the gradients' norms to the row.
    fn on_log_step(
        &mut self,
        cx: &mut Context<'_, B, M>,
        row: &mut Vec<(String, f64)>,
    ) -> Result<()> {
        let optimizer = &cx.state.optimizer;
        if self.views.lr_per_group {
            let lrs = optimizer.learning_rates();
            if lrs.len() > 1 {
                for (i, lr) in lrs.into_iter().enumerate() {
                    row.push((format!("lr/group_{i}"), lr));
                }
            }
        }
        if self.views.grad_norms {
            let norms = optimizer.gradient_norms()?;
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

    /// The histograms every `histograms_every` steps; the graph after the
    /// run's first step (when the graph holds the training step).
    fn on_step_end(&mut self, cx: &mut Context<'_, B, M>, _loss: f64) -> Result<Flow> {
        let (step, every) = (cx.state.step, self.views.histograms_every);
        if every > 0 && step.is_multiple_of(every) && !cx.sinks.is_empty() {
            let histograms = histograms(cx.state)?;
            cx.sinks.log_histograms(step, &histograms)?;
        }
        if self.views.graph && !self.graph_logged {
            if let Some(graph) = cx.state.model.graph_def()? {
                cx.sinks.log_graph(&graph)?;
            }
            self.graph_logged = true;
        }
        Ok(Flow::Continue)
    }

    fn needs_step_loss(&self) -> bool {
        false
    }
}

/// The weights and (where the optimizer keeps them) gradients, as the
/// histograms of a step.
fn histograms<B: TrainBackend, M: Trainable<B>>(
    state: &crate::TrainingState<B, M>,
) -> Result<Vec<(String, HostTensor)>> {
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
