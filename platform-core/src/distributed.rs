//! Data-parallel training, backend-neutral: where the ranks of a job meet
//! ([`Rendezvous`], read from the variables `torchrun`, SLURM's `srun` and
//! `kiln launch` set), the reductions ([`ReduceOp`]), and the collectives every
//! backend's training step uses ([`Collectives`]). The engine is libtorch's c10d
//! (the `kiln-c10d` crate): Gloo for CPU tensors, NCCL for CUDA ones.
//!
//! ```
//! use kiln_core::distributed::{Launcher, Rendezvous, StoreAddress};
//!
//! // What `torchrun --nproc-per-node=2` gives its second worker.
//! let env = [
//!     ("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2"),
//!     ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"),
//!     ("TORCHELASTIC_RESTART_COUNT", "0"), ("TORCHELASTIC_USE_AGENT_STORE", "True"),
//! ];
//! let get = |name: &str| env.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string());
//! let rdzv = Rendezvous::from_vars(get)?.expect("a distributed environment");
//! assert_eq!((rdzv.rank, rdzv.world_size, rdzv.local_rank), (1, 2, 1));
//! assert_eq!(rdzv.launcher, Launcher::Torchrun);
//! // torchrun's agent hosts the store: every rank connects as a client.
//! assert!(matches!(rdzv.store, StoreAddress::Tcp { hosted_here: false, .. }));
//! # Ok::<(), kiln_core::Error>(())
//! ```

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result};

/// How the values of the ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// The sum over ranks.
    Sum,
    /// The mean over ranks (the sum divided by the world size).
    Mean,
    /// The largest value.
    Max,
    /// The smallest value.
    Min,
    /// The product over ranks.
    Product,
}

/// The collectives a training step needs, on host memory, implemented by a
/// process group (`kiln_c10d::ProcessGroup`). Every rank must
/// make the same calls in the same order.
///
/// Contract: on error the data is unspecified (a collective may have been half
/// done) and the group should not be used again: the job is failing.
pub trait Collectives: Send + Sync {
    /// This process's rank, `0..world_size()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world_size(&self) -> usize;
    /// Reduces `data` in place over every rank (no copy of `data` is made).
    fn all_reduce_f32(&self, data: &mut [f32], op: ReduceOp) -> Result<()>;
    /// Reduces `data` in place over every rank, in double precision (counts
    /// and sums of metrics).
    fn all_reduce_f64(&self, data: &mut [f64], op: ReduceOp) -> Result<()>;
    /// Replaces `data` on every rank with rank `root`'s.
    fn broadcast_f32(&self, data: &mut [f32], root: usize) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// Replaces `bytes` on every rank with rank `root`'s, whatever their
    /// lengths (two broadcasts: the length, then the bytes, 16 bits to an
    /// `f32` word, which holds them exactly).
    fn broadcast_bytes(&self, bytes: &mut Vec<u8>, root: usize) -> Result<()> {
        let is_root = self.rank() == root;
        let length = if is_root { bytes.len() as u64 } else { 0 };
        let mut header = [0, 16, 32, 48].map(|shift| f32::from((length >> shift) as u16));
        self.broadcast_f32(&mut header, root)?;
        let length = header
            .iter()
            .zip([0, 16, 32, 48])
            .fold(0u64, |sum, (&word, shift)| {
                sum | (u64::from(word as u16) << shift)
            });
        let length = usize::try_from(length).map_err(|_| {
            Error::distributed(
                "broadcasting bytes",
                format!("{length} bytes do not fit memory"),
            )
        })?;
        let mut words: Vec<f32> = if is_root {
            bytes
                .chunks(2)
                .map(|pair| {
                    f32::from(u16::from_le_bytes([
                        pair[0],
                        pair.get(1).copied().unwrap_or(0),
                    ]))
                })
                .collect()
        } else {
            vec![0.0; length.div_ceil(2)]
        };
        self.broadcast_f32(&mut words, root)?;
        bytes.clear();
        bytes.extend(words.iter().flat_map(|&word| (word as u16).to_le_bytes()));
        bytes.truncate(length);
        Ok(())
    }
}

