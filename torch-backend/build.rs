//! Puts the native libraries on the rpath of this package's binaries, tests and
//! examples (see kiln-build), and compiles the C++ bridges to what tch does not
//! expose: the `at::Tensor` glue every crate's bridges share (src/cxx_tensor.rs),
//! libtorch's autocast (src/autocast.rs, src/autocast.cc), its fused Adam kernels
//! (src/optim/fused.rs, src/optim/fused.cc), TorchScript buffers
//! (src/script/bridge.rs, src/script/bridge.cc), TorchScript export
//! (src/script/export_bridge.rs, src/script/export.cc), activation checkpointing
//! (src/checkpoint.rs, src/checkpoint.cc), sharded units (src/sharded_unit.rs,
//! src/sharded_unit.cc), the profiler (src/profile/bridge.rs, src/profile/profiler.cc) and, with the `cuda` feature, CUDA
//! graphs (src/graph/bridge.rs, src/graph/cuda_graph.cc, built with the CUDA headers).
//! libtorch's distributed engine, c10d, is the `kiln-c10d` crate's.

fn main() {
    kiln_build::build_script(kiln_build::Native {
        torch: true,
        tensorflow: false,
    });
    let mut bridges = kiln_build::TorchOps::new("kiln_torch_bridge")
        .bridge("src/cxx_tensor.rs")
        .bridge("src/autocast.rs")
        .bridge_source("src/autocast.cc")
        .bridge("src/script/bridge.rs")
        .bridge_source("src/script/bridge.cc")
        .bridge("src/script/export_bridge.rs")
        .bridge_source("src/script/export.cc")
        .bridge("src/optim/fused.rs")
        .bridge_source("src/optim/fused.cc")
        .bridge("src/checkpoint.rs")
        .bridge_source("src/checkpoint.cc")
        .bridge("src/sharded_unit.rs")
        .bridge_source("src/sharded_unit.cc")
        .bridge("src/profile/bridge.rs")
        .bridge_source("src/profile/profiler.cc");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        // The graph's C++ needs the CUDA headers: a CUDA source (compiled only with
        // the feature, which also links torch_cuda, c10_cuda and the CUDA runtime).
        bridges = bridges
            .bridge("src/graph/bridge.rs")
            .cuda_source("src/graph/cuda_graph.cc");
    }
    bridges.compile().unwrap_or_else(|e| {
        println!("cargo:warning=kiln-torch: {}", e.display_chain());
        std::process::exit(1);
    });
    for header in [
        "cxx_tensor.h",
        "autocast.h",
        "fused_adam.h",
        "cuda_graph.h",
        "script.h",
        "script_export.h",
        "activation_checkpoint.h",
        "sharded_unit.h",
        "profiler.h",
    ] {
        println!("cargo:rerun-if-changed=include/{header}");
    }
}
