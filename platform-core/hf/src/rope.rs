//! A config's rotary embedding as `transformers` 5 reads it: `rope_parameters`
//! (one object, or one per layer type) or the older top-level `rope_theta`,
//! `partial_rotary_factor` and `rope_scaling`, with every `rope_type` of its
//! `ROPE_INIT_FUNCTIONS` registry and the defaults its initialisers derive
//! (YaRN's and LongRoPE's attention factors, their `factor` from the context
//! lengths).

use kiln_core::model::{RopeConfig, RopeScaling};
use serde_json::{Map, Value};

use crate::config::HfConfig;
use crate::error::{HfError, Result};

/// The `rope_type`s Kiln computes, for messages.
const ROPE_TYPES: &str = "default, linear, dynamic, yarn, llama3, longrope, proportional";

/// The keys each `rope_type` reads (beyond `rope_type`, `type`, `rope_theta`
/// and `partial_rotary_factor`); others are ignored with a warning, as
/// `transformers` ignores them.
fn known_keys(rope_type: &str) -> &'static [&'static str] {
    match rope_type {
        "linear" | "proportional" => &["factor"],
        "dynamic" => &["factor", "original_max_position_embeddings"],
        "yarn" => &[
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ],
        "llama3" => &[
            "factor",
            "original_max_position_embeddings",
            "low_freq_factor",
            "high_freq_factor",
        ],
        "longrope" => &[
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "short_factor",
            "long_factor",
        ],
        _ => &[],
    }
}

/// The parameters of one rotary embedding and where they came from.
struct Params<'a> {
    config: &'a HfConfig,
    /// The config key they are under (`rope_parameters`, `rope_scaling`,
    /// `rope_parameters.sliding_attention`), for messages.
    key: String,
    map: Option<&'a Map<String, Value>>,
}

impl Params<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.map.and_then(|m| m.get(name)).filter(|v| !v.is_null())
    }

    fn error(&self, name: &str, reason: impl Into<String>) -> HfError {
        HfError::Config {
            path: self.config.path().to_owned(),
            key: format!("{}.{name}", self.key),
            reason: reason.into(),
        }
    }

    fn opt_f64(&self, name: &str) -> Result<Option<f64>> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.error(name, format!("expected a number, got {v}"))),
        }
    }

    fn f64(&self, name: &str, rope_type: &str) -> Result<f64> {
        self.opt_f64(name)?
            .ok_or_else(|| self.error(name, format!("missing; rope_type {rope_type:?} needs it")))
    }

    fn factors(&self, name: &str) -> Result<Vec<f64>> {
        let bad = |v: &Value| self.error(name, format!("expected a list of numbers, got {v}"));
        match self.get(name) {
            None => Err(self.error(name, "missing; rope_type \"longrope\" needs it")),
            Some(Value::Array(items)) => items
                .iter()
                .map(|x| x.as_f64().ok_or_else(|| bad(x)))
                .collect(),
            Some(v) => Err(bad(v)),
        }
    }

    /// `original_max_position_embeddings`: the config's top-level key when it
    /// has one (Phi-3 keeps it there, and `transformers` prefers it), else
    /// the parameters', else `max_position_embeddings`.
    fn original_max_positions(&self) -> Result<usize> {
        let key = "original_max_position_embeddings";
        if let Some(n) = self.config.opt_usize(key)? {
            return Ok(n);
        }
        match self.get(key) {
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| self.error(key, format!("expected a positive integer, got {v}"))),
            None => self.config.usize("max_position_embeddings"),
        }
    }
}

