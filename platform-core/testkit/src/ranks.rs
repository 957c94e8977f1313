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

/// A free local TCP port for a rank 0's store, outside the kernel's ephemeral
/// range, and a different one at each call in this process.
///
/// A port the kernel handed out (`bind` to port 0) and released is free only
/// for a moment: until rank 0 binds it, any process's next outgoing connection
/// or listener (another test's Gloo pairs, its store clients) may be given it,
/// and then one test's ranks talk to another test's sockets. Ports below the
/// ephemeral range (`net.ipv4.ip_local_port_range`) are never handed out that
/// way, so only a process that names the same port can take it; the ports
/// tried start at an offset drawn from this process's id, and each is checked
/// free before it is returned.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let (low, span) = below_ephemeral_range();
    let offset = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = low + ((offset + k) % span);
        let Ok(port) = u16::try_from(port) else {
            continue;
        };
        let free = [
            std::net::Ipv4Addr::UNSPECIFIED,
            std::net::Ipv4Addr::LOCALHOST,
        ]
        .iter()
        .all(|ip| std::net::TcpListener::bind((*ip, port)).is_ok());
        if free {
            return port;
        }
    }
    // Every port below the range is taken: fall back on the kernel's choice.
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free local port")
}

/// The first port and the number of ports of the block just below the
/// kernel's ephemeral range (at most 8000 ports, none below 10000).
fn below_ephemeral_range() -> (u32, u32) {
    let start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let low = start.saturating_sub(8000).max(10000);
    (low, start.saturating_sub(low).max(1000))
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
