//! Links libtorch (rpath), compiles the C++ glue (src/glue/: the autograd kernel
//! and error plumbing the stable C ABI lacks, against libtorch's full headers)
//! and generates the bindings to libtorch's stable C ABI
//! (`torch/csrc/stable/c/shim.h`) from the same libtorch's headers.

use std::path::PathBuf;

fn main() {
    kiln_build::build_script(kiln_build::Native {
        torch: true,
        tensorflow: false,
    });
    if let Err(e) = glue_and_bindings() {
        println!(
            "cargo:warning=kiln-torch-op: {}",
            kiln_build::ErrorChain::new(&*e)
        );
        std::process::exit(1);
    }
}

fn glue_and_bindings() -> Result<(), Box<dyn std::error::Error>> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let glue = manifest.join("src/glue");
    // A bridge source only (no op sources): linked whole into this crate's
    // archive, so into every binary and cdylib that uses the crate.
    let torch = kiln_build::TorchOps::new("kiln_torch_op_glue")
        .bridge_source(glue.join("kiln_torch_op.cc"))
        .include(&glue)
        .compile()?;
    println!(
        "cargo:rerun-if-changed={}",
        glue.join("kiln_torch_op.h").display()
    );
    // After the archive, so the linker sees its references first. With the `tch`
    // feature torch-sys links these too; without it (a cdylib for Python) this
    // crate is what links libtorch.
    for lib in ["torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }

    let layout = kiln_build::Layout::find_from(&manifest)
        .ok_or("kiln-torch-op is built outside the Kiln workspace (no layout found)")?;
    let include = torch
        .libtorch_lib
        .parent()
        .ok_or("libtorch's lib/ directory has no parent")?
        .join("include");
    let mut builder = kiln_build::bindgen_builder(&layout, &[include, glue], true)?
        .header_contents(
            "kiln_torch_op_wrapper.h",
            "#include <torch/csrc/stable/c/shim.h>\n#include <torch/headeronly/version.h>\n\
             #include \"kiln_torch_op.h\"\n",
        )
        // The Rust side raises a kernel's error by calling this C++ function,
        // whose exception unwinds through the calling Rust frame.
        .override_abi(bindgen::Abi::CUnwind, "kiln_torch_op_throw");
    for function in FUNCTIONS {
        builder = builder.allowlist_function(function);
    }
    for var in VARS {
        builder = builder.allowlist_var(var);
    }
    let out = PathBuf::from(std::env::var("OUT_DIR")?).join("torch_stable_abi.rs");
    builder.generate()?.write_to_file(&out)?;
    Ok(())
}

/// Every C function kiln-torch-op calls, and nothing else.
const FUNCTIONS: &[&str] = &[
    // Registration (the stable corollaries of torch::Library).
    "aoti_torch_library_init_fragment",
    "aoti_torch_library_init_impl",
    "aoti_torch_library_def",
    "torch_library_impl",
    // Tensor queries.
    "aoti_torch_get_dtype",
    "aoti_torch_get_device_type",
    "aoti_torch_get_device_index",
    "aoti_torch_get_dim",
    "aoti_torch_get_sizes",
    "aoti_torch_is_contiguous",
    "aoti_torch_get_data_ptr",
    // Tensor lifetime and allocation.
    "aoti_torch_empty_strided",
    "aoti_torch_new_tensor_handle",
    "aoti_torch_delete_tensor_object",
    "torch_call_dispatcher",
    "aoti_torch_memory_format_contiguous_format",
    // dtypes (the two a kernel reads, and those named in errors).
    "aoti_torch_dtype_float32",
    "aoti_torch_dtype_float64",
    "aoti_torch_dtype_float16",
    "aoti_torch_dtype_bfloat16",
    "aoti_torch_dtype_int64",
    "aoti_torch_dtype_int32",
    "aoti_torch_dtype_int16",
    "aoti_torch_dtype_int8",
    "aoti_torch_dtype_uint8",
    "aoti_torch_dtype_bool",
    "aoti_torch_dtype_complex64",
    "aoti_torch_dtype_complex128",
    // Device types.
    "aoti_torch_device_type_cpu",
    "aoti_torch_device_type_cuda",
    "aoti_torch_device_type_meta",
    // libtorch's intra-op thread pool.
    "torch_parallel_for",
    // src/glue/kiln_torch_op.h
    "kiln_torch_op_throw",
    "kiln_torch_op_exists",
    "kiln_torch_op_register_autograd",
    "kiln_torch_op_call",
];

/// Constants: libtorch's version (for the version-aware shim functions) and
/// the glue's attribute kinds.
const VARS: &[&str] = &[
    "TORCH_VERSION_MAJOR",
    "TORCH_VERSION_MINOR",
    "TORCH_VERSION_PATCH",
    "TORCH_VERSION_ABI_TAG",
    "KILN_TORCH_OP_ATTR_FLOAT",
    "KILN_TORCH_OP_ATTR_INT",
    "KILN_TORCH_OP_ATTR_BOOL",
];