/// The rotary embedding of `config` for heads of `head_dim` features, of
/// layers of `layer_type` where `rope_parameters` holds one object per layer
/// type (`"full_attention"`, `"sliding_attention"`), reading each `(old, new)`
/// of `aliases` as the `rope_type` `new` (Phi-3 reads `"su"` and `"yarn"` as
/// `"longrope"`); `default_theta` is the family's base where the config
/// gives none (10000; Gemma 3's global layers 1000000).
pub(crate) fn rope(
    config: &HfConfig,
    head_dim: usize,
    layer_type: &str,
    aliases: &[(&str, &str)],
    default_theta: f64,
) -> Result<RopeConfig> {
    let (key, map) = match config.get("rope_parameters") {
        Some(Value::Object(m)) => match m.get(layer_type) {
            Some(Value::Object(nested)) => (format!("rope_parameters.{layer_type}"), Some(nested)),
            _ => ("rope_parameters".to_owned(), Some(m)),
        },
        Some(v) => {
            return Err(HfError::Config {
                path: config.path().to_owned(),
                key: "rope_parameters".to_owned(),
                reason: format!("expected an object, got {v}"),
            })
        }
        None => match config.get("rope_scaling") {
            Some(Value::Object(m)) => ("rope_scaling".to_owned(), Some(m)),
            Some(v) => {
                return Err(HfError::Config {
                    path: config.path().to_owned(),
                    key: "rope_scaling".to_owned(),
                    reason: format!("expected an object or null, got {v}"),
                })
            }
            None => ("rope_scaling".to_owned(), None),
        },
    };
    let p = Params { config, key, map };
    let theta = match p.opt_f64("rope_theta")? {
        Some(theta) => theta,
        None => config.f64_or("rope_theta", default_theta)?,
    };
    let partial = match p.opt_f64("partial_rotary_factor")? {
        Some(f) => f,
        None => config.f64_or("partial_rotary_factor", 1.0)?,
    };
    let rope_type = match p.get("rope_type").or_else(|| p.get("type")) {
        None => "default",
        Some(v) => v
            .as_str()
            .ok_or_else(|| p.error("rope_type", format!("expected a string, got {v}")))?,
    };
    let rope_type = aliases
        .iter()
        .find(|(old, _)| *old == rope_type)
        .map_or(rope_type, |(_, new)| new);
    if let Some(map) = p.map {
        let known = known_keys(rope_type);
        for name in map.keys() {
            let shared = ["rope_type", "type", "rope_theta", "partial_rotary_factor"];
            if !shared.contains(&name.as_str()) && !known.contains(&name.as_str()) {
                log::warn!(
                    "{}: {}.{name} is not read by rope_type {rope_type:?} (as in transformers)",
                    config.path().display(),
                    p.key
                );
            }
        }
    }
    let mut rope = RopeConfig::new(theta);
    let rotated = (head_dim as f64 * partial) as usize;
    if rope_type != "proportional" && rotated != head_dim {
        rope = rope.with_rotary_dim(rotated);
    }
    let scaling = match rope_type {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: p.f64("factor", rope_type)?,
        }),
        "dynamic" => Some(RopeScaling::Dynamic {
            factor: p.f64("factor", rope_type)?,
            max_positions: config.usize("max_position_embeddings")?,
        }),
        "yarn" => Some(yarn(&p, config)?),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: p.f64("factor", rope_type)?,
            low_freq_factor: p.f64("low_freq_factor", rope_type)?,
            high_freq_factor: p.f64("high_freq_factor", rope_type)?,
            original_max_positions: p.original_max_positions()?,
        }),
        "longrope" => Some(longrope(&p, config)?),
        "proportional" => Some(RopeScaling::Proportional {
            factor: p.opt_f64("factor")?.unwrap_or(1.0),
            fraction: partial,
        }),
        other => {
            return Err(HfError::UnsupportedKey {
                path: config.path().to_owned(),
                key: format!("{}.rope_type", p.key),
                value: Value::from(other).to_string(),
                reason: format!("Kiln computes the rope_types {ROPE_TYPES}"),
            })
        }
    };
    // Linear scaling by 1 is plain RoPE, computed as such.
    let scaling = scaling.filter(|s| *s != RopeScaling::Linear { factor: 1.0 });
    Ok(match scaling {
        Some(s) => rope.with_scaling(s),
        None => rope,
    })
}

