//! Times `OnnxModel::predict` on a one-input ONNX model: latency at batch 1 and
//! throughput at batch 64 (by default), each the median of many calls after a
//! warm-up, printed as one JSON line (the benchmark harness's worker format).
//!
//! ```sh
//! cargo run --release -p kiln-onnx --example onnx_predict_timing -- model.onnx \
//!     [--threads N] [--warmup W] [--runs R] [--batches 1,64] [--dim seq=128]
//! ```
//!
//! The input is made from what the file declares: the leading dimension is the
//! batch, other fixed dimensions as declared, other symbolic or unknown ones
//! from `--dim NAME=SIZE` (else 1); float inputs hold a repeating ramp, integer
//! inputs zeros (a valid index for embedding lookups).

use std::collections::BTreeMap;
use std::error::Error;

use kiln_core::HostTensor;
use kiln_onnx::{Dim, OnnxModel, TensorInfo};
use serde_json::json;

/// An input of `info`'s dtype and declared shape, with `batch` rows.
fn example_input(
    info: &TensorInfo,
    batch: usize,
    dims: &BTreeMap<String, usize>,
) -> Result<HostTensor, Box<dyn Error>> {
    let dtype = info.dtype.ok_or_else(|| {
        format!(
            "input '{}' is {}, not a Kiln dtype",
            info.name, info.type_name
        )
    })?;
    let shape: Vec<usize> = info
        .shape
        .iter()
        .enumerate()
        .map(|(axis, d)| match d {
            Dim::Fixed(n) => *n,
            _ if axis == 0 => batch,
            Dim::Symbolic(s) => dims.get(s).copied().unwrap_or(1),
            Dim::Unknown => 1,
        })
        .collect();
    let numel: usize = shape.iter().product();
    let ramp = HostTensor::new(
        (0..numel)
            .map(|i| (i % 17) as f64 / 17.0 - 0.5)
            .collect::<Vec<f64>>(),
        shape.clone(),
    )?;
    Ok(if dtype.is_float() {
        ramp.to_dtype(dtype)
    } else {
        HostTensor::zeros(dtype, shape)?
    })
}

fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let mut path = None;
    let (mut threads, mut warmup, mut runs) = (None, 50usize, 500usize);
    let mut batches = vec![1usize, 64];
    let mut dims = BTreeMap::new();
    while let Some(a) = args.next() {
        let mut value = |flag: &str| args.next().ok_or(format!("{flag} needs a value"));
        match a.as_str() {
            "--threads" => threads = Some(value("--threads")?.parse::<usize>()?),
            "--warmup" => warmup = value("--warmup")?.parse()?,
            "--runs" => runs = value("--runs")?.parse()?,
            "--batches" => {
                batches = value("--batches")?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--dim" => {
                let v = value("--dim")?;
                let (name, size) = v.split_once('=').ok_or("--dim takes NAME=SIZE")?;
                dims.insert(name.to_string(), size.parse::<usize>()?);
            }
            _ if path.is_none() && !a.starts_with("--") => path = Some(a),
            _ => return Err(format!("unexpected argument {a}").into()),
        }
    }
    let path = path.ok_or("usage: onnx_predict_timing MODEL.onnx [--threads N] [--warmup W] [--runs R] [--batches 1,64] [--dim NAME=SIZE]")?;
    let mut builder = OnnxModel::builder();
    if let Some(n) = threads {
        builder = builder.intra_threads(n);
    }
    let model = builder.load(&path)?;
    let [input] = model.inputs() else {
        return Err(format!(
            "{path} has {} inputs; predict needs one",
            model.inputs().len()
        )
        .into());
    };
    let mut results = Vec::new();
    for batch in batches {
        let x = example_input(input, batch, &dims)?;
        let t = model.time_predict(&x, warmup, runs)?;
        results.push(json!({
            "batch": t.batch,
            "input_shape": x.dims(),
            "input_dtype": x.dtype().name(),
            "median_us": t.median_s * 1e6,
            "min_us": t.min_s * 1e6,
            "p90_us": t.p90_s * 1e6,
            "samples_per_s": t.samples_per_s,
        }));
    }
    println!(
        "{}",
        json!({
            "variant": "kiln-onnxruntime",
            "model": path,
            "threads": threads,
            "warmup": warmup,
            "runs": runs,
            "results": results,
        })
    );
    Ok(())
}
