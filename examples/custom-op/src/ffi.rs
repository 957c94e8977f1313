//! Step 3: the cxx bridge (the template to copy: one opaque `at::Tensor`, one
//! unsafe function per op, `Result` so C++ exceptions become Rust errors).

#[cxx::bridge(namespace = "example")]
pub(crate) mod bridge {
    // SAFETY: the declaration matches cpp/bridge.h (cxx checks it at compile
    // time); the pointer is a live tensor borrowed for the call and the result a
    // new heap tensor the caller owns.
    unsafe extern "C++" {
        include!("kiln-example-custom-op/cpp/bridge.h");

        #[namespace = "at"]
        type Tensor;

        unsafe fn squared_relu(x: *const Tensor) -> Result<*mut Tensor>;
    }
}
