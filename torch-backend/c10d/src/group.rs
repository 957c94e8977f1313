//! [`ProcessGroup`]: the ranks of a job, joined, and their collectives.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cxx::UniquePtr;
use kiln_core::distributed::{
    Collectives, CommBackend, DistributedOptions, ReduceOp, Rendezvous, StoreAddress,
};
use kiln_core::{DType, Device, Error, HostTensor, Result};
use tch::Tensor;

use crate::bridge::ffi;
use kiln_torch::cxx_tensor::{as_at, from_at};
use kiln_torch::{from_tch, to_tch};

/// The backend name of errors from c10d.
pub(crate) const C10D: &str = "c10d";

pub(crate) fn c10d_error(context: impl Into<String>, e: cxx::Exception) -> Error {
    Error::backend_with_source(C10D, context, e)
}

/// The ranks of a data-parallel job, joined (see the [crate docs](crate)).
///
/// Every rank must make the same collective calls in the same order. A rank
/// that dies makes the others' next collective fail at once (its connection
/// closes) or, if it hangs, after the group's timeout; both are errors.
pub struct ProcessGroup {
    inner: UniquePtr<ffi::DistGroup>,
    rank: usize,
    world_size: usize,
    nccl: bool,
    timeout: Duration,
    /// Serialises calls: c10d matches collectives across ranks by order.
    order: Mutex<()>,
}

// SAFETY: c10d's ProcessGroup and its Gloo/NCCL backends are built to be used
// from any thread (PyTorch calls them from autograd's threads); the C++ object is
// owned by this value alone, and `order` serialises the calls made through it.
#[allow(unsafe_code)]
unsafe impl Send for ProcessGroup {}
// SAFETY: as for `Send`: every method takes `&self` and locks `order`.
#[allow(unsafe_code)]
unsafe impl Sync for ProcessGroup {}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("nccl", &self.nccl)
            .finish()
    }
}

