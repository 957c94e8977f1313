//! Puts libtorch on the rpath of this package's binaries and tests (see
//! kiln-build) and compiles the bridge to libtorch's c10d (src/bridge.rs,
//! src/c10d.cc, with Kiln's own declarations of Gloo's API in include/gloo-api);
//! NCCL's half (src/nccl.cc) with the CUDA headers under the `cuda` feature.

fn main() {
    kiln_build::build_script(kiln_build::Native {
        torch: true,
        tensorflow: false,
    });
    let mut bridge = kiln_build::TorchOps::new("kiln_c10d_bridge")
        .bridge("src/bridge.rs")
        .bridge_source("src/c10d.cc")
        .include("include/gloo-api");
    bridge = if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        bridge.cuda_source("src/nccl.cc")
    } else {
        bridge.bridge_source("src/no_nccl.cc")
    };
    bridge.compile().unwrap_or_else(|e| {
        println!("cargo:warning=kiln-c10d: {}", e.display_chain());
        std::process::exit(1);
    });
    for header in ["c10d.h", "c10d_nccl.h"] {
        println!("cargo:rerun-if-changed=include/{header}");
    }
}
