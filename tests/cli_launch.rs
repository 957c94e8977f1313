//! `kiln launch` starts its workers as `torchrun --standalone --no-python`
//! does: each test runs the real binary with `--exec /bin/sh -- -c SCRIPT`
//! workers that write what they saw into a scratch directory, and checks the
//! environment they got, how a failure, a restart and a signal end the job, and
//! that no worker outlives the launcher.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kiln_testkit::TempDir;

const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// Longer than any test needs by far: a guard against hangs, not a timing check.
const GUARD: Duration = Duration::from_secs(20);

/// What a finished launcher left: its status, its output, how long it ran.
struct Finished {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

/// Starts `kiln launch ARGS` with its output in files under `dir`.
fn start(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (Child, Instant) {
    let mut command = Command::new(KILN);
    command
        .arg("launch")
        .args(args)
        .env_remove("OMP_NUM_THREADS")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join("launcher.out")).unwrap())
        .stderr(std::fs::File::create(dir.join("launcher.err")).unwrap());
    for (key, value) in env {
        command.env(key, value);
    }
    // A test run started in the background by a non-interactive shell ignores
    // SIGINT, and the launcher keeps an ignored signal ignored (as `nohup`
    // intends): the launcher starts with SIGINT as a terminal would give it.
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec and calls
    // only signal(2), which is async-signal-safe.
    #[allow(unsafe_code)]
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    (command.spawn().unwrap(), Instant::now())
}

