//! libtorch's C++ tensor in `cxx` bridges: the one place where a [`tch::Tensor`]
//! becomes an `at::Tensor` for C++ and back.
//!
//! A bridge (in any crate) declares the C++ type as [`AtTensor`], takes tensors
//! as `&Tensor` (C++ `const at::Tensor&`) and returns new ones as
//! `UniquePtr<Tensor>` (C++ `std::unique_ptr<at::Tensor>`):
//!
//! ```text
//! #[cxx::bridge(namespace = "my_ops")]
//! mod ffi {
//!     unsafe extern "C++" {
//!         include!("my-crate/cpp/bridge.h");
//!
//!         #[namespace = "at"]
//!         type Tensor = kiln_torch::cxx_tensor::AtTensor;
//!
//!         fn my_op(x: &Tensor) -> Result<UniquePtr<Tensor>>;
//!     }
//! }
//!
//! fn my_op(x: &tch::Tensor) -> kiln_core::Result<tch::Tensor> {
//!     use kiln_torch::cxx_tensor::{as_at, from_at};
//!     let out = ffi::my_op(as_at(x))
//!         .map_err(|e| kiln_core::Error::backend_with_source("my-crate", "my_op", e))?;
//!     from_at(out)
//! }
//! ```
//!
//! The C++ side includes `<ATen/core/Tensor.h>` and returns
//! `std::make_unique<at::Tensor>(...)`. No `unsafe` is needed outside this module:
//! [`as_at`] borrows the `at::Tensor` a `tch::Tensor` holds, and [`from_at`] moves
//! the one C++ returned into a `tch::Tensor`. kiln-torch's build script compiles
//! the `std::unique_ptr<at::Tensor>` glue that `UniquePtr<Tensor>` needs, once for
//! every bridge (a bridge that names `AtTensor` under another name does not
//! generate it again).

use std::marker::{PhantomData, PhantomPinned};

use kiln_core::{Error, Result};

/// libtorch's `at::Tensor`, opaque to Rust: only ever behind a reference
/// ([`as_at`]) or a `cxx::UniquePtr` (which [`from_at`] turns into a
/// `tch::Tensor`).
#[repr(C)]
pub struct AtTensor {
    _opaque: [u8; 0],
    // Neither `Send`, `Sync` nor `Unpin`: C++ owns the value and its address.
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

// SAFETY: `AtTensor` is exactly C++'s `at::Tensor` (the type id), and it is opaque
// (zero-sized, `!Unpin`, never built or moved in Rust), which is what
// `cxx::kind::Opaque` requires: Rust only handles it behind references and
// `UniquePtr`.
#[allow(unsafe_code)]
unsafe impl cxx::ExternType for AtTensor {
    type Id = cxx::type_id!("at::Tensor");
    type Kind = cxx::kind::Opaque;
}

impl std::fmt::Debug for AtTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("at::Tensor")
    }
}

/// The `std::unique_ptr<at::Tensor>` glue that `UniquePtr<AtTensor>` needs, compiled
/// here once for every crate's bridges.
#[allow(unsafe_code)]
#[cxx::bridge]
mod bridge {
    // SAFETY: the header declares nothing; it includes libtorch's `at::Tensor`,
    // the type `AtTensor` stands for (`cxx::ExternType` above).
    unsafe extern "C++" {
        include!("kiln-torch/include/cxx_tensor.h");

        #[namespace = "at"]
        type Tensor = super::AtTensor;
    }

    impl UniquePtr<Tensor> {}
}

/// The `at::Tensor` that `tensor` holds, for a bridge function taking `&Tensor`
/// (C++ `const at::Tensor&`), borrowed as long as `tensor`.
pub fn as_at(tensor: &tch::Tensor) -> &AtTensor {
    // SAFETY: a tch `Tensor` owns a `C_tensor` pointer, which is an `at::Tensor`
    // allocated with `new` (torch-sys' `tensor` typedef), non-null and alive until
    // the `Tensor` drops, so for the returned borrow. `AtTensor` is zero-sized, so
    // Rust reads nothing through the reference; C++ sees the `at::Tensor`. It stays
    // shared: bridges take it as `const at::Tensor&` (libtorch may still update the
    // tensor's data in place, as tch's own `&Tensor` methods do).
    #[allow(unsafe_code)]
    unsafe {
        &*tensor.as_ptr().cast::<AtTensor>()
    }
}

/// The tensor a bridge function returned as `UniquePtr<Tensor>` (C++
/// `std::unique_ptr<at::Tensor>`), now owned by a `tch::Tensor`. A null pointer
/// is an [`Error::Backend`].
pub fn from_at(tensor: cxx::UniquePtr<AtTensor>) -> Result<tch::Tensor> {
    if tensor.is_null() {
        return Err(Error::backend(
            "torch",
            "a C++ bridge's result",
            "the C++ function returned a null at::Tensor",
        ));
    }
    let raw = tensor.into_raw();
    // SAFETY: `raw` is a non-null `at::Tensor*` that `std::unique_ptr` owned with the
    // default deleter (so allocated with `new`), released to us by `into_raw`. That
    // is what a tch `C_tensor` is: the new `Tensor` owns it and frees it with
    // `delete` (torch-sys' `at_free`), once.
    #[allow(unsafe_code)]
    let owned = unsafe { tch::Tensor::from_ptr(raw.cast()) };
    Ok(owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_null_result_is_an_error() {
        let err = from_at(cxx::UniquePtr::null()).unwrap_err();
        assert!(matches!(err, Error::Backend { .. }), "{err}");
        assert!(err.display_chain().to_string().contains("null at::Tensor"));
    }

    #[test]
    fn as_at_points_at_the_tensor_tch_holds() {
        let t = tch::Tensor::ones([2], (tch::Kind::Float, tch::Device::Cpu));
        let at: *const AtTensor = as_at(&t);
        assert_eq!(at.cast::<u8>(), t.as_ptr().cast::<u8>());
    }
}
