//! Checkpoint files: round trip, readable by Python's safetensors, atomic writes
//! (a failed or interrupted write leaves the previous checkpoint loadable), typed
//! errors for truncated, foreign and damaged files, and the keep-last / keep-best
//! policy.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_core::{
    model::{Layer, LinearConfig},
    state_dict::StateDict,
    Error, HostTensor,
};
use kiln_train::{Checkpoint, CheckpointPolicy, Checkpointer, MonitorMode};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn sample(step: u64, val_loss: f64) -> Checkpoint {
    let model: StateDict = [
        (
            "0.weight".to_owned(),
            HostTensor::new(vec![0.5f32, -1.0, 2.0, 0.25], [2, 2]).expect("tensor"),
        ),
        (
            "0.bias".to_owned(),
            HostTensor::new(vec![step as f32, 1.0], [2]).expect("tensor"),
        ),
    ]
    .into_iter()
    .collect();
    let optimizer: StateDict = [
        (
            "state.0.weight.step".to_owned(),
            HostTensor::scalar(step as i64),
        ),
        ("group.0.lr".to_owned(), HostTensor::scalar(0.01f64)),
    ]
    .into_iter()
    .collect();
    Checkpoint {
        model,
        optimizer,
        step,
        epoch: step / 10,
        batch_in_epoch: step % 10,
        seed: 42,
        world_size: 2,
        backend: "torch".to_owned(),
        optimizer_kind: None,
        model_definition: Some(Layer::from(LinearConfig::new(2, 2))),
        lora: None,
        data: Some(serde_json::json!({"dataset": "digits", "train_samples": 40})),
        data_order: Some(kiln_core::rng::EPOCH_ORDER.to_owned()),
        scheduler: Some(serde_json::json!({"last_epoch": step, "lrs": [0.01]})),
        metrics: BTreeMap::from([("val_loss".to_owned(), val_loss)]),
        epoch_loss: Some((12.5, 40)),
        epoch_metrics: [("kl".to_owned(), (3.0, 40))].into(),
        averaged: None,
        callbacks: Default::default(),
    }
}

#[test]
fn round_trip_keeps_everything() {
    let dir = scratch("roundtrip");
    let path = dir.join("c.safetensors");
    let original = sample(17, 0.25);
    original.save(&path).expect("save");
    assert_eq!(Checkpoint::load(&path).expect("load"), original);
    // A checkpoint of a Kiln that recorded no data order reads back without one.
    let unstamped = Checkpoint {
        data_order: None,
        ..sample(17, 0.25)
    };
    unstamped.save(&path).expect("save");
    let read = Checkpoint::load(&path).expect("load");
    assert_eq!(read.data_order, None);
    assert_eq!(read, unstamped);
}

#[test]
fn python_reads_a_checkpoint() {
    let Some(python) = kiln_testkit::python("python_reads_a_checkpoint") else {
        return;
    };
    let dir = scratch("python");
    let path = dir.join("c.safetensors");
    sample(3, 1.5).save(&path).expect("save");
    let script = dir.join("read.py");
    std::fs::write(
        &script,
        "import sys, json\nfrom safetensors import safe_open\n\
         with safe_open(sys.argv[1], 'pt') as f:\n    \
         m = f.metadata(); print(json.dumps({'keys': sorted(f.keys()), 'step': m['kiln.step'], \
         'bias': f.get_tensor('model.0.bias').tolist()}))\n",
    )
    .expect("script");
    let out = std::process::Command::new(python)
        .arg(&script)
        .arg(&path)
        .output()
        .expect("python");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["step"], "3");
    assert_eq!(v["bias"], serde_json::json!([3.0, 1.0]));
    assert_eq!(
        v["keys"],
        serde_json::json!([
            "model.0.bias",
            "model.0.weight",
            "optimizer.group.0.lr",
            "optimizer.state.0.weight.step"
        ])
    );
}

#[test]
fn truncated_foreign_and_damaged_files_are_named_errors() {
    let dir = scratch("errors");
    let good = dir.join("good.safetensors");
    sample(1, 0.0).save(&good).expect("save");
    let bytes = std::fs::read(&good).expect("read");

    let truncated = dir.join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 7]).expect("write");
    let err = Checkpoint::load(&truncated).expect_err("truncated");
    assert!(matches!(err, Error::Checkpoint { .. }), "{err}");
    assert!(err.to_string().contains("truncated.safetensors"), "{err}");

    let plain = dir.join("plain.safetensors");
    sample(1, 0.0)
        .model
        .save_safetensors(&plain, &BTreeMap::new())
        .expect("save");
    let err = Checkpoint::load(&plain).expect_err("foreign").to_string();
    assert!(err.contains("not a Kiln checkpoint"), "{err}");

    let missing =
        Checkpoint::load(Path::new("/nonexistent/ckpt.safetensors")).expect_err("missing");
    assert!(matches!(missing, Error::Io { .. }), "{missing}");
}

