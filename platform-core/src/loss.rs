//! Loss function configurations; backends compute them natively.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How per-element losses are combined (PyTorch's `reduction`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reduction {
    /// The (weighted) mean over elements (the default).
    #[default]
    Mean,
    /// The sum over elements.
    Sum,
    /// No reduction: one loss per element.
    None,
}

fn default_beta() -> f64 {
    1.0
}

/// `nn.CrossEntropyLoss` on logits `[N, C, ...]` and class indices `[N, ...]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CrossEntropyConfig {
    /// A weight per class (length `C`), or `None` for equal weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<Vec<f64>>,
    /// A target value that contributes nothing (PyTorch's `ignore_index`);
    /// `None` ignores no class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_index: Option<i64>,
    /// Mixes the one-hot target with the uniform distribution, in `[0, 1]` (default 0).
    #[serde(default)]
    pub label_smoothing: f64,
    /// How the per-sample losses are combined (default mean).
    #[serde(default)]
    pub reduction: Reduction,
}

impl CrossEntropyConfig {
    /// Cross-entropy with PyTorch's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the per-class weights.
    pub fn with_weight(mut self, weight: Vec<f64>) -> Self {
        self.weight = Some(weight);
        self
    }

    /// Sets the ignored target value.
    pub fn with_ignore_index(mut self, ignore_index: i64) -> Self {
        self.ignore_index = Some(ignore_index);
        self
    }

    /// Sets the label smoothing.
    pub fn with_label_smoothing(mut self, label_smoothing: f64) -> Self {
        self.label_smoothing = label_smoothing;
        self
    }

    /// Sets the reduction.
    pub fn with_reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }
}

/// `nn.NLLLoss` on log-probabilities `[N, C, ...]` and class indices `[N, ...]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NllConfig {
    /// A weight per class (length `C`), or `None` for equal weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<Vec<f64>>,
    /// A target value that contributes nothing; `None` ignores no class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_index: Option<i64>,
    /// How the per-sample losses are combined (default mean).
    #[serde(default)]
    pub reduction: Reduction,
}

impl NllConfig {
    /// Negative log-likelihood with PyTorch's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the per-class weights.
    pub fn with_weight(mut self, weight: Vec<f64>) -> Self {
        self.weight = Some(weight);
        self
    }

    /// Sets the ignored target value.
    pub fn with_ignore_index(mut self, ignore_index: i64) -> Self {
        self.ignore_index = Some(ignore_index);
        self
    }

    /// Sets the reduction.
    pub fn with_reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }
}

/// `nn.SmoothL1Loss`: quadratic below `beta`, linear above.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SmoothL1Config {
    /// Where the loss changes from quadratic to linear; must be > 0 (default 1).
    #[serde(default = "default_beta")]
    pub beta: f64,
    /// How the per-element losses are combined (default mean).
    #[serde(default)]
    pub reduction: Reduction,
}

impl Default for SmoothL1Config {
    fn default() -> Self {
        SmoothL1Config {
            beta: 1.0,
            reduction: Reduction::Mean,
        }
    }
}

impl SmoothL1Config {
    /// Smooth L1 with PyTorch's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `beta`.
    pub fn with_beta(mut self, beta: f64) -> Self {
        self.beta = beta;
        self
    }

    /// Sets the reduction.
    pub fn with_reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }
}

/// `nn.BCEWithLogitsLoss`: sigmoid and binary cross-entropy in one stable step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BceWithLogitsConfig {
    /// A weight for positive examples per class (broadcast over the last
    /// dimension), or `None` for 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pos_weight: Option<Vec<f64>>,
    /// How the per-element losses are combined (default mean).
    #[serde(default)]
    pub reduction: Reduction,
}

impl BceWithLogitsConfig {
    /// Binary cross-entropy on logits with PyTorch's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the positive-class weights.
    pub fn with_pos_weight(mut self, pos_weight: Vec<f64>) -> Self {
        self.pos_weight = Some(pos_weight);
        self
    }

    /// Sets the reduction.
    pub fn with_reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }
}

