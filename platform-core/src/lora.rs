//! LoRA adapters (low-rank adaptation, Hu et al. 2021), as PEFT's `LoraConfig`
//! defines them: each targeted projection `y = x W^T + b` gains
//! `scale * B (A dropout(x))` with `A` `[r, in]` and `B` `[out, r]`, and only
//! `A` and `B` train.
//!
//! [`LoraConfig`] says which projections take an adapter and how it is
//! scaled; backends add the tensors it declares ([`LoraConfig::parameter_specs`])
//! next to the projection's own (`1.0.block.1.q_proj.lora_A.weight`) and run
//! the extra branch. [`LoraConfig::merge`] folds trained adapters into the base
//! weights for an export.
//!
//! ```
//! use kiln_core::lora::LoraConfig;
//! use kiln_core::model::{Layer, LinearConfig};
//!
//! let net = Layer::sequential([LinearConfig::new(16, 32).into(), Layer::Relu,
//!                              LinearConfig::new(32, 4).into()]);
//! let lora = LoraConfig::new(4, 8.0).with_target_modules(["0"]);
//! let targets = lora.targets(&net)?;
//! assert_eq!(targets.len(), 1);
//! assert_eq!((targets[0].module.as_str(), targets[0].in_features, targets[0].out_features),
//!            ("0", 16, 32));
//! let names: Vec<String> = lora.parameter_specs(&net)?.into_iter().map(|s| s.name).collect();
//! assert_eq!(names, ["0.lora_A.weight", "0.lora_B.weight"]);
//! assert_eq!(lora.scale(), 2.0);
//! # Ok::<(), kiln_core::Error>(())
//! ```

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::model::{InitDistribution, Layer, ParamKind, ParamSpec};
use crate::state_dict::StateDict;
use crate::tensor::HostTensor;

/// The suffix of an adapter's down projection `A` (`[r, in]`), after the module's path.
pub const LORA_A: &str = "lora_A.weight";
/// The suffix of an adapter's up projection `B` (`[out, r]`), after the module's path.
pub const LORA_B: &str = "lora_B.weight";

/// Which projections take LoRA adapters, and how (PEFT's `LoraConfig` fields).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// The adapters' rank.
    pub r: usize,
    /// `lora_alpha`: the update is scaled by `alpha / r` (`alpha / sqrt(r)` with `use_rslora`).
    pub alpha: f64,
    /// Dropout on the adapter's input while training (PEFT's `lora_dropout`).
    #[serde(default)]
    pub dropout: f64,
    /// The projections to adapt, matched as PEFT matches module names: a
    /// module whose path is a target or ends with `.` and a target
    /// (`"q_proj"` adapts every attention layer's query projection; a
    /// `linear` layer's module is its path, `"3"` or `"2.block.0"`).
    pub target_modules: Vec<String>,
    /// Rank-stabilised scaling, `alpha / sqrt(r)`.
    #[serde(default)]
    pub use_rslora: bool,
}

/// One projection that takes an adapter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraTarget {
    /// The projection's module path; its weight is `{module}.weight`.
    pub module: String,
    /// Input features (columns of the weight).
    pub in_features: usize,
    /// Output features (rows of the weight).
    pub out_features: usize,
}

impl LoraConfig {
    /// Rank `r` and `alpha`, no dropout, PEFT's default targets for LLaMA-style
    /// attention (`q_proj`, `v_proj`).
    pub fn new(r: usize, alpha: f64) -> Self {
        LoraConfig {
            r,
            alpha,
            dropout: 0.0,
            target_modules: vec!["q_proj".into(), "v_proj".into()],
            use_rslora: false,
        }
    }

    /// Sets the dropout on the adapters' input.
    pub fn with_dropout(mut self, dropout: f64) -> Self {
        self.dropout = dropout;
        self
    }

    /// Sets the projections to adapt.
    pub fn with_target_modules<S: Into<String>>(
        mut self,
        targets: impl IntoIterator<Item = S>,
    ) -> Self {
        self.target_modules = targets.into_iter().map(Into::into).collect();
        self
    }

    /// Sets rank-stabilised scaling.
    pub fn with_rslora(mut self, use_rslora: bool) -> Self {
        self.use_rslora = use_rslora;
        self
    }