#[test]
fn a_failed_write_leaves_the_previous_checkpoint_loadable() {
    let dir = scratch("atomic");
    let mut checkpointer =
        Checkpointer::new(&dir, CheckpointPolicy::default()).expect("checkpointer");
    checkpointer.save(&sample(1, 0.5)).expect("first save");
    // Make the second write fail midway: its target name is taken by a directory.
    std::fs::create_dir_all(dir.join("step-00000002.safetensors")).expect("blocker");
    assert!(checkpointer.save(&sample(2, 0.4)).is_err());
    let last = Checkpoint::load(&Checkpointer::last_path(&dir)).expect("last still loads");
    assert_eq!(last.step, 1);
    // No temporary file is left looking like a checkpoint.
    let names: Vec<String> = std::fs::read_dir(&dir)
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors") && !n.starts_with("step-00000002"))
        .collect();
    assert!(
        names
            .iter()
            .all(|n| n == "last.safetensors" || n == "step-00000001.safetensors"),
        "{names:?}"
    );
}

#[test]
fn keeps_the_last_and_the_best() {
    let dir = scratch("policy");
    let policy = CheckpointPolicy {
        every_n_steps: Some(1),
        every_n_epochs: None,
        keep_last: 2,
        keep_best: 1,
        monitor: Some("val_loss".to_owned()),
        mode: MonitorMode::Min,
    };
    let mut checkpointer = Checkpointer::new(&dir, policy).expect("checkpointer");
    for (step, loss) in [(1, 0.9), (2, 0.3), (3, 0.5), (4, 0.6), (5, 0.7)] {
        checkpointer.save(&sample(step, loss)).expect("save");
    }
    let mut kept: Vec<String> = std::fs::read_dir(&dir)
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    kept.sort();
    assert_eq!(
        kept,
        [
            "last.safetensors",
            "step-00000002.safetensors",
            "step-00000004.safetensors",
            "step-00000005.safetensors"
        ]
    );
    assert_eq!(
        checkpointer.best(),
        Some(dir.join("step-00000002.safetensors").as_path())
    );
    assert_eq!(
        Checkpoint::load(&Checkpointer::last_path(&dir))
            .expect("last")
            .step,
        5
    );
    assert!(CheckpointPolicy {
        keep_last: 0,
        ..CheckpointPolicy::default()
    }
    .validate()
    .is_err());
}

/// The policy a restarted run (a resume) continues with: keep 1 last and 1 best.
fn keep_one_and_the_best() -> CheckpointPolicy {
    CheckpointPolicy {
        every_n_steps: Some(1),
        every_n_epochs: None,
        keep_last: 1,
        keep_best: 1,
        monitor: Some("val_loss".to_owned()),
        mode: MonitorMode::Min,
    }
}

#[test]
fn the_best_checkpoint_survives_a_restart_and_last_is_a_link() {
    let dir = scratch("restart");
    let mut first = Checkpointer::new(&dir, keep_one_and_the_best()).expect("checkpointer");
    first.save(&sample(1, 0.1)).expect("save");
    first.save(&sample(2, 0.5)).expect("save");
    drop(first);
    // A resumed run reads the metric each checkpoint recorded.
    let mut second = Checkpointer::new(&dir, keep_one_and_the_best()).expect("checkpointer");
    assert_eq!(
        second.best(),
        Some(dir.join("step-00000001.safetensors").as_path())
    );
    second.save(&sample(3, 0.9)).expect("save");
    assert!(dir.join("step-00000001.safetensors").exists(), "best kept");
    assert!(!dir.join("step-00000002.safetensors").exists());
    let last = Checkpointer::last_path(&dir);
    #[cfg(unix)]
    assert_eq!(
        std::fs::read_link(&last).expect("a link"),
        Path::new("step-00000003.safetensors")
    );
    assert_eq!(Checkpoint::load(&last).expect("last").step, 3);
}

#[test]
fn a_file_already_deleted_counts_as_pruned_and_latest_falls_back() {
    let dir = scratch("gone");
    let policy = CheckpointPolicy {
        keep_best: 0,
        monitor: None,
        ..keep_one_and_the_best()
    };
    let mut checkpointer = Checkpointer::new(&dir, policy).expect("checkpointer");
    checkpointer.save(&sample(1, 0.0)).expect("save");
    std::fs::remove_file(dir.join("step-00000001.safetensors")).expect("rm");
    checkpointer
        .save(&sample(2, 0.0))
        .expect("prunes what is already gone");
    checkpointer.save(&sample(3, 0.0)).expect("save");
    std::fs::remove_file(Checkpointer::last_path(&dir)).expect("rm last");
    assert_eq!(
        Checkpointer::latest(&dir).expect("latest"),
        Some(dir.join("step-00000003.safetensors"))
    );
    assert_eq!(
        Checkpointer::latest(&dir.join("absent")).expect("latest"),
        None
    );
}

