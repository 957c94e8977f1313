//! `kiln launch`: start the workers of a data-parallel job on this node, as
//! `torchrun --standalone --nproc-per-node=N --no-python` does, without Python.
//!
//! Each worker runs the kiln binary itself (or `--exec PROGRAM`) with the
//! arguments after `--`, and gets torchrun's environment (`RANK`, `LOCAL_RANK`,
//! `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_*`, ...) plus
//! `KILN_LAUNCH=1`: no agent store runs here, so the worker of rank 0 hosts the
//! TCP store itself.
//!
//! Each worker leads its own process group, so that one signal reaches it and
//! everything it started, and a terminal's Ctrl-C reaches the launcher only,
//! which forwards it once. On Linux a worker is also killed when the launcher
//! dies without forwarding anything (SIGKILL), so no worker outlives it.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;

/// `kiln launch`'s options.
#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Worker processes to start on this node (at most 4 per CPU, and 1024).
    #[arg(long, alias = "nproc_per_node", value_name = "N")]
    nproc_per_node: usize,
    /// Nodes in the job; each runs its own `kiln launch`.
    #[arg(long, default_value_t = 1, value_name = "M")]
    nnodes: usize,
    /// This node's index, from 0 to nnodes - 1.
    #[arg(long, alias = "node_rank", default_value_t = 0, value_name = "R")]
    node_rank: usize,
    /// The address of rank 0's node [default: 127.0.0.1; required when nnodes > 1].
    #[arg(long, alias = "master_addr", value_name = "HOST")]
    master_addr: Option<String>,
    /// The port rank 0 listens on [default: a free port; required when nnodes > 1].
    #[arg(long, alias = "master_port", value_name = "PORT")]
    master_port: Option<u16>,
    /// Restart all workers up to K times when one fails, before giving up.
    #[arg(long, alias = "max_restarts", default_value_t = 0, value_name = "K")]
    max_restarts: u32,
    /// Run PROGRAM in each worker instead of this kiln binary.
    #[arg(long, value_name = "PROGRAM")]
    pub(crate) exec: Option<PathBuf>,
    /// Start each line a worker prints with `[rank N] `.
    #[arg(long)]
    prefix_output: bool,
    /// Seconds the workers get to exit after SIGTERM (or the signal forwarded)
    /// before SIGKILL.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    grace_period: f64,
    /// Each worker's arguments: a kiln command (`train --config CFG`), or PROGRAM's.
    #[arg(last = true, value_name = "ARGS")]
    pub(crate) args: Vec<OsString>,
}

/// The launcher stopped because it received a signal, which it forwarded to
/// the workers: `kiln` exits with 128 + the signal, as a shell reports it.
#[derive(Debug)]
pub struct Interrupted {
    signal: i32,
    stopped: usize,
}

impl Interrupted {
    /// The exit code a process killed by the signal reports.
    pub fn exit_code(&self) -> i32 {
        128 + self.signal
    }
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "interrupted by {}; forwarded it to {} running worker(s) and stopped them",
            signal_name(self.signal),
            self.stopped
        )
    }
}

impl std::error::Error for Interrupted {}

/// Workers per CPU `kiln launch` starts at most: CPU ranks share the cores, and
/// more than a few per core only wait on each other.
const WORKERS_PER_CPU: usize = 4;

/// Workers per node `kiln launch` starts at most, whatever the CPU count.
const MAX_WORKERS_PER_NODE: usize = 1024;

/// The CPUs this process may run on (its affinity mask, as `nproc` counts).
fn available_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// The most workers `--nproc-per-node` may ask for on this node.
fn max_workers_per_node() -> usize {
    (WORKERS_PER_CPU * available_cpus()).min(MAX_WORKERS_PER_NODE)
}