/// A training objective, with the options of the PyTorch loss of the same name.
///
/// `Loss::cross_entropy()`, `Loss::mse()`, ... give PyTorch's defaults;
/// [`with_reduction`](Loss::with_reduction) applies to every loss, and the
/// other options are set on the variant's config. In a config file:
/// `loss = { type = "cross_entropy", label_smoothing = 0.1 }`.
///
/// ```
/// use kiln_core::loss::{CrossEntropyConfig, Loss, Reduction};
///
/// let loss: Loss = CrossEntropyConfig::new().with_label_smoothing(0.1).into();
/// loss.validate()?;
/// let mse = Loss::mse().with_reduction(Reduction::Sum);
/// assert_eq!(mse.reduction(), Reduction::Sum);
///
/// let parsed: Loss = serde_json::from_str(r#"{"type": "smooth_l1", "beta": 0.5}"#).expect("valid");
/// assert_eq!(parsed, Loss::SmoothL1(kiln_core::loss::SmoothL1Config::new().with_beta(0.5)));
/// assert!(Loss::SmoothL1(kiln_core::loss::SmoothL1Config::new().with_beta(0.0)).validate().is_err());
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
#[non_exhaustive]
pub enum Loss {
    /// `nn.CrossEntropyLoss`.
    CrossEntropy(CrossEntropyConfig),
    /// `nn.NLLLoss`.
    Nll(NllConfig),
    /// `nn.MSELoss`.
    Mse {
        /// How the per-element losses are combined (default mean).
        #[serde(default)]
        reduction: Reduction,
    },
    /// `nn.L1Loss`.
    L1 {
        /// How the per-element losses are combined (default mean).
        #[serde(default)]
        reduction: Reduction,
    },
    /// `nn.SmoothL1Loss`.
    SmoothL1(SmoothL1Config),
    /// `nn.BCEWithLogitsLoss`.
    BceWithLogits(BceWithLogitsConfig),
}

impl From<CrossEntropyConfig> for Loss {
    fn from(config: CrossEntropyConfig) -> Self {
        Loss::CrossEntropy(config)
    }
}

impl From<NllConfig> for Loss {
    fn from(config: NllConfig) -> Self {
        Loss::Nll(config)
    }
}

impl From<SmoothL1Config> for Loss {
    fn from(config: SmoothL1Config) -> Self {
        Loss::SmoothL1(config)
    }
}

impl From<BceWithLogitsConfig> for Loss {
    fn from(config: BceWithLogitsConfig) -> Self {
        Loss::BceWithLogits(config)
    }
}