    /// The factor of the adapters' update: `alpha / r`, or `alpha / sqrt(r)`.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    /// Checks the values: a rank of at least 1, a finite alpha, a dropout in
    /// `[0, 1)`, and at least one target.
    pub fn validate(&self) -> Result<()> {
        let invalid = |key: &str, reason: String| Err(Error::invalid_argument(key, reason));
        if self.r == 0 {
            return invalid("lora.r", "the rank must be at least 1, got 0".into());
        }
        if !self.alpha.is_finite() || self.alpha <= 0.0 {
            return invalid(
                "lora.alpha",
                format!("must be a positive number, got {}", self.alpha),
            );
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return invalid(
                "lora.dropout",
                format!("must be in [0, 1), got {}", self.dropout),
            );
        }
        if self.target_modules.is_empty() {
            return invalid(
                "lora.target_modules",
                "name at least one projection, e.g. [\"q_proj\", \"v_proj\"]".into(),
            );
        }
        Ok(())
    }

    /// Whether the module at `path` is one of the targets (PEFT's rule: the
    /// path itself, or a suffix after a dot).
    pub fn is_target(&self, path: &str) -> bool {
        self.target_modules
            .iter()
            .any(|t| path == t || path.ends_with(&format!(".{t}")))
    }

    /// The projections of `model` that take an adapter, in state-dict order.
    ///
    /// The projections are `linear` layers and the named projections of
    /// `self_attention` (`q_proj`, `k_proj`, `v_proj`, `o_proj`) and
    /// `gated_mlp` (`gate_proj`, `up_proj`, `down_proj`). A target that matches
    /// none of them is [`Error::InvalidArgument`] listing the projections there are.
    pub fn targets(&self, model: &Layer) -> Result<Vec<LoraTarget>> {
        self.validate()?;
        let all = projections(model)?;
        if let Some(missing) = self.target_modules.iter().find(|t| {
            !all.iter()
                .any(|p| p.module == **t || p.module.ends_with(&format!(".{t}")))
        }) {
            // Each name once, in the model's order: a projection of every
            // block by its own name (`q_proj`), a plain linear layer by its path.
            let mut kinds: Vec<&str> = Vec::new();
            for p in &all {
                let name = p
                    .module
                    .rsplit('.')
                    .next()
                    .filter(|last| last.ends_with("_proj"))
                    .unwrap_or(&p.module);
                if !kinds.contains(&name) {
                    kinds.push(name);
                }
            }
            const SHOWN: usize = 32;
            let mut list = if kinds.is_empty() {
                "none".to_owned()
            } else {
                kinds[..kinds.len().min(SHOWN)].join(", ")
            };
            if kinds.len() > SHOWN {
                list.push_str(&format!(" and {} more", kinds.len() - SHOWN));
            }
            return Err(Error::invalid_argument(
                "lora.target_modules",
                format!(
                    "`{missing}` matches no projection of the model (linear layers and attention / \
                     MLP projections; it has: {list})"
                ),
            ));
        }
        Ok(all
            .into_iter()
            .filter(|p| self.is_target(&p.module))
            .collect())
    }

    /// The adapters' parameters for `model`, two per target: `{module}.lora_A.weight`
    /// `[r, in]`, initialised as PEFT does (`kaiming_uniform_(a=sqrt(5))`,
    /// `U(-1/sqrt(in), 1/sqrt(in))`), and `{module}.lora_B.weight` `[out, r]`, zero,
    /// so that the adapted model starts as the base model.
    pub fn parameter_specs(&self, model: &Layer) -> Result<Vec<ParamSpec>> {
        let mut specs = Vec::new();
        for t in self.targets(model)? {
            let bound = 1.0 / (t.in_features as f64).sqrt();
            specs.push(ParamSpec {
                name: format!("{}.{LORA_A}", t.module),
                shape: vec![self.r, t.in_features],
                dtype: DType::F32,
                kind: ParamKind::Parameter,
                init: InitDistribution::Uniform {
                    low: -bound,
                    high: bound,
                },
                zero_row: None,
            });
            specs.push(ParamSpec {
                name: format!("{}.{LORA_B}", t.module),
                shape: vec![t.out_features, self.r],
                dtype: DType::F32,
                kind: ParamKind::Parameter,
                init: InitDistribution::Constant { value: 0.0 },
                zero_row: None,
            });
        }
        Ok(specs)
    }

