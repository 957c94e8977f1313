//! Preference training without a reference model as an [`Objective`]:
//! SimPO (Meng et al., 2024), with CPO's negative log-likelihood term, as
//! TRL's `CPOTrainer` computes it with `loss_type="simpo"`.

use kiln_core::{
    backend::EagerBackend,
    module::Module,
    objective::{Objective, ObjectiveBatch, ObjectiveOutput},
    Error, Result,
};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::backend::TorchBackend;
use crate::error::torch_error;

/// The label TRL and `transformers` give a token that does not train.
const IGNORE: i64 = -100;

/// [`Simpo`]'s weights, with TRL's `CPOConfig` defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimpoConfig {
    /// `β`, the scale of the length-normalised log-probabilities (the
    /// rewards) inside the sigmoid (> 0; TRL's `beta`, 0.1; the SimPO paper
    /// uses 2 to 10).
    #[serde(default = "default_beta")]
    pub beta: f64,
    /// `γ`, the target reward margin (TRL's `simpo_gamma`, 0.5).
    #[serde(default = "default_gamma")]
    pub gamma: f64,
    /// The weight of the chosen completions' negative log-likelihood (TRL's
    /// `cpo_alpha`, 1.0: CPO-SimPO; 0 for the paper's SimPO).
    #[serde(default = "default_cpo_alpha")]
    pub cpo_alpha: f64,
    /// The probability `ε` that a pair's preference is flipped, in `[0, 0.5)`
    /// (TRL's `label_smoothing`, 0).
    #[serde(default)]
    pub label_smoothing: f64,
}

fn default_beta() -> f64 {
    0.1
}
fn default_gamma() -> f64 {
    0.5
}
fn default_cpo_alpha() -> f64 {
    1.0
}

impl Default for SimpoConfig {
    fn default() -> Self {
        Self {
            beta: default_beta(),
            gamma: default_gamma(),
            cpo_alpha: default_cpo_alpha(),
            label_smoothing: 0.0,
        }
    }
}

impl SimpoConfig {
    /// Rejects a `beta` that is not positive and finite, a `gamma` or
    /// `cpo_alpha` that is not finite (or a negative `cpo_alpha`), and a
    /// `label_smoothing` outside `[0, 0.5)`, naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, value: f64, expected: &str| {
            Err(Error::invalid_argument(
                format!("simpo.{field}"),
                format!("is {value}; it must be {expected}"),
            ))
        };
        if !(self.beta.is_finite() && self.beta > 0.0) {
            return bad("beta", self.beta, "a finite number above 0");
        }
        if !self.gamma.is_finite() {
            return bad("gamma", self.gamma, "finite");
        }
        if !(self.cpo_alpha.is_finite() && self.cpo_alpha >= 0.0) {
            return bad("cpo_alpha", self.cpo_alpha, "a finite number, 0 or above");
        }
        if !(0.0..0.5).contains(&self.label_smoothing) {
            return bad("label_smoothing", self.label_smoothing, "in [0, 0.5)");
        }
        Ok(())
    }
}