impl ProcessGroup {
    /// Joins the job `rendezvous` describes: connects to (or hosts) its store,
    /// waits for every rank up to `options.timeout`, and connects Gloo (and
    /// NCCL when `options.backend` asks for it) to every other rank. Gloo binds
    /// the interfaces in `GLOO_SOCKET_IFNAME` (comma-separated) when set, else
    /// the address this machine's host name resolves to, as PyTorch does.
    ///
    /// A rank that does not arrive in time gives [`Error::Distributed`] saying
    /// how many did.
    pub fn join(rendezvous: &Rendezvous, options: &DistributedOptions) -> Result<Self> {
        let nccl = match options.backend {
            CommBackend::Nccl => {
                if !ffi::nccl_compiled() {
                    return Err(Error::unsupported(
                        "the NCCL backend: kiln-c10d was built without its `cuda` feature",
                    ));
                }
                true
            }
            CommBackend::Gloo | CommBackend::Auto => false,
        };
        let timeout_ms = i64::try_from(options.timeout.as_millis()).unwrap_or(i64::MAX);
        let (store, host, port, is_server, file_path) = match &rendezvous.store {
            StoreAddress::Tcp {
                host,
                port,
                hosted_here,
            } => (
                ffi::StoreKind::Tcp,
                host.clone(),
                *port,
                *hosted_here,
                String::new(),
            ),
            StoreAddress::File(path) => (
                ffi::StoreKind::File,
                String::new(),
                0,
                false,
                path.to_string_lossy().into_owned(),
            ),
        };
        let gloo_interfaces = std::env::var("GLOO_SOCKET_IFNAME")
            .map(|v| {
                v.split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let config = ffi::GroupConfig {
            store,
            host,
            port,
            is_server,
            file_path,
            prefix: rendezvous.store_prefix(),
            rank: rank_i32(rendezvous.rank)?,
            world_size: rank_i32(rendezvous.world_size)?,
            timeout_ms,
            gloo_interfaces,
            nccl,
            cuda_device: rank_i32(rendezvous.local_rank)?,
        };
        log::info!(
            "joining a job of {} ranks as rank {} ({}, store {:?}, timeout {:?})",
            rendezvous.world_size,
            rendezvous.rank,
            rendezvous.launcher,
            rendezvous.store,
            options.timeout
        );
        let inner = ffi::new_dist_group(&config).map_err(|e| {
            let message = e.what().to_owned();
            if message.starts_with("rendezvous") {
                Error::distributed(
                    format!("rank {} of {}", rendezvous.rank, rendezvous.world_size),
                    message,
                )
            } else {
                c10d_error("creating the process group", e)
            }
        })?;
        Ok(ProcessGroup {
            inner,
            rank: rendezvous.rank,
            world_size: rendezvous.world_size,
            nccl,
            timeout: options.timeout,
            order: Mutex::new(()),
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Whether CUDA tensors go through NCCL.
    pub fn has_nccl(&self) -> bool {
        self.nccl
    }

    /// Runs `f` on the C++ group, one call at a time.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&ffi::DistGroup) -> T) -> T {
        let _order = self
            .order
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&self.inner)
    }

    /// Reduces `tensor` in place over every rank. CPU tensors go through
    /// Gloo, CUDA tensors through NCCL (the `cuda` feature and
    /// `backend = "nccl"`). [`ReduceOp::Mean`] divides the sum by the world
    /// size, so it needs a floating-point tensor.
    pub fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.check_device(tensor, "all_reduce")?;
        self.with(|g| g.all_reduce(as_at(tensor), reduce_kind(op)))
            .map_err(|e| self.diagnose("all_reduce", e.what()))?;
        if op == ReduceOp::Mean {
            let _ = tensor
                .shallow_clone()
                .f_div_scalar_(self.world_size as f64)
                .map_err(|e| kiln_torch::torch_error("all_reduce (mean)", e))?;
        }
        Ok(())
    }

    /// Starts reducing `tensor` in place over every rank and returns at once;
    /// the result is there when [`PendingAllReduce::wait`] returns.
    pub(crate) fn all_reduce_start(
        self: &Arc<Self>,
        tensor: &Tensor,
        op: ReduceOp,
    ) -> Result<PendingAllReduce> {
        self.check_device(tensor, "all_reduce")?;
        let work = self
            .with(|g| g.all_reduce_start(as_at(tensor), reduce_kind(op)))
            .map_err(|e| self.diagnose("all_reduce", e.what()))?;
        Ok(PendingAllReduce {
            work,
            tensor: tensor.shallow_clone(),
            op,
            group: Arc::clone(self),
        })
    }

    /// Replaces `tensor` on every rank with rank `root`'s, in place.
    pub fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        self.check_device(tensor, "broadcast")?;
        let root = self.check_root(root)?;
        self.with(|g| g.broadcast(as_at(tensor), root))
            .map_err(|e| self.diagnose("broadcast", e.what()))
    }

    /// Every rank's `tensor`, stacked along a new leading axis of length
    /// `world_size` (every rank must pass the same shape and dtype).
    pub fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        self.check_device(tensor, "all_gather")?;
        let out = self
            .with(|g| g.all_gather(as_at(tensor)))
            .map_err(|e| self.diagnose("all_gather", e.what()))?;
        from_at(out)
    }

    /// Reduces `input` (`world_size` equal segments, one per rank, flat)
    /// over every rank and leaves segment `rank` of the result in `output`
    /// (PyTorch's `reduce_scatter_tensor`): what each rank receives is its
    /// share of the reduction, and only that. Both tensors are contiguous, of
    /// one dtype, with `input` holding `world_size` times `output`'s elements.
    pub fn reduce_scatter(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        self.check_device(input, "reduce_scatter")?;
        self.check_flat(output, input, "reduce_scatter")?;
        self.with(|g| g.reduce_scatter_flat(as_at(output), as_at(input), reduce_kind(op)))
            .map_err(|e| self.diagnose("reduce_scatter", e.what()))?;
        if op == ReduceOp::Mean {
            let _ = output
                .shallow_clone()
                .f_div_scalar_(self.world_size as f64)
                .map_err(|e| kiln_torch::torch_error("reduce_scatter (mean)", e))?;
        }
        Ok(())
    }

