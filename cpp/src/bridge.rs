//! The cxx bridge: private; the crate exposes safe wrappers only.

#[cxx::bridge(namespace = "kiln::ops")]
pub(crate) mod ffi {
    // SAFETY: the declarations match include/ops.h exactly (cxx checks the
    // signatures at compile time). The tensor functions take pointers to live
    // `at::Tensor`s borrowed for the call and return a new heap `at::Tensor`
    // (`new`) that the caller owns; every function that can throw returns `Result`.
    unsafe extern "C++" {
        include!("kiln-ops/include/ops.h");

        /// libtorch's tensor (tch's `C_tensor` points at one).
        #[namespace = "at"]
        type Tensor;

        fn cxx11_abi() -> i32;
        fn checked_numel(dims: &[i64]) -> Result<i64>;
        fn torch_ops_registered() -> i32;

        unsafe fn bias_gelu(x: *const Tensor, bias: *const Tensor) -> Result<*mut Tensor>;
        unsafe fn softmax_xent(
            logits: *const Tensor,
            target: *const Tensor,
            label_smoothing: f64,
        ) -> Result<*mut Tensor>;
        unsafe fn swish(x: *const Tensor, beta: *const Tensor) -> Result<*mut Tensor>;
    }
}
