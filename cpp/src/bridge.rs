//! The cxx bridge: private; the crate exposes safe wrappers only.

#[cxx::bridge(namespace = "kiln::ops")]
pub(crate) mod ffi {
    // SAFETY: the declarations match include/ops.h exactly (cxx checks the
    // signatures at compile time); the functions take only values and slices
    // borrowed for the call, and every one that can throw returns `Result`.
    unsafe extern "C++" {
        include!("kiln-ops/include/ops.h");

        fn cxx11_abi() -> i32;
        fn checked_numel(dims: &[i64]) -> Result<i64>;
    }
}
