//! Compiles the C++ ops with cc (flags from kiln-build) and generates the cxx bridge.

fn main() {
    let mut build = cxx_build::bridge("src/bridge.rs");
    kiln_build::configure_cxx(&mut build);
    build.file("src/ops.cc").compile("kiln_ops");
    for path in ["src/bridge.rs", "src/ops.cc", "include/ops.h"] {
        println!("cargo:rerun-if-changed={path}");
    }
}
