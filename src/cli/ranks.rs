//! What the ranks of a data-parallel job must agree on before the first step:
//! ranks that would take different steps (another batch size, another data
//! set, another model) would wait on each other in a collective until its
//! timeout, so they are compared once, at start-up, and every rank fails
//! naming the first difference.

use std::path::Path;

use crate::prelude::*;
use anyhow::Result;
use kiln_core::distributed::{Collectives, ReduceOp};

use crate::config::RunConfig;

/// What every rank of a job must share, as JSON: the resolved config, less
/// what may differ by rank (the CUDA device index, the loader's worker threads,
/// the logging sinks, which rank 0 alone writes), the model definition with
/// resolved shapes, the data's identity (kind, sizes, fingerprint) and the
/// checkpoint the run resumes from.
pub(crate) fn what_ranks_share(
    config: &RunConfig,
    definition: &Layer,
    data: &serde_json::Value,
    resume_from: Option<&Path>,
) -> Result<serde_json::Value> {
    let mut config = serde_json::to_value(config)?;
    if let Some(fields) = config.as_object_mut() {
        let device = if fields
            .get("device")
            .and_then(|d| d.as_str())
            .is_some_and(|d| d.starts_with("cuda"))
        {
            "cuda"
        } else {
            "cpu"
        };
        fields.insert("device".into(), device.into());
        fields.remove("logging");
        if let Some(data) = fields.get_mut("data").and_then(|d| d.as_object_mut()) {
            data.remove("workers");
        }
    }
    Ok(serde_json::json!({
        "config": config,
        "model": definition,
        "data": data,
        "resume": resume_from.map(|p| p.display().to_string()),
    }))
}

/// Compares `mine` ([`what_ranks_share`]) with rank 0's on every rank: rank 0
/// broadcasts its own, each rank says whether it differs (one all-reduce),
/// and the lowest rank that differs broadcasts its own, so that every rank fails
/// with the same message naming that rank and the first difference.
pub(crate) fn check_ranks_agree(group: &dyn Collectives, mine: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_vec(mine)?;
    let mut rank0 = text.clone();
    group.broadcast_bytes(&mut rank0, 0)?;
    let mut differs = vec![0f32; group.world_size()];
    if let Some(flag) = differs.get_mut(group.rank()) {
        *flag = f32::from(u8::from(rank0 != text));
    }
    group.all_reduce_f32(&mut differs, ReduceOp::Sum)?;
    let ranks: Vec<usize> = (0..differs.len()).filter(|&r| differs[r] != 0.0).collect();
    let Some(&first) = ranks.first() else {
        return Ok(());
    };
    let mut theirs = text;
    group.broadcast_bytes(&mut theirs, first)?;
    let rank0: serde_json::Value = serde_json::from_slice(&rank0)?;
    let theirs: serde_json::Value = serde_json::from_slice(&theirs)?;
    let (at, ours, other) = kiln_train::first_difference(&rank0, &theirs, "");
    anyhow::bail!(
        "the ranks of this job do not run the same training: rank {first} differs from rank 0 \
         at `{}`, where rank 0 has {ours} and rank {first} {other} (ranks that differ from rank \
         0: {ranks:?}; this is rank {}). Every rank must run the same config (except the CUDA \
         device and data.workers) on the same data",
        at.trim_start_matches('.'),
        group.rank()
    )
}
