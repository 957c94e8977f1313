//! The example's ops written in Rust (`../../src/ops.rs`: squared ReLU, a fused
//! RMSNorm and Swish-β, each with its gradient op) as a shared library for
//! Python's torch: loading it registers them in libtorch.
//!
//! ```python
//! import torch
//! torch.ops.load_library("target/release/libkiln_example_rust_op_torch.so")
//! y = torch.ops.example_rs.rms_norm(x, weight, eps=1e-6)  # autograd through rms_norm_backward
//! ```
//!
//! Build it with `cargo build --release -p kiln-example-rust-op-torch`.

#[path = "../../src/ops.rs"]
mod ops;

kiln_torch_op::torch_library!(
    ops::SquaredRelu,
    ops::SquaredReluBackward,
    ops::RmsNorm,
    ops::RmsNormBackward,
    ops::Swish,
    ops::SwishBackward,
);
