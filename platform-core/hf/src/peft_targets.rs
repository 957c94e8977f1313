//! Which modules an adapter's `adapter_config.json` says it adapts, read as
//! PEFT reads `target_modules`, `exclude_modules`, `layers_to_transform` and
//! `layers_pattern` (`peft.tuners.tuners_utils.check_target_module_exists`):
//! so that its tensors can be compared with what it claims.

use regex::Regex;
use serde_json::Value;

/// The layer names PEFT looks for when `layers_to_transform` is set and
/// `layers_pattern` is not.
const DEFAULT_LAYER_PATTERNS: [&str; 5] = ["layers", "h", "block", "blocks", "layer"];

/// A list of names, or a pattern that a module's whole name must match.
#[derive(Debug)]
enum Names {
    /// A module matches a name when it is that name or ends with `.name`.
    List(Vec<String>),
    /// `"all-linear"`: every linear module but the output head.
    AllLinear,
    /// A regular expression matched against the whole module name.
    Pattern(Regex),
}

impl Names {
    fn parse(key: &str, value: &Value) -> Result<Self, String> {
        match value {
            Value::String(s) if s == "all-linear" => Ok(Names::AllLinear),
            Value::String(s) => Regex::new(&format!("^(?:{s})$"))
                .map(Names::Pattern)
                .map_err(|e| format!("`{key}` = {s:?} is not a pattern Kiln can read: {e}")),
            Value::Array(items) => items
                .iter()
                .map(|v| v.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .map(Names::List)
                .ok_or_else(|| {
                    format!("`{key}` must be a list of names or a pattern, got {value}")
                }),
            other => Err(format!(
                "`{key}` must be a list of names or a pattern, got {other}"
            )),
        }
    }

    fn matches(&self, module: &str) -> bool {
        match self {
            Names::List(names) => names
                .iter()
                .any(|n| module == n || module.ends_with(&format!(".{n}"))),
            Names::AllLinear => !is_output_head(module),
            Names::Pattern(re) => re.is_match(module),
        }
    }
}

/// Whether `module` is the model's output head, which `"all-linear"` leaves out.
fn is_output_head(module: &str) -> bool {
    let last = module.rsplit('.').next().unwrap_or(module);
    matches!(last, "lm_head" | "score" | "classifier")
}

/// The modules an adapter's config targets.
#[derive(Debug)]
pub(crate) struct PeftTargets {
    targets: Names,
    excluded: Option<Names>,
    /// `layers_to_transform` with the layer names to find them by.
    layers: Option<(Vec<u64>, Vec<String>)>,
    /// The config's `target_modules`, as written, for messages.
    written: String,
}

impl PeftTargets {
    /// Reads the targets from an adapter config; `get` returns a key's value
    /// unless it is missing or null.
    pub(crate) fn from_config<'c>(get: impl Fn(&str) -> Option<&'c Value>) -> Result<Self, String> {
        let value = get("target_modules").ok_or_else(|| {
            "`target_modules` is missing: an adapter names the modules it adapts".to_owned()
        })?;
        let targets = Names::parse("target_modules", value)?;
        let excluded = get("exclude_modules")
            .map(|v| Names::parse("exclude_modules", v))
            .transpose()?;
        let layers = match get("layers_to_transform") {
            None => None,
            Some(v) => {
                let indices = match v {
                    Value::Number(n) => n.as_u64().map(|i| vec![i]),
                    Value::Array(items) => items.iter().map(Value::as_u64).collect(),
                    _ => None,
                }
                .ok_or_else(|| {
                    format!(
                        "`layers_to_transform` must be a layer index or a list of them, got {v}"
                    )
                })?;
                let patterns = match get("layers_pattern") {
                    None => DEFAULT_LAYER_PATTERNS.map(str::to_owned).to_vec(),
                    Some(Value::String(p)) => vec![p.clone()],
                    Some(Value::Array(items)) => items
                        .iter()
                        .map(|v| v.as_str().map(str::to_owned))
                        .collect::<Option<_>>()
                        .ok_or_else(|| "`layers_pattern` must be names".to_owned())?,
                    Some(other) => {
                        return Err(format!("`layers_pattern` must be a name, got {other}"))
                    }
                };
                Some((indices, patterns))
            }
        };
        Ok(PeftTargets {
            targets,
            excluded,
            layers,
            written: value.to_string(),
        })
    }

    /// Whether PEFT adapts the module `module` (the base model's name,
    /// `model.layers.0.self_attn.q_proj`).
    pub(crate) fn adapts(&self, module: &str) -> bool {
        if self.excluded.as_ref().is_some_and(|e| e.matches(module)) {
            return false;
        }
        if !self.targets.matches(module) {
            return false;
        }
        // PEFT applies `layers_to_transform` to a list of names only.
        match (&self.layers, &self.targets) {
            (Some((indices, patterns)), Names::List(_)) => {
                layer_index(module, patterns).is_some_and(|i| indices.contains(&i))
            }
            _ => true,
        }
    }

    /// `target_modules` as the config writes it.
    pub(crate) fn written(&self) -> &str {
        &self.written
    }
}

/// The layer index in `module` after one of `patterns` (`model.layers.3.mlp` → 3).
fn layer_index(module: &str, patterns: &[String]) -> Option<u64> {
    let parts: Vec<&str> = module.split('.').collect();
    parts.windows(2).find_map(|w| {
        patterns
            .iter()
            .any(|p| p == w[0])
            .then(|| w[1].parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn targets(config: Value) -> PeftTargets {
        PeftTargets::from_config(|k| config.get(k).filter(|v| !v.is_null()))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn names_patterns_layers_and_exclusions_match_as_peft_does() {
        let list = targets(json!({ "target_modules": ["q_proj", "v_proj"] }));
        assert!(list.adapts("model.layers.0.self_attn.q_proj"));
        assert!(!list.adapts("model.layers.0.self_attn.k_proj"));
        assert!(!list.adapts("model.layers.0.self_attn.xq_proj"));
        let pattern = targets(json!({ "target_modules": ".*layers\\.1\\..*(q|v)_proj" }));
        assert!(pattern.adapts("model.layers.1.self_attn.v_proj"));
        assert!(!pattern.adapts("model.layers.0.self_attn.v_proj"));
        let layers = targets(json!({
            "target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": null
        }));
        assert!(layers.adapts("model.layers.1.self_attn.q_proj"));
        assert!(!layers.adapts("model.layers.0.self_attn.q_proj"));
        let gpt2 = targets(json!({ "target_modules": ["c_proj"], "layers_to_transform": 0 }));
        assert!(gpt2.adapts("transformer.h.0.attn.c_proj"));
        assert!(!gpt2.adapts("transformer.h.1.mlp.c_proj"));
        let all = targets(json!({ "target_modules": "all-linear", "exclude_modules": ["o_proj"] }));
        assert!(all.adapts("model.layers.0.mlp.up_proj"));
        assert!(!all.adapts("model.layers.0.self_attn.o_proj"));
        assert!(!all.adapts("lm_head"));
    }

    #[test]
    fn malformed_targets_are_named() {
        for (config, key) in [
            (json!({}), "`target_modules` is missing"),
            (json!({ "target_modules": 3 }), "`target_modules` must be"),
            (json!({ "target_modules": "(" }), "is not a pattern"),
            (
                json!({ "target_modules": ["q_proj"], "layers_to_transform": "all" }),
                "`layers_to_transform` must be",
            ),
        ] {
            let err = PeftTargets::from_config(|k| config.get(k)).unwrap_err();
            assert!(err.contains(key), "{err}");
        }
    }
}