/// SimPO: a preference loss over chosen and rejected completions that needs
/// no reference model. With `c` and `r` a pair's mean log-probability per
/// trained token of the chosen and the rejected completion under the model,
///
/// `loss = mean(-(1 - ε) log σ(β (c - r) - γ) - ε log σ(-(β (c - r) - γ))) + cpo_alpha · nll`
///
/// where `nll` is the cross-entropy of the chosen completions' trained
/// tokens (TRL's `CPOTrainer` with `loss_type="simpo"`).
///
/// A micro-batch holds pairs: inputs and targets `[pairs, 2, length]`, token
/// ids with the chosen completion at index 0 of the second dimension and the
/// rejected one at index 1; a target is the input's token, or `-100` where
/// the token does not train (the prompt, padding). Targets are not shifted:
/// position `t + 1`'s target is scored by the logits at `t`, as in
/// `transformers`. The model takes `[rows, length]` token ids and returns
/// `[rows, length, vocabulary]` logits; both completions of every pair go
/// through it in one forward pass (TRL's `concatenated_forward`).
///
/// Its metrics are TRL's, `/` written `_`: `rewards_chosen` and
/// `rewards_rejected` (`β c`, `β r`), `rewards_accuracies` (the share of
/// pairs whose chosen reward is higher), `rewards_margins`, `logps_chosen`,
/// `logps_rejected` and `nll_loss`. It gives no predictions to the run's
/// metrics.
///
/// ```no_run
/// use kiln_torch::{Simpo, SimpoConfig, TorchBackend};
/// use kiln_train::{Trainer, TrainerConfig};
///
/// let objective = Simpo::new(SimpoConfig { beta: 2.0, cpo_alpha: 0.0, ..Default::default() })?;
/// let trainer = Trainer::<TorchBackend>::with_objective(TrainerConfig::default(), objective)?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Simpo {
    config: SimpoConfig,
}

impl Simpo {
    /// SimPO with `config`, checked here.
    pub fn new(config: SimpoConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self { config })
    }

    /// The configuration.
    pub fn config(&self) -> &SimpoConfig {
        &self.config
    }
}

/// The shape error of a batch that is not pairs.
fn not_pairs(what: &str, actual: &[i64]) -> Error {
    Error::ShapeMismatch {
        context: format!("SimPO: the batch's {what}"),
        expected: "[pairs, 2, length] token ids (chosen, rejected), length at least 2".to_owned(),
        actual: format!("{actual:?}"),
    }
}

/// `[pairs, 2, length]` as `[2 * pairs, length]`: every chosen row, then
/// every rejected row.
fn chosen_then_rejected(t: &Tensor) -> Result<Tensor> {
    t.f_select(1, 0)
        .and_then(|chosen| Tensor::f_cat(&[chosen, t.f_select(1, 1)?], 0))
        .map_err(|e| torch_error("SimPO: the pairs' rows", e))
}

impl Objective<TorchBackend> for Simpo {
    fn name(&self) -> String {
        "simpo".to_owned()
    }

    fn metric_names(&self, _model: &dyn Module<TorchBackend>) -> Vec<String> {
        [
            "rewards_chosen",
            "rewards_rejected",
            "rewards_accuracies",
            "rewards_margins",
            "logps_chosen",
            "logps_rejected",
            "nll_loss",
        ]
        .map(str::to_owned)
        .to_vec()
    }

