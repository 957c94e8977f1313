//! The pinned versions of everything Kiln links or provisions.

/// libtorch version `tch` 0.24 (`torch-sys` 0.24) is written against.
pub const TORCH_VERSION: &str = "2.11.0";
/// TensorFlow version whose C API the `tensorflow` 0.21 crate is used with.
pub const TENSORFLOW_VERSION: &str = "2.21.0";

/// The `onnx` wheel whose `onnx.proto` Kiln's ONNX types are generated from.
pub const ONNX_VERSION: &str = "1.23.2";
/// The `onnxruntime` wheel whose `libonnxruntime.so` runs ONNX models in Kiln.
pub const ONNXRUNTIME_VERSION: &str = "1.31.1";

/// The Python packages of the project virtualenv, exactly pinned.
///
/// torch and tensorflow-cpu carry the native libraries; scikit-learn ships the
/// UCI digits data set; onnx ships `onnx.proto` (Kiln's ONNX types are
/// generated from it) and checks exported models in tests; onnxruntime ships
/// `libonnxruntime.so` (`OnnxModel`); safetensors reads and writes checkpoints in
/// reference scripts; tensorboard reads back the event files Kiln writes;
/// torchvision (with pillow) is the reference for image decoding, transforms and
/// `ImageFolder`, and the data-loading benchmark's Python side; transformers and
/// tokenizers are the reference for the Hugging Face model families, their
/// checkpoints (`save_pretrained`/`from_pretrained`), tokenizers and generation
/// (tiny models made locally: nothing is downloaded at test time); trl is the reference
/// for supervised fine-tuning's data (`SFTTrainer`'s tokenized conversations, labels and
/// packing) and the preference trainers. cuda-toolkit
/// gives nvcc (`nvidia/cu13/bin/nvcc`, CUDA 13.0, the toolkit torch's `+cu130`
/// wheel was built with) and the CUDA C++ headers, for kiln-fused-ops' `cuda` feature,
/// which compiles without a GPU. Its extras pin every piece to 13.0: nvcc alone
/// pulls the newest nvvm and crt, whose PTX ptxas 13.0 rejects (`Unsupported
/// .version 9.5`), and without cccl, `cuda_fp16.h` (which libtorch's headers
/// include) misses `<nv/target>`. Changing this list re-provisions the virtualenv.
pub const PYTHON_REQUIREMENTS: &[&str] = &[
    "torch==2.11.0",
    "tensorflow-cpu==2.21.0",
    "scikit-learn==1.9.1",
    "onnx==1.23.2",
    "onnxruntime==1.31.1",
    "safetensors==0.8.0",
    "tensorboard==2.21.0",
    "torchvision==0.26.0",
    "pillow==13.0.0",
    "transformers==5.23.0",
    "tokenizers==0.23.3",
    "peft==0.21.2",
    "datasets==5.2.0",
    "trl==1.16.0",
    "cuda-toolkit[nvcc,nvvm,crt,cccl]==13.0.2",
];

/// Disk space the virtualenv takes once installed, rounded up, in GB.
pub const VENV_SIZE_GB: u64 = 7;

/// `_GLIBCXX_USE_CXX11_ABI` of the libtorch and TensorFlow 2.x wheels; C++ that
/// exchanges standard-library types with them must be compiled with the same value.
pub const CXX11_ABI: u8 = 1;
