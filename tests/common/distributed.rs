//! What the data-parallel CLI tests share: a small MLP run config, `kiln
//! launch`, and readers that compare two runs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kiln::core::state_dict::StateDict;

use super::{losses, KILN};

/// An MLP on the digits without dropout or batch norm, so that ranks of B rows
/// and one process of 2B rows compute the same gradients.
pub fn config(dir: &Path) -> PathBuf {
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

pub fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .env("RUST_LOG", "warn")
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .output()
        .unwrap()
}

pub fn succeeded(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `kiln launch --nproc-per-node n -- train --config cfg --output out extra...`.
pub fn launch(n: usize, cfg: &Path, out: &Path, extra: &[&str]) -> Output {
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

pub fn weights(run: &Path) -> Vec<(String, Vec<f64>)> {
    let (state, _) = StateDict::load_safetensors(run.join("model.safetensors")).unwrap();
    state
        .iter()
        .map(|(k, t)| (k.clone(), t.to_f64_vec()))
        .collect()
}

/// A column of epochs.csv.
pub fn epoch_column(run: &Path, name: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(run.join("epochs.csv")).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == name).unwrap();
    lines
        .map(|l| l.split(',').nth(col).unwrap().parse().unwrap())
        .collect()
}

pub fn max_weight_diff(a: &Path, b: &Path) -> f64 {
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

pub fn max_loss_diff(a: &Path, b: &Path) -> f64 {
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

pub fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// The pid of the child of `parent` whose environment has `RANK=rank`.
pub fn rank_pid(parent: u32, rank: usize) -> Option<u32> {
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

/// Trains `cfg` into `out` under `torchrun --max-restarts=1`, killing rank 1
/// once the checkpoint of step 20 is written, and checks that attempt 1
/// finishes the run. False (a skip) without torchrun.
pub fn killed_and_restarted_by_torchrun(cfg: &Path, out: &Path, extra: &[&str]) -> bool {
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
    let pid = rank_1_after_step_20(&mut agent, out);
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

/// Waits (two minutes at most) until the checkpoint of step 20 is complete
/// in `out` while `job` (a launcher) runs; then the pid of its rank 1.
pub fn rank_1_after_step_20(job: &mut Child, out: &Path) -> u32 {
    let target = out.join("checkpoints/step-00000020.safetensors");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !target.exists() {
        assert!(
            Instant::now() < deadline,
            "no checkpoint at {}",
            target.display()
        );
        assert!(
            job.try_wait().unwrap().is_none(),
            "the run ended before the kill"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    rank_pid(job.id(), 1).expect("rank 1's process under the launcher")
}