    fn compute(
        &self,
        model: &dyn Module<TorchBackend>,
        batch: &ObjectiveBatch<'_, Tensor>,
    ) -> Result<ObjectiveOutput<Tensor>> {
        let shape = batch.inputs.size();
        if shape.len() != 3 || shape[1] != 2 || shape[2] < 2 {
            return Err(not_pairs("inputs", &shape));
        }
        if batch.targets.size() != shape {
            return Err(not_pairs("targets", &batch.targets.size()));
        }
        let (pairs, length) = (shape[0], shape[2]);
        let inputs = chosen_then_rejected(batch.inputs)?;
        let labels = chosen_then_rejected(batch.targets)?;
        let logits = model.forward(&inputs)?;
        let ls = logits.size();
        if ls.len() != 3 || ls[0] != 2 * pairs || ls[1] != length {
            return Err(Error::ShapeMismatch {
                context: "SimPO: the model's logits".to_owned(),
                expected: format!("[{}, {length}, vocabulary]", 2 * pairs),
                actual: format!("{ls:?}"),
            });
        }
        let err = |what: &str| {
            let context = format!("SimPO: {what}");
            move |e| torch_error(&context, e)
        };
        // Position t's logits score token t + 1.
        let labels = labels
            .f_narrow(1, 1, length - 1)
            .map_err(err("the shifted labels"))?;
        let mask = labels.f_ne(IGNORE).map_err(err("the trained tokens"))?;
        let counts = mask
            .f_sum_dim_intlist(-1, false, Kind::Float)
            .map_err(err("the trained tokens"))?;
        let fewest = TorchBackend::no_grad(|| counts.f_min().and_then(|m| m.f_double_value(&[])))
            .map_err(err("the trained tokens"))?;
        if fewest < 1.0 {
            return Err(Error::invalid_argument(
                "targets",
                "a chosen or rejected completion has no token to train (every target is -100): \
                 each completion needs at least one target after its first position",
            ));
        }
        let token_logps = logits
            .f_narrow(1, 0, length - 1)
            .and_then(|l| l.f_log_softmax(-1, Kind::Float))
            .and_then(|l| {
                let safe = labels.f_masked_fill(&mask.f_logical_not()?, 0)?;
                l.f_gather(-1, &safe.f_unsqueeze(-1)?, false)
            })
            .and_then(|l| l.f_squeeze_dim(-1))
            .and_then(|l| l.f_mul(&mask))
            .map_err(err("the tokens' log-probabilities"))?;
        let sums = token_logps
            .f_sum_dim_intlist(-1, false, Kind::Float)
            .map_err(err("the completions' log-probabilities"))?;
        let mean_logps = sums
            .f_div(&counts)
            .map_err(err("the completions' log-probabilities"))?;
        let (chosen, rejected) = (
            mean_logps.f_narrow(0, 0, pairs).map_err(err("chosen"))?,
            mean_logps
                .f_narrow(0, pairs, pairs)
                .map_err(err("rejected"))?,
        );
        let SimpoConfig {
            beta,
            gamma,
            cpo_alpha,
            label_smoothing,
        } = self.config;
        let preference = (|| -> std::result::Result<Tensor, tch::TchError> {
            let z = chosen
                .f_sub(&rejected)?
                .f_sub_scalar(gamma / beta)?
                .f_mul_scalar(beta)?;
            let agree = z.f_log_sigmoid()?.f_mul_scalar(-(1.0 - label_smoothing))?;
            let flipped = z.f_neg()?.f_log_sigmoid()?.f_mul_scalar(-label_smoothing)?;
            agree.f_add(&flipped)?.f_mean(Kind::Float)
        })()
        .map_err(err("the preference loss"))?;
        // The chosen completions' cross-entropy over all their trained tokens.
        let nll = (|| -> std::result::Result<Tensor, tch::TchError> {
            let total = sums.f_narrow(0, 0, pairs)?.f_sum(Kind::Float)?;
            let tokens = counts.f_narrow(0, 0, pairs)?.f_sum(Kind::Float)?;
            total.f_neg()?.f_div(&tokens)
        })()
        .map_err(err("the chosen completions' cross-entropy"))?;
        let loss = if cpo_alpha == 0.0 {
            preference
        } else {
            preference
                .f_add(&nll.f_mul_scalar(cpo_alpha).map_err(err("the loss"))?)
                .map_err(err("the loss"))?
        };
        let metrics =
            TorchBackend::no_grad(|| -> std::result::Result<Vec<Tensor>, tch::TchError> {
                let (rc, rr) = (chosen.f_mul_scalar(beta)?, rejected.f_mul_scalar(beta)?);
                Ok(vec![
                    rc.f_mean(Kind::Float)?,
                    rr.f_mean(Kind::Float)?,
                    rc.f_gt_tensor(&rr)?
                        .f_to_kind(Kind::Float)?
                        .f_mean(Kind::Float)?,
                    rc.f_sub(&rr)?.f_mean(Kind::Float)?,
                    chosen.f_mean(Kind::Float)?,
                    rejected.f_mean(Kind::Float)?,
                    nll.f_detach()?,
                ])
            })
            .map_err(err("its metrics"))?;
        Ok(ObjectiveOutput {
            loss,
            outputs: None,
            metrics,
        })
    }
}
