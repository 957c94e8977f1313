//! Workload (f): each fused op, forward and backward, against the composition
//! of built-in ops: Kiln's C++ kernels (kiln-fused-ops), the same ops' kernels written
//! in Rust (`examples/rust-op`, registered through libtorch's stable C ABI by
//! kiln-torch-op), and PyTorch.

use anyhow::Result;
use serde_json::{json, Value};
use tch::{Kind, Reduction, Tensor};

use crate::tasks::{synchronize, TaskArgs};
use crate::worker::{median, timed};

/// The example's Rust ops, compiled into the benchmark (the file depends on kiln-custom-op alone).
#[path = "../../examples/rust-op/src/ops.rs"]
#[allow(dead_code)]
mod rust_ops;

/// The variants: Kiln's C++ kernels, Kiln's Rust kernels, Kiln calling the
/// built-in composition, and the Python side's two.
pub const VARIANTS: [&str; 5] = [
    "kiln-fused",
    "kiln-rust",
    "kiln-composed",
    "pytorch-fused",
    "pytorch-composed",
];

/// The ops, in table order.
const OPS: [&str; 5] = [
    "bias_gelu",
    "softmax_xent",
    "swish",
    "squared_relu",
    "rms_norm",
];

/// Calls per timed repeat of each op (forward and backward).
pub const CALLS: usize = 50;
/// Rows of the inputs, and their feature / class counts.
const ROWS: i64 = 512;
const FEATURES: i64 = 1024;
const CLASSES: i64 = 1000;
const SMOOTHING: f64 = 0.1;
const RMS_EPS: f64 = rust_ops::RMS_NORM_EPS;

/// How a variant computes an op.
#[derive(Clone, Copy, PartialEq)]
pub enum Kernels {
    /// kiln-fused-ops' C++ kernels.
    Cpp,
    /// The Rust kernels of examples/rust-op.
    Rust,
    /// The composition of libtorch's built-in ops.
    Composed,
}

/// Registers the Rust ops in libtorch (once per worker process).
fn register_rust_ops() -> Result<()> {
    use rust_ops::*;
    kiln::torch_op::register::<SquaredRelu>()?;
    kiln::torch_op::register::<SquaredReluBackward>()?;
    kiln::torch_op::register::<RmsNorm>()?;
    kiln::torch_op::register::<RmsNormBackward>()?;
    kiln::torch_op::register::<Swish>()?;
    kiln::torch_op::register::<SwishBackward>()?;
    Ok(())
}

