//! Knowledge distillation (Hinton et al., 2015) as an [`Objective`]: the
//! student (the model being trained) learns from a frozen teacher's softened
//! predictions and from the labels.

use kiln_core::{
    backend::{Backend, EagerBackend, Mode},
    loss::Loss,
    module::Module,
    objective::{Objective, ObjectiveBatch, ObjectiveOutput},
    Error, Result,
};
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::backend::TorchBackend;
use crate::error::torch_error;
use crate::loss::compute_loss;

/// How [`Distillation`] weighs the teacher against the labels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DistillationConfig {
    /// The softmax temperature `T` both models' logits are divided by
    /// (> 0; 1 leaves them as they are). The soft term is multiplied by `T²`,
    /// so that its gradients keep their size as `T` changes.
    #[serde(default = "two")]
    pub temperature: f64,
    /// The soft term's weight `α` in `[0, 1]`; the labels' loss has `1 - α`.
    #[serde(default = "half")]
    pub alpha: f64,
    /// The loss against the labels (cross-entropy by default).
    #[serde(default = "Loss::cross_entropy")]
    pub hard_loss: Loss,
}

fn two() -> f64 {
    2.0
}
fn half() -> f64 {
    0.5
}

impl Default for DistillationConfig {
    fn default() -> Self {
        Self {
            temperature: 2.0,
            alpha: 0.5,
            hard_loss: Loss::cross_entropy(),
        }
    }
}

impl DistillationConfig {
    /// Rejects a temperature that is not positive and finite, an `alpha`
    /// outside `[0, 1]`, and an invalid labels' loss, naming the field.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(Error::invalid_argument(
                "distillation.temperature",
                format!(
                    "is {}; it must be a finite number above 0",
                    self.temperature
                ),
            ));
        }
        if !(0.0..=1.0).contains(&self.alpha) {
            return Err(Error::invalid_argument(
                "distillation.alpha",
                format!("is {}; it must lie in [0, 1]", self.alpha),
            ));
        }
        self.hard_loss.validate()
    }
}

/// Knowledge distillation: with student logits `s`, teacher logits `t`,
/// labels `y`, temperature `T` and weight `α`,
///
/// `loss = α · T² · KL(softmax(t / T) ‖ softmax(s / T)) + (1 - α) · hard(s, y)`
///
/// where the KL divergence is summed over the classes and averaged over the
/// rows (`F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1),
/// reduction="batchmean", log_target=True)` in PyTorch), and `hard` is the
/// configured loss against the labels (cross-entropy). The teacher is frozen:
/// it runs in eval mode without autograd, on the batch's inputs. The metrics
/// are `distill_kl` (the KL term before its weights) and `hard_loss`; the
/// predictions given to the run's metrics are the student's logits. A
/// student with auxiliary losses (a mixture of experts' `aux_loss` and
/// `router_z_loss`) adds them with their weights, as under [`Supervised`](kiln_core::objective::Supervised),
/// and reports them as metrics after those two.
///
/// ```no_run
/// use kiln_core::{backend::TrainBackend, loss::Loss, model::{Layer, LinearConfig}, Device};
/// use kiln_torch::{Distillation, DistillationConfig, TorchBackend};
/// use kiln_train::{Trainer, TrainerConfig};
///
/// let teacher = TorchBackend::build_model(&Layer::from(LinearConfig::new(4, 3)), Device::Cpu)?;
/// let objective = Distillation::new(teacher, DistillationConfig { temperature: 4.0, ..Default::default() })?;
/// let trainer = Trainer::<TorchBackend>::with_objective(TrainerConfig::default(), objective)?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub struct Distillation {
    teacher: Box<dyn Module<TorchBackend> + Send>,
    config: DistillationConfig,
}

impl std::fmt::Debug for Distillation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Distillation")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Distillation {
    /// Distillation from `teacher` (any torch module: a built model with
    /// pretrained weights, a TorchScript model...), which is put in eval mode
    /// and never trained. The config is checked here.
    pub fn new(
        mut teacher: impl Module<TorchBackend> + Send + 'static,
        config: DistillationConfig,
    ) -> Result<Self> {
        config.validate()?;
        teacher.set_mode(Mode::Eval);
        Ok(Self {
            teacher: Box::new(teacher),
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &DistillationConfig {
        &self.config
    }

    /// The KL term (before its weights) of student logits `s` against
    /// teacher logits `t`, both `[rows, classes]`.
    fn kl(&self, s: &Tensor, t: &Tensor) -> Result<Tensor> {
        let temperature = self.config.temperature;
        let log_p_s = s
            .f_div_scalar(temperature)
            .and_then(|x| x.f_log_softmax(-1, x.kind()))
            .map_err(|e| torch_error("distillation: the student's log-probabilities", e))?;
        let log_p_t = t
            .f_div_scalar(temperature)
            .and_then(|x| x.f_log_softmax(-1, x.kind()))
            .map_err(|e| torch_error("distillation: the teacher's log-probabilities", e))?;
        let rows = s.size().first().copied().unwrap_or(1).max(1);
        log_p_t
            .f_exp()
            .and_then(|p_t| p_t.f_mul(&log_p_t.f_sub(&log_p_s)?))
            .and_then(|x| x.f_sum(x.kind()))
            .and_then(|x| x.f_div_scalar(rows as f64))
            .map_err(|e| torch_error("distillation: the KL divergence", e))
    }
}

impl Objective<TorchBackend> for Distillation {
    fn name(&self) -> String {
        "distillation".to_owned()
    }

    /// `distill_kl` and `hard_loss`, then the student's auxiliary losses
    /// (a mixture of experts' router losses).
    fn metric_names(&self, model: &dyn Module<TorchBackend>) -> Vec<String> {
        let mut names = vec!["distill_kl".to_owned(), "hard_loss".to_owned()];
        names.extend(model.auxiliary_loss_names());
        names
    }

    fn compute(
        &self,
        model: &dyn Module<TorchBackend>,
        batch: &ObjectiveBatch<'_, Tensor>,
    ) -> Result<ObjectiveOutput<Tensor>> {
        let student = model.forward(batch.inputs)?;
        let teacher = TorchBackend::no_grad(|| self.teacher.forward(batch.inputs))?;
        let (ss, ts) = (TorchBackend::shape(&student), TorchBackend::shape(&teacher));
        if ss != ts || ss.rank() != 2 {
            return Err(Error::ShapeMismatch {
                context: "distillation: the teacher's logits against the student's".to_owned(),
                expected: format!("[rows, classes] as the student's {ss}"),
                actual: ts.to_string(),
            });
        }
        let kl = self.kl(&student, &teacher)?;
        let hard = compute_loss(&self.config.hard_loss, &student, batch.targets)?;
        let alpha = self.config.alpha;
        let soft_weight = alpha * self.config.temperature * self.config.temperature;
        let loss = kl
            .f_mul_scalar(soft_weight)
            .and_then(|soft| soft.f_add(&hard.f_mul_scalar(1.0 - alpha)?))
            .map_err(|e| torch_error("distillation: the loss", e))?;
        // The student's router losses, as its supervised training adds them.
        let with = model.add_auxiliary_losses(loss)?;
        let detach = |t: &Tensor| {
            t.f_detach()
                .map_err(|e| torch_error("distillation: a metric", e))
        };
        let mut metrics = vec![detach(&kl)?, detach(&hard)?];
        metrics.extend(with.values);
        Ok(ObjectiveOutput {
            metrics,
            loss: with.loss,
            outputs: Some(student),
        })
    }
}