/// Who started the workers, as read from their environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// `torchrun` (torch elastic): `TORCHELASTIC_*` variables are present.
    Torchrun,
    /// `kiln launch` (`KILN_LAUNCH=1`).
    Kiln,
    /// SLURM's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
    Slurm,
    /// `RANK` and `WORLD_SIZE` set by hand (PyTorch's `env://`).
    Environment,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Kiln => "kiln launch",
            Launcher::Slurm => "srun",
            Launcher::Environment => "env://",
        })
    }
}

/// The key-value store the ranks exchange their addresses through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreAddress {
    /// A TCP store at `host:port` (`MASTER_ADDR`, `MASTER_PORT`).
    Tcp {
        /// The host name or address.
        host: String,
        /// The port.
        port: u16,
        /// This process hosts the store: rank 0, unless torchrun's agent
        /// already hosts it (`TORCHELASTIC_USE_AGENT_STORE=True`).
        hosted_here: bool,
    },
    /// A file on a file system every rank sees (`file:///path`).
    File(PathBuf),
}

/// Where and as what this process joins a data-parallel job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// The number of processes of the job.
    pub world_size: usize,
    /// The rank among the processes of this machine (its GPU, when one per rank).
    pub local_rank: usize,
    /// The number of processes on this machine.
    pub local_world_size: usize,
    /// Where the ranks meet.
    pub store: StoreAddress,
    /// How many times the launcher restarted the job (`TORCHELASTIC_RESTART_COUNT`).
    pub restart_count: u32,
    /// Who started this process.
    pub launcher: Launcher,
}

impl Rendezvous {
    /// The rendezvous of this process from its environment, or `None` when it
    /// was not started as part of a job (no `RANK`/`WORLD_SIZE`, no multi-task
    /// SLURM step). `KILN_INIT_METHOD=file:///path` selects a file store.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`from_env`](Self::from_env), reading variables through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let var = |name: &str| get(name).filter(|v| !v.is_empty());
        let (rank, world_size, local_rank, local_world_size, launcher) =
            if var("RANK").is_some() || var("WORLD_SIZE").is_some() {
                let rank: usize = required(&var, "RANK")?;
                let world_size: usize = required(&var, "WORLD_SIZE")?;
                let local_rank = optional(&var, "LOCAL_RANK")?.unwrap_or(rank);
                let local_world_size = optional(&var, "LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
                // `kiln launch` sets torchrun's variables too.
                let launcher = if var("KILN_LAUNCH").is_some() {
                    Launcher::Kiln
                } else if var("TORCHELASTIC_RUN_ID").is_some()
                    || var("TORCHELASTIC_RESTART_COUNT").is_some()
                {
                    Launcher::Torchrun
                } else {
                    Launcher::Environment
                };
                (rank, world_size, local_rank, local_world_size, launcher)
            } else if var("SLURM_PROCID").is_some() {
                let world_size: usize = required(&var, "SLURM_NTASKS")?;
                if world_size < 2 && var("MASTER_ADDR").is_none() {
                    // A one-task allocation (`sbatch` running kiln directly): not a job.
                    return Ok(None);
                }
                let rank: usize = required(&var, "SLURM_PROCID")?;
                let local_rank = optional(&var, "SLURM_LOCALID")?.unwrap_or(0);
                let local_world_size = match optional::<usize>(&var, "SLURM_NTASKS_PER_NODE") {
                    Ok(Some(n)) => n,
                    // `2(x3)` and other forms: the node's share is not one number.
                    _ => slurm_tasks_on_node(var("SLURM_TASKS_PER_NODE").as_deref())
                        .unwrap_or(world_size),
                };
                (
                    rank,
                    world_size,
                    local_rank,
                    local_world_size,
                    Launcher::Slurm,
                )
            } else {
                return Ok(None);
            };
        if world_size == 0 {
            return Err(rendezvous_error(
                "WORLD_SIZE is 0: a job has at least one rank",
            ));
        }
        if rank >= world_size {
            return Err(rendezvous_error(format!(
                "RANK {rank} is not below WORLD_SIZE {world_size}"
            )));
        }
        if local_rank >= local_world_size.max(1) {
            return Err(rendezvous_error(format!(
                "LOCAL_RANK {local_rank} is not below LOCAL_WORLD_SIZE {local_world_size}"
            )));
        }
        let restart_count = optional(&var, "TORCHELASTIC_RESTART_COUNT")?.unwrap_or(0);
        let store = match var("KILN_INIT_METHOD") {
            Some(method) => parse_init_method(&method, &var, rank, launcher)?,
            None => tcp_store(&var, rank, launcher)?,
        };
        Ok(Some(Rendezvous {
            rank,
            world_size,
            local_rank,
            local_world_size,
            store,
            restart_count,
            launcher,
        }))
    }