/// Waits (within [`GUARD`]) for a launcher [`start`] started.
fn finish(dir: &Path, mut child: Child, started: Instant) -> Finished {
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > GUARD {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "kiln launch ran past {GUARD:?}; stderr:\n{}",
                read(&dir.join("launcher.err"))
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Finished {
        status,
        stdout: read(&dir.join("launcher.out")),
        stderr: read(&dir.join("launcher.err")),
        elapsed: started.elapsed(),
    }
}

/// `kiln launch ARGS` to its end.
fn launch(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Finished {
    let (child, started) = start(dir, args, env);
    finish(dir, child, started)
}

/// The arguments that run `script` in `sh` on each worker, with `$1` the scratch directory.
fn sh<'a>(dir: &'a Path, options: &[&'a str], script: &'a str) -> Vec<&'a str> {
    let mut args = options.to_vec();
    args.extend(["--exec", "/bin/sh", "--", "-c", script, "worker"]);
    args.push(dir.to_str().unwrap());
    args
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// `KEY=value` lines of a file.
fn vars(path: &Path) -> BTreeMap<String, String> {
    read(path)
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// Whether `pid` is a live process (a zombie, which nobody reaps in some
/// containers, counts as dead).
fn alive(pid: u32) -> bool {
    let stat = read(&PathBuf::from(format!("/proc/{pid}/stat")));
    match stat.rsplit_once(')') {
        Some((_, rest)) => !matches!(rest.trim_start().chars().next(), Some('Z' | 'X') | None),
        None => false,
    }
}

/// Asserts each pid in the files `names` under `dir` dies soon (SIGKILL is not instant).
fn assert_all_dead(dir: &Path, names: &[&str]) {
    let pids: Vec<u32> = names
        .iter()
        .map(|n| read(&dir.join(n)).trim().parse().unwrap())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    for (name, pid) in names.iter().zip(&pids) {
        assert!(!alive(*pid), "{name}: process {pid} outlived the launcher");
    }
}

/// Waits (within [`GUARD`]) until each of `names` exists under `dir`.
fn wait_for(dir: &Path, names: &[&str]) {
    let started = Instant::now();
    while !names.iter().all(|n| dir.join(n).exists()) {
        assert!(
            started.elapsed() < GUARD,
            "the workers never wrote {names:?}; stderr:\n{}",
            read(&dir.join("launcher.err"))
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

const WRITE_ENV: &str = r#"env | grep -E '^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_[A-Z_]*|OMP_NUM_THREADS|KILN_LAUNCH)=' > "$1/env-$RANK""#;

#[test]
fn every_worker_gets_torchrun_environment() {
    let tmp = TempDir::new("launch-env");
    let dir = tmp.path();
    // An agent store an outer torchrun announced is not the workers' to use.
    let run = launch(
        dir,
        &sh(dir, &["--nproc-per-node", "3"], WRITE_ENV),
        &[("TORCHELASTIC_USE_AGENT_STORE", "True")],
    );
    assert!(run.status.success(), "{}", run.stderr);
    let envs: Vec<_> = (0..3)
        .map(|r| vars(&dir.join(format!("env-{r}"))))
        .collect();
    for (rank, env) in envs.iter().enumerate() {
        let rank = rank.to_string();
        for (key, expected) in [
            ("RANK", rank.as_str()),
            ("LOCAL_RANK", &rank),
            ("ROLE_RANK", &rank),
            ("WORLD_SIZE", "3"),
            ("LOCAL_WORLD_SIZE", "3"),
            ("GROUP_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("TORCHELASTIC_MAX_RESTARTS", "0"),
            ("OMP_NUM_THREADS", "1"),
            ("KILN_LAUNCH", "1"),
        ] {
            assert_eq!(
                env.get(key).map(String::as_str),
                Some(expected),
                "rank {rank}: {key} in {env:?}"
            );
        }
        assert!(
            !env.contains_key("TORCHELASTIC_USE_AGENT_STORE"),
            "rank {rank}: {env:?}"
        );
        // One port and one run id, the same for every worker.
        assert_eq!(env["MASTER_PORT"], envs[0]["MASTER_PORT"]);
        assert_eq!(env["TORCHELASTIC_RUN_ID"], envs[0]["TORCHELASTIC_RUN_ID"]);
    }
    assert!(envs[0]["MASTER_PORT"].parse::<u16>().unwrap() > 0);
    assert!(!envs[0]["TORCHELASTIC_RUN_ID"].is_empty());
    assert!(run.stderr.contains("OMP_NUM_THREADS=1"), "{}", run.stderr);
}

#[test]
fn the_second_node_of_two_gets_the_upper_ranks() {
    let tmp = TempDir::new("launch-node");
    let dir = tmp.path();
    let options = [
        "--nproc-per-node",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.1.2.3",
        "--master-port",
        "29555",
    ];
    let run = launch(
        dir,
        &sh(dir, &options, WRITE_ENV),
        &[("OMP_NUM_THREADS", "7")],
    );
    assert!(run.status.success(), "{}", run.stderr);
    for (local, rank) in [(0, 2), (1, 3)] {
        let env = vars(&dir.join(format!("env-{rank}")));
        assert_eq!(env["LOCAL_RANK"], local.to_string(), "{env:?}");
        assert_eq!(env["WORLD_SIZE"], "4");
        assert_eq!(env["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(env["GROUP_RANK"], "1");
        assert_eq!(env["MASTER_ADDR"], "10.1.2.3");
        assert_eq!(env["MASTER_PORT"], "29555");
        // The user's choice is kept.
        assert_eq!(env["OMP_NUM_THREADS"], "7");
    }
}

#[test]
fn a_failing_rank_stops_the_others() {
    let tmp = TempDir::new("launch-fail");
    let dir = tmp.path();
    // Rank 1 fails once rank 0 is sleeping.
    let script = r#"if [ "$RANK" = 1 ]; then
  while [ ! -s "$1/sleep-0" ]; do sleep 0.05; done; exit 3
fi
sleep 60 & echo $! > "$1/sleep.tmp" && mv "$1/sleep.tmp" "$1/sleep-0"; wait"#;
    let run = launch(dir, &sh(dir, &["--nproc-per-node", "2"], script), &[]);
    assert_eq!(run.status.code(), Some(1), "{}", run.stderr);
    assert!(
        run.stderr.contains("rank 1 (pid ") && run.stderr.contains(") exited with status 3"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("stopped the other 1 worker(s)"),
        "{}",
        run.stderr
    );
    assert!(run.elapsed < GUARD, "{:?}", run.elapsed);
    assert_all_dead(dir, &["sleep-0"]);
}

#[test]
fn a_worker_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let tmp = TempDir::new("launch-kill");
    let dir = tmp.path();
    let script = r#"if [ "$RANK" = 1 ]; then
  while [ ! -s "$1/pid-0" ]; do sleep 0.05; done; exit 5
fi
trap '' TERM; echo $$ > "$1/pid.tmp" && mv "$1/pid.tmp" "$1/pid-0"; sleep 60"#;
    let options = ["--nproc-per-node", "2", "--grace-period", "1"];
    let run = launch(dir, &sh(dir, &options, script), &[]);
    assert!(!run.status.success());
    assert!(run.stderr.contains("rank 1 (pid "), "{}", run.stderr);
    assert!(
        run.stderr.contains("exited with status 5"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("still running: SIGKILL"),
        "{}",
        run.stderr
    );
    assert_all_dead(dir, &["pid-0"]);
}

#[test]
fn a_restart_runs_every_worker_again() {
    let tmp = TempDir::new("launch-restart");
    let dir = tmp.path();
    let script = r#"touch "$1/attempt-$TORCHELASTIC_RESTART_COUNT-rank-$RANK"
echo "$MASTER_PORT" > "$1/port-$TORCHELASTIC_RESTART_COUNT"
if [ "$RANK" = 1 ] && [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then exit 3; fi"#;
    let options = ["--nproc-per-node", "2", "--max-restarts", "1"];
    let run = launch(dir, &sh(dir, &options, script), &[]);
    assert!(run.status.success(), "{}", run.stderr);
    assert!(
        run.stderr
            .contains("restarting all 2 worker(s) (restart 1 of 1)"),
        "{}",
        run.stderr
    );
    for rank in 0..2 {
        assert!(
            dir.join(format!("attempt-1-rank-{rank}")).exists(),
            "rank {rank} not restarted"
        );
    }
    assert!(dir.join("attempt-0-rank-1").exists());
    assert!(read(&dir.join("port-1")).trim().parse::<u16>().is_ok());

    // A worker that always fails uses the restarts up, then fails the launch.
    let tmp = TempDir::new("launch-restart-out");
    let dir = tmp.path();
    let script = r#"if [ "$RANK" = 0 ]; then exit 7; fi"#;
    let options = ["--nproc-per-node", "2", "--max-restarts", "2"];
    let run = launch(dir, &sh(dir, &options, script), &[]);
    assert_eq!(run.status.code(), Some(1));
    assert!(run.stderr.contains("(restart 2 of 2)"), "{}", run.stderr);
    assert!(
        run.stderr.contains("error: rank 0 (pid ")
            && run.stderr.contains("exited with status 7")
            && run.stderr.contains("no restart left (--max-restarts 2)"),
        "{}",
        run.stderr
    );
}

/// Sends `signal` (a `kill` name: TERM, INT) to the launcher once every worker
/// has written its pid files, and checks that each worker trapped it and that
/// nothing it started is still running after the launcher exits.
fn signal_reaches_every_worker(signal: &str, code: i32, script: &str) {
    let tmp = TempDir::new(&format!("launch-{signal}"));
    let dir = tmp.path();
    let (child, started) = start(dir, &sh(dir, &["--nproc-per-node", "2"], script), &[]);
    wait_for(dir, &["pid-0", "pid-1"]);
    let kill = Command::new("/bin/sh")
        .args(["-c", &format!("kill -{signal} {}", child.id())])
        .status()
        .unwrap();
    assert!(kill.success());
    let run = finish(dir, child, started);
    assert_eq!(run.status.code(), Some(code), "{}", run.stderr);
    assert!(
        run.stderr.contains(&format!("interrupted by SIG{signal}")),
        "{}",
        run.stderr
    );
    for rank in 0..2 {
        assert_eq!(
            read(&dir.join(format!("trapped-{rank}"))).trim(),
            signal,
            "rank {rank}"
        );
    }
    let mut pids = vec!["pid-0", "pid-1"];
    if dir.join("sleep-0").exists() {
        pids.extend(["sleep-0", "sleep-1"]);
    }
    // Every worker and what it started.
    assert_all_dead(dir, &pids);
}

#[test]
fn sigterm_to_the_launcher_reaches_every_worker() {
    // The sleep in the background: the trap runs at once, and `sleep` is left
    // for the launcher to stop.
    let script = r#"trap 'echo TERM > "$1/trapped-$RANK"; exit 0' TERM
sleep 60 & echo $! > "$1/sleep-$RANK"
echo $$ > "$1/pid-$RANK.tmp" && mv "$1/pid-$RANK.tmp" "$1/pid-$RANK"
wait"#;
    signal_reaches_every_worker("TERM", 128 + 15, script);
}

#[test]
fn sigint_to_the_launcher_reaches_every_worker() {
    // A background job of a script ignores SIGINT, so the sleep runs in the
    // foreground: SIGINT to the worker's group ends it, then the trap runs.
    let script = r#"trap 'echo INT > "$1/trapped-$RANK"; exit 0' INT
echo $$ > "$1/pid-$RANK.tmp" && mv "$1/pid-$RANK.tmp" "$1/pid-$RANK"
sleep 60"#;
    signal_reaches_every_worker("INT", 128 + 2, script);
}

#[test]
fn without_exec_each_worker_runs_kiln_itself() {
    let tmp = TempDir::new("launch-kiln");
    let dir = tmp.path();
    let run = launch(
        dir,
        &[
            "--nproc-per-node",
            "2",
            "--",
            "inspect",
            "/nonexistent/ckpt.safetensors",
        ],
        &[],
    );
    assert_eq!(run.status.code(), Some(1), "{}", run.stderr);
    // The worker's own error, then the launcher's naming its rank.
    assert!(
        run.stderr.contains("/nonexistent/ckpt.safetensors"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("error: rank ") && run.stderr.contains("exited with status 1"),
        "{}",
        run.stderr
    );
}

#[test]
fn prefix_output_names_each_line_s_rank() {
    let tmp = TempDir::new("launch-prefix");
    let dir = tmp.path();
    let script = r#"echo "out of $RANK"; echo "err of $RANK" >&2"#;
    let run = launch(
        dir,
        &sh(dir, &["--nproc-per-node", "2", "--prefix-output"], script),
        &[],
    );
    assert!(run.status.success(), "{}", run.stderr);
    for rank in 0..2 {
        assert!(
            run.stdout
                .contains(&format!("[rank {rank}] out of {rank}\n")),
            "{}",
            run.stdout
        );
        assert!(
            run.stderr
                .contains(&format!("[rank {rank}] err of {rank}\n")),
            "{}",
            run.stderr
        );
    }
}

#[test]
fn argument_errors_say_what_was_expected() {
    let tmp = TempDir::new("launch-args");
    let dir = tmp.path();
    for (args, expected) in [
        (
            &["--nproc-per-node", "0", "--", "train"][..],
            "--nproc-per-node must be at least 1",
        ),
        (
            &[
                "--nproc-per-node",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "--master-addr",
                "h",
                "--master-port",
                "1",
                "--",
                "x",
            ],
            "--node-rank 2 is out of range: expected 0 to 1 for --nnodes 2",
        ),
        (
            &[
                "--nproc-per-node",
                "1",
                "--nnodes",
                "2",
                "--master-addr",
                "h",
                "--",
                "x",
            ],
            "--nnodes 2 needs --master-addr and --master-port",
        ),
        (
            &["--nproc-per-node", "2", "--"],
            "no worker command after `--`",
        ),
        (&["--nproc-per-node", "2"], "no worker command after `--`"),
        (&["--", "train"], "--nproc-per-node"),
        (
            &["--nproc-per-node", "1", "--exec", "/nonexistent/trainer"],
            "starting rank 0: /nonexistent/trainer",
        ),
    ] {
        let run = launch(dir, args, &[]);
        assert!(!run.status.success(), "{args:?} succeeded");
        assert!(
            run.stderr.contains(expected),
            "{args:?}: expected `{expected}` in:\n{}",
            run.stderr
        );
    }
}
