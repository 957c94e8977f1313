//! The sharded strategies through the CLI, two and four ranks on this
//! machine (Gloo over loopback):
//!
//! - ZeRO-1, ZeRO-2 and full sharding train what one rank of the global
//!   batch trains, and resume across strategies;
//! - their checkpoints are sharded (each rank writes its part, rank 0 the
//!   index), resume on another number of ranks, consolidate into one file
//!   that `kiln eval`, `kiln export` and Python read, and a set with a shard
//!   missing or of another checkpoint is refused naming it;
//! - a torchrun restart after a killed rank resumes from the last complete
//!   sharded checkpoint to the uninterrupted run's weights.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::Path;
use std::process::Command;

use common::distributed::{
    config, epoch_column, killed_and_restarted_by_torchrun, launch, max_diff, max_loss_diff,
    max_weight_diff, run, succeeded,
};
use common::{digits_available, scratch, serial, KILN};
use kiln::train::Checkpoint;

mod common;

/// A ZeRO-2 run and a fully sharded one whose rank 1 is killed once the
/// sharded checkpoint of step 20 is complete (its index written), restarted
/// by torchrun, end on the uninterrupted runs' weights bitwise: the restart
/// resumes from the last complete set.
#[test]
fn a_torchrun_restart_resumes_zero2_and_fsdp_runs_bitwise() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("sharded-restart");
    let text = std::fs::read_to_string(config(&dir)).unwrap();
    for (strategy, units) in [
        ("zero2", ""),
        ("fsdp", "\n[distributed.fsdp]\nunits = [\"0\"]"),
    ] {
        let cfg = dir.join(format!("{strategy}.toml"));
        let body = text.replace(
            "timeout = 60",
            &format!("timeout = 60\nstrategy = \"{strategy}\"{units}"),
        );
        std::fs::write(&cfg, body).unwrap();
        let whole = dir.join(format!("{strategy}-whole"));
        let extra = ["--batch-size", "16", "--epochs", "4", "--resume", "auto"];
        succeeded(&launch(2, &cfg, &whole, &extra), "uninterrupted");
        let restarted = dir.join(format!("{strategy}-restarted"));
        if !killed_and_restarted_by_torchrun(&cfg, &restarted, &extra) {
            return;
        }
        let dw = max_weight_diff(&restarted, &whole);
        eprintln!("{strategy}: torchrun restart vs uninterrupted: weight diff {dw:e}");
        assert_eq!(dw, 0.0, "{strategy}: weights differ by {dw}");
    }
}

