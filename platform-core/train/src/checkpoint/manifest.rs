//! `kiln.optimizer_state`: what optimizer state a checkpoint was written with
//! (the algorithm, the step, how many entries of each name, and a checksum over
//! every entry's key, dtype and dims), so that state removed, added or renamed
//! after saving, or the `kiln.optimizer` or `kiln.step` beside it edited, is
//! refused on load naming what differs. Editing `kiln.optimizer_tensors` alone
//! no longer hides a stripped state; the trainer also checks the state against
//! the optimizer the config builds
//! ([`check_state_after_steps`](kiln_core::optim::check_state_after_steps)),
//! which covers files from before this record.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_core::dtype::DType;
use kiln_core::error::{Error, Result};
use kiln_core::state_dict::StateDict;
use kiln_core::state_tensors::WritableState;
use serde::{Deserialize, Serialize};

/// The metadata key of the record.
pub(super) const OPTIMIZER_STATE: &str = "kiln.optimizer_state";

/// What `kiln.optimizer_state` records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct OptimizerManifest {
    /// The algorithm, as `kiln.optimizer`.
    kind: Option<String>,
    /// The optimizer steps taken, as `kiln.step`.
    step: u64,
    /// How many entries of each name: the key's last part (`exp_avg`, `step`, `lr`).
    entries: BTreeMap<String, u64>,
    /// CRC-64/XZ over every entry's `key dtype [dims]` line, in key order.
    checksum: String,
}

impl OptimizerManifest {
    /// The record of `entries` (key, dtype, dims), written by `kind` at `step`.
    fn new(kind: Option<&str>, step: u64, mut entries: Vec<(&str, DType, Vec<usize>)>) -> Self {
        entries.sort_by(|a, b| a.0.cmp(b.0));
        let crc = crc::Crc::<u64>::new(&crc::CRC_64_XZ);
        let mut digest = crc.digest();
        let mut counts = BTreeMap::new();
        for (key, dtype, dims) in &entries {
            digest.update(format!("{key} {dtype} {dims:?}\n").as_bytes());
            let name = key.rsplit('.').next().unwrap_or(key);
            *counts.entry(name.to_owned()).or_insert(0) += 1;
        }
        OptimizerManifest {
            kind: kind.map(str::to_owned),
            step,
            entries: counts,
            checksum: format!("{:016x}", digest.finalize()),
        }
    }

    /// The record of the optimizer state about to be written.
    pub(super) fn of_writable(
        kind: Option<&str>,
        step: u64,
        state: &impl WritableState,
    ) -> Result<Self> {
        let entries = state
            .writable_tensors()
            .into_iter()
            .map(|(key, t)| Ok((key, t.dtype()?, t.dims())))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::new(kind, step, entries))
    }

    /// The record of a state read back.
    fn of_loaded(kind: Option<&str>, step: u64, state: &StateDict) -> Self {
        let entries = state
            .iter()
            .map(|(key, t)| (key.as_str(), t.dtype(), t.dims().to_vec()))
            .collect();
        Self::new(kind, step, entries)
    }
}

/// Checks the loaded optimizer state, with the `kind` and `step` the metadata
/// gives, against the record `recorded` (the text of `kiln.optimizer_state`),
/// naming every difference.
pub(super) fn check_manifest(
    recorded: &str,
    kind: Option<&str>,
    step: u64,
    state: &StateDict,
    path: &Path,
) -> Result<()> {
    let recorded: OptimizerManifest = serde_json::from_str(recorded).map_err(|e| {
        Error::checkpoint_caused_by(
            path,
            format!("metadata `{OPTIMIZER_STATE}` is not a record of optimizer state"),
            e,
        )
    })?;
    let found = OptimizerManifest::of_loaded(kind, step, state);
    if found == recorded {
        return Ok(());
    }
    let mut differences = Vec::new();
    if found.kind != recorded.kind {
        let show =
            |k: &Option<String>| k.as_deref().map_or("none".to_owned(), |k| format!("`{k}`"));
        differences.push(format!(
            "metadata `kiln.optimizer` is {}, the state was written by {}",
            show(&found.kind),
            show(&recorded.kind)
        ));
    }
    if found.step != recorded.step {
        differences.push(format!(
            "metadata `kiln.step` is {}, the state was written at step {}",
            found.step, recorded.step
        ));
    }
    let mut missing = Vec::new();
    let mut extra = Vec::new();
    let names: std::collections::BTreeSet<&String> = found
        .entries
        .keys()
        .chain(recorded.entries.keys())
        .collect();
    for name in names {
        let had = recorded.entries.get(name).copied().unwrap_or(0);
        let has = found.entries.get(name).copied().unwrap_or(0);
        if has < had {
            missing.push(format!("{} of {had} `{name}`", had - has));
        } else if has > had {
            extra.push(format!("{} `{name}`", has - had));
        }
    }
    if !missing.is_empty() {
        differences.push(format!(
            "optimizer entries are missing: {}",
            missing.join(", ")
        ));
    }
    if !extra.is_empty() {
        differences.push(format!(
            "optimizer entries were added: {}",
            extra.join(", ")
        ));
    }
    if differences.is_empty() {
        differences.push("the optimizer entries' names, dtypes or shapes changed".to_owned());
    }
    Err(Error::checkpoint(
        path,
        format!(
            "holds other optimizer state than it was written with (`{OPTIMIZER_STATE}`): {}; \
             the file was changed after saving, so resuming from it would not be exact",
            differences.join("; ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::tensor::HostTensor;

    fn adam_state() -> StateDict {
        let mut sd = StateDict::new();
        for p in ["0.weight", "0.bias"] {
            sd.insert(format!("state.{p}.step"), HostTensor::scalar(6i64));
            for b in ["exp_avg", "exp_avg_sq"] {
                sd.insert(
                    format!("state.{p}.{b}"),
                    HostTensor::new(vec![0f32; 2], [2]).unwrap(),
                );
            }
        }
        sd.insert("group.0.lr", HostTensor::scalar(0.1f64));
        sd
    }

    #[test]
    fn the_record_catches_a_stripped_state_and_edited_metadata() -> Result<()> {
        let state = adam_state();
        let path = Path::new("c.safetensors");
        let text = serde_json::to_string(&OptimizerManifest::of_writable(Some("adam"), 6, &state)?)
            .unwrap();
        check_manifest(&text, Some("adam"), 6, &state, path)?;

        let err = check_manifest(&text, Some("adam"), 6, &StateDict::new(), path).unwrap_err();
        let msg = err.to_string();
        for wanted in [
            "2 of 2 `exp_avg`",
            "2 of 2 `step`",
            "1 of 1 `lr`",
            "c.safetensors",
        ] {
            assert!(msg.contains(wanted), "{wanted}: {msg}");
        }
        let err = check_manifest(&text, Some("sgd"), 0, &state, path).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("`sgd`") && msg.contains("`adam`"), "{msg}");
        assert!(msg.contains("`kiln.step` is 0"), "{msg}");

        let mut reshaped = state.clone();
        reshaped.insert(
            "state.0.bias.exp_avg",
            HostTensor::new(vec![0f32; 3], [3]).unwrap(),
        );
        let err = check_manifest(&text, Some("adam"), 6, &reshaped, path).unwrap_err();
        assert!(err.to_string().contains("shapes changed"), "{err}");
        Ok(())
    }
}
