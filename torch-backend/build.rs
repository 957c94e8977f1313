//! Puts the native libraries on the rpath of this package's binaries, tests and
//! examples (see kiln-build), and compiles the C++ bridges to what tch does not
//! expose: libtorch's autocast (src/autocast.rs, src/autocast.cc) and its fused Adam
//! kernels (src/optim/fused.rs, src/optim/fused.cc).

fn main() {
    kiln_build::build_script(kiln_build::Native {
        torch: true,
        tensorflow: false,
    });
    kiln_build::TorchOps::new("kiln_torch_bridge")
        .bridge("src/autocast.rs")
        .bridge_source("src/autocast.cc")
        .bridge("src/optim/fused.rs")
        .bridge_source("src/optim/fused.cc")
        .compile()
        .unwrap_or_else(|e| {
            println!("cargo:warning=kiln-torch: {e}");
            std::process::exit(1);
        });
    println!("cargo:rerun-if-changed=include/autocast.h");
    println!("cargo:rerun-if-changed=include/fused_adam.h");
}