/// A checked launch: what each worker runs, and where it sits in the job.
struct Plan {
    program: OsString,
    args: Vec<OsString>,
    nproc_per_node: usize,
    nnodes: usize,
    node_rank: usize,
    master_addr: String,
    master_port: Option<u16>,
    max_restarts: u32,
    grace: Duration,
    prefix_output: bool,
    /// `OMP_NUM_THREADS=1` for the workers: as torchrun, when N > 1 and the user set none.
    set_omp: bool,
    run_id: String,
}

/// A running worker, until it is reaped.
struct Worker {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
}

/// The first worker of an attempt to fail.
struct Failure {
    rank: usize,
    pid: u32,
    status: ExitStatus,
    /// The other workers still running then, stopped because of it.
    stopped: usize,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} (pid {}) ", self.rank, self.pid)?;
        match (self.status.code(), self.status.signal()) {
            (Some(code), _) => write!(f, "exited with status {code}")?,
            (None, Some(signal)) => {
                write!(f, "was killed by signal {signal} ({})", signal_name(signal))?
            }
            _ => write!(f, "ended with {}", self.status)?,
        }
        match self.stopped {
            0 => write!(f, "; no other worker was running"),
            n => write!(f, "; stopped the other {n} worker(s)"),
        }
    }
}

/// Runs the workers until they all succeed (`Ok`), or one fails with no
/// restart left, or the launcher is interrupted (an [`Interrupted`] error).
pub fn launch(args: LaunchArgs) -> Result<()> {
    let plan = Plan::new(args)?;
    signals::install()?;
    if plan.set_omp {
        log::info!(
            "setting OMP_NUM_THREADS=1 for each worker, so that {} workers do not overload \
             the machine; set it yourself to tune it",
            plan.nproc_per_node
        );
    }
    let mut attempt = 0;
    loop {
        if let Some(signal) = signals::received() {
            return Err(Interrupted { signal, stopped: 0 }.into());
        }
        let (mut workers, output_done) = plan.start(attempt)?;
        let outcome = supervise(&mut workers, plan.grace);
        // What the workers printed last, unless something they started holds their pipes.
        let deadline = Instant::now() + Duration::from_secs(2);
        while output_done
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .is_ok()
        {}
        let Some(failure) = outcome? else {
            return Ok(());
        };
        if attempt == plan.max_restarts {
            if attempt > 0 {
                bail!("{failure}; no restart left (--max-restarts {attempt})");
            }
            bail!("{failure}");
        }
        attempt += 1;
        log::warn!(
            "{failure}; restarting all {} worker(s) (restart {attempt} of {})",
            plan.nproc_per_node,
            plan.max_restarts
        );
    }
}

impl Plan {
    /// Checks `args`; the errors say what was expected.
    fn new(args: LaunchArgs) -> Result<Plan> {
        if args.nproc_per_node == 0 {
            bail!("--nproc-per-node must be at least 1 (workers on this node), got 0");
        }
        let limit = max_workers_per_node();
        if args.nproc_per_node > limit {
            bail!(
                "--nproc-per-node {} is more workers than this node can run: at most {limit} \
                 ({WORKERS_PER_CPU} per CPU this process may use, {} here, and never more than \
                 {MAX_WORKERS_PER_NODE}). Each worker is a whole training process with its own \
                 copy of libtorch; data-parallel jobs run one worker per GPU, or a few per \
                 node on CPUs",
                args.nproc_per_node,
                available_cpus()
            );
        }
        if args.nnodes == 0 {
            bail!("--nnodes must be at least 1, got 0");
        }
        if args.node_rank >= args.nnodes {
            bail!(
                "--node-rank {} is out of range: expected 0 to {} for --nnodes {}",
                args.node_rank,
                args.nnodes - 1,
                args.nnodes
            );
        }
        if args.nnodes > 1 && (args.master_addr.is_none() || args.master_port.is_none()) {
            bail!(
                "--nnodes {} needs --master-addr and --master-port: the address and port of \
                 rank 0's node, the same on every node",
                args.nnodes
            );
        }
        let grace = Duration::try_from_secs_f64(args.grace_period).map_err(|_| {
            anyhow::anyhow!(
                "--grace-period must be a number of seconds >= 0, got {}",
                args.grace_period
            )
        })?;
        let program = match args.exec {
            Some(program) => program.into_os_string(),
            None if args.args.is_empty() => bail!(
                "no worker command after `--`: expected the kiln command each worker runs, \
                 e.g. `kiln launch --nproc-per-node 2 -- train --config CONFIG`, or \
                 `--exec PROGRAM -- ARGS...` to run your own program"
            ),
            None => std::env::current_exe()
                .context("finding the kiln binary for the workers (pass --exec PROGRAM)")?
                .into_os_string(),
        };
        Ok(Plan {
            program,
            args: args.args,
            nproc_per_node: args.nproc_per_node,
            nnodes: args.nnodes,
            node_rank: args.node_rank,
            master_addr: args.master_addr.unwrap_or_else(|| "127.0.0.1".to_owned()),
            master_port: args.master_port,
            max_restarts: args.max_restarts,
            grace,
            prefix_output: args.prefix_output,
            set_omp: args.nproc_per_node > 1 && std::env::var_os("OMP_NUM_THREADS").is_none(),
            run_id: run_id(),
        })
    }

