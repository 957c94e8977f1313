//! Data-parallel tests as real processes: the test binary runs itself once
//! per rank ([`spawn_ranks`]), with the variables `torchrun` sets, and the
//! driver waits for them all ([`wait_all`]) and checks they passed
//! ([`assert_all_passed`]).
//!
//! ```no_run
//! use std::time::Duration;
//! use kiln_testkit::ranks::{assert_all_passed, spawn_ranks, wait_all};
//!
//! const ROLE: &str = "MY_TEST_ROLE";
//! if std::env::var_os(ROLE).is_none() {
//!     // The driver: two ranks of this same test.
//!     let children = spawn_ranks(ROLE, "my_test", 2, &[0, 1], &[]);
//!     assert_all_passed(&wait_all(children, Duration::from_secs(300)));
//! }
//! ```

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free local TCP port, for a rank 0's store.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free local port")
}

/// Starts ranks `ranks` of a `world`-rank job, each running test `test` of this
/// test binary alone, with `role` set (which tells the test it is a rank, not
/// the driver), `torchrun`'s variables, one OpenMP thread, and `extra`.
pub fn spawn_ranks(
    role: &str,
    test: &str,
    world: usize,
    ranks: &[usize],
    extra: &[(&str, String)],
) -> Vec<Child> {
    let exe = std::env::current_exe().expect("the test binary");
    let port = free_port().to_string();
    ranks
        .iter()
        .map(|&rank| {
            let mut cmd = Command::new(&exe);
            cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(role, "rank")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("KILN_LAUNCH", "1")
                .env("OMP_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in extra {
                cmd.env(k, v);
            }
            cmd.spawn().expect("spawning a rank")
        })
        .collect()
}

/// Waits for every rank, killing those still running after `limit`, and
/// returns each one's exit code and output (stdout, then stderr), in order.
pub fn wait_all(children: Vec<Child>, limit: Duration) -> Vec<(Option<i32>, String)> {
    let start = Instant::now();
    let mut children: Vec<Option<Child>> = children.into_iter().map(Some).collect();
    let mut done: Vec<Option<(Option<i32>, String)>> = vec![None; children.len()];
    while done.iter().any(Option::is_none) {
        for (i, slot) in children.iter_mut().enumerate() {
            let finished = match slot {
                Some(child) => matches!(child.try_wait(), Ok(Some(_))),
                None => false,
            };
            if finished || (start.elapsed() > limit && slot.is_some()) {
                if let Some(mut child) = slot.take() {
                    let _ = child.kill();
                    let out = child.wait_with_output().expect("a rank's output");
                    let text = format!(
                        "{}{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                    done[i] = Some((out.status.code(), text));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    done.into_iter().flatten().collect()
}

/// Fails naming every rank that exited with an error or ran no test.
pub fn assert_all_passed(results: &[(Option<i32>, String)]) {
    let failed: Vec<String> = results
        .iter()
        .enumerate()
        .filter(|(_, (code, out))| *code != Some(0) || !out.contains("1 passed"))
        .map(|(rank, (code, out))| format!("rank {rank} (exit {code:?}):\n{out}"))
        .collect();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
