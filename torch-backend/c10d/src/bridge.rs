//! The cxx bridge to libtorch's c10d (include/c10d.h, src/c10d.cc).

#[allow(unsafe_code)]
#[cxx::bridge(namespace = "kiln::dist")]
pub(crate) mod ffi {
    /// Where the ranks meet.
    #[repr(u8)]
    enum StoreKind {
        /// A `c10d::TCPStore` at `host:port`.
        Tcp,
        /// A `c10d::FileStore` at `file_path` (a shared file system).
        File,
    }

    /// What `new_dist_group` builds.
    struct GroupConfig {
        store: StoreKind,
        host: String,
        port: u16,
        /// This rank hosts the TCP store (rank 0 unless an agent hosts it).
        is_server: bool,
        file_path: String,
        /// Prepended to every store key (the restart count, so that a restarted
        /// attempt never reads the addresses of a dead one).
        prefix: String,
        rank: i32,
        world_size: i32,
        /// For the rendezvous, the store, and every collective.
        timeout_ms: i64,
        /// Gloo's network interfaces (`GLOO_SOCKET_IFNAME`); empty: the address
        /// this machine's hostname resolves to.
        gloo_interfaces: Vec<String>,
        /// Also an NCCL backend for CUDA tensors.
        nccl: bool,
        cuda_device: i32,
    }

    /// A reduction of collectives (mean is a sum divided on the Rust side:
    /// Gloo has no average).
    #[repr(u8)]
    enum ReduceKind {
        Sum,
        Max,
        Min,
        Product,
    }

    /// DDP's reducer settings (`DistributedDataParallel`'s arguments).
    struct ReducerConfig {
        bucket_cap_bytes: i64,
        first_bucket_bytes: i64,
        find_unused_parameters: bool,
        /// The parameters' names, in order, for the reducer's error messages.
        param_names: Vec<String>,
    }

    // SAFETY: the declarations match include/c10d.h exactly (cxx checks the
    // signatures at compile time); every function that can throw returns
    // `Result`, so a C++ exception comes back as an error instead of unwinding
    // into Rust, and the destructors catch what c10d's may throw. Tensors cross
    // as `const at::Tensor&` (kiln-torch's `cxx_tensor`), which C++ copies as
    // handles (a reference count); host memory crosses as a `&mut [f32]` that
    // C++ uses only for the duration of the call.
    unsafe extern "C++" {
        include!("kiln-c10d/include/c10d.h");

        #[namespace = "at"]
        type Tensor = kiln_torch::cxx_tensor::AtTensor;

        type TensorList;
        fn new_tensor_list() -> UniquePtr<TensorList>;
        fn push(self: Pin<&mut TensorList>, tensor: &Tensor);

        type DistGroup;
        fn new_dist_group(config: &GroupConfig) -> Result<UniquePtr<DistGroup>>;
        fn all_reduce(self: &DistGroup, tensor: &Tensor, op: ReduceKind) -> Result<()>;
        fn broadcast(self: &DistGroup, tensor: &Tensor, root: i32) -> Result<()>;
        fn all_reduce_start(
            self: &DistGroup,
            tensor: &Tensor,
            op: ReduceKind,
        ) -> Result<UniquePtr<PendingWork>>;

        type PendingWork;
        fn wait(self: &PendingWork) -> Result<()>;
        fn all_gather(self: &DistGroup, tensor: &Tensor) -> Result<UniquePtr<Tensor>>;
        fn barrier(self: &DistGroup) -> Result<()>;
        fn reduce_scatter_flat(
            self: &DistGroup,
            output: &Tensor,
            input: &Tensor,
            op: ReduceKind,
        ) -> Result<()>;
        fn all_gather_flat(self: &DistGroup, output: &Tensor, input: &Tensor) -> Result<()>;
        fn all_gather_flat_start(
            self: &DistGroup,
            output: &Tensor,
            input: &Tensor,
        ) -> Result<UniquePtr<PendingWork>>;
        fn all_reduce_host_f32(self: &DistGroup, data: &mut [f32], op: ReduceKind) -> Result<()>;
        fn broadcast_coalesced(
            self: &DistGroup,
            tensors: &TensorList,
            buffer_bytes: usize,
            root: i32,
        ) -> Result<()>;
        fn verify_same_tensors(self: &DistGroup, tensors: &TensorList) -> Result<()>;
        fn store_set(self: &DistGroup, key: &str, value: &[u8]) -> Result<()>;
        fn store_get(self: &DistGroup, key: &str) -> Result<Vec<u8>>;
        fn store_check(self: &DistGroup, key: &str) -> Result<bool>;

        type DdpReducer;
        fn new_ddp_reducer(
            group: &DistGroup,
            params: &TensorList,
            config: &ReducerConfig,
        ) -> Result<UniquePtr<DdpReducer>>;
        fn prepare_for_forward(self: &DdpReducer) -> Result<()>;
        fn prepare_for_backward(self: &DdpReducer, outputs: &TensorList) -> Result<()>;

        fn nccl_compiled() -> bool;
    }
}

// SAFETY: a c10d `Work` and a c10d `Reducer` have no thread affinity: PyTorch
// waits on a `Work` from whichever thread needs its result (its state is
// guarded by its own mutex), and drives a `Reducer` from the training thread
// and from autograd's threads, which run its gradient hooks. Moving one to
// another thread is therefore sound. They are not `Sync`: each is owned by one
// Rust value, which calls it from one thread at a time.
#[allow(unsafe_code)]
unsafe impl Send for ffi::PendingWork {}
// SAFETY: as for `PendingWork`.
#[allow(unsafe_code)]
unsafe impl Send for ffi::DdpReducer {}