/// `[distributed] strategy = "zero1" | "zero2"`: two ranks of B under ZeRO
/// train what one rank of 2B trains; their checkpoints (written while both
/// ranks gather the sharded optimizer state) hold one process's optimizer
/// state, so a ZeRO-1 run resumes under DDP and under ZeRO-2 to the same
/// weights. On TensorFlow, a ZeRO-2 run resumed under ZeRO-1 from its sharded
/// checkpoint trains what one TensorFlow process trains; FSDP is refused.
#[test]
fn zero_strategies_train_what_one_rank_trains_and_resume_across_strategies() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("zero");
    let cfg = config(&dir);
    let text = std::fs::read_to_string(&cfg).unwrap();
    let with = |strategy: &str| {
        let path = dir.join(format!("{strategy}.toml"));
        let changed = text.replace(
            "timeout = 60",
            &format!("timeout = 60\nstrategy = \"{strategy}\""),
        );
        std::fs::write(&path, changed).unwrap();
        path
    };
    let one = dir.join("one");
    succeeded(&launch(1, &cfg, &one, &["--batch-size", "32"]), "1 rank");
    let single = Checkpoint::load(&one.join("checkpoints/last.safetensors")).unwrap();
    for strategy in ["zero1", "zero2"] {
        let out = dir.join(strategy);
        let ran = launch(2, &with(strategy), &out, &["--batch-size", "16"]);
        succeeded(&ran, strategy);
        let stdout = String::from_utf8_lossy(&ran.stdout);
        assert!(stdout.contains(&format!("{strategy} strategy")), "{stdout}");
        let (dl, dw) = (max_loss_diff(&out, &one), max_weight_diff(&out, &one));
        eprintln!("{strategy}: 2 ranks x 16 vs 1 rank x 32: loss diff {dl:e}, weight diff {dw:e}");
        assert!(dl < 1e-5, "{strategy}: losses differ by {dl}");
        assert!(dw < 1e-5, "{strategy}: weights differ by {dw}");
        let last = Checkpoint::load(&out.join("checkpoints/last.safetensors")).unwrap();
        assert_eq!(last.step, single.step);
        let keys = |c: &Checkpoint| {
            c.optimizer
                .iter()
                .map(|(k, _)| k.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            keys(&last),
            keys(&single),
            "{strategy}: the optimizer state"
        );
        for (key, value) in last.optimizer.iter() {
            let reference = single.optimizer.get(key).unwrap().to_f64_vec();
            let diff = value
                .to_f64_vec()
                .iter()
                .zip(&reference)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(diff < 1e-5, "{strategy}: {key} differs by {diff}");
        }
    }
    // ZeRO-2 with every layer's activations recomputed in the backward pass.
    let recomputed = dir.join("zero2-recomputed.toml");
    std::fs::write(
        &recomputed,
        format!(
            "activation_checkpointing = [\"*\"]\n{}",
            std::fs::read_to_string(with("zero2")).unwrap()
        ),
    )
    .unwrap();
    let out = dir.join("zero2-recomputed");
    succeeded(
        &launch(2, &recomputed, &out, &["--batch-size", "16"]),
        "zero2 with activation checkpointing",
    );
    let dw = max_weight_diff(&out, &one);
    eprintln!("zero2 with activation checkpointing: weight diff {dw:e}");
    assert!(
        dw < 1e-5,
        "zero2 with activation checkpointing: weights differ by {dw}"
    );
    // A pattern that matches no layer fails before anything is written.
    let typo = dir.join("typo.toml");
    std::fs::write(
        &typo,
        format!("activation_checkpointing = [\"blocks.*\"]\n{text}"),
    )
    .unwrap();
    let out = dir.join("typo");
    let ran = run(
        KILN,
        &[
            "train",
            "--config",
            typo.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ],
    );
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(!ran.status.success());
    assert!(
        stderr.contains("activation_checkpointing")
            && stderr.contains("`blocks.*` matches no layer"),
        "{stderr}"
    );
    assert!(!out.exists(), "a refused run wrote {}", out.display());

    // One epoch under ZeRO-1, the second under DDP or ZeRO-2.
    for (second, config) in [("ddp", cfg.clone()), ("zero2", with("zero2"))] {
        let out = dir.join(format!("zero1-then-{second}"));
        succeeded(
            &launch(
                2,
                &with("zero1"),
                &out,
                &["--batch-size", "16", "--epochs", "1"],
            ),
            "zero1, first epoch",
        );
        succeeded(
            &launch(
                2,
                &config,
                &out,
                &["--batch-size", "16", "--resume", "auto"],
            ),
            &format!("{second}, resumed"),
        );
        let dw = max_weight_diff(&out, &one);
        eprintln!("zero1 then {second}: weight diff {dw:e}");
        assert!(dw < 1e-5, "zero1 then {second}: weights differ by {dw}");
    }
    // TensorFlow: ZeRO-2 for the first epoch, resumed from its sharded
    // checkpoint under ZeRO-1 for the second, equals one TensorFlow process.
    let tf_config = |strategy: &str| {
        let path = dir.join(format!("tf-{strategy}.toml"));
        std::fs::write(
            &path,
            format!(
                "backend = \"tensorflow\"\n{}",
                std::fs::read_to_string(with(strategy)).unwrap()
            ),
        )
        .unwrap();
        path
    };
    let tf_one = dir.join("tf-one");
    let tf_single = format!("backend = \"tensorflow\"\n{text}");
    let tf_single_cfg = dir.join("tf-one.toml");
    std::fs::write(&tf_single_cfg, tf_single).unwrap();
    succeeded(
        &launch(1, &tf_single_cfg, &tf_one, &["--batch-size", "32"]),
        "1 TensorFlow rank",
    );
    let tf_out = dir.join("tf-zero2-then-zero1");
    let ran = launch(
        2,
        &tf_config("zero2"),
        &tf_out,
        &["--batch-size", "16", "--epochs", "1"],
    );
    succeeded(&ran, "TensorFlow zero2, first epoch");
    assert!(
        String::from_utf8_lossy(&ran.stdout).contains("zero2 strategy"),
        "{}",
        String::from_utf8_lossy(&ran.stdout)
    );
    let shards = files(&tf_out.join("checkpoints"));
    assert!(
        shards
            .iter()
            .any(|f| f.ends_with(".shard-1-of-2.safetensors")),
        "TensorFlow ZeRO writes sharded checkpoints: {shards:?}"
    );
    succeeded(
        &launch(
            2,
            &tf_config("zero1"),
            &tf_out,
            &["--batch-size", "16", "--resume", "auto"],
        ),
        "TensorFlow zero1, resumed",
    );
    let (dl, dw) = (
        max_loss_diff(&tf_out, &tf_one),
        max_weight_diff(&tf_out, &tf_one),
    );
    eprintln!("TensorFlow zero2 then zero1 vs 1 rank: loss diff {dl:e}, weight diff {dw:e}");
    assert!(dl < 1e-5, "TensorFlow ZeRO: losses differ by {dl}");
    assert!(dw < 1e-5, "TensorFlow ZeRO: weights differ by {dw}");
    let last = Checkpoint::load(&tf_out.join("checkpoints/last.safetensors")).unwrap();
    let single = Checkpoint::load(&tf_one.join("checkpoints/last.safetensors")).unwrap();
    assert_eq!(last.step, single.step);
    let keys = |c: &Checkpoint| c.optimizer.keys().cloned().collect::<Vec<_>>();
    assert_eq!(
        keys(&last),
        keys(&single),
        "TensorFlow ZeRO: the optimizer state"
    );
    for (key, value) in last.optimizer.iter() {
        let diff = max_diff(
            &value.to_f64_vec(),
            &single.optimizer.get(key).unwrap().to_f64_vec(),
        );
        assert!(diff < 1e-5, "TensorFlow ZeRO: {key} differs by {diff}");
    }
    // Full sharding is refused on TensorFlow, before anything is written.
    let out = dir.join("tf-fsdp");
    let ran = run(
        KILN,
        &[
            "train",
            "--config",
            tf_config("fsdp").to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ],
    );
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(!ran.status.success());
    assert!(
        stderr.contains("distributed.strategy") && stderr.contains("\"zero2\""),
        "{stderr}"
    );
    assert!(!out.exists(), "a refused run wrote {}", out.display());
}