    /// Starts attempt `attempt`'s workers; the receiver hears of each output
    /// stream's end (`--prefix-output`). A worker that cannot start stops the others.
    fn start(&self, attempt: u32) -> Result<(Vec<Worker>, mpsc::Receiver<()>)> {
        let port = match self.master_port {
            Some(port) => port,
            // Free now; rank 0 binds it a moment later, as torchrun --standalone does.
            None => std::net::TcpListener::bind((self.master_addr.as_str(), 0))
                .and_then(|l| l.local_addr())
                .with_context(|| format!("finding a free port on {}", self.master_addr))?
                .port(),
        };
        let world_size = (self.nnodes * self.nproc_per_node).to_string();
        let (output_done, output_rx) = mpsc::channel();
        let mut workers = Vec::new();
        for local_rank in 0..self.nproc_per_node {
            // A signal stops the launch at once, with the workers started so far.
            if let Some(signal) = signals::received() {
                let stopped = stop(&mut workers, signal, self.grace);
                return Err(Interrupted { signal, stopped }.into());
            }
            let rank = self.node_rank * self.nproc_per_node + local_rank;
            let mut command = Command::new(&self.program);
            command
                .args(&self.args)
                .env("MASTER_ADDR", &self.master_addr)
                .env("MASTER_PORT", port.to_string())
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", local_rank.to_string())
                .env("WORLD_SIZE", &world_size)
                .env("LOCAL_WORLD_SIZE", self.nproc_per_node.to_string())
                .env("GROUP_RANK", self.node_rank.to_string())
                .env("GROUP_WORLD_SIZE", self.nnodes.to_string())
                .env("ROLE_NAME", "default")
                .env("ROLE_RANK", rank.to_string())
                .env("ROLE_WORLD_SIZE", &world_size)
                .env("TORCHELASTIC_RESTART_COUNT", attempt.to_string())
                .env("TORCHELASTIC_MAX_RESTARTS", self.max_restarts.to_string())
                .env("TORCHELASTIC_RUN_ID", &self.run_id)
                .env("KILN_LAUNCH", "1")
                // The worker of rank 0 hosts the store: there is no agent's store to use.
                .env_remove("TORCHELASTIC_USE_AGENT_STORE")
                // A worker outside the terminal's foreground group that read it would stop.
                .stdin(Stdio::null());
            if self.set_omp {
                command.env("OMP_NUM_THREADS", "1");
            }
            if self.prefix_output {
                command.stdout(Stdio::piped()).stderr(Stdio::piped());
            }
            own_session(&mut command);
            die_with_launcher(&mut command);
            let mut child = match command.spawn() {
                Ok(child) => child,
                Err(e) => {
                    stop(&mut workers, libc::SIGTERM, self.grace);
                    return Err(e).with_context(|| {
                        format!("starting rank {rank}: {}", self.program.to_string_lossy())
                    });
                }
            };
            if let Some(out) = child.stdout.take() {
                pump(rank, out, std::io::stdout(), output_done.clone());
            }
            if let Some(err) = child.stderr.take() {
                pump(rank, err, std::io::stderr(), output_done.clone());
            }
            workers.push(Worker {
                rank,
                child,
                status: None,
            });
        }
        Ok((workers, output_rx))
    }
}