impl Loss {
    /// The loss's name as configs write it (`"cross_entropy"`, `"mse"`...).
    pub fn name(&self) -> &'static str {
        match self {
            Loss::CrossEntropy(_) => "cross_entropy",
            Loss::Nll(_) => "nll",
            Loss::Mse { .. } => "mse",
            Loss::L1 { .. } => "l1",
            Loss::SmoothL1(_) => "smooth_l1",
            Loss::BceWithLogits(_) => "bce_with_logits",
        }
    }

    /// Cross-entropy with PyTorch's defaults.
    pub fn cross_entropy() -> Self {
        Loss::CrossEntropy(CrossEntropyConfig::new())
    }

    /// Negative log-likelihood with PyTorch's defaults.
    pub fn nll() -> Self {
        Loss::Nll(NllConfig::new())
    }

    /// Mean squared error.
    pub fn mse() -> Self {
        Loss::Mse {
            reduction: Reduction::Mean,
        }
    }

    /// Mean absolute error.
    pub fn l1() -> Self {
        Loss::L1 {
            reduction: Reduction::Mean,
        }
    }

    /// Smooth L1 with `beta = 1`.
    pub fn smooth_l1() -> Self {
        Loss::SmoothL1(SmoothL1Config::new())
    }

    /// Binary cross-entropy on logits with PyTorch's defaults.
    pub fn bce_with_logits() -> Self {
        Loss::BceWithLogits(BceWithLogitsConfig::new())
    }

    /// The same loss with another reduction.
    pub fn with_reduction(mut self, reduction: Reduction) -> Self {
        match &mut self {
            Loss::CrossEntropy(c) => c.reduction = reduction,
            Loss::Nll(c) => c.reduction = reduction,
            Loss::Mse { reduction: r } | Loss::L1 { reduction: r } => *r = reduction,
            Loss::SmoothL1(c) => c.reduction = reduction,
            Loss::BceWithLogits(c) => c.reduction = reduction,
        }
        self
    }

    /// The reduction.
    pub fn reduction(&self) -> Reduction {
        match self {
            Loss::CrossEntropy(c) => c.reduction,
            Loss::Nll(c) => c.reduction,
            Loss::Mse { reduction } | Loss::L1 { reduction } => *reduction,
            Loss::SmoothL1(c) => c.reduction,
            Loss::BceWithLogits(c) => c.reduction,
        }
    }

    /// The PyTorch class this loss corresponds to (`"CrossEntropyLoss"`, ...).
    pub fn torch_name(&self) -> &'static str {
        match self {
            Loss::CrossEntropy(_) => "CrossEntropyLoss",
            Loss::Nll(_) => "NLLLoss",
            Loss::Mse { .. } => "MSELoss",
            Loss::L1 { .. } => "L1Loss",
            Loss::SmoothL1(_) => "SmoothL1Loss",
            Loss::BceWithLogits(_) => "BCEWithLogitsLoss",
        }
    }

    /// Rejects options no input could make work: `label_smoothing` outside
    /// `[0, 1]`, `beta <= 0`, and empty, negative or non-finite weights.
    /// Fails with [`Error::InvalidArgument`] naming the field.
    pub fn validate(&self) -> Result<()> {
        match self {
            Loss::CrossEntropy(c) => {
                check_weights("weight", c.weight.as_deref())?;
                if !(0.0..=1.0).contains(&c.label_smoothing) {
                    return Err(Error::invalid_argument(
                        "label_smoothing",
                        format!("must be in [0, 1], got {}", c.label_smoothing),
                    ));
                }
                Ok(())
            }
            Loss::Nll(c) => check_weights("weight", c.weight.as_deref()),
            Loss::Mse { .. } | Loss::L1 { .. } => Ok(()),
            Loss::SmoothL1(c) => {
                if !(c.beta > 0.0 && c.beta.is_finite()) {
                    return Err(Error::invalid_argument(
                        "beta",
                        format!("must be finite and > 0, got {}", c.beta),
                    ));
                }
                Ok(())
            }
            Loss::BceWithLogits(c) => check_weights("pos_weight", c.pos_weight.as_deref()),
        }
    }
}