    /// [`reduce_scatter`](Self::reduce_scatter) of a buffer the caller gives
    /// up: what `input` holds afterwards is unspecified.
    ///
    /// Gloo's reduce-scatter (c10d's `_reduce_scatter_base`) clones the whole
    /// input, all-reduces the clone and copies this rank's segment out, so that
    /// the input survives; on a buffer built only to be reduced, that clone is
    /// a whole extra allocation and copy. Given the buffer, Kiln all-reduces it
    /// in place and copies the segment out. CUDA tensors (NCCL, which
    /// reduce-scatters natively) take [`reduce_scatter`](Self::reduce_scatter)'s path.
    pub fn reduce_scatter_owned(&self, output: &Tensor, input: Tensor, op: ReduceOp) -> Result<()> {
        self.check_device(&input, "reduce_scatter")?;
        self.check_flat(output, &input, "reduce_scatter")?;
        if input.device() != tch::Device::Cpu {
            return self.reduce_scatter(output, &input, op);
        }
        let sum_like = if op == ReduceOp::Mean {
            ReduceOp::Sum
        } else {
            op
        };
        self.with(|g| g.all_reduce(as_at(&input), reduce_kind(sum_like)))
            .map_err(|e| self.diagnose("reduce_scatter", e.what()))?;
        let len = output.numel() as i64;
        let fail = |e| kiln_torch::torch_error("reduce_scatter", e);
        // Both are contiguous (checked above): flat views of the same memory.
        let mut out = output.f_view([-1]).map_err(fail)?;
        let segment = input
            .f_view([-1])
            .map_err(fail)?
            .narrow(0, self.rank as i64 * len, len);
        out.f_copy_(&segment).map_err(fail)?;
        if op == ReduceOp::Mean {
            let _ = out
                .f_div_scalar_(self.world_size as f64)
                .map_err(|e| kiln_torch::torch_error("reduce_scatter (mean)", e))?;
        }
        Ok(())
    }

    /// Every rank's `input` into `output`, rank after rank (PyTorch's
    /// `all_gather_into_tensor`): `output` holds `world_size` times `input`'s
    /// elements, both contiguous and of one dtype.
    pub fn all_gather_into(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        self.check_device(input, "all_gather")?;
        self.check_flat(input, output, "all_gather")?;
        self.with(|g| g.all_gather_flat(as_at(output), as_at(input)))
            .map_err(|e| self.diagnose("all_gather", e.what()))
    }

    /// Starts [`all_gather_into`](Self::all_gather_into) and returns at
    /// once, holding both buffers until [`PendingAllGather::wait`] returns
    /// `output` filled: how full sharding gathers the next unit's parameters
    /// while the current one computes.
    pub(crate) fn all_gather_start(
        self: &Arc<Self>,
        output: Tensor,
        input: Tensor,
    ) -> Result<PendingAllGather> {
        self.check_device(&input, "all_gather")?;
        self.check_flat(&input, &output, "all_gather")?;
        let work = self
            .with(|g| g.all_gather_flat_start(as_at(&output), as_at(&input)))
            .map_err(|e| self.diagnose("all_gather", e.what()))?;
        Ok(PendingAllGather {
            work,
            output,
            _input: input,
            group: Arc::clone(self),
        })
    }

    /// Checks that `whole` has `world_size` times `part`'s elements, one dtype,
    /// both contiguous: c10d's flat collectives assume it.
    fn check_flat(&self, part: &Tensor, whole: &Tensor, what: &str) -> Result<()> {
        let world = self.world_size as i64;
        if whole.numel() as i64 != world * part.numel() as i64 {
            return Err(Error::ShapeMismatch {
                context: format!("{what}: the whole buffer"),
                expected: format!("{world} x {} elements", part.numel()),
                actual: format!("{} elements", whole.numel()),
            });
        }
        if part.kind() != whole.kind() || !part.is_contiguous() || !whole.is_contiguous() {
            return Err(Error::invalid_argument(
                what,
                format!(
                    "both buffers must be contiguous and of one dtype, got {:?} and {:?}",
                    part.kind(),
                    whole.kind()
                ),
            ));
        }
        Ok(())
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        self.with(|g| g.barrier())
            .map_err(|e| c10d_error("barrier", e))
    }