/// Waits for the workers: all succeed (`None`), or the first that fails stops
/// the others; a signal to the launcher is forwarded to them.
fn supervise(workers: &mut [Worker], grace: Duration) -> Result<Option<Failure>> {
    loop {
        if let Some(signal) = signals::received() {
            let stopped = stop(workers, signal, grace);
            return Err(Interrupted { signal, stopped }.into());
        }
        let mut failed = None;
        for worker in workers.iter_mut().filter(|w| w.status.is_none()) {
            match worker.child.try_wait() {
                Ok(None) => {}
                Ok(Some(status)) => {
                    worker.status = Some(status);
                    if !status.success() {
                        // Whatever it started dies with it: the job ends or restarts.
                        signal_group(worker.child.id(), libc::SIGKILL);
                        failed = Some(Ok((worker.rank, worker.child.id(), status)));
                        break;
                    }
                }
                Err(e) => {
                    failed = Some(Err(e).context(format!("waiting for rank {}", worker.rank)));
                    break;
                }
            }
        }
        if let Some(failed) = failed {
            let stopped = stop(workers, libc::SIGTERM, grace);
            let (rank, pid, status) = failed?;
            return Ok(Some(Failure {
                rank,
                pid,
                status,
                stopped,
            }));
        }
        if workers.iter().all(|w| w.status.is_some()) {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends `signal` to the process group of each running worker, then SIGKILL to
/// those still running after `grace` (or at once on another signal to the
/// launcher), and reaps them; how many were running. What a worker leaves
/// behind in its group when it exits is killed.
fn stop(workers: &mut [Worker], signal: i32, grace: Duration) -> usize {
    let mut running: Vec<&mut Worker> = workers
        .iter_mut()
        .filter(|w| w.status.is_none())
        .filter_map(|w| matches!(w.child.try_wait(), Ok(None)).then_some(w))
        .collect();
    let count = running.len();
    for worker in &running {
        signal_group(worker.child.id(), signal);
    }
    let deadline = Instant::now() + grace;
    let signals_before = signals::count();
    while Instant::now() < deadline && signals::count() == signals_before {
        running.retain_mut(|w| match w.child.try_wait() {
            Ok(None) => true,
            _ => {
                signal_group(w.child.id(), libc::SIGKILL);
                false
            }
        });
        if running.is_empty() {
            return count;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for worker in running {
        log::warn!(
            "rank {} (pid {}) still running: SIGKILL",
            worker.rank,
            worker.child.id()
        );
        signal_group(worker.child.id(), libc::SIGKILL);
        let _ = worker.child.wait();
    }
    count
}

/// Signals the process group worker `pid` leads, or led until it was reaped
/// just now.
fn signal_group(pid: u32, signal: i32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill(2) has no memory effects. A negative pid names the worker's
    // group (it called setsid, see own_session); its id is not reused while the
    // worker is unreaped or the group has members, and pids are allocated
    // cyclically, so not in the moments after the worker was reaped either.
    unsafe { libc::kill(-pid, signal) };
}

/// The worker leads its own session and process group, as torchrun's workers
/// do: a terminal's Ctrl-C goes to the launcher alone, what the launcher
/// forwards reaches the worker's children, and where the kernel shares the CPU
/// by session (`sched_autogroup`) each worker gets a share of its own, not a
/// part of the launcher's (which halved a 2-rank job's speed on a loaded machine).
fn own_session(command: &mut Command) {
    // SAFETY: the closure runs in the child between fork and exec and calls
    // only setsid(2), which is async-signal-safe, and builds an io::Error from
    // the raw error code, which does not allocate.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
}

/// On Linux, the worker receives SIGKILL when the launcher dies, however it dies.
fn die_with_launcher(command: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        let launcher = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
        // SAFETY: the closure runs in the child between fork and exec, and calls
        // only prctl(2) and getppid(2), which are async-signal-safe, and builds an
        // io::Error from a raw code, which does not allocate.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher died before prctl: nobody would signal this worker.
                if libc::getppid() != launcher {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            })
        };
    }
}

/// Copies a worker's output to `to` line by line, each line after `[rank N] `;
/// signals `done` at the end of the stream.
fn pump<R, W>(rank: usize, from: R, to: W, done: mpsc::Sender<()>)
where
    R: Read + Send + 'static,
    W: Write + Send + 'static,
{
    std::thread::spawn(move || {
        let (mut from, mut to) = (BufReader::new(from), to);
        let mut line = Vec::new();
        while matches!(from.read_until(b'\n', &mut line), Ok(n) if n > 0) {
            if !line.ends_with(b"\n") {
                line.push(b'\n');
            }
            let _ = write!(to, "[rank {rank}] ").and_then(|()| to.write_all(&line));
            let _ = to.flush();
            line.clear();
        }
        let _ = done.send(());
    });
}

fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => return format!("signal {signal}"),
    };
    name.to_owned()
}