    /// A rendezvous of `world_size` ranks through a file store at `path`.
    pub fn with_file_store(
        rank: usize,
        world_size: usize,
        path: impl Into<PathBuf>,
    ) -> Result<Self> {
        if rank >= world_size {
            return Err(rendezvous_error(format!(
                "rank {rank} is not below the world size {world_size}"
            )));
        }
        Ok(Rendezvous {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            store: StoreAddress::File(path.into()),
            restart_count: 0,
            launcher: Launcher::Environment,
        })
    }

    /// The prefix of this attempt's store keys: a restarted job never reads the
    /// addresses a dead attempt left in a store that outlived it.
    pub fn store_prefix(&self) -> String {
        format!("kiln/attempt-{}/", self.restart_count)
    }

    /// Whether this rank writes logs, plots and checkpoints (rank 0).
    pub fn is_primary(&self) -> bool {
        self.rank == 0
    }
}

/// The collective engine of a job (`[distributed] backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CommBackend {
    /// Gloo for CPU training, NCCL for CUDA (what PyTorch picks).
    #[default]
    Auto,
    /// Gloo (CPU tensors; TCP between hosts).
    Gloo,
    /// NCCL (CUDA tensors).
    Nccl,
}

impl FromStr for CommBackend {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(CommBackend::Auto),
            "gloo" => Ok(CommBackend::Gloo),
            "nccl" => Ok(CommBackend::Nccl),
            other => Err(Error::invalid_argument(
                "backend",
                format!("expected \"gloo\", \"nccl\" or \"auto\", got {other:?}"),
            )),
        }
    }
}

impl fmt::Display for CommBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CommBackend::Auto => "auto",
            CommBackend::Gloo => "gloo",
            CommBackend::Nccl => "nccl",
        })
    }
}

/// How a data-parallel job runs: the settings of PyTorch's
/// `init_process_group` and `DistributedDataParallel`, with their defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct DistributedOptions {
    /// The collective engine.
    pub backend: CommBackend,
    /// How long the rendezvous and any collective may wait for the other ranks
    /// before the job fails naming what it waited for (PyTorch: 30 minutes).
    pub timeout: Duration,
    /// Broadcast buffers (batch-norm running statistics) from rank 0 before
    /// every training forward pass (DDP's default: true).
    pub broadcast_buffers: bool,
    /// Search each step's graph for parameters that got no gradient, and reduce
    /// zeros for them (DDP's `find_unused_parameters`); without it such a
    /// parameter is an error naming it.
    pub find_unused_parameters: bool,
    /// The gradient bucket cap in MiB (DDP's `bucket_cap_mb`, 25); under
    /// ZeRO, the flat buffer of each reduce-scatter and all-gather.
    pub bucket_cap_mb: f64,
}

impl Default for DistributedOptions {
    fn default() -> Self {
        DistributedOptions {
            backend: CommBackend::Auto,
            timeout: Duration::from_secs(1800),
            broadcast_buffers: true,
            find_unused_parameters: false,
            bucket_cap_mb: 25.0,
        }
    }
}

/// DDP's first gradient bucket: 1 MiB, so that the last layers' gradients are
/// sent while the backward pass goes on.
pub const FIRST_BUCKET_BYTES: i64 = 1024 * 1024;

fn rendezvous_error(reason: impl Into<String>) -> Error {
    Error::distributed("rendezvous", reason)
}

