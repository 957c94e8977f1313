//! Data-parallel training through the CLI, as users launch it: `kiln launch`
//! and `torchrun --no-python`, two ranks on this machine (Gloo over loopback).
//!
//! - two ranks of batch B train what one rank of batch 2B trains (an MLP:
//!   no batch statistics, no dropout), with the same data order
//!   (`DistributedSampler`'s) and gradient accumulation;
//! - torchrun drives the same binary to the same result;
//! - a rank killed mid-run stops the job with an error naming it, and
//!   `--resume auto` finishes with the weights of an uninterrupted run;
//! - a run resumes on another number of ranks.
//!
//! The sharded strategies are in `cli_sharded.rs`.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::distributed::{
    config, epoch_column, killed_and_restarted_by_torchrun, launch, max_loss_diff, max_weight_diff,
    rank_1_after_step_20, run, succeeded,
};
use common::{digits_available, losses, scratch, serial, KILN};
use kiln::train::Checkpoint;

mod common;

#[test]
fn two_ranks_of_b_train_what_one_rank_of_2b_trains() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("ddp-equal");
    let cfg = config(&dir);
    let (two, one) = (dir.join("two"), dir.join("one"));
    succeeded(&launch(2, &cfg, &two, &["--batch-size", "16"]), "2 ranks");
    succeeded(&launch(1, &cfg, &one, &["--batch-size", "32"]), "1 rank");
    let steps = losses(&two).len();
    assert!(steps > 40, "{steps} steps");
    let (dl, dw) = (max_loss_diff(&two, &one), max_weight_diff(&two, &one));
    eprintln!("2 ranks x 16 vs 1 rank x 32: {steps} steps, loss diff {dl:e}, weight diff {dw:e}");
    assert!(dl < 1e-5, "losses differ by {dl}");
    assert!(dw < 1e-5, "weights differ by {dw}");
    // Validation is sharded without padding and the metric states are added up
    // across ranks: the values over the whole split, as one process gets them.
    for column in ["val_loss", "val_accuracy"] {
        let (a, b) = (epoch_column(&two, column), epoch_column(&one, column));
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-5, "{column}: {x} vs {y}");
        }
    }
    // Only rank 0 wrote the run; its checkpoints say how many ranks trained.
    let last = Checkpoint::load(&two.join("checkpoints/last.safetensors")).unwrap();
    assert_eq!(last.world_size, 2);
}

/// How a run is launched does not change its data order: `kiln train` of
/// batch 2B shuffles with the global order of `DistributedSampler` at world
/// size 1, whose positions `[2Bk, 2B(k+1))` are exactly the union of the
/// k-th batches of two ranks of batch B (with `drop_last`).
#[test]
fn kiln_train_and_launches_of_one_and_two_ranks_train_the_same_weights() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("ddp-plain");
    let cfg = config(&dir);
    let (plain, one, two) = (dir.join("plain"), dir.join("one"), dir.join("two"));
    let train = [
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--output",
        plain.to_str().unwrap(),
        "--batch-size",
        "32",
    ];
    succeeded(&run(KILN, &train), "kiln train");
    succeeded(&launch(1, &cfg, &one, &["--batch-size", "32"]), "1 rank");
    succeeded(&launch(2, &cfg, &two, &["--batch-size", "16"]), "2 ranks");
    let (plain_one, plain_two) = (max_weight_diff(&plain, &one), max_weight_diff(&plain, &two));
    let one_two = max_weight_diff(&one, &two);
    eprintln!(
        "kiln train x 32 vs launch 1 x 32: {plain_one:e}; vs launch 2 x 16: {plain_two:e}; \
         launch 1 vs 2: {one_two:e}"
    );
    assert!(
        plain_one < 1e-6,
        "kiln train vs 1 rank: weights differ by {plain_one}"
    );
    assert!(
        plain_two < 1e-6,
        "kiln train vs 2 ranks: weights differ by {plain_two}"
    );
    assert!(
        one_two < 1e-6,
        "1 rank vs 2 ranks: weights differ by {one_two}"
    );
    assert!(max_loss_diff(&plain, &one) < 1e-6);
}

