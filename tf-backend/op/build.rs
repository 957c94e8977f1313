//! Links TensorFlow (rpath), compiles the C++ glue (src/glue/: gradients and
//! attribute reads, against the wheel's C++ headers) and generates the bindings
//! to TensorFlow's C op and kernel API from the same wheel's headers.

use std::path::{Path, PathBuf};

fn main() {
    kiln_build::build_script(kiln_build::Native {
        torch: false,
        tensorflow: true,
    });
    if let Err(e) = bindings() {
        println!(
            "cargo:warning=kiln-tf-op: {}",
            kiln_build::ErrorChain::new(&*e)
        );
        std::process::exit(1);
    }
}

fn bindings() -> Result<(), Box<dyn std::error::Error>> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let glue = manifest.join("src/glue");
    let tf = kiln_build::TfOps::new("kiln_tf_op_glue")
        .op_source(glue.join("gradient.cc"))
        .include(&glue)
        // Called from Rust only (no static registration): linked where it is reached,
        // so a binary that never registers a TensorFlow op does not load TensorFlow.
        .link_whole(false)
        .compile()?;
    println!(
        "cargo:rerun-if-changed={}",
        glue.join("kiln_tf_op.h").display()
    );

    let layout = kiln_build::Layout::find_from(&manifest)
        .ok_or("kiln-tf-op is built outside the Kiln workspace (no layout found)")?;
    let header = |name: &str| format!("#include \"{name}\"\n");
    // kiln_tf_op.h first: it makes tensorflow/c/ops.h valid C.
    let wrapper = [
        "kiln_tf_op.h",
        "tensorflow/c/kernels.h",
        "tensorflow/c/ops.h",
        "tensorflow/c/tf_status.h",
        "tensorflow/c/tf_tensor.h",
        "tensorflow/c/tf_datatype.h",
    ]
    .map(header)
    .concat();
    let mut builder =
        kiln_build::bindgen_builder(&layout, &[tf.tensorflow_include.clone(), glue], false)?
            .header_contents("kiln_tf_op_wrapper.h", &wrapper)
            .prepend_enum_name(false)
            .default_enum_style(bindgen::EnumVariation::Consts)
            .allowlist_type("TF_DataType")
            .allowlist_type("TSL_Code");
    for function in FUNCTIONS {
        builder = builder.allowlist_function(function);
    }
    let out = PathBuf::from(std::env::var("OUT_DIR")?).join("tf_c_api.rs");
    builder.generate()?.write_to_file(Path::new(&out))?;
    Ok(())
}

/// Every C function kiln-tf-op calls, and nothing else.
const FUNCTIONS: &[&str] = &[
    // ops.h: op definitions and shape inference
    "TF_NewOpDefinitionBuilder",
    "TF_OpDefinitionBuilderAddInput",
    "TF_OpDefinitionBuilderAddOutput",
    "TF_OpDefinitionBuilderAddAttr",
    "TF_OpDefinitionBuilderSetShapeInferenceFunction",
    "TF_RegisterOpDefinition",
    "TF_ShapeInferenceContextGetInput",
    "TF_ShapeInferenceContextRankKnown",
    "TF_ShapeInferenceContextRank",
    "TF_ShapeInferenceContextDim",
    "TF_ShapeInferenceContextSetUnknownShape",
    "TF_NewShapeHandle",
    "TF_DeleteShapeHandle",
    "TF_NewDimensionHandle",
    "TF_DeleteDimensionHandle",
    "TF_DimensionHandleValueKnown",
    "TF_DimensionHandleValue",
    // kernels.h: kernels
    "TF_NewKernelBuilder",
    "TF_KernelBuilder_TypeConstraint",
    "TF_DeleteKernelBuilder",
    "TF_RegisterKernelBuilder",
    "TF_OpKernelConstruction_GetAttrFloat",
    "TF_OpKernelConstruction_GetAttrInt64",
    "TF_OpKernelConstruction_GetAttrBool",
    "TF_OpKernelConstruction_Failure",
    "TF_NumInputs",
    "TF_GetInput",
    "TF_AllocateOutput",
    "TF_OpKernelContext_Failure",
    // tf_status.h
    "TF_NewStatus",
    "TF_DeleteStatus",
    "TF_SetStatus",
    "TF_GetCode",
    "TF_Message",
    // tf_tensor.h
    "TF_TensorType",
    "TF_NumDims",
    "TF_Dim",
    "TF_TensorData",
    "TF_TensorElementCount",
    "TF_DeleteTensor",
    // src/glue/kiln_tf_op.h
    "kiln_tf_op_is_registered",
    "kiln_tf_op_register_gradient",
    "kiln_tf_op_shape_attr",
    "kiln_tf_op_set_output_shape",
];