fn parse_var<T: FromStr>(name: &str, value: &str) -> Result<T> {
    let what = if name.ends_with("PORT") {
        "port number"
    } else {
        "non-negative integer"
    };
    value
        .trim()
        .parse()
        .map_err(|_| rendezvous_error(format!("{name}={value:?} is not a {what}")))
}

fn required<T: FromStr>(var: &impl Fn(&str) -> Option<String>, name: &str) -> Result<T> {
    match var(name) {
        Some(value) => parse_var(name, &value),
        None => Err(rendezvous_error(format!(
            "{name} is not set (torchrun, srun and `kiln launch` set it for every worker)"
        ))),
    }
}

fn optional<T: FromStr>(var: &impl Fn(&str) -> Option<String>, name: &str) -> Result<Option<T>> {
    var(name).map(|value| parse_var(name, &value)).transpose()
}

/// This node's task count from SLURM's `SLURM_TASKS_PER_NODE` (`4`, `4(x2)`,
/// `4(x2),3`): the first node's share, which is every node's when uniform.
fn slurm_tasks_on_node(value: Option<&str>) -> Option<usize> {
    let first = value?.split(',').next()?;
    first.split('(').next()?.trim().parse().ok()
}

fn tcp_store(
    var: &impl Fn(&str) -> Option<String>,
    rank: usize,
    launcher: Launcher,
) -> Result<StoreAddress> {
    let host = var("MASTER_ADDR").ok_or_else(|| {
        rendezvous_error(format!(
            "MASTER_ADDR is not set: {} sets it; under srun, export the first node's \
             address (e.g. MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1))",
            if launcher == Launcher::Slurm { "torchrun" } else { "the launcher" }
        ))
    })?;
    let port: u16 = required(var, "MASTER_PORT")?;
    let agent_store = var("TORCHELASTIC_USE_AGENT_STORE")
        .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
    Ok(StoreAddress::Tcp {
        host,
        port,
        hosted_here: rank == 0 && !agent_store,
    })
}

