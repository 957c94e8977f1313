//! Workload (i): serving a trained model. Latency at batch 1 and throughput at
//! batch 64 of the digits CNN (`examples/configs/digits-cnn.toml`) and a
//! transformer encoder block, run five ways on the same weights and inputs:
//! Kiln's eager `TorchModel`, the TorchScript file Kiln exported run by Kiln's
//! `ScriptModule`, the ONNX file Kiln exported run by ONNX Runtime from Kiln
//! (`OnnxModel`), that ONNX file in Python's `onnxruntime`, and the same model
//! as a PyTorch `nn.Module` (rebuilt from Kiln's definition by
//! `platform-core/tests/reference/model_specs.py`, Kiln's weights loaded).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use kiln::core::backend::TrainBackend;
use kiln::core::export::ExportOptions;
use kiln::core::model::Layer;
use kiln::core::module::Module;
use kiln::onnx::{OnnxExport, OnnxModel};
use kiln::prelude::*;
use kiln::torch::{ScriptModule, TorchBackend};
use serde_json::{json, Value};

use crate::tasks::TaskArgs;
use crate::worker::{median, timed};

pub const DESCRIBE: &str =
    "(i) serving: latency at batch 1 and throughput at batch 64, digits CNN \
     and transformer block, Kiln eager / exported TorchScript / exported ONNX in ONNX Runtime";

pub const VARIANTS: [&str; 5] = [
    "kiln-eager",
    "kiln-torchscript",
    "kiln-onnx",
    "python-onnxruntime",
    "pytorch-eager",
];

/// The models: name, per-sample input shape.
pub const MODELS: [(&str, &[usize]); 2] = [("cnn", &[1, 8, 8]), ("transformer", &[64, 256])];

/// Batch size of the throughput measurement.
pub const BATCH: usize = 64;

/// Calls per timed repeat: (batch 1, batch 64), per model.
pub fn calls(model: &str) -> (usize, usize) {
    match model {
        "cnn" => (500, 40),
        _ => (50, 4),
    }
}

/// The model definition of `name`.
pub fn definition(name: &str) -> Result<Layer> {
    Ok(match name {
        "cnn" => {
            let text = std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/configs/digits-cnn.toml"),
            )?;
            let table: toml::Table = toml::from_str(&text)?;
            table
                .get("model")
                .context("digits-cnn.toml has no [model]")?
                .clone()
                .try_into()?
        }
        _ => Layer::transformer_encoder_block(256, 8, 1024, false, 0.1),
    })
}

/// Builds both models (seed 0), and writes for each: its definition
/// (`NAME.json`), weights (`NAME.safetensors`), the TorchScript and ONNX
/// exports (`NAME.pt`, `NAME.onnx`) and the inputs (`NAME-inputs.safetensors`:
/// `x1` and `x64`).
pub fn prepare(dir: &Path) -> Result<()> {
    for (name, sample) in MODELS {
        let spec = definition(name)?;
        TorchBackend::manual_seed(0);
        let mut model = TorchBackend::build_model(&spec, Device::Cpu)?;
        model.set_mode(Mode::Eval);
        let state = model.state_dict()?;
        std::fs::write(
            dir.join(format!("{name}.json")),
            serde_json::to_string(&spec)?,
        )?;
        state.save_safetensors(dir.join(format!("{name}.safetensors")), &BTreeMap::new())?;
        let shape: Vec<usize> = std::iter::once(1).chain(sample.iter().copied()).collect();
        OnnxExport::new(
            &spec,
            &state,
            &ExportOptions::new(&shape).with_overwrite(true),
        )
        .write(dir.join(format!("{name}.onnx")))?;
        kiln::torch::export_torchscript(
            &model,
            dir.join(format!("{name}.pt")),
            &ExportOptions::default().with_overwrite(true),
        )?;
        let mut inputs = StateDict::new();
        let mut next = crate::xorshift(0x5eed);
        for batch in [1, BATCH] {
            let dims: Vec<usize> = std::iter::once(batch)
                .chain(sample.iter().copied())
                .collect();
            let n: usize = dims.iter().product();
            let values: Vec<f32> = (0..n)
                .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            inputs.insert(format!("x{batch}"), HostTensor::new(values, dims)?);
        }
        inputs.save_safetensors(
            dir.join(format!("{name}-inputs.safetensors")),
            &BTreeMap::new(),
        )?;
    }
    Ok(())
}