#[test]
fn a_checkpoint_missing_optimizer_tensors_is_refused() {
    let dir = scratch("optimizer-count");
    let path = dir.join("c.safetensors");
    let original = sample(4, 0.0);
    original.save(&path).expect("save");
    let (tensors, meta) = StateDict::load_safetensors(&path).expect("raw");
    for drop in [
        &["optimizer.group.0.lr"][..],
        &["optimizer.group.0.lr", "optimizer.state.0.weight.step"][..],
    ] {
        let kept: StateDict = tensors
            .iter()
            .filter(|(k, _)| !drop.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let damaged = dir.join("damaged.safetensors");
        kept.save_safetensors(&damaged, &meta).expect("save");
        let err = Checkpoint::load(&damaged).expect_err("missing optimizer state");
        let text = err.to_string();
        assert!(
            text.contains("damaged.safetensors") && text.contains("optimizer tensors"),
            "{text}"
        );
    }
    // The kind of optimizer round-trips.
    let with_kind = Checkpoint {
        optimizer_kind: Some("adamw".to_owned()),
        ..original
    };
    with_kind.save(&path).expect("save");
    assert_eq!(
        Checkpoint::load(&path)
            .expect("load")
            .optimizer_kind
            .as_deref(),
        Some("adamw")
    );
}

/// One process as a job of one rank: every collective leaves its data as it is.
struct Alone;

impl kiln_core::distributed::Collectives for Alone {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_f32(
        &self,
        _: &mut [f32],
        _: kiln_core::distributed::ReduceOp,
    ) -> kiln_core::Result<()> {
        Ok(())
    }
    fn all_reduce_f64(
        &self,
        _: &mut [f64],
        _: kiln_core::distributed::ReduceOp,
    ) -> kiln_core::Result<()> {
        Ok(())
    }
    fn broadcast_f32(&self, _: &mut [f32], _: usize) -> kiln_core::Result<()> {
        Ok(())
    }
    fn barrier(&self) -> kiln_core::Result<()> {
        Ok(())
    }
}

/// A sharded set (here of one rank, its weight as a slice of rows) is read
/// back through its index as the state it was written from; the next set
/// prunes it, shards and all; rank 0 without a checkpointer writes nothing;
/// a shard left without its index (a job killed mid-set) is removed when a
/// checkpointer starts in the directory, and a complete set's are kept.
#[test]
fn a_sharded_set_is_read_through_its_index_and_pruned_whole() {
    use kiln_core::state_tensors::RowSlice;
    use kiln_train::save_sharded_checkpoint;
    let dir = scratch("sharded");
    let policy = CheckpointPolicy {
        keep_last: 1,
        ..CheckpointPolicy::default()
    };
    let mut checkpointer = Checkpointer::new(&dir, policy.clone()).expect("checkpointer");
    let rows = BTreeMap::from([("model.0.weight".to_owned(), RowSlice { start: 0, total: 2 })]);
    let shard = |step: u64| dir.join(format!("step-{step:08}.shard-0-of-1.safetensors"));
    let first = sample(5, 0.5);
    let index =
        save_sharded_checkpoint(&dir, &first, rows.clone(), &Alone, Some(&mut checkpointer))
            .expect("a set");
    assert_eq!(index, dir.join("step-00000005.safetensors"));
    assert!(shard(5).exists());
    let (tensors, _) = StateDict::load_safetensors(&index).expect("the index");
    assert!(tensors.is_empty(), "the index holds tensors");
    let back = Checkpoint::load(&Checkpointer::last_path(&dir)).expect("the set");
    assert_eq!(back.model, first.model);
    assert_eq!(back.optimizer, first.optimizer);
    assert_eq!(
        (back.step, back.epoch, back.batch_in_epoch, back.seed),
        (5, 0, 5, 42)
    );
    assert_eq!((back.metrics, back.data), (first.metrics, first.data));

    save_sharded_checkpoint(
        &dir,
        &sample(6, 0.4),
        rows.clone(),
        &Alone,
        Some(&mut checkpointer),
    )
    .expect("a second set");
    assert!(
        !index.exists() && !shard(5).exists(),
        "the first set was not pruned"
    );

    let err = save_sharded_checkpoint(&dir, &sample(7, 0.3), rows, &Alone, None)
        .expect_err("rank 0 without a checkpointer");
    assert!(err.to_string().contains("Checkpointer"), "{err}");
    assert!(!shard(7).exists() && !dir.join("step-00000007.safetensors").exists());

    std::fs::copy(shard(6), shard(9)).expect("copy");
    Checkpointer::new(&dir, policy).expect("checkpointer");
    assert!(!shard(9).exists(), "a shard without its index was kept");
    assert!(shard(6).exists(), "a complete set's shard was removed");
    let err = Checkpoint::load(&shard(6)).expect_err("a shard alone");
    assert!(
        err.to_string()
            .contains("is shard 0 of 1 of a sharded checkpoint"),
        "{err}"
    );
}