#[test]
fn tensorflow_ranks_train_what_one_process_trains() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("ddp-tf");
    let cfg = config(&dir);
    let (two, one) = (dir.join("two"), dir.join("one"));
    let tf = ["--backend", "tensorflow", "--epochs", "1"];
    let two_args = [&tf[..], &["--batch-size", "16"]].concat();
    let one_args = [&tf[..], &["--batch-size", "32"]].concat();
    succeeded(&launch(2, &cfg, &two, &two_args), "2 TensorFlow ranks");
    succeeded(&launch(1, &cfg, &one, &one_args), "1 TensorFlow rank");
    let (dl, dw) = (max_loss_diff(&two, &one), max_weight_diff(&two, &one));
    eprintln!("TensorFlow, 2 ranks x 16 vs 1 rank x 32: loss diff {dl:e}, weight diff {dw:e}");
    assert!(dl < 1e-5 && dw < 1e-5, "losses {dl}, weights {dw}");
}

#[test]
fn torchrun_drives_the_cli() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let torchrun = kiln_testkit::workspace_root().join(".kiln/venv/bin/torchrun");
    if !torchrun.exists() {
        kiln_testkit::skip("torchrun_drives_the_cli", "no torchrun in .kiln/venv");
        return;
    }
    let dir = scratch("ddp-torchrun");
    let cfg = config(&dir);
    let (ours, theirs) = (dir.join("kiln-launch"), dir.join("torchrun"));
    let extra = ["--batch-size", "16", "--epochs", "1"];
    succeeded(&launch(2, &cfg, &ours, &extra), "kiln launch");
    let mut args = vec![
        "--standalone",
        "--nproc-per-node=2",
        "--no-python",
        KILN,
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--output",
        theirs.to_str().unwrap(),
    ];
    args.extend_from_slice(&extra);
    succeeded(&run(torchrun.to_str().unwrap(), &args), "torchrun");
    let (dl, dw) = (
        max_loss_diff(&theirs, &ours),
        max_weight_diff(&theirs, &ours),
    );
    eprintln!("torchrun vs kiln launch: loss diff {dl:e}, weight diff {dw:e}");
    assert!(dl < 1e-6 && dw < 1e-6, "losses {dl}, weights {dw}");
}

#[test]
fn a_killed_rank_stops_the_job_and_resume_auto_finishes_it() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("ddp-kill");
    let cfg = config(&dir);
    let (whole, killed) = (dir.join("whole"), dir.join("killed"));
    let extra = ["--batch-size", "16", "--epochs", "4", "--resume", "auto"];
    succeeded(&launch(2, &cfg, &whole, &extra), "uninterrupted");

    let mut launcher = Command::new(KILN)
        .args(["launch", "--nproc-per-node", "2", "--", "train", "--config"])
        .arg(&cfg)
        .arg("--output")
        .arg(&killed)
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = rank_1_after_step_20(&mut launcher, &killed);
    let killed_at = Instant::now();
    let status = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = launcher.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the job survived a dead rank");
    assert!(killed_at.elapsed() < Duration::from_secs(60));
    assert!(
        stderr.contains("rank 1"),
        "the error does not name rank 1:\n{stderr}"
    );

    succeeded(&launch(2, &cfg, &killed, &extra), "resumed");
    let dw = max_weight_diff(&killed, &whole);
    eprintln!("killed and resumed vs uninterrupted: weight diff {dw:e}");
    assert!(dw < 1e-6, "weights differ by {dw}");

    // torchrun's elastic restart: rank 1 killed in attempt 0, attempt 1 (keys
    // under a new store prefix) resumes from the last checkpoint.
    let restarted = dir.join("restarted");
    if !killed_and_restarted_by_torchrun(&cfg, &restarted, &extra) {
        return;
    }
    let dw = max_weight_diff(&restarted, &whole);
    eprintln!("torchrun restart vs uninterrupted: weight diff {dw:e}");
    assert!(dw < 1e-6, "weights differ by {dw}");
}

