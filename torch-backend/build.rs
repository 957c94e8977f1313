//! Puts the native libraries on the rpath of this package's binaries, tests and
//! examples (see kiln-build), and compiles the C++ bridge to libtorch's autocast
//! (src/autocast.rs, src/autocast.cc), which tch does not expose.

fn main() {
    kiln_build::build_script(kiln_build::Native {
        torch: true,
        tensorflow: false,
    });
    kiln_build::TorchOps::new("kiln_torch_bridge")
        .bridge("src/autocast.rs")
        .bridge_source("src/autocast.cc")
        .compile()
        .unwrap_or_else(|e| {
            println!("cargo:warning=kiln-torch: {e}");
            std::process::exit(1);
        });
    println!("cargo:rerun-if-changed=include/autocast.h");
}