    /// Reduces host `f32` memory in place over every rank, without copying it
    /// (libtorch wraps the memory; the Gloo engine reads and writes it there).
    pub fn all_reduce_f32(&self, data: &mut [f32], op: ReduceOp) -> Result<()> {
        let kind = reduce_kind(op);
        self.with(|g| g.all_reduce_host_f32(data, kind))
            .map_err(|e| self.diagnose("all_reduce", e.what()))?;
        if op == ReduceOp::Mean {
            let n = self.world_size as f32;
            data.iter_mut().for_each(|x| *x /= n);
        }
        Ok(())
    }

    /// Reduces a [`HostTensor`] in place over every rank (any numeric dtype;
    /// [`ReduceOp::Mean`] needs a floating-point one).
    pub fn all_reduce_host(&self, tensor: &mut HostTensor, op: ReduceOp) -> Result<()> {
        if tensor.dtype() == DType::F32 {
            return self.all_reduce_f32(tensor.as_mut_slice::<f32>()?, op);
        }
        let native = to_tch(tensor, Device::Cpu)?;
        self.all_reduce(&native, op)?;
        *tensor = from_tch(&native)?;
        Ok(())
    }

    /// Every tensor broadcast from `root`, packed into buffers of up to
    /// `buffer_bytes` (how DDP syncs a model: few large messages).
    pub fn broadcast_coalesced(
        &self,
        tensors: &[&Tensor],
        buffer_bytes: usize,
        root: usize,
    ) -> Result<()> {
        let root = self.check_root(root)?;
        let list = tensor_list(tensors);
        self.with(|g| g.broadcast_coalesced(&list, buffer_bytes, root))
            .map_err(|e| self.diagnose("broadcast_coalesced", e.what()))
    }