fn check_weights(name: &str, weights: Option<&[f64]>) -> Result<()> {
    let Some(weights) = weights else {
        return Ok(());
    };
    if weights.is_empty() {
        return Err(Error::invalid_argument(
            name,
            "must hold one value per class, got none",
        ));
    }
    if let Some((i, w)) = weights
        .iter()
        .enumerate()
        .find(|(_, w)| !(w.is_finite() && **w >= 0.0))
    {
        return Err(Error::invalid_argument(
            name,
            format!("entry {i} must be finite and >= 0, got {w}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Loss> {
        serde_json::from_str(json).map_err(|e| Error::invalid_argument("json", e.to_string()))
    }

    #[test]
    fn constructors_have_torch_defaults() {
        assert_eq!(
            Loss::cross_entropy(),
            Loss::CrossEntropy(CrossEntropyConfig {
                weight: None,
                ignore_index: None,
                label_smoothing: 0.0,
                reduction: Reduction::Mean
            })
        );
        assert_eq!(
            Loss::smooth_l1(),
            Loss::SmoothL1(SmoothL1Config {
                beta: 1.0,
                reduction: Reduction::Mean
            })
        );
        for loss in [
            Loss::cross_entropy(),
            Loss::nll(),
            Loss::mse(),
            Loss::l1(),
            Loss::smooth_l1(),
            Loss::bce_with_logits(),
        ] {
            assert_eq!(loss.reduction(), Reduction::Mean);
            loss.validate().expect("defaults are valid");
            let summed = loss.with_reduction(Reduction::None);
            assert_eq!(summed.reduction(), Reduction::None);
        }
        assert_eq!(Loss::nll().torch_name(), "NLLLoss");
        assert_eq!(Loss::bce_with_logits().torch_name(), "BCEWithLogitsLoss");
    }

    #[test]
    fn builders_set_options() -> Result<()> {
        let loss: Loss = CrossEntropyConfig::new()
            .with_weight(vec![1.0, 2.0])
            .with_ignore_index(-100)
            .with_label_smoothing(0.1)
            .with_reduction(Reduction::Sum)
            .into();
        loss.validate()?;
        let Loss::CrossEntropy(c) = &loss else {
            panic!("{loss:?}")
        };
        assert_eq!(c.weight.as_deref(), Some(&[1.0, 2.0][..]));
        assert_eq!(c.ignore_index, Some(-100));
        let nll: Loss = NllConfig::new()
            .with_weight(vec![0.5])
            .with_ignore_index(0)
            .with_reduction(Reduction::Sum)
            .into();
        nll.validate()?;
        let bce: Loss = BceWithLogitsConfig::new()
            .with_pos_weight(vec![3.0])
            .with_reduction(Reduction::None)
            .into();
        bce.validate()?;
        let smooth: Loss = SmoothL1Config::new()
            .with_beta(0.5)
            .with_reduction(Reduction::Sum)
            .into();
        smooth.validate()
    }

    #[test]
    fn validation_names_the_field() {
        let cases: [(Loss, &str); 6] = [
            (
                CrossEntropyConfig::new().with_label_smoothing(1.5).into(),
                "invalid argument `label_smoothing`: must be in [0, 1], got 1.5",
            ),
            (
                CrossEntropyConfig::new().with_label_smoothing(-0.1).into(),
                "invalid argument `label_smoothing`: must be in [0, 1], got -0.1",
            ),
            (
                SmoothL1Config::new().with_beta(0.0).into(),
                "invalid argument `beta`: must be finite and > 0, got 0",
            ),
            (
                NllConfig::new().with_weight(vec![1.0, -2.0]).into(),
                "invalid argument `weight`: entry 1 must be finite and >= 0, got -2",
            ),
            (
                BceWithLogitsConfig::new()
                    .with_pos_weight(Vec::new())
                    .into(),
                "invalid argument `pos_weight`: must hold one value per class, got none",
            ),
            (
                CrossEntropyConfig::new().with_weight(vec![f64::NAN]).into(),
                "invalid argument `weight`: entry 0 must be finite and >= 0, got NaN",
            ),
        ];
        for (loss, message) in cases {
            let err = loss.validate().expect_err(message);
            assert_eq!(err.to_string(), message);
        }
    }

    #[test]
    fn serde_is_hand_writable() -> Result<()> {
        assert_eq!(
            parse(r#"{"type": "cross_entropy"}"#)?,
            Loss::cross_entropy()
        );
        assert_eq!(
            parse(r#"{"type": "cross_entropy", "label_smoothing": 0.1, "ignore_index": -100}"#)?,
            CrossEntropyConfig::new()
                .with_label_smoothing(0.1)
                .with_ignore_index(-100)
                .into()
        );
        assert_eq!(
            parse(r#"{"type": "mse", "reduction": "sum"}"#)?,
            Loss::mse().with_reduction(Reduction::Sum)
        );
        assert_eq!(parse(r#"{"type": "l1"}"#)?, Loss::l1());
        assert_eq!(
            parse(r#"{"type": "bce_with_logits", "pos_weight": [2.0, 1.0]}"#)?,
            BceWithLogitsConfig::new()
                .with_pos_weight(vec![2.0, 1.0])
                .into()
        );
        assert_eq!(
            parse(r#"{"type": "nll", "reduction": "none"}"#)?,
            Loss::nll().with_reduction(Reduction::None)
        );
        let err = parse(r#"{"type": "cross_entropy", "smoothing": 0.1}"#).expect_err("typo");
        assert!(err.to_string().contains("smoothing"), "{err}");
        let err = parse(r#"{"type": "mse", "reductoin": "sum"}"#).expect_err("typo");
        assert!(err.to_string().contains("reductoin"), "{err}");
        for loss in [
            Loss::cross_entropy(),
            Loss::nll(),
            Loss::mse(),
            Loss::l1(),
            Loss::smooth_l1(),
            Loss::bce_with_logits(),
        ] {
            let json = serde_json::to_string(&loss)
                .map_err(|e| Error::invalid_argument("json", e.to_string()))?;
            assert_eq!(parse(&json)?, loss, "{json}");
        }
        Ok(())
    }
}