/// Runs a Kiln variant: `{model: {latency_us, samples_per_s, checksum}}`.
pub fn worker(variant: &str, a: &TaskArgs) -> Result<Value> {
    let mut out = serde_json::Map::new();
    for (name, _) in MODELS {
        if a.models
            .as_ref()
            .is_some_and(|m| !m.iter().any(|m| m == name))
        {
            continue;
        }
        let (inputs, _) =
            StateDict::load_safetensors(a.dir.join(format!("{name}-inputs.safetensors")))?;
        let (x1, x64) = (
            inputs.get("x1").context("x1")?,
            inputs.get("x64").context("x64")?,
        );
        let (n1, n64) = calls(name);
        let result = match variant {
            "kiln-eager" => {
                let spec = definition(name)?;
                let mut model = TorchBackend::build_model(&spec, Device::Cpu)?;
                let (state, _) =
                    StateDict::load_safetensors(a.dir.join(format!("{name}.safetensors")))?;
                model.load_state_dict(&state)?;
                model.set_mode(Mode::Eval);
                let (t1, t64) = (
                    TorchBackend::from_host(x1, Device::Cpu)?,
                    TorchBackend::from_host(x64, Device::Cpu)?,
                );
                tch::no_grad(|| {
                    measure(a, n1, n64, |batch| {
                        let y = model.forward(if batch == 1 { &t1 } else { &t64 })?;
                        torch_checksum(&y)
                    })
                })?
            }
            "kiln-torchscript" => {
                let mut model = ScriptModule::load(a.dir.join(format!("{name}.pt")), Device::Cpu)?;
                model.eval();
                let (t1, t64) = (
                    kiln::torch::to_tch(x1, Device::Cpu)?,
                    kiln::torch::to_tch(x64, Device::Cpu)?,
                );
                tch::no_grad(|| {
                    measure(a, n1, n64, |batch| {
                        let y = model.forward(if batch == 1 { &t1 } else { &t64 })?;
                        torch_checksum(&y)
                    })
                })?
            }
            "kiln-onnx" => {
                let model = OnnxModel::builder()
                    .intra_threads(a.threads)
                    .load(a.dir.join(format!("{name}.onnx")))?;
                measure(a, n1, n64, |batch| {
                    let y = model.predict(if batch == 1 { x1 } else { x64 })?;
                    checksum(&y)
                })?
            }
            other => anyhow::bail!("{other} is not a Rust variant of the serve workload"),
        };
        out.insert(name.to_owned(), result);
    }
    Ok(Value::Object(out))
}

/// The sum of a host output, as Python's `float(y.sum())` on onnxruntime's
/// output: in place, no copy (in f64, in eight lanes, which vectorise).
fn checksum(y: &HostTensor) -> Result<f64> {
    let mut lanes = [0.0f64; 8];
    let data = y.as_slice::<f32>()?;
    let mut chunks = data.chunks_exact(8);
    for chunk in &mut chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += f64::from(v);
        }
    }
    let rest: f64 = chunks.remainder().iter().map(|&v| f64::from(v)).sum();
    Ok(lanes.iter().sum::<f64>() + rest)
}

/// The sum of a libtorch output, computed by libtorch as PyTorch eager's
/// `float(model(x).sum())` is: the output is not copied out first.
fn torch_checksum(y: &tch::Tensor) -> Result<f64> {
    Ok(y.f_sum(tch::Kind::Double)?.f_double_value(&[])?)
}

/// Median time per call at batch 1 and at batch 64, and the batch-64 output's sum.
fn measure(
    a: &TaskArgs,
    n1: usize,
    n64: usize,
    mut call: impl FnMut(usize) -> Result<f64>,
) -> Result<Value> {
    let mut sum = 0.0;
    let t1 = timed(a.warmup, a.repeats, || {
        for _ in 0..n1 {
            call(1)?;
        }
        Ok(())
    })?;
    let t64 = timed(a.warmup, a.repeats, || {
        for _ in 0..n64 {
            sum = call(BATCH)?;
        }
        Ok(())
    })?;
    ensure!(sum.is_finite(), "the output is not finite");
    let (m1, m64) = (median(t1) / n1 as f64, median(t64) / n64 as f64);
    Ok(json!({
        "latency_us": m1 * 1e6,
        "samples_per_s": BATCH as f64 / m64,
        "checksum": sum,
    }))
}