/// `0.1 * mscale * ln(scale) + 1` above a scale of 1 (YaRN's `get_mscale`).
fn mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// YaRN, with `_compute_yarn_parameters`' defaults.
fn yarn(p: &Params<'_>, config: &HfConfig) -> Result<RopeScaling> {
    let original = p.original_max_positions()?;
    let factor = match p.opt_f64("factor")? {
        Some(f) => f,
        None => config.usize("max_position_embeddings")? as f64 / original as f64,
    };
    let attention_factor = match p.opt_f64("attention_factor")? {
        Some(a) => a,
        None => match (p.opt_f64("mscale")?, p.opt_f64("mscale_all_dim")?) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                mscale(factor, m) / mscale(factor, all)
            }
            _ => mscale(factor, 1.0),
        },
    };
    // `get("beta_fast") or 32`: a zero is the default too.
    let beta = |name: &str, default: f64| -> Result<f64> {
        Ok(p.opt_f64(name)?.filter(|b| *b != 0.0).unwrap_or(default))
    };
    let truncate = match p.get("truncate") {
        None => true,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| p.error("truncate", format!("expected true or false, got {v}")))?,
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_max_positions: original,
        attention_factor,
        beta_fast: beta("beta_fast", 32.0)?,
        beta_slow: beta("beta_slow", 1.0)?,
        truncate,
    })
}

/// LongRoPE, with `_compute_longrope_parameters`' defaults.
fn longrope(p: &Params<'_>, config: &HfConfig) -> Result<RopeScaling> {
    let original = p.original_max_positions()?;
    let attention_factor = match p.opt_f64("attention_factor")? {
        Some(a) => a,
        None => {
            let factor = match p.opt_f64("factor")? {
                Some(f) => f,
                None => config.usize("max_position_embeddings")? as f64 / original as f64,
            };
            if factor <= 1.0 {
                1.0
            } else {
                (1.0 + factor.ln() / (original as f64).ln()).sqrt()
            }
        }
    };
    Ok(RopeScaling::LongRope {
        short_factor: p.factors("short_factor")?,
        long_factor: p.factors("long_factor")?,
        original_max_positions: original,
        attention_factor,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn parse(json: &str) -> Result<RopeConfig> {
        let config = HfConfig::parse(Path::new("config.json"), json)?;
        rope(&config, 16, "full_attention", &[], 10_000.0)
    }

    #[test]
    fn both_config_forms_give_the_same_rotary_embedding() {
        let old = parse(
            r#"{"rope_theta": 500000.0, "max_position_embeddings": 64, "rope_scaling":
                {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}"#,
        )
        .unwrap();
        let new = parse(
            r#"{"max_position_embeddings": 64, "rope_parameters":
                {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 16}}"#,
        )
        .unwrap();
        assert_eq!(old, new);
        assert_eq!(old.theta, 500_000.0);
    }

    #[test]
    fn yarn_derives_its_attention_factor_and_per_layer_parameters_are_read() {
        let rope = parse(
            r#"{"max_position_embeddings": 64, "rope_parameters": {"full_attention":
                {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                 "original_max_position_embeddings": 16}}}"#,
        )
        .unwrap();
        let Some(RopeScaling::Yarn {
            attention_factor,
            beta_fast,
            truncate,
            ..
        }) = rope.scaling
        else {
            panic!("{rope:?}");
        };
        assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
        assert_eq!((beta_fast, truncate), (32.0, true));
    }

    #[test]
    fn an_unknown_rope_type_or_a_missing_key_is_named() {
        let err = parse(r#"{"rope_scaling": {"rope_type": "su", "factor": 2.0}}"#).unwrap_err();
        assert!(err.to_string().contains("rope_scaling.rope_type"), "{err}");
        assert!(err.to_string().contains("llama3"), "{err}");
        let err = parse(r#"{"rope_scaling": {"type": "linear"}}"#).unwrap_err();
        assert!(err.to_string().contains("rope_scaling.factor"), "{err}");
        let linear_one = parse(r#"{"rope_scaling": {"type": "linear", "factor": 1.0}}"#).unwrap();
        assert_eq!(linear_one, RopeConfig::new(10_000.0));
    }
}