    /// The store's key-value interface, shared by every rank of this attempt.
    pub fn store_set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.with(|g| g.store_set(key, value))
            .map_err(|e| c10d_error(format!("store set {key:?}"), e))
    }

    /// The value of `key`, waiting up to the timeout for some rank to set it.
    pub fn store_get(&self, key: &str) -> Result<Vec<u8>> {
        self.with(|g| g.store_get(key))
            .map_err(|e| c10d_error(format!("store get {key:?}"), e))
    }

    /// The error of a failed collective (`context`, c10d's `cause`), naming
    /// the ranks that are gone: every surviving rank marks itself in the store
    /// and waits a few seconds for the others' marks; a rank without one has
    /// died or become unreachable. When the store itself is gone, so is rank 0,
    /// which hosts it (unless torchrun's agent does).
    pub(crate) fn diagnose(&self, context: &str, cause: &str) -> Error {
        let key = |rank: usize| format!("kiln/survivor/{rank}");
        let marked = self.inner.store_set(&key(self.rank), b"1");
        if marked.is_err() {
            return Error::distributed(
                context,
                format!(
                    "rank {} lost the rendezvous store (rank 0, or torchrun's agent, hosts \
                     it): rank 0 has probably died; c10d said: {cause}",
                    self.rank
                ),
            );
        }
        let wait = self.timeout.min(Duration::from_secs(5));
        let start = Instant::now();
        let missing = loop {
            let missing: Vec<usize> = (0..self.world_size)
                .filter(|&r| !matches!(self.inner.store_check(&key(r)), Ok(true)))
                .collect();
            if missing.is_empty() || start.elapsed() >= wait {
                break missing;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if missing.is_empty() {
            return Error::distributed(
                context,
                format!("every rank is still there, but the collective failed: {cause}"),
            );
        }
        let names: Vec<String> = missing.iter().map(usize::to_string).collect();
        Error::distributed(
            context,
            format!(
                "rank {} of {} stopped responding (its process died or its machine is \
                 unreachable); c10d said: {cause}",
                names.join(", "),
                self.world_size
            ),
        )
    }

    fn check_root(&self, root: usize) -> Result<i32> {
        if root >= self.world_size {
            return Err(Error::invalid_argument(
                "root",
                format!(
                    "rank {root} is not below the world size {}",
                    self.world_size
                ),
            ));
        }
        rank_i32(root)
    }

    fn check_device(&self, tensor: &Tensor, what: &str) -> Result<()> {
        if tensor.device().is_cuda() && !self.nccl {
            return Err(Error::unsupported(format!(
                "{what} of a CUDA tensor on a Gloo group: join with backend = \"nccl\" \
                 (kiln's `cuda` feature)"
            )));
        }
        Ok(())
    }
}

/// An all-reduce under way ([`ProcessGroup::all_reduce_start`]); dropping it
/// unwaited lets it finish in c10d's threads.
pub(crate) struct PendingAllReduce {
    work: UniquePtr<ffi::PendingWork>,
    /// Kept alive (and read) until the collective is done.
    tensor: Tensor,
    op: ReduceOp,
    group: Arc<ProcessGroup>,
}

impl PendingAllReduce {
    /// Waits for the collective; the reduced tensor.
    pub(crate) fn wait(self) -> Result<Tensor> {
        self.work
            .wait()
            .map_err(|e| self.group.diagnose("all_reduce", e.what()))?;
        if self.op == ReduceOp::Mean {
            let _ = self
                .tensor
                .shallow_clone()
                .f_div_scalar_(self.group.world_size as f64)
                .map_err(|e| kiln_torch::torch_error("all_reduce (mean)", e))?;
        }
        Ok(self.tensor)
    }
}

/// An all-gather under way ([`ProcessGroup::all_gather_start`]); dropping it
/// unwaited lets it finish in c10d's threads, which hold their own references
/// to both buffers.
pub(crate) struct PendingAllGather {
    work: UniquePtr<ffi::PendingWork>,
    output: Tensor,
    /// Read by the collective until it is done.
    _input: Tensor,
    group: Arc<ProcessGroup>,
}

impl PendingAllGather {
    /// Waits for the collective; the gathered buffer.
    pub(crate) fn wait(self) -> Result<Tensor> {
        self.work
            .wait()
            .map_err(|e| self.group.diagnose("all_gather", e.what()))?;
        Ok(self.output)
    }
}

impl Collectives for ProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_f32(&self, data: &mut [f32], op: ReduceOp) -> Result<()> {
        ProcessGroup::all_reduce_f32(self, data, op)
    }

    fn all_reduce_f64(&self, data: &mut [f64], op: ReduceOp) -> Result<()> {
        let tensor =
            Tensor::f_from_slice(data).map_err(|e| kiln_torch::torch_error("all_reduce", e))?;
        self.all_reduce(&tensor, op)?;
        tensor
            .f_copy_data(data, data.len())
            .map_err(|e| kiln_torch::torch_error("all_reduce", e))
    }

    fn broadcast_f32(&self, data: &mut [f32], root: usize) -> Result<()> {
        let tensor =
            Tensor::f_from_slice(data).map_err(|e| kiln_torch::torch_error("broadcast", e))?;
        self.broadcast(&tensor, root)?;
        tensor
            .f_copy_data(data, data.len())
            .map_err(|e| kiln_torch::torch_error("broadcast", e))
    }

    fn barrier(&self) -> Result<()> {
        ProcessGroup::barrier(self)
    }
}

fn reduce_kind(op: ReduceOp) -> ffi::ReduceKind {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => ffi::ReduceKind::Sum,
        ReduceOp::Max => ffi::ReduceKind::Max,
        ReduceOp::Min => ffi::ReduceKind::Min,
        ReduceOp::Product => ffi::ReduceKind::Product,
    }
}

fn rank_i32(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::invalid_argument("rank", format!("{n} is too large")))
}

pub(crate) fn tensor_list(tensors: &[&Tensor]) -> UniquePtr<ffi::TensorList> {
    let mut list = ffi::new_tensor_list();
    for t in tensors {
        if let Some(list) = list.as_mut() {
            list.push(as_at(t));
        }
    }
    list
}
