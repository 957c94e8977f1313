//! Step 1 of adding an op: compile its C++ with kiln-build's helper, which sets
//! C++17, libtorch's ABI flag and include paths, generates the cxx bridge, links
//! the archive whole (so `TORCH_LIBRARY` registrations survive) and also builds
//! `libsquared_relu.so` for Python's `torch.ops.load_library`. The TensorFlow op
//! (step 5) is compiled the same way with `TfOps`, against the tensorflow-cpu
//! wheel's headers and libraries.

fn main() {
    // The libraries' directories on the binaries' rpath.
    kiln_build::build_script(kiln_build::Native {
        torch: true,
        tensorflow: true,
    });
    let ops = kiln_build::TorchOps::new("squared_relu")
        .bridge("src/ffi.rs")
        .bridge_source("cpp/bridge.cc")
        .op_source("cpp/squared_relu.cc")
        .compile()
        .unwrap_or_else(|e| {
            println!("cargo:warning={}", e.display_chain());
            std::process::exit(1);
        });
    // Some: there are op sources to link for Python.
    if let Some(library) = &ops.shared_library {
        println!("cargo:rustc-env=SQUARED_RELU_LIBRARY={}", library.display());
    }
    println!("cargo:rerun-if-changed=cpp/bridge.h");

    kiln_build::TfOps::new("squared_relu_tf")
        .bridge("src/tf_ffi.rs")
        .op_source("cpp/squared_relu_tf.cc")
        .compile()
        .unwrap_or_else(|e| {
            println!("cargo:warning={}", e.display_chain());
            std::process::exit(1);
        });
    println!("cargo:rerun-if-changed=cpp/squared_relu_tf.h");
}