/// `[distributed] strategy = "fsdp"` with `[distributed.fsdp] units`: two
/// ranks of B, each holding half of every parameter, train what one rank of 2B
/// trains (losses, weights, the checkpoint's whole optimizer state), and
/// validate in lockstep on 33 examples (17 and 16: two batches and one), as one
/// process does; a run stopped after one epoch resumes to the same weights
/// (with `reshard_after_forward = false` and `prefetch = false`). Misused
/// keys fail before anything
/// is written.
#[test]
fn fsdp_trains_what_one_rank_trains_and_resumes() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("fsdp");
    let cfg = config(&dir);
    let text = std::fs::read_to_string(&cfg).unwrap().replace(
        "dataset = \"digits\"",
        "dataset = \"digits\"\nval_fraction = 0.0183",
    );
    std::fs::write(&cfg, &text).unwrap();
    let write = |name: &str, body: String| {
        let path = dir.join(name);
        std::fs::write(&path, body).unwrap();
        path
    };
    let fsdp = write(
        "fsdp.toml",
        format!(
            "{}\n[distributed.fsdp]\nunits = [\"0\"]\nreshard_after_forward = true\n",
            text.replace("timeout = 60", "timeout = 60\nstrategy = \"fsdp\"")
        ),
    );
    let one = dir.join("one");
    succeeded(&launch(1, &cfg, &one, &["--batch-size", "32"]), "1 rank");
    let out = dir.join("fsdp");
    let ran = launch(2, &fsdp, &out, &["--batch-size", "16"]);
    succeeded(&ran, "fsdp");
    let stdout = String::from_utf8_lossy(&ran.stdout);
    assert!(stdout.contains("fsdp strategy"), "{stdout}");
    let (dl, dw) = (max_loss_diff(&out, &one), max_weight_diff(&out, &one));
    let val = |run: &Path| epoch_column(run, "val_loss");
    let dv = max_diff(&val(&out), &val(&one));
    eprintln!("fsdp: 2 ranks x 16 vs 1 rank x 32: loss diff {dl:e}, weight diff {dw:e}, val_loss diff {dv:e}");
    assert!(dl < 1e-5, "losses differ by {dl}");
    assert!(dw < 1e-5, "weights differ by {dw}");
    assert!(dv < 1e-5, "validation losses differ by {dv}");
    let last = Checkpoint::load(&out.join("checkpoints/last.safetensors")).unwrap();
    let single = Checkpoint::load(&one.join("checkpoints/last.safetensors")).unwrap();
    assert_eq!(last.step, single.step);
    for (key, value) in single.optimizer.iter() {
        let ours = last.optimizer.get(key).expect("the whole optimizer state");
        assert_eq!(ours.dims(), value.dims(), "{key}");
        let d = max_diff(&ours.to_f64_vec(), &value.to_f64_vec());
        assert!(d < 1e-5, "{key} differs by {d}");
    }

    assert!(
        stdout.contains("the next unit's gather prefetched"),
        "{stdout}"
    );
    // Stopped after one epoch and resumed, the units' parameters kept
    // gathered from their forward to their backward pass, and gathered only
    // when each unit runs.
    let kept = write(
        "kept.toml",
        std::fs::read_to_string(&fsdp).unwrap().replace(
            "reshard_after_forward = true",
            "reshard_after_forward = false\nprefetch = false",
        ),
    );
    let resumed = dir.join("fsdp-resumed");
    let first = ["--batch-size", "16", "--epochs", "1"];
    let ran = launch(2, &kept, &resumed, &first);
    succeeded(&ran, "fsdp, first epoch");
    let stdout = String::from_utf8_lossy(&ran.stdout);
    assert!(
        stdout.contains("each unit gathered when it runs")
            && stdout.contains("parameters kept from each unit's forward"),
        "{stdout}"
    );
    let again = ["--batch-size", "16", "--resume", "auto"];
    succeeded(&launch(2, &kept, &resumed, &again), "fsdp, resumed");
    let dw = max_weight_diff(&resumed, &one);
    eprintln!("fsdp (reshard_after_forward = false), resumed after one epoch: weight diff {dw:e}");
    assert!(dw < 1e-5, "resumed: weights differ by {dw}");

    // bf16-mixed, the units gathering bf16 and reducing float32, against one
    // rank in bf16-mixed: only the gradients' rounding to bf16 differs.
    let mixed = |body: &str| {
        body.replace(
            "accumulate = 2",
            "accumulate = 2\nprecision = \"bf16-mixed\"",
        )
    };
    let one_bf16 = dir.join("one-bf16");
    let cfg_bf16 = write("one-bf16.toml", mixed(&text));
    succeeded(
        &launch(1, &cfg_bf16, &one_bf16, &["--batch-size", "32"]),
        "1 rank, bf16-mixed",
    );
    let gathers = std::fs::read_to_string(&fsdp).unwrap().replace(
        "reshard_after_forward = true",
        "reshard_after_forward = true\nparam_dtype = \"bf16\"\nreduce_dtype = \"f32\"",
    );
    let bf16 = write("fsdp-bf16.toml", mixed(&gathers));
    let out = dir.join("fsdp-bf16");
    succeeded(
        &launch(2, &bf16, &out, &["--batch-size", "16"]),
        "fsdp, bf16 gathers",
    );
    // Adam turns the gradients' rounding into weights that drift apart over
    // the run's 110 steps (about 4e-2 here); the losses stay close.
    let (dl, dv) = (
        max_loss_diff(&out, &one_bf16),
        max_diff(&val(&out), &val(&one_bf16)),
    );
    eprintln!("fsdp, bf16 gathers vs 1 rank in bf16-mixed: loss diff {dl:e}, val_loss diff {dv:e}");
    assert!(
        dl < 1e-2 && dv < 5e-3,
        "bf16 gathers: losses differ by {dl}, {dv}"
    );
    // The same gathers without autocast: refused, naming the key.
    let unmixed = write("fsdp-bf16-32.toml", gathers);
    let out = dir.join("fsdp-bf16-32");
    let ran = launch(2, &unmixed, &out, &[]);
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(!ran.status.success());
    assert!(
        stderr.contains("param_dtype") && stderr.contains("bf16-mixed"),
        "{stderr}"
    );
    assert!(!out.exists(), "a refused run wrote {}", out.display());

    // `[distributed.fsdp]` under another strategy, and a unit that matches no layer.
    let stray = write(
        "stray.toml",
        format!("{text}\n[distributed.fsdp]\nunits = [\"0\"]\n"),
    );
    let ran = run(KILN, &["train", "--config", stray.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(!ran.status.success());
    assert!(
        stderr.contains("distributed.fsdp") && stderr.contains("strategy = \"fsdp\" only"),
        "{stderr}"
    );
    let typo = write(
        "typo.toml",
        std::fs::read_to_string(&fsdp)
            .unwrap()
            .replace("units = [\"0\"]", "units = [\"blocks.*\"]"),
    );
    let out = dir.join("typo");
    let ran = launch(2, &typo, &out, &[]);
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(!ran.status.success());
    assert!(
        stderr.contains("distributed.fsdp") && stderr.contains("`blocks.*` matches no layer"),
        "{stderr}"
    );
    assert!(!out.exists(), "a refused run wrote {}", out.display());
}

/// The files of a checkpoint directory, sorted by name.
fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        let kind = entry.file_type().unwrap();
        if kind.is_dir() {
            copy_dir(&entry.path(), &target);
        } else if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(entry.path()).unwrap(), &target).unwrap();
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

