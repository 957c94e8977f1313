//! Compiler settings for C++ that links against libtorch or TensorFlow.

use crate::versions::CXX11_ABI;

/// Sets C++17, position-independent code, warnings, and libtorch's
/// `_GLIBCXX_USE_CXX11_ABI` on a `cc` build, and records the ABI value for the
/// crate as the compile-time variable `KILN_CXX11_ABI`.
pub fn configure_cxx(build: &mut cc::Build) {
    build
        .cpp(true)
        .std("c++17")
        .pic(true)
        .warnings(true)
        .define("_GLIBCXX_USE_CXX11_ABI", CXX11_ABI.to_string().as_str());
    println!("cargo:rustc-env=KILN_CXX11_ABI={CXX11_ABI}");
}