fn parse_init_method(
    method: &str,
    var: &impl Fn(&str) -> Option<String>,
    rank: usize,
    launcher: Launcher,
) -> Result<StoreAddress> {
    if let Some(path) = method.strip_prefix("file://") {
        if path.is_empty() {
            return Err(rendezvous_error("KILN_INIT_METHOD=file:// names no file"));
        }
        Ok(StoreAddress::File(PathBuf::from(path)))
    } else if method == "env://" {
        tcp_store(var, rank, launcher)
    } else {
        Err(rendezvous_error(format!(
            "KILN_INIT_METHOD={method:?}: expected env:// or file:///path"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// One rank of a two-rank group run in turn in one process: the root's
    /// broadcasts are queued, the other rank's take them in order.
    struct Queued {
        rank: usize,
        sent: Arc<std::sync::Mutex<std::collections::VecDeque<Vec<f32>>>>,
    }

    impl Collectives for Queued {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world_size(&self) -> usize {
            2
        }
        fn all_reduce_f32(&self, _: &mut [f32], _: ReduceOp) -> Result<()> {
            Err(Error::unsupported("all_reduce_f32 in this test"))
        }
        fn all_reduce_f64(&self, _: &mut [f64], _: ReduceOp) -> Result<()> {
            Err(Error::unsupported("all_reduce_f64 in this test"))
        }
        fn broadcast_f32(&self, data: &mut [f32], root: usize) -> Result<()> {
            let mut sent = self
                .sent
                .lock()
                .map_err(|_| Error::unsupported("poisoned"))?;
            if self.rank == root {
                sent.push_back(data.to_vec());
            } else {
                let words = sent
                    .pop_front()
                    .ok_or_else(|| Error::unsupported("nothing sent"))?;
                assert_eq!(words.len(), data.len(), "the receiver sized its buffer");
                data.copy_from_slice(&words);
            }
            Ok(())
        }
        fn barrier(&self) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn broadcast_bytes_carries_every_byte_value_and_odd_lengths() -> Result<()> {
        let sent = Arc::default();
        let root = Queued {
            rank: 0,
            sent: Arc::clone(&sent),
        };
        let other = Queued { rank: 1, sent };
        for length in [0usize, 1, 2, 511, 70_001] {
            let original: Vec<u8> = (0..length).map(|i| (i * 7 + i / 256) as u8).collect();
            let mut at_root = original.clone();
            root.broadcast_bytes(&mut at_root, 0)?;
            assert_eq!(at_root, original, "the root keeps its bytes");
            let mut received = b"something longer than nothing at all".to_vec();
            other.broadcast_bytes(&mut received, 0)?;
            assert_eq!(received, original, "{length} bytes");
        }
        Ok(())
    }

    fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn no_launcher_is_no_job() {
        assert_eq!(Rendezvous::from_vars(vars(&[])).ok(), Some(None));
        // sbatch running kiln directly: one task, no master address.
        let one_task = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")];
        assert_eq!(Rendezvous::from_vars(vars(&one_task)).ok(), Some(None));
    }

    #[test]
    fn kiln_launch_rank_zero_hosts_the_store() -> Result<()> {
        let env = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29511"),
            ("TORCHELASTIC_RESTART_COUNT", "3"),
            ("KILN_LAUNCH", "1"),
        ];
        let r = Rendezvous::from_vars(vars(&env))?.ok_or(Error::unsupported("none"))?;
        assert_eq!(r.launcher, Launcher::Kiln);
        assert_eq!(
            r.store,
            StoreAddress::Tcp {
                host: "127.0.0.1".into(),
                port: 29511,
                hosted_here: true
            }
        );
        assert_eq!(r.store_prefix(), "kiln/attempt-3/");
        Ok(())
    }

    #[test]
    fn slurm_with_a_master_address() -> Result<()> {
        let env = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("MASTER_ADDR", "node01"),
            ("MASTER_PORT", "29500"),
        ];
        let r = Rendezvous::from_vars(vars(&env))?.ok_or(Error::unsupported("none"))?;
        assert_eq!(
            (r.rank, r.world_size, r.local_rank, r.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!(r.launcher, Launcher::Slurm);
        assert!(matches!(
            r.store,
            StoreAddress::Tcp {
                hosted_here: false,
                ..
            }
        ));
        // Without the master address the error says how to give it.
        let missing = Rendezvous::from_vars(vars(&env[..4]))
            .err()
            .map(|e| e.to_string());
        assert!(
            missing
                .as_deref()
                .is_some_and(|m| m.contains("MASTER_ADDR is not set")),
            "{missing:?}"
        );
        Ok(())
    }

    #[test]
    fn bad_values_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (
                &[("RANK", "2"), ("WORLD_SIZE", "2")],
                "RANK 2 is not below WORLD_SIZE 2",
            ),
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK=\"x\""),
            (&[("RANK", "0")], "WORLD_SIZE is not set"),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "h")],
                "MASTER_PORT is not set",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "1"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "70000"),
                ],
                "MASTER_PORT=\"70000\" is not a port number",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "1"),
                    ("KILN_INIT_METHOD", "tcp://x"),
                ],
                "expected env:// or file:///path",
            ),
        ];
        for (env, expected) in cases {
            let message = Rendezvous::from_vars(vars(env))
                .err()
                .map(|e| e.to_string());
            assert!(
                message.as_deref().is_some_and(|m| m.contains(expected)),
                "{env:?}: {message:?}"
            );
        }
    }

    #[test]
    fn file_init_method() -> Result<()> {
        let env = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("KILN_INIT_METHOD", "file:///tmp/kiln-store"),
        ];
        let r = Rendezvous::from_vars(vars(&env))?.ok_or(Error::unsupported("none"))?;
        assert_eq!(r.store, StoreAddress::File("/tmp/kiln-store".into()));
        assert_eq!(r.launcher, Launcher::Environment);
        Ok(())
    }

    #[test]
    fn slurm_tasks_per_node_forms() {
        assert_eq!(slurm_tasks_on_node(Some("4")), Some(4));
        assert_eq!(slurm_tasks_on_node(Some("4(x2),3")), Some(4));
        assert_eq!(slurm_tasks_on_node(Some("x")), None);
        assert_eq!(slurm_tasks_on_node(None), None);
    }
}
