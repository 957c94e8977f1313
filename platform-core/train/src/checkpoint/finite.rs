//! Checkpoints holding NaN or infinite values: named when one is loaded for use.

use std::path::Path;

use kiln_core::error::{Error, Result};
use kiln_core::state_dict::StateDict;

use super::Checkpoint;

/// A tensor of a checkpoint that holds non-finite values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonFinite {
    /// The tensor's name in the file (`model.0.weight`, `optimizer.state.0.exp_avg`).
    pub name: String,
    /// How many of its values are NaN.
    pub nan: usize,
    /// How many are infinite.
    pub infinite: usize,
    /// How many values it holds in all.
    pub numel: usize,
}

impl std::fmt::Display for NonFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` holds ", self.name)?;
        match (self.nan, self.infinite) {
            (n, 0) => write!(f, "{n} NaN")?,
            (0, i) => write!(f, "{i} infinite")?,
            (n, i) => write!(f, "{n} NaN and {i} infinite")?,
        }
        write!(f, " of {} values", self.numel)
    }
}

/// The floating-point tensors of `dict` that hold NaN or infinite values,
/// named `prefix` + their key.
pub fn find_non_finite(prefix: &str, dict: &StateDict) -> Vec<NonFinite> {
    dict.iter()
        .filter(|(_, t)| t.dtype().is_float())
        .filter_map(|(name, t)| {
            let values = t.to_f64_vec();
            let nan = values.iter().filter(|v| v.is_nan()).count();
            let infinite = values.iter().filter(|v| v.is_infinite()).count();
            (nan + infinite > 0).then(|| NonFinite {
                name: format!("{prefix}{name}"),
                nan,
                infinite,
                numel: values.len(),
            })
        })
        .collect()
}

/// [`Error::Checkpoint`] for the file at `path` naming the tensors `found`
/// (the first five, and how many more), or `Ok` when there are none.
pub fn refuse_non_finite(path: &Path, found: &[NonFinite]) -> Result<()> {
    if found.is_empty() {
        return Ok(());
    }
    let shown: Vec<String> = found.iter().take(5).map(ToString::to_string).collect();
    let more = match found.len() {
        n if n > 5 => format!(" (and {} more tensors)", n - 5),
        _ => String::new(),
    };
    Err(Error::checkpoint(
        path,
        format!(
            "holds non-finite values: {}{more}. The run that wrote it had diverged; use an \
             earlier checkpoint (`kiln inspect` lists each file's tensors)",
            shown.join(", ")
        ),
    ))
}

impl Checkpoint {
    /// The floating-point tensors of the checkpoint (model and optimizer
    /// state) that hold NaN or infinite values, in file order.
    pub fn non_finite_tensors(&self) -> Vec<NonFinite> {
        let mut found = find_non_finite("model.", &self.model);
        found.extend(find_non_finite("optimizer.", &self.optimizer));
        found
    }

    /// Refuses a checkpoint whose weights or optimizer state hold NaN or
    /// infinite values, as [`Error::Checkpoint`] naming each such tensor and
    /// its count: a model restored from it would predict nonsense, and a run
    /// resumed from it would fail at its first step. Called before a checkpoint
    /// is used to resume, evaluate, predict or export (`kiln inspect` lists
    /// them instead).
    pub fn check_finite(&self, path: &Path) -> Result<()> {
        refuse_non_finite(path, &self.non_finite_tensors())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::HostTensor;

    #[test]
    fn nan_and_infinity_are_named_with_their_counts() {
        let mut model = StateDict::new();
        model.insert(
            "a",
            HostTensor::new(vec![1.0f32, f32::NAN, f32::NAN], [3]).unwrap(),
        );
        model.insert("b", HostTensor::new(vec![1i64, 2], [2]).unwrap());
        let mut optimizer = StateDict::new();
        optimizer.insert("m", HostTensor::new(vec![f64::INFINITY, 0.0], [2]).unwrap());
        let checkpoint = Checkpoint {
            model,
            optimizer,
            step: 1,
            epoch: 0,
            batch_in_epoch: 1,
            seed: 0,
            world_size: 1,
            backend: "torch".into(),
            optimizer_kind: None,
            model_definition: None,
            lora: None,
            data: None,
            data_order: None,
            scheduler: None,
            metrics: Default::default(),
            epoch_loss: None,
            epoch_metrics: Default::default(),
            averaged: None,
            callbacks: Default::default(),
        };
        let err = checkpoint
            .check_finite(Path::new("c.safetensors"))
            .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("`model.a` holds 2 NaN of 3 values"), "{text}");
        assert!(
            text.contains("`optimizer.m` holds 1 infinite of 2 values"),
            "{text}"
        );
        assert!(!text.contains("model.b"), "{text}");
    }
}