    /// The adapters of `weights` (the tensors named `*.lora_A.weight` and
    /// `*.lora_B.weight`), without the base model's.
    pub fn adapter_weights(weights: &StateDict) -> StateDict {
        let mut out = StateDict::new();
        for (name, tensor) in weights.iter() {
            if is_adapter_name(name) {
                out.insert(name.clone(), tensor.clone());
            }
        }
        out
    }

    /// `weights` with every adapter folded into its projection,
    /// `W + scale * B A` (computed in float64, stored in the weight's dtype),
    /// and the adapter tensors removed: the plain model to export.
    ///
    /// An adapter without its pair or its base weight, or with shapes that do
    /// not fit them, is [`Error::ShapeMismatch`] / [`Error::MissingKey`] naming it.
    pub fn merge(&self, weights: &StateDict) -> Result<StateDict> {
        let mut merged = StateDict::new();
        for (name, tensor) in weights.iter() {
            if !is_adapter_name(name) {
                merged.insert(name.clone(), tensor.clone());
            }
        }
        let scale = self.scale();
        for (name, a) in weights.iter() {
            let Some(module) = name.strip_suffix(&format!(".{LORA_A}")) else {
                continue;
            };
            let b_name = format!("{module}.{LORA_B}");
            let w_name = format!("{module}.weight");
            let missing = |key: &str| Error::MissingKey {
                key: key.to_owned(),
                available: weights.len(),
            };
            let b = weights.get(&b_name).ok_or_else(|| missing(&b_name))?;
            let w = merged.get(&w_name).ok_or_else(|| missing(&w_name))?;
            let (out_f, in_f) = match w.dims() {
                [o, i] => (*o, *i),
                other => {
                    return Err(Error::ShapeMismatch {
                        context: format!("merging {name}: the projection {w_name}"),
                        expected: "[out, in]".into(),
                        actual: format!("{other:?}"),
                    })
                }
            };
            let r = a.dims().first().copied().unwrap_or(0);
            if a.dims() != [r, in_f] || b.dims() != [out_f, r] {
                return Err(Error::ShapeMismatch {
                    context: format!("merging the adapter of {w_name} ({:?})", w.dims()),
                    expected: format!("lora_A [r, {in_f}] and lora_B [{out_f}, r]"),
                    actual: format!("lora_A {:?}, lora_B {:?}", a.dims(), b.dims()),
                });
            }
            let a32 = a.to_dtype(DType::F64);
            let b32 = b.to_dtype(DType::F64);
            let (av, bv) = (a32.as_slice::<f64>()?, b32.as_slice::<f64>()?);
            let w64 = w.to_dtype(DType::F64);
            let mut out = w64.as_slice::<f64>()?.to_vec();
            for o in 0..out_f {
                let row = &mut out[o * in_f..(o + 1) * in_f];
                for k in 0..r {
                    let coeff = scale * bv[o * r + k];
                    if coeff == 0.0 {
                        continue;
                    }
                    let a_row = &av[k * in_f..(k + 1) * in_f];
                    for (x, &y) in row.iter_mut().zip(a_row) {
                        *x += coeff * y;
                    }
                }
            }
            let tensor = HostTensor::new(out, [out_f, in_f])?.to_dtype(w.dtype());
            merged.insert(w_name, tensor);
        }
        Ok(merged)
    }
}

/// Whether `name` is an adapter tensor (`*.lora_A.weight` or `*.lora_B.weight`).
pub fn is_adapter_name(name: &str) -> bool {
    name.ends_with(&format!(".{LORA_A}")) || name.ends_with(&format!(".{LORA_B}"))
}

