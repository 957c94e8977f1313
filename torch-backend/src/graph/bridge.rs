//! The cxx bridge of [`CudaGraph`](super::CudaGraph): private, wrapped safely there.

#[cxx::bridge(namespace = "kiln::torch")]
pub(crate) mod ffi {
    // SAFETY: the declarations match include/cuda_graph.h exactly (cxx checks the
    // signatures at compile time); every method that can throw returns `Result`,
    // so a C++ exception comes back as an error instead of unwinding into Rust.
    unsafe extern "C++" {
        include!("kiln-torch/include/cuda_graph.h");

        type CudaGraph;

        fn new_cuda_graph(device: i8) -> Result<UniquePtr<CudaGraph>>;
        fn enter_side_stream(self: Pin<&mut CudaGraph>) -> Result<()>;
        fn leave_side_stream(self: Pin<&mut CudaGraph>) -> Result<()>;
        fn capture_begin(self: Pin<&mut CudaGraph>) -> Result<()>;
        fn capture_end(self: Pin<&mut CudaGraph>) -> Result<()>;
        fn replay(self: Pin<&mut CudaGraph>) -> Result<()>;
        fn is_captured(self: &CudaGraph) -> bool;
    }
}