/// Runs `program args` quietly; whether it succeeded.
fn quietly(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `ip args`; `Err` says why it did not succeed (no `ip`, or its message).
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` ({e}): install iproute2"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two network namespaces joined by a veth pair, removed on drop.
struct TwoNodes {
    names: [String; 2],
}

impl TwoNodes {
    /// `None` after `kiln_testkit::skip`ping `test` where namespaces cannot be
    /// made (not root, no iproute2): a failure in CI, which runs as root and
    /// installs iproute2 (`.ci/run`).
    fn new(test: &str) -> Option<Self> {
        let id = std::process::id() % 100_000;
        let names = [format!("kiln-a-{id}"), format!("kiln-b-{id}")];
        let (va, vb) = (format!("kva{id}"), format!("kvb{id}"));
        if let Err(why) = ip(&["netns", "add", &names[0]]) {
            kiln_testkit::skip(
                test,
                &format!("cannot create a network namespace (needs root and iproute2): {why}"),
            );
            return None;
        }
        let nodes = TwoNodes { names };
        let [a, b] = &nodes.names;
        let steps: [&[&str]; 9] = [
            &["netns", "add", b],
            &["link", "add", &va, "type", "veth", "peer", "name", &vb],
            &["link", "set", &va, "netns", a],
            &["link", "set", &vb, "netns", b],
            &["-n", a, "addr", "add", "10.213.7.1/24", "dev", &va],
            &["-n", b, "addr", "add", "10.213.7.2/24", "dev", &vb],
            &["-n", a, "link", "set", &va, "up"],
            &["-n", b, "link", "set", &vb, "up"],
            &["-n", a, "link", "set", "lo", "up"],
        ];
        for step in steps {
            if let Err(why) = ip(step) {
                // `nodes` removes what was made, also when the skip panics (CI).
                kiln_testkit::skip(test, &format!("cannot join two network namespaces: {why}"));
                return None;
            }
        }
        Some(nodes)
    }
}

impl Drop for TwoNodes {
    fn drop(&mut self) {
        for name in &self.names {
            quietly("ip", &["netns", "del", name]);
        }
    }
}

/// Two "machines": a rank in each of two network namespaces joined by a veth
/// pair, non-loopback addresses, the master (and the TCP store) in the first,
/// Gloo's device chosen by interface (`GLOO_SOCKET_IFNAME`), one `kiln launch`
/// per node with `--nnodes 2 --node-rank R`: the run of two ranks on one node.
#[test]
fn two_nodes_in_network_namespaces() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let Some(nodes) = TwoNodes::new("two_nodes_in_network_namespaces") else {
        return;
    };
    let dir = scratch("ddp-nodes");
    let cfg = config(&dir);
    let (local, spread) = (dir.join("local"), dir.join("spread"));
    let extra = ["--batch-size", "16", "--epochs", "1"];
    succeeded(&launch(2, &cfg, &local, &extra), "one node");
    let id = std::process::id() % 100_000;
    let node = |rank: usize| {
        let interface = format!("kv{}{id}", ["a", "b"][rank]);
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &nodes.names[rank],
                KILN,
                "launch",
                "--nnodes",
                "2",
            ])
            .args(["--node-rank", &rank.to_string(), "--nproc-per-node", "1"])
            .args([
                "--master-addr",
                "10.213.7.1",
                "--master-port",
                "29517",
                "--",
            ])
            .args(["train", "--config"])
            .arg(&cfg)
            .arg("--output")
            .arg(&spread)
            .args(extra)
            .env("GLOO_SOCKET_IFNAME", interface)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (first, second) = (node(0), node(1));
    for (rank, child) in [first, second].into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        succeeded(&out, &format!("node {rank}"));
    }
    let dw = max_weight_diff(&spread, &local);
    eprintln!("two namespaces vs one node: weight diff {dw:e}");
    assert!(dw < 1e-6, "weights differ by {dw}");
}

#[test]
fn a_run_resumes_on_another_number_of_ranks() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("ddp-reshard");
    let cfg = config(&dir);
    let out = dir.join("run");
    // Two ranks for one epoch, then one rank (twice the batch) for the second.
    succeeded(
        &launch(2, &cfg, &out, &["--batch-size", "16", "--epochs", "1"]),
        "2 ranks",
    );
    let first = Checkpoint::load(&out.join("checkpoints/last.safetensors")).unwrap();
    assert_eq!(
        (first.world_size, first.epoch, first.batch_in_epoch),
        (2, 1, 0)
    );
    succeeded(
        &launch(
            1,
            &cfg,
            &out,
            &["--batch-size", "32", "--epochs", "2", "--resume", "auto"],
        ),
        "1 rank",
    );
    let last = Checkpoint::load(&out.join("checkpoints/last.safetensors")).unwrap();
    assert_eq!((last.world_size, last.epoch), (1, 2));
    assert_eq!(last.step, 2 * first.step);
}

/// Sharded validation of a model with batch norm (each rank updates its own
/// running statistics; rank 0's are given to every rank before evaluating)
/// reports what one process measures on the whole split with rank 0's model:
/// `kiln eval` of the checkpoint written after that evaluation.
#[test]
fn sharded_validation_equals_one_process_evaluating_rank_zeros_model() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("ddp-eval");
    let cfg = kiln_testkit::workspace_root().join("examples/configs/digits-cnn.toml");
    let out = dir.join("run");
    let extra = ["--epochs", "1", "--no-progress"];
    succeeded(&launch(2, &cfg, &out, &extra), "2 ranks");
    let last = out.join("checkpoints/last.safetensors");
    let table = common::kiln_stdout(&[
        "eval",
        "--config",
        cfg.to_str().unwrap(),
        "--checkpoint",
        last.to_str().unwrap(),
    ]);
    for (column, metric) in [
        ("val_loss", "loss"),
        ("val_accuracy", "accuracy"),
        ("val_f1", "f1"),
    ] {
        let logged = *epoch_column(&out, column).last().unwrap();
        let measured = common::metric(&table, metric);
        assert!(
            (logged - measured).abs() < 1e-6,
            "{column}: {logged} logged by the ranks, {measured} by one process"
        );
    }
}

/// `strategy = "post_local_sgd"`: two ranks step alone after the warm-up and
/// average their weights every `period` steps, which DDP does not (their
/// weights differ from a DDP run's); a run stopped at step 10 and resumed
/// with `--resume auto` ends with the weights of an uninterrupted one, which
/// needs the averaging schedule to continue at the checkpoint's step (a
/// schedule restarted at 0 would run the warm-up's synchronised steps again).
/// Steps 5, 10, 15 and 20 end with an average and `every_n_steps = 5` writes
/// checkpoints there, so rank 0's replica is every rank's, and SGD without
/// momentum keeps no per-rank state: the resume is exact.
#[test]
fn post_local_sgd_trains_apart_from_ddp_and_resumes_its_schedule() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("ddp-local-sgd");
    let ddp_cfg = config(&dir);
    let text = std::fs::read_to_string(&ddp_cfg)
        .unwrap()
        .replace("type = \"adam\"\nlr = 0.003", "type = \"sgd\"\nlr = 0.05");
    std::fs::write(&ddp_cfg, &text).unwrap();
    let local_cfg = dir.join("local.toml");
    std::fs::write(
        &local_cfg,
        text.replace(
            "timeout = 60\n",
            "timeout = 60\nstrategy = \"post_local_sgd\"\n\n\
             [distributed.post_local_sgd]\nwarmup_steps = 4\nperiod = 5\n",
        ),
    )
    .unwrap();
    let (whole, stopped, ddp) = (dir.join("whole"), dir.join("stopped"), dir.join("ddp"));
    let extra = ["--batch-size", "16", "--epochs", "1"];
    let out = launch(2, &local_cfg, &whole, &extra);
    succeeded(&out, "post-local SGD");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(
            "post-local SGD: gradients averaged for 4 steps, then each rank steps alone and \
             the parameters are averaged every 5 steps"
        ),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    succeeded(&launch(2, &ddp_cfg, &ddp, &extra), "DDP");
    let first = [&extra[..], &["--max-steps", "10"]].concat();
    succeeded(
        &launch(2, &local_cfg, &stopped, &first),
        "stopped at step 10",
    );
    let at = Checkpoint::load(&stopped.join("checkpoints/last.safetensors")).unwrap();
    assert_eq!(at.step, 10);
    let again = [&extra[..], &["--resume", "auto"]].concat();
    succeeded(&launch(2, &local_cfg, &stopped, &again), "resumed");
    let steps = losses(&whole).len();
    assert!(steps > 20, "{steps} steps");
    let (resumed, apart) = (
        max_weight_diff(&whole, &stopped),
        max_weight_diff(&whole, &ddp),
    );
    eprintln!(
        "post-local SGD, {steps} steps: resumed at 10 vs uninterrupted {resumed:e}; vs DDP {apart:e}"
    );
    assert!(
        resumed < 1e-6,
        "the resumed run's weights differ by {resumed}"
    );
    assert!(
        apart > 1e-4,
        "post-local SGD trained DDP's weights ({apart})"
    );

    // Its keys are checked before anything runs.
    for (edit, key, expected) in [
        (
            text.replace("timeout = 60\n", "timeout = 60\n[distributed.post_local_sgd]\nperiod = 2\n"),
            "distributed.post_local_sgd",
            "is read by strategy = \"post_local_sgd\" only, and the strategy is \"ddp\"",
        ),
        (
            text.replace(
                "timeout = 60\n",
                "timeout = 60\nstrategy = \"post_local_sgd\"\n[distributed.post_local_sgd]\nperiod = 0\n",
            ),
            "distributed.post_local_sgd.period",
            "must be at least 1",
        ),
        (
            text.replace(
                "timeout = 60\n",
                "timeout = 60\nstrategy = \"post_local_sgd\"\ncheckpoint = \"sharded\"\n",
            ),
            "distributed.checkpoint",
            "strategy = \"post_local_sgd\" holds the whole state on every rank",
        ),
        (
            text.replace("timeout = 60\n", "timeout = 60\nstrategy = \"post_local_sgd\"\n")
                .replace("seed = 5", "seed = 5\nbackend = \"tensorflow\""),
            "distributed.strategy",
            "\"post_local_sgd\" needs the torch backend",
        ),
    ] {
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, edit).unwrap();
        let out = run(KILN, &["train", "--config", bad.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            stderr.contains(key) && stderr.contains(expected),
            "{key}: {stderr}"
        );
    }
}

/// `[distributed] timeout`: one rank of two started alone fails after that
/// many seconds, saying how many joined; `backend = "nccl"` on a CPU run is a
/// config error naming the key, judged after `--device`.
#[test]
fn distributed_config_keys() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("ddp-config");
    let cfg = config(&dir);
    let text = std::fs::read_to_string(&cfg).unwrap();
    let short = dir.join("short.toml");
    std::fs::write(&short, text.replace("timeout = 60", "timeout = 2")).unwrap();
    let port = kiln_testkit::ranks::free_port();
    let start = Instant::now();
    let out = Command::new(KILN)
        .args(["train", "--config"])
        .arg(&short)
        .arg("--output")
        .arg(dir.join("alone"))
        .envs([
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("KILN_LAUNCH", "1"),
            ("RUST_LOG", "warn"),
        ])
        .env("MASTER_PORT", port.to_string())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("rendezvous timed out after 2 s: 1 of 2 ranks joined"),
        "{stderr}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );

    let nccl = dir.join("nccl.toml");
    std::fs::write(
        &nccl,
        text.replace("backend = \"gloo\"", "backend = \"nccl\""),
    )
    .unwrap();
    let out = run(KILN, &["train", "--config", nccl.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("distributed.backend") && stderr.contains("\"nccl\" reduces CUDA tensors"),
        "{stderr}"
    );
    // The config is judged with the flags in place: `--device cuda:0` makes the
    // NCCL config valid (it then needs the GPU), and makes the Gloo one invalid.
    let out = run(
        KILN,
        &[
            "train",
            "--config",
            nccl.to_str().unwrap(),
            "--device",
            "cuda:0",
            "--max-steps",
            "1",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("reduces CUDA tensors"), "{stderr}");
    assert!(
        out.status.success() || stderr.contains("cuda:0"),
        "{stderr}"
    );
    let out = run(
        KILN,
        &[
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--device",
            "cuda:0",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("\"gloo\" reduces CPU tensors, but the device is cuda:0"),
        "{stderr}"
    );
}