/// Every projection of `model` that can take an adapter, in state-dict order.
pub fn projections(model: &Layer) -> Result<Vec<LoraTarget>> {
    let mut out = Vec::new();
    for (path, layer) in model.layers() {
        let named = match layer {
            Layer::Linear(_) => false,
            Layer::SelfAttention(_) | Layer::GatedMlp(_) => true,
            _ => continue,
        };
        for spec in layer.parameter_specs(&path)? {
            let Some(module) = spec.name.strip_suffix(".weight") else {
                continue;
            };
            let is_projection = if named {
                module.ends_with("_proj")
            } else {
                module == path
            };
            if let ([o, i], true) = (spec.shape.as_slice(), is_projection) {
                out.push(LoraTarget {
                    module: module.to_owned(),
                    in_features: *i,
                    out_features: *o,
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{GatedMlpConfig, LinearConfig, SelfAttentionConfig};

    fn block() -> Layer {
        Layer::sequential([
            Layer::SelfAttention(SelfAttentionConfig::new(8, 2).with_num_kv_heads(1)),
            Layer::GatedMlp(GatedMlpConfig::new(8, 12)),
            LinearConfig::new(8, 5).into(),
        ])
    }

    #[test]
    fn targets_match_as_peft_does() -> Result<()> {
        let lora = LoraConfig::new(2, 4.0).with_target_modules(["q_proj", "v_proj", "down_proj"]);
        let t = lora.targets(&block())?;
        let got: Vec<(&str, usize, usize)> = t
            .iter()
            .map(|t| (t.module.as_str(), t.in_features, t.out_features))
            .collect();
        assert_eq!(
            got,
            [
                ("0.q_proj", 8, 8),
                ("0.v_proj", 8, 4),
                ("1.down_proj", 12, 8)
            ]
        );
        let head = LoraConfig::new(2, 4.0).with_target_modules(["2"]);
        assert_eq!(head.targets(&block())?[0].module, "2");
        let err = LoraConfig::new(2, 4.0)
            .with_target_modules(["query"])
            .targets(&block())
            .unwrap_err()
            .to_string();
        assert!(err.contains("`query` matches no projection"), "{err}");
        assert!(err.contains("q_proj"), "{err}");
        // Twenty blocks: each projection named once, none left out.
        let deep = Layer::sequential((0..20).map(|_| block()).collect::<Vec<_>>());
        let err = LoraConfig::new(2, 4.0)
            .with_target_modules(["query"])
            .targets(&deep)
            .unwrap_err()
            .to_string();
        let list = err.split("it has: ").nth(1).unwrap_or_default();
        let names: Vec<&str> = list.trim_end_matches(')').split(", ").collect();
        assert_eq!(
            &names[..7],
            [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj"
            ],
            "{err}"
        );
        assert_eq!(names.len(), 7 + 20, "{err}");
        assert!(names.contains(&"19.2"), "{err}");
        Ok(())
    }

    #[test]
    fn bad_values_are_refused() {
        for (lora, key) in [
            (LoraConfig::new(0, 1.0), "lora.r"),
            (LoraConfig::new(2, 0.0), "lora.alpha"),
            (LoraConfig::new(2, 1.0).with_dropout(1.0), "lora.dropout"),
            (
                LoraConfig::new(2, 1.0).with_target_modules(Vec::<String>::new()),
                "lora.target_modules",
            ),
        ] {
            let err = lora.validate().unwrap_err().to_string();
            assert!(err.contains(key), "{err}");
        }
        assert_eq!(LoraConfig::new(4, 8.0).with_rslora(true).scale(), 4.0);
    }

    #[test]
    fn merge_adds_the_scaled_product() -> Result<()> {
        // W = 0 (2x3), A = [[1, 2, 3]], B = [[1], [-1]], scale = 2: W' = 2 * B A.
        let lora = LoraConfig::new(1, 2.0).with_target_modules(["0"]);
        let mut w = StateDict::new();
        w.insert("0.weight", HostTensor::new(vec![0f32; 6], [2, 3])?);
        w.insert("0.bias", HostTensor::new(vec![1f32, 1.0], [2])?);
        w.insert(
            "0.lora_A.weight",
            HostTensor::new(vec![1f32, 2.0, 3.0], [1, 3])?,
        );
        w.insert(
            "0.lora_B.weight",
            HostTensor::new(vec![1f32, -1.0], [2, 1])?,
        );
        assert_eq!(LoraConfig::adapter_weights(&w).len(), 2);
        let m = lora.merge(&w)?;
        assert_eq!(m.len(), 2);
        let merged = m
            .get("0.weight")
            .map(|t| t.as_slice::<f32>().map(<[f32]>::to_vec));
        assert_eq!(
            merged.transpose()?,
            Some(vec![2.0, 4.0, 6.0, -2.0, -4.0, -6.0])
        );
        w.remove("0.lora_B.weight");
        assert!(matches!(lora.merge(&w), Err(Error::MissingKey { .. })));
        Ok(())
    }
}
