//! The cxx bridge: private; the crate exposes safe wrappers only.

#[cxx::bridge(namespace = "kiln::ops")]
pub(crate) mod ffi {
    // SAFETY: the declarations match include/ops.h exactly (cxx checks the
    // signatures at compile time). The tensor functions take `const at::Tensor&`
    // and return a new `std::unique_ptr<at::Tensor>` (kiln-torch's `cxx_tensor`
    // converts both); every function that can throw returns `Result`.
    unsafe extern "C++" {
        include!("kiln-fused-ops/include/ops.h");

        /// libtorch's tensor, shared by every bridge (`kiln_torch::cxx_tensor`).
        #[namespace = "at"]
        type Tensor = kiln_torch::cxx_tensor::AtTensor;

        fn cxx11_abi() -> i32;
        fn checked_numel(dims: &[i64]) -> Result<i64>;
        fn torch_ops_registered() -> i32;

        fn bias_gelu(x: &Tensor, bias: &Tensor) -> Result<UniquePtr<Tensor>>;
        fn softmax_xent(
            logits: &Tensor,
            target: &Tensor,
            label_smoothing: f64,
        ) -> Result<UniquePtr<Tensor>>;
        fn swish(x: &Tensor, beta: &Tensor) -> Result<UniquePtr<Tensor>>;
    }
}
