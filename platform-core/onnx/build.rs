//! Generates the ONNX protobuf types from the `onnx.proto` that the pinned
//! `onnx` wheel ships (proto2), with `protox` (a protobuf compiler in Rust, so
//! no `protoc` binary is needed) and `prost-build`; and tells the crate where the
//! `onnxruntime` wheel's `libonnxruntime.so` is, for `OnnxModel` to load at run
//! time (`KILN_ONNXRUNTIME_LIB` overrides both at build time; `ORT_DYLIB_PATH`
//! overrides the library at run time).

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=KILN_ONNX_PROTO");
    println!("cargo:rerun-if-env-changed=KILN_ONNXRUNTIME_LIB");
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let onnx = kiln_build::Onnx::find_from(&manifest).unwrap_or_else(|e| {
        println!("cargo:warning=kiln-onnx: {}", e.display_chain());
        std::process::exit(1);
    });
    println!("cargo:rerun-if-changed={}", onnx.proto.display());
    let include = onnx.proto.parent().expect("a file has a parent");
    let descriptors = protox::compile([&onnx.proto], [include]).unwrap_or_else(|e| {
        println!(
            "cargo:warning=kiln-onnx: compiling {}: {e}",
            onnx.proto.display()
        );
        std::process::exit(1);
    });
    prost_build::Config::new()
        .compile_fds(descriptors)
        .unwrap_or_else(|e| {
            println!("cargo:warning=kiln-onnx: generating the ONNX types: {e}");
            std::process::exit(1);
        });
    println!(
        "cargo:rustc-env=KILN_ONNXRUNTIME_LIB={}",
        onnx.runtime_library.display()
    );
}
