//! Which key of an internally tagged section (`type = ...`, `[data]`'s
//! `dataset = ...`) makes it fail to parse: serde loses the path there, so the
//! section is probed.

use kiln_core::loss::Loss;
use kiln_core::model::Layer;
use kiln_core::optim::OptimizerConfig;

/// The path below `section` (e.g. `.lr` under `optimizer`) of the value that
/// makes an internally tagged section fail, or an empty string where it
/// cannot be told.
pub(super) fn tagged_key_path(root: &toml::Value, section: &str) -> String {
    let mut value = root;
    for part in section.split('.') {
        match value.get(part) {
            Some(v) => value = v,
            None => return String::new(),
        }
    }
    match section {
        "optimizer" => culprit::<OptimizerConfig>(value, "type"),
        "loss" => culprit::<Loss>(value, "type"),
        "schedule" => culprit::<kiln_core::schedule::SchedulerConfig>(value, "type"),
        "training.clip" => culprit::<kiln_core::optim::GradClip>(value, "type"),
        "model" => culprit::<Layer>(value, "type"),
        "data" => culprit::<super::DataConfig>(value, "dataset"),
        _ => String::new(),
    }
}

/// Finds which key of `value` (a table that does not deserialize as `T`,
/// tagged by its key `tag`) causes the error: the one whose removal changes
/// the error. Inside a model,
/// recurses into `layers` and `block`, which are layers themselves.
fn culprit<T: serde::de::DeserializeOwned>(value: &toml::Value, tag: &str) -> String {
    let Err(error) = value.clone().try_into::<T>() else {
        return String::new();
    };
    let error = error.to_string();
    let Some(table) = value.as_table() else {
        return String::new();
    };
    for key in table.keys().filter(|k| *k != tag) {
        let mut without = table.clone();
        let removed = without.remove(key);
        let changed = match toml::Value::Table(without).try_into::<T>() {
            Ok(_) => true,
            Err(e) => e.to_string() != error,
        };
        if !changed {
            continue;
        }
        let inner = match (key.as_str(), removed) {
            ("layers", Some(toml::Value::Array(layers))) => layers
                .iter()
                .position(|l| l.clone().try_into::<Layer>().is_err())
                .map(|i| format!("[{i}]{}", culprit::<Layer>(&layers[i], "type")))
                .unwrap_or_default(),
            ("block", Some(block)) => culprit::<Layer>(&block, "type"),
            _ => String::new(),
        };
        return format!(".{key}{inner}");
    }
    String::new()
}