fn assert_same_state(a: &Checkpoint, b: &Checkpoint, what: &str) {
    for (ours, theirs, part) in [
        (&a.model, &b.model, "model"),
        (&a.optimizer, &b.optimizer, "optimizer"),
    ] {
        let keys = |s: &kiln::core::state_dict::StateDict| s.keys().cloned().collect::<Vec<_>>();
        assert_eq!(keys(ours), keys(theirs), "{what}: the {part}'s keys");
        for (key, value) in ours.iter() {
            let other = theirs.get(key).unwrap();
            assert_eq!(value.dims(), other.dims(), "{what}: {part} {key}");
            assert_eq!(value.dtype(), other.dtype(), "{what}: {part} {key}");
            assert_eq!(
                value.as_bytes(),
                other.as_bytes(),
                "{what}: {part} {key} differs"
            );
        }
    }
}

/// Full sharding's checkpoints: each rank writes its rows, rank 0 an index
/// (no tensors) last, and pruning removes a set whole. The set read back is
/// bitwise what rank 0 gathers into one file under `checkpoint = "full"`;
/// it resumes on one process under DDP and on four ranks; `kiln consolidate`
/// writes one checkpoint (for `kiln eval`) or the weights alone (for Python's
/// `safetensors`). A shard missing, or of another step, is refused naming it
/// before anything is loaded or written; so is a shard given alone.
#[test]
fn sharded_checkpoints_resume_elsewhere_consolidate_and_refuse_broken_sets() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("sharded-checkpoints");
    let cfg = config(&dir);
    let text = std::fs::read_to_string(&cfg).unwrap();
    let write = |name: &str, body: String| {
        let path = dir.join(name);
        std::fs::write(&path, body).unwrap();
        path
    };
    let strategy = |extra: &str| {
        text.replace(
            "timeout = 60",
            &format!(
                "timeout = 60\nstrategy = \"fsdp\"{extra}\n[distributed.fsdp]\nunits = [\"0\"]"
            ),
        )
    };
    let fsdp = write("fsdp.toml", strategy(""));
    let full = write("full.toml", strategy("\ncheckpoint = \"full\""));
    let one = dir.join("one");
    succeeded(&launch(1, &cfg, &one, &["--batch-size", "32"]), "1 rank");

    let first = ["--batch-size", "16", "--epochs", "1"];
    let out = dir.join("fsdp");
    succeeded(&launch(2, &fsdp, &out, &first), "fsdp, one epoch");
    let gathered = dir.join("full");
    succeeded(
        &launch(2, &full, &gathered, &first),
        "fsdp, full checkpoints",
    );
    let ckpts = out.join("checkpoints");
    let last = ckpts.join("last.safetensors");
    let index = std::fs::canonicalize(&last).unwrap();
    let step: u64 = index.file_name().unwrap().to_str().unwrap()[5..13]
        .parse()
        .unwrap();
    let listed = files(&ckpts);
    let shard = |step: u64, rank: usize| format!("step-{step:08}.shard-{rank}-of-2.safetensors");
    assert!(
        listed.contains(&shard(step, 0)) && listed.contains(&shard(step, 1)),
        "{listed:?}"
    );
    // keep_last = 2: two sets of an index and two shards, and `last`.
    assert_eq!(listed.len(), 2 * 3 + 1, "{listed:?}");
    let (tensors, _) = kiln::core::state_dict::StateDict::load_safetensors(&index).unwrap();
    assert!(tensors.is_empty(), "the index holds tensors");
    let (rank1, _) =
        kiln::core::state_dict::StateDict::load_safetensors(ckpts.join(shard(step, 1))).unwrap();
    assert_eq!(rank1.get("model.0.weight").unwrap().dims(), &[24, 64]);
    let sharded = Checkpoint::load(&last).unwrap();
    let whole = Checkpoint::load(&gathered.join("checkpoints/last.safetensors")).unwrap();
    assert_eq!(whole.step, step);
    assert_same_state(&sharded, &whole, "sharded against gathered");
    assert_eq!(sharded.world_size, 2);

    // Resumed on one process (no strategy) and on four ranks.
    let again = |batch: &'static str| ["--batch-size", batch, "--resume", "auto"];
    let four = dir.join("fsdp-4");
    copy_dir(&out, &four);
    succeeded(
        &launch(1, &cfg, &out, &again("32")),
        "resumed on one process",
    );
    let dw = max_weight_diff(&out, &one);
    eprintln!("fsdp on 2 ranks, then 1 process: weight diff {dw:e}");
    assert!(dw < 1e-5, "resumed on one process: weights differ by {dw}");
    // Its whole checkpoints pruned the sharded sets, shards and all.
    let listed = files(&ckpts);
    assert!(!listed.iter().any(|n| n.contains(".shard-")), "{listed:?}");
    succeeded(&launch(4, &fsdp, &four, &again("8")), "resumed on 4 ranks");
    let dw = max_weight_diff(&four, &one);
    eprintln!("fsdp on 2 ranks, then 4: weight diff {dw:e}");
    assert!(dw < 1e-5, "resumed on four ranks: weights differ by {dw}");
    // Its sets of four shards pruned the sets of two.
    let listed = files(&four.join("checkpoints"));
    assert!(
        listed
            .iter()
            .any(|n| n.ends_with(".shard-3-of-4.safetensors"))
            && !listed.iter().any(|n| n.ends_with("-of-2.safetensors")),
        "{listed:?}"
    );

    // One file from the sharded run of four ranks: a checkpoint and the weights.
    let consolidated = dir.join("consolidated.safetensors");
    let four_str = four.to_str().unwrap();
    common::kiln(&[
        "consolidate",
        four_str,
        "--output",
        consolidated.to_str().unwrap(),
    ]);
    let from_index = Checkpoint::load(&four.join("checkpoints/last.safetensors")).unwrap();
    assert_eq!(from_index.world_size, 4);
    assert_same_state(
        &Checkpoint::load(&consolidated).unwrap(),
        &from_index,
        "consolidated",
    );
    let table = |checkpoint: &Path| {
        common::kiln_stdout(&[
            "eval",
            "--config",
            cfg.to_str().unwrap(),
            "--checkpoint",
            checkpoint.to_str().unwrap(),
        ])
    };
    let loss = common::metric(&table(&consolidated), "loss");
    let through_index = common::metric(&table(&four.join("checkpoints/last.safetensors")), "loss");
    assert_eq!(loss, through_index);
    let weights = dir.join("model.safetensors");
    common::kiln(&[
        "consolidate",
        four_str,
        "--weights-only",
        "--output",
        weights.to_str().unwrap(),
    ]);
    if let Some(python) = kiln_testkit::python("consolidated weights in Python") {
        let script = "import sys\nfrom safetensors.torch import load_file\n\
                      for k, v in sorted(load_file(sys.argv[1]).items()):\n    \
                      print(k, list(v.shape), repr(v.double().sum().item()))";
        let printed = Command::new(python)
            .args(["-c", script])
            .arg(&weights)
            .output()
            .unwrap();
        assert!(
            printed.status.success(),
            "{}",
            String::from_utf8_lossy(&printed.stderr)
        );
        let printed = String::from_utf8(printed.stdout).unwrap();
        let expected: String = from_index
            .model
            .iter()
            .map(|(k, v)| {
                let sum: f64 = v.to_f64_vec().iter().sum();
                format!("{k} {:?} {sum:?}\n", v.dims())
            })
            .collect();
        let parse = |text: &str| -> Vec<(String, f64)> {
            text.lines()
                .map(|l| {
                    let (head, sum) = l.rsplit_once(' ').unwrap();
                    (head.replace(' ', ""), sum.parse().unwrap())
                })
                .collect()
        };
        for ((a, x), (b, y)) in parse(&printed).iter().zip(parse(&expected).iter()) {
            assert_eq!(a, b);
            assert!(
                (x - y).abs() <= 1e-9 * y.abs().max(1.0),
                "{a}: {x} in Python, {y} here"
            );
        }
    }
    // Never over a file it did not make.
    let stderr = common::kiln_fails(&[
        "consolidate",
        four_str,
        "--output",
        consolidated.to_str().unwrap(),
    ]);
    assert!(
        stderr.contains("exists") && stderr.contains("--overwrite"),
        "{stderr}"
    );
    // Nor, with --overwrite, over a shard of the set it reads: that would
    // destroy the run's newest checkpoint.
    let newest = std::fs::canonicalize(four.join("checkpoints/last.safetensors")).unwrap();
    let shard = newest.with_file_name(
        newest
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .replace(".safetensors", ".shard-1-of-4.safetensors"),
    );
    let shard_bytes = std::fs::read(&shard).unwrap();
    let stderr = common::kiln_fails(&[
        "consolidate",
        four_str,
        "--output",
        shard.to_str().unwrap(),
        "--overwrite",
    ]);
    assert!(
        stderr.contains("a shard of the checkpoint being read"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&shard).unwrap(), shard_bytes);

    // Broken sets: a shard missing, a shard of another step, a shard alone.
    let broken = dir.join("broken");
    copy_dir(&four, &broken);
    let bckpts = broken.join("checkpoints");
    let index = std::fs::canonicalize(bckpts.join("last.safetensors")).unwrap();
    let last_step: u64 = index.file_name().unwrap().to_str().unwrap()[5..13]
        .parse()
        .unwrap();
    let quad = |step: u64, rank: usize| {
        bckpts.join(format!("step-{step:08}.shard-{rank}-of-4.safetensors"))
    };
    let older = files(&bckpts)
        .iter()
        .filter_map(|n| {
            n.strip_prefix("step-")?
                .strip_suffix(".shard-2-of-4.safetensors")?
                .parse::<u64>()
                .ok()
        })
        .find(|&s| s != last_step)
        .expect("an older sharded checkpoint");
    let out_file = dir.join("never.safetensors");
    let consolidate = |_: ()| {
        common::kiln_fails(&[
            "consolidate",
            broken.to_str().unwrap(),
            "--output",
            out_file.to_str().unwrap(),
        ])
    };
    let aside = dir.join("aside.safetensors");
    std::fs::rename(quad(last_step, 2), &aside).unwrap();
    let stderr = consolidate(());
    assert!(
        stderr.contains(&format!("step-{last_step:08}.shard-2-of-4.safetensors"))
            && stderr.contains("is missing")
            && stderr.contains("shard 2 of 4"),
        "{stderr}"
    );
    // Resuming from it is refused alike, and writes nothing.
    let before = files(&bckpts);
    let ran = launch(4, &fsdp, &broken, &again("8"));
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(!ran.status.success());
    assert!(
        stderr.contains("shard-2-of-4") && stderr.contains("is missing"),
        "{stderr}"
    );
    assert_eq!(files(&bckpts), before);
    std::fs::copy(quad(older, 2), quad(last_step, 2)).unwrap();
    let stderr = consolidate(());
    assert!(
        stderr.contains(&format!("step-{last_step:08}.shard-2-of-4.safetensors"))
            && stderr.contains(&format!("is a shard of another checkpoint (step {older}")),
        "{stderr}"
    );
    assert!(!out_file.exists());
    std::fs::rename(&aside, quad(last_step, 2)).unwrap();
    let stderr = common::kiln_fails(&["inspect", quad(last_step, 1).to_str().unwrap()]);
    assert!(
        stderr.contains("is shard 1 of 4 of a sharded checkpoint"),
        "{stderr}"
    );

    // `checkpoint = "sharded"` under DDP, which shards nothing: a config error.
    let ddp = write(
        "ddp-sharded.toml",
        text.replace("timeout = 60", "timeout = 60\ncheckpoint = \"sharded\""),
    );
    let ran = run(KILN, &["train", "--config", ddp.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(!ran.status.success());
    assert!(
        stderr.contains("distributed.checkpoint") && stderr.contains("\"ddp\""),
        "{stderr}"
    );
}
