//! Data-parallel training through the CLI, as users launch it: `kiln launch`
//! and `torchrun --no-python`, two ranks on this machine (Gloo over loopback).
//!
//! - two ranks of batch B train what one rank of batch 2B trains (an MLP:
//!   no batch statistics, no dropout), with the same data order
//!   (`DistributedSampler`'s) and gradient accumulation;
//! - torchrun drives the same binary to the same result;
//! - a rank killed mid-run stops the job with an error naming it, and
//!   `--resume auto` finishes with the weights of an uninterrupted run;
//! - a run resumes on another number of ranks;
//! - the ZeRO strategies train what one rank trains, and resume across
//!   strategies.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{digits_available, losses, scratch, serial, KILN};
use kiln::core::state_dict::StateDict;
use kiln::train::Checkpoint;

mod common;

/// An MLP on the digits without dropout or batch norm, so that ranks of B rows
/// and one process of 2B rows compute the same gradients.
fn config(dir: &Path) -> PathBuf {
    let text = format!(
        r#"
seed = 5
output_dir = "{out}"

[data]
dataset = "digits"
batch_size = 32
drop_last = true
workers = 1
scale = 16.0

[model]
type = "sequential"
layers = [
  {{ type = "linear", in_features = 64, out_features = 48 }},
  {{ type = "relu" }},
  {{ type = "linear", in_features = 48, out_features = 10 }},
]

[loss]
type = "cross_entropy"

[optimizer]
type = "adam"
lr = 0.003

[training]
epochs = 2
log_every = 1
accumulate = 2

[training.clip]
type = "norm"
max_norm = 1.0

[checkpoint]
every_n_steps = 5
keep_last = 2

[distributed]
backend = "gloo"
timeout = 60

[logging]
tensorboard = false
plots = false
progress = false
"#,
        out = dir.join("default-out").display()
    );
    let path = dir.join("config.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .env("RUST_LOG", "warn")
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .output()
        .unwrap()
}

fn succeeded(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `kiln launch --nproc-per-node n -- train --config cfg --output out extra...`.
fn launch(n: usize, cfg: &Path, out: &Path, extra: &[&str]) -> Output {
    let n = n.to_string();
    let mut args = vec![
        "launch",
        "--nproc-per-node",
        &n,
        "--",
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    run(KILN, &args)
}

fn weights(run: &Path) -> Vec<(String, Vec<f64>)> {
    let (state, _) = StateDict::load_safetensors(run.join("model.safetensors")).unwrap();
    state
        .iter()
        .map(|(k, t)| (k.clone(), t.to_f64_vec()))
        .collect()
}

/// A column of epochs.csv.
fn epoch_column(run: &Path, name: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(run.join("epochs.csv")).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == name).unwrap();
    lines
        .map(|l| l.split(',').nth(col).unwrap().parse().unwrap())
        .collect()
}

fn max_weight_diff(a: &Path, b: &Path) -> f64 {
    let (a, b) = (weights(a), weights(b));
    assert_eq!(a.len(), b.len());
    let mut max = 0.0f64;
    for ((ka, va), (kb, vb)) in a.iter().zip(&b) {
        assert_eq!(ka, kb);
        for (x, y) in va.iter().zip(vb) {
            max = max.max((x - y).abs());
        }
    }
    max
}

fn max_loss_diff(a: &Path, b: &Path) -> f64 {
    let (a, b) = (losses(a), losses(b));
    assert_eq!(a.len(), b.len(), "number of steps");
    a.iter()
        .zip(&b)
        .map(|((_, x), (_, y))| {
            let (x, y): (f64, f64) = (x.parse().unwrap(), y.parse().unwrap());
            (x - y).abs()
        })
        .fold(0.0, f64::max)
}

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

/// The pid of the child of `parent` whose environment has `RANK=rank`.
fn rank_pid(parent: u32, rank: usize) -> Option<u32> {
    let want = format!("RANK={rank}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let ppid: u32 = stat
            .rsplit(')')
            .next()?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        let has_rank = environ.split(|&b| b == 0).any(|v| v == want.as_bytes());
        (ppid == parent && has_rank).then_some(pid)
    })
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
    let target = killed.join("checkpoints/step-00000020.safetensors");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !target.exists() {
        assert!(
            Instant::now() < deadline,
            "no checkpoint at {}",
            target.display()
        );
        assert!(
            launcher.try_wait().unwrap().is_none(),
            "the run ended before the kill"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = rank_pid(launcher.id(), 1).expect("rank 1's process");
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

/// A ZeRO-2 run whose rank 1 is killed after the checkpoint of step 20 and
/// restarted by torchrun ends on the uninterrupted run's weights: the last
/// checkpoint holds the optimizer state both ranks gathered.
#[test]
fn a_torchrun_restart_resumes_a_zero2_run() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("zero-restart");
    let cfg = config(&dir);
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        text.replace("timeout = 60", "timeout = 60\nstrategy = \"zero2\""),
    )
    .unwrap();
    let whole = dir.join("whole");
    let extra = ["--batch-size", "16", "--epochs", "4", "--resume", "auto"];
    succeeded(&launch(2, &cfg, &whole, &extra), "uninterrupted");
    let restarted = dir.join("restarted");
    if !killed_and_restarted_by_torchrun(&cfg, &restarted, &extra) {
        return;
    }
    let dw = max_weight_diff(&restarted, &whole);
    eprintln!("zero2: torchrun restart vs uninterrupted: weight diff {dw:e}");
    assert!(dw < 1e-6, "weights differ by {dw}");
}

/// Trains `cfg` into `out` under `torchrun --max-restarts=1`, killing rank 1
/// once the checkpoint of step 20 is written, and checks that attempt 1
/// finishes the run. False (a skip) without torchrun.
fn killed_and_restarted_by_torchrun(cfg: &Path, out: &Path, extra: &[&str]) -> bool {
    let torchrun = kiln_testkit::workspace_root().join(".kiln/venv/bin/torchrun");
    if !torchrun.exists() {
        kiln_testkit::skip("torchrun --max-restarts", "no torchrun in .kiln/venv");
        return false;
    }
    let mut agent = Command::new(&torchrun)
        .args([
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--no-python",
            KILN,
        ])
        .args(["train", "--config"])
        .arg(cfg)
        .arg("--output")
        .arg(out)
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let target = out.join("checkpoints/step-00000020.safetensors");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !target.exists() {
        assert!(
            Instant::now() < deadline,
            "no checkpoint at {}",
            target.display()
        );
        assert!(
            agent.try_wait().unwrap().is_none(),
            "the run ended before the kill"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = rank_pid(agent.id(), 1).expect("rank 1's process under torchrun");
    assert!(Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    let done = agent.wait_with_output().unwrap();
    assert!(
        done.status.success(),
        "torchrun did not finish after its restart:\n{}",
        String::from_utf8_lossy(&done.stderr)
    );
    true
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

/// `[distributed] strategy = "zero1" | "zero2"`: two ranks of B under ZeRO
/// train what one rank of 2B trains; their checkpoints (written while both
/// ranks gather the sharded optimizer state) hold one process's optimizer
/// state, so a ZeRO-1 run resumes under DDP and under ZeRO-2 to the same
/// weights; TensorFlow refuses the key.
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
    let tf = dir.join("tf.toml");
    std::fs::write(
        &tf,
        format!(
            "backend = \"tensorflow\"\n{}",
            std::fs::read_to_string(with("zero2")).unwrap()
        ),
    )
    .unwrap();
    let out = run(KILN, &["train", "--config", tf.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("distributed.strategy") && stderr.contains("torch backend"),
        "{stderr}"
    );
}

/// `[distributed] strategy = "fsdp"` with `[distributed.fsdp] units`: two
/// ranks of B, each holding half of every parameter, train what one rank of 2B
/// trains (losses, weights, the checkpoint's whole optimizer state), and
/// validate in lockstep on 33 examples (17 and 16: two batches and one), as one
/// process does; a run stopped after one epoch resumes to the same weights
/// (with `reshard_after_forward = false`). Misused keys fail before anything
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

    // Stopped after one epoch and resumed, the units' parameters kept
    // gathered from their forward to their backward pass.
    let kept = write(
        "kept.toml",
        std::fs::read_to_string(&fsdp).unwrap().replace(
            "reshard_after_forward = true",
            "reshard_after_forward = false",
        ),
    );
    let resumed = dir.join("fsdp-resumed");
    let first = ["--batch-size", "16", "--epochs", "1"];
    succeeded(&launch(2, &kept, &resumed, &first), "fsdp, first epoch");
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

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
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

/// `[distributed] timeout`: one rank of two started alone fails after that
/// many seconds, saying how many joined; `backend = "nccl"` on a CPU run is a
/// config error naming the key.
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
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
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
}