/// Forward and backward of every op that `kernels` has, in microseconds per call.
pub fn run(a: &TaskArgs, kernels: Kernels) -> Result<Value> {
    tch::manual_seed(0);
    let device = kiln::torch::device_to_tch(a.device)?;
    if kernels == Kernels::Rust {
        if device != tch::Device::Cpu {
            // The Rust kernels are CPU kernels: nothing to time on a GPU.
            return Ok(json!({ "ops_us": {} }));
        }
        register_rust_ops()?;
    }
    let opts = (Kind::Float, device);
    let x = Tensor::f_randn([ROWS, FEATURES], opts)?.set_requires_grad(true);
    let bias = Tensor::f_randn([FEATURES], opts)?.set_requires_grad(true);
    let weight = Tensor::f_randn([FEATURES], opts)?.set_requires_grad(true);
    let beta = Tensor::f_ones([1], opts)?.set_requires_grad(true);
    let logits = Tensor::f_randn([ROWS, CLASSES], opts)?.set_requires_grad(true);
    let target = Tensor::f_randint(CLASSES, [ROWS], (Kind::Int64, device))?;
    let no_attrs = kiln_custom_op::Attrs::default();
    let rms_attrs =
        kiln_custom_op::Attrs::defaults(&<rust_ops::RmsNorm as kiln_custom_op::CustomOp>::schema());
    let rust = |op: &str, inputs: &[&Tensor], attrs: &kiln_custom_op::Attrs| -> Result<Tensor> {
        Ok(kiln::torch_op::call(&format!("example_rs::{op}"), inputs, attrs)?.remove(0))
    };
    let mut out = serde_json::Map::new();
    for op in OPS {
        let call = || -> Result<Option<Tensor>> {
            Ok(Some(match (op, kernels) {
                ("bias_gelu", Kernels::Cpp) => kiln::fused_ops::bias_gelu(&x, &bias)?,
                ("bias_gelu", Kernels::Composed) => x.f_add(&bias)?.f_gelu("none")?,
                ("softmax_xent", Kernels::Cpp) => {
                    kiln::fused_ops::softmax_cross_entropy(&logits, &target, SMOOTHING)?
                }
                ("softmax_xent", Kernels::Composed) => logits.f_cross_entropy_loss::<Tensor>(
                    &target,
                    None,
                    Reduction::None,
                    -100,
                    SMOOTHING,
                )?,
                ("swish", Kernels::Cpp) => kiln::fused_ops::swish(&x, &beta)?,
                ("swish", Kernels::Rust) => rust("swish", &[&x, &beta], &no_attrs)?,
                ("swish", Kernels::Composed) => x.f_mul(&beta.f_mul(&x)?.f_sigmoid()?)?,
                ("squared_relu", Kernels::Rust) => rust("squared_relu", &[&x], &no_attrs)?,
                ("squared_relu", Kernels::Composed) => x.f_relu()?.f_square()?,
                ("rms_norm", Kernels::Rust) => rust("rms_norm", &[&x, &weight], &rms_attrs)?,
                ("rms_norm", Kernels::Composed) => {
                    let ms = x.f_square()?.f_mean_dim(-1, true, Kind::Float)?;
                    x.f_mul(&ms.f_add_scalar(RMS_EPS)?.f_rsqrt()?)?
                        .f_mul(&weight)?
                }
                // This kind of kernel does not exist for this op.
                _ => return Ok(None),
            }))
        };
        if call()?.is_none() {
            continue;
        }
        let times = timed(a.warmup, a.repeats, || {
            for _ in 0..CALLS {
                if let Some(y) = call()? {
                    y.f_sum(Kind::Float)?.f_backward()?;
                }
            }
            synchronize(a.device);
            Ok(())
        })?;
        out.insert(op.to_owned(), json!(median(times) / CALLS as f64 * 1e6));
    }
    Ok(json!({ "ops_us": out }))
}

/// The workload's table, from the variants' results (`ok(variant)`).
pub fn table<'a>(ok: impl Fn(&str) -> Option<&'a Value>) -> String {
    let mut t = format!(
        "Microseconds per call of forward and backward ({CALLS} calls per repeat); \
         inputs [{ROWS}, {FEATURES}] float32 (logits [{ROWS}, {CLASSES}], label smoothing \
         {SMOOTHING}). `kiln-fused` is kiln-fused-ops' C++ kernel, `kiln-rust` the Rust kernel of \
         `examples/rust-op` (registered through libtorch's stable C ABI), `composed` is \
         `F.gelu(x + b)`, `F.cross_entropy(..., label_smoothing)`, `x * sigmoid(beta * x)`, \
         `relu(x).square()` and `x * rsqrt(mean(x^2, -1) + 1e-6) * w`; `pytorch-fused` is \
         kiln-fused-ops' library in Python, and PyTorch's own `F.rms_norm` for rms_norm.\n\n\
         | op | kiln-fused (C++) | kiln-rust | kiln-composed | pytorch-fused | pytorch-composed | C++ vs composed (Kiln) | Rust vs composed (Kiln) | Rust vs C++ | Kiln fastest vs PyTorch composed |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    );
    for op in OPS {
        let us = |v: &str| ok(v).and_then(|r| r["ops_us"][op].as_f64());
        let cell = |v: &str| us(v).map_or("-".to_owned(), |x| format!("{x:.0}"));
        let speedup = |fast: Option<f64>, slow: Option<f64>| match (fast, slow) {
            (Some(f), Some(s)) => format!("{:.2}x", s / f),
            _ => "-".to_owned(),
        };
        let fastest = [us("kiln-fused"), us("kiln-rust")]
            .into_iter()
            .flatten()
            .reduce(f64::min);
        t += &format!(
            "| {op} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            cell("kiln-fused"),
            cell("kiln-rust"),
            cell("kiln-composed"),
            cell("pytorch-fused"),
            cell("pytorch-composed"),
            speedup(us("kiln-fused"), us("kiln-composed")),
            speedup(us("kiln-rust"), us("kiln-composed")),
            speedup(us("kiln-rust"), us("kiln-fused")),
            speedup(fastest, us("pytorch-composed")),
        );
    }
    t
}
