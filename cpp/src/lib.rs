//! Kiln's own fused C++ (and, with the `cuda` feature, CUDA) ops: bias+GELU,
//! softmax cross-entropy and Swish-β, with their gradients (`kiln::fused_ops` in
//! the facade). For ops you write yourself in Rust, see `kiln-custom-op`.
//!
//! The C++ sources under `src/` are compiled by the build script with `cc`
//! (flags from kiln-build: C++17, libtorch's `_GLIBCXX_USE_CXX11_ABI`) and bridged
//! with `cxx` in a private module. A C++ exception never crosses into Rust as an
//! abort: each bridged function that can throw returns `Result`, and the wrappers
//! here turn the exception into [`kiln_core::Error::Backend`] with the
//! [`cxx::Exception`] (its message) as the source. Tensors cross the bridge as
//! `&Tensor` and come back as `UniquePtr<Tensor>`, libtorch's `at::Tensor` as
//! [`kiln_torch::cxx_tensor`] declares and converts it, so the wrappers need no
//! `unsafe` block.
//!
//! ```
//! assert_eq!(kiln_fused_ops::checked_numel(&[2, 3, 4])?, 24);
//! assert!(kiln_fused_ops::checked_numel(&[2, -1]).is_err());
//! # Ok::<(), kiln_core::Error>(())
//! ```
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[allow(unsafe_code)]
mod bridge;
pub mod layer;
#[cfg(feature = "tf")]
pub mod tf;
mod torch;

use kiln_core::{Error, Result};

pub use torch::{bias_gelu, register, softmax_cross_entropy, swish, TORCH_LIBRARY};

/// Registers the ops with libtorch and TensorFlow and makes the fused layers
/// ([`layer::BIAS_GELU`], [`layer::SWISH`]) available to both backends' models,
/// so a [`Layer`](kiln_core::model::Layer) holding them trains with `Trainer<TorchBackend>`
/// or `Trainer<TfBackend>`, and registers the layers' lowerings to standard ops
/// with the exporters (ONNX, TorchScript and SavedModel), so exported models
/// need no Kiln library. Idempotent; call it once at start-up. Without the
/// `tf` feature (on by default) only libtorch's side is registered.
///
/// A failed TensorFlow registration is an [`Error::Backend`].
///
/// ```
/// use kiln_core::{model::{Layer, LinearConfig}, module::Module, Device};
///
/// kiln_fused_ops::register_layers()?;
/// let net = Layer::sequential([LinearConfig::new(4, 8).into(), kiln_fused_ops::layer::swish(1.0)]);
/// let model = kiln_torch::TorchModel::new(&net, Device::Cpu)?;
/// let y = model.forward(&tch::Tensor::ones([2, 4], (tch::Kind::Float, tch::Device::Cpu)))?;
/// assert_eq!(y.size(), [2, 8]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn register_layers() -> Result<()> {
    register_torch_layers();
    #[cfg(feature = "tf")]
    {
        tf::register()?;
        layer::register_tf();
    }
    Ok(())
}

/// [`register_layers`] for libtorch alone: registers the ops with libtorch,
/// makes the fused layers available to the torch backend's models, and
/// registers their ONNX and TorchScript lowerings. It reaches no
/// TensorFlow code, so a binary that calls it rather than `register_layers` (the
/// `kiln` CLI) does not load TensorFlow. Idempotent.
pub fn register_torch_layers() {
    register();
    layer::register_torch();
    layer::register_lowerings();
}

/// The `_GLIBCXX_USE_CXX11_ABI` value the C++ code was compiled with.
pub fn cxx11_abi() -> i32 {
    bridge::ffi::cxx11_abi()
}

/// The number of elements of a shape, computed and validated in C++.
///
/// A negative dimension or an element count beyond `i64` is an
/// [`Error::Backend`] whose source is the C++ exception (its message).
pub fn checked_numel(dims: &[i64]) -> Result<i64> {
    bridge::ffi::checked_numel(dims).map_err(|e| cxx_error("checked_numel", e))
}

/// A C++ exception caught by the bridge, as a Kiln error with the exception as
/// its source.
fn cxx_error(op: &str, exception: cxx::Exception) -> Error {
    Error::backend_with_source("kiln-fused-ops", op, exception)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compiled_with_libtorchs_abi() {
        assert_eq!(cxx11_abi(), i32::from(kiln_build_abi()));
    }

    fn kiln_build_abi() -> u8 {
        // The value kiln-build passed to the compiler, recorded by build.rs.
        env!("KILN_CXX11_ABI").parse().unwrap()
    }

    #[test]
    fn numel_matches_hand_computed_values() {
        assert_eq!(checked_numel(&[]).unwrap(), 1);
        assert_eq!(checked_numel(&[7]).unwrap(), 7);
        assert_eq!(checked_numel(&[2, 0, 5]).unwrap(), 0);
        assert_eq!(checked_numel(&[3, 4, 5]).unwrap(), 60);
    }

    #[test]
    fn exceptions_come_back_as_backend_errors() {
        let err = checked_numel(&[2, -3]).unwrap_err();
        let text = err.display_chain().to_string();
        assert!(matches!(err, Error::Backend { .. }), "{text}");
        assert!(text.contains("dimension 1 is -3, expected >= 0"), "{text}");
        let source = std::error::Error::source(&err);
        assert!(
            source.is_some_and(|e| e.downcast_ref::<cxx::Exception>().is_some()),
            "{err:?}"
        );

        let err = checked_numel(&[i64::MAX, 2])
            .unwrap_err()
            .display_chain()
            .to_string();
        assert!(err.contains("overflows int64 at dimension 1"), "{err}");
    }
}
