//! Compiles the C++ ops with cc against libtorch (flags from kiln-build), generates
//! the cxx bridge, and links the ops a second time as `libkiln_fused_ops.so` for Python;
//! compiles the TensorFlow ops against TensorFlow's headers and libraries (feature `tf`).

fn main() {
    kiln_build::build_script(kiln_build::Native {
        torch: true,
        tensorflow: false,
    });
    let ops = kiln_build::TorchOps::new("kiln_fused_ops")
        .bridge("src/bridge.rs")
        .bridge_source("src/ops.cc")
        .op_source("src/torch_ops.cc")
        .cuda_source("src/cuda/kernels.cu")
        .cuda_source("src/cuda_ops.cc")
        .compile()
        .unwrap_or_else(|e| {
            println!("cargo:warning=kiln-fused-ops: {}", e.display_chain());
            std::process::exit(1);
        });
    // Some: there are op sources to link for Python.
    if let Some(library) = &ops.shared_library {
        println!(
            "cargo:rustc-env=KILN_FUSED_OPS_TORCH_LIBRARY={}",
            library.display()
        );
    }
    for path in ["include/ops.h", "include/kernels.h"] {
        println!("cargo:rerun-if-changed={path}");
    }
    // The same kernels as TensorFlow ops with gradients (src/tf.rs), against the
    // TensorFlow that kiln-tf links (DEP_KILN_TF_TENSORFLOW_LIB); feature `tf`.
    if std::env::var_os("CARGO_FEATURE_TF").is_none() {
        return;
    }
    kiln_build::TfOps::new("kiln_tf_ops")
        .bridge("src/tf.rs")
        .op_source("src/tf_ops.cc")
        .op_source("src/tf/gradients.cc")
        // Not linked whole, hidden visibility, no static initialiser: a binary that
        // never reaches `kiln_fused_ops::tf::register` (the `kiln` CLI, which calls
        // `register_torch_layers`) does not load TensorFlow.
        .link_whole(false)
        .compile()
        .unwrap_or_else(|e| {
            println!("cargo:warning=kiln-fused-ops: {}", e.display_chain());
            std::process::exit(1);
        });
    for path in ["src/tf/register.h", "src/tf/gradients.h"] {
        println!("cargo:rerun-if-changed={path}");
    }
}
