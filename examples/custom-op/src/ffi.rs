//! Step 3: the cxx bridge (the template to copy: libtorch's `at::Tensor` as
//! kiln-torch's `AtTensor`, one function per op taking `&Tensor` and returning
//! `UniquePtr<Tensor>`, `Result` so C++ exceptions become Rust errors).

#[cxx::bridge(namespace = "example")]
pub(crate) mod bridge {
    // SAFETY: the declaration matches cpp/bridge.h (cxx checks it at compile
    // time); the tensor crosses as `const at::Tensor&` and the result comes back as
    // a `std::unique_ptr<at::Tensor>` the caller owns (`kiln_torch::cxx_tensor`
    // converts both).
    unsafe extern "C++" {
        include!("kiln-example-custom-op/cpp/bridge.h");

        /// libtorch's tensor, as every Kiln bridge declares it.
        #[namespace = "at"]
        type Tensor = kiln_torch::cxx_tensor::AtTensor;

        fn squared_relu(x: &Tensor) -> Result<UniquePtr<Tensor>>;
    }
}