/// A new id for each launch: random (std's per-process hash keys), the time and the pid.
fn run_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    if let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        hasher.write_u128(now.as_nanos());
    }
    format!("kiln-{:016x}", hasher.finish())
}

/// The signals the launcher forwards: SIGINT, SIGTERM, SIGHUP and SIGQUIT.
pub(crate) mod signals {
    use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

    static LAST: AtomicI32 = AtomicI32::new(0);
    static COUNT: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn record(signal: libc::c_int) {
        // Atomic stores only: async-signal-safe.
        LAST.store(signal, Ordering::SeqCst);
        COUNT.fetch_add(1, Ordering::SeqCst);
    }

    /// Records the forwarded signals instead of dying of them; one that is
    /// ignored (`nohup`, a background job's SIGINT) stays ignored.
    pub(super) fn install() -> anyhow::Result<()> {
        handle(
            &[libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT],
            record,
        )
    }

    /// Makes `handler` handle each of `signals`, except one that is ignored
    /// (`nohup`), which stays ignored (and a child inherits that).
    pub(crate) fn handle(
        signals: &[libc::c_int],
        handler: extern "C" fn(libc::c_int),
    ) -> anyhow::Result<()> {
        for &signal in signals {
            // SAFETY: a zeroed sigaction is valid (empty mask, no flags); the
            // handler is async-signal-safe (the callers' contract); both structs
            // outlive the calls that use them.
            let ok = unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                let mut previous: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = handler as libc::sighandler_t;
                action.sa_flags = libc::SA_RESTART;
                libc::sigaction(signal, &action, &mut previous) == 0
                    && (previous.sa_sigaction != libc::SIG_IGN
                        || libc::sigaction(signal, &previous, std::ptr::null_mut()) == 0)
            };
            if !ok {
                let error = std::io::Error::last_os_error();
                anyhow::bail!("installing a handler for signal {signal}: {error}");
            }
        }
        Ok(())
    }

    /// The last signal received, if any.
    pub(super) fn received() -> Option<i32> {
        Some(LAST.load(Ordering::SeqCst)).filter(|&s| s != 0)
    }

    /// How many signals were received so far.
    pub(super) fn count() -> usize {
        COUNT.load(Ordering::SeqCst)
    }
}
