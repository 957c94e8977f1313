//! kiln-data's vision transforms against torchvision 0.26 (`transforms.v2` on
//! tensors), on the same pixels. One Python run computes every reference
//! (`tests/reference/vision_parity.py`).
//!
//! Run with `KILN_REQUIRE_REFERENCES=1 cargo test -p kiln-data --test
//! vision_parity -- --nocapture` to see the table of largest differences.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_core::{DType, HostTensor};
use kiln_data::{Transform, TransformRng};
use kiln_vision::transforms::{
    adjust_brightness, adjust_contrast, adjust_hue, adjust_saturation, center_crop, crop, hflip,
    resize, resized_crop, to_tensor, ColorJitter, JitterOp, RandomResizedCrop, ResizeTo,
};
use kiln_vision::Normalize;
use serde_json::{json, Value};

/// A photo-like test image `[channels, height, width]`: smooth gradients, a
/// disc and a bar with hard edges, and noise, different in every channel.
fn photo(channels: usize, height: usize, width: usize, seed: u64) -> HostTensor {
    let noise = kiln_testkit::noise(channels * height * width, seed);
    let mut px = Vec::with_capacity(channels * height * width);
    for c in 0..channels {
        for y in 0..height {
            for x in 0..width {
                let (fy, fx) = (y as f32 / height as f32, x as f32 / width as f32);
                let mut v = 40.0 + 120.0 * fx * (c as f32 + 1.0) / 3.0 + 60.0 * fy;
                let (dy, dx) = (fy - 0.45, fx - 0.55);
                if dy * dy + dx * dx < 0.06 {
                    v = 230.0 - 50.0 * c as f32;
                }
                if (x + 2 * y) % 17 < 3 {
                    v *= 0.3;
                }
                v += 25.0 * noise[(c * height + y) * width + x];
                px.push(v.clamp(0.0, 255.0) as u8);
            }
        }
    }
    HostTensor::new(px, [channels, height, width]).expect("image")
}

/// The cases: an input, a torchvision op with its arguments, and Kiln's result.
struct Cases {
    inputs: BTreeMap<String, HostTensor>,
    cases: Vec<(String, String, String, Value, HostTensor)>,
}

impl Cases {
    fn add(&mut self, name: String, input: &str, op: &str, args: Value, kiln: HostTensor) {
        self.cases
            .push((name, input.to_string(), op.to_string(), args, kiln));
    }
}

fn write_inputs(dir: &Path, cases: &Cases) -> Value {
    let mut meta = serde_json::Map::new();
    for (name, t) in &cases.inputs {
        std::fs::write(dir.join(format!("{name}.bin")), t.as_bytes()).expect("write input");
        let dtype = if t.dtype() == DType::U8 {
            "uint8"
        } else {
            "float32"
        };
        meta.insert(name.clone(), json!({"dtype": dtype, "shape": t.dims()}));
    }
    Value::Object(meta)
}

/// The largest absolute difference between Kiln's tensor and the reference's
/// raw output; panics on a shape or dtype mismatch.
fn compare(name: &str, kiln: &HostTensor, dir: &Path, meta: &Value) -> f64 {
    let shape: Vec<usize> = serde_json::from_value(meta["shape"].clone()).expect("shape");
    assert_eq!(kiln.dims(), &shape[..], "{name}: shape");
    let bytes = std::fs::read(dir.join(format!("{name}.out"))).expect("reference output");
    let dtype = meta["dtype"].as_str().expect("dtype");
    let expected = match dtype {
        "uint8" => HostTensor::from_bytes(DType::U8, shape, &bytes),
        "float32" => HostTensor::from_bytes(DType::F32, shape, &bytes),
        other => panic!("{name}: unexpected reference dtype {other}"),
    }
    .expect("reference tensor");
    assert_eq!(kiln.dtype(), expected.dtype(), "{name}: dtype");
    kiln_testkit::max_abs_diff(&kiln.to_f64_vec(), &expected.to_f64_vec())
}

fn dtype_name(t: &HostTensor) -> &'static str {
    if t.dtype() == DType::U8 {
        "u8"
    } else {
        "f32"
    }
}

/// Largest difference allowed for `op` on `dtype` (the module docs' table).
fn tolerance(op: &str, dtype: &str) -> f64 {
    match (op, dtype) {
        // resize, crops, flips: u8 bit-exact
        (_, "u8")
            if matches!(
                op,
                "resize" | "center_crop" | "crop" | "resized_crop" | "hflip"
            ) =>
        {
            0.0
        }
        ("center_crop" | "crop" | "hflip", _) => 0.0,
        ("resize" | "resized_crop", _) => 1e-5,
        ("to_tensor_v1", _) => 0.0,
        // ToDtype(scale=True) multiplies by 1/255 where to_tensor divides: 1 ulp
        ("to_dtype_scale", _) => 1e-7,
        ("normalize", _) => 1e-6,
        // colour ops: exact formulas in float32; u8 truncation can flip on a
        // rounding difference of the last bit
        (_, "u8") => 1.0,
        _ => 1e-6,
    }
}

fn build_cases() -> kiln_core::Result<Cases> {
    let mut c = Cases {
        inputs: BTreeMap::new(),
        cases: Vec::new(),
    };
    let images = [
        ("a", photo(3, 37, 53, 1)),
        ("b", photo(3, 64, 64, 2)),
        ("c", photo(3, 200, 300, 3)),
        ("g", photo(1, 31, 29, 4)),
        // Four and two channels (resized packed 4 bytes a pixel), and an
        // image narrower than the taps' window.
        ("r", photo(4, 23, 41, 5)),
        ("t", photo(2, 3, 5, 6)),
    ];
    for (name, img) in &images {
        let f = to_tensor(img)?;
        c.inputs.insert(format!("{name}_u8"), img.clone());
        c.inputs.insert(format!("{name}_f32"), f);
    }
    // a batch of two images
    let batch = HostTensor::stack(&[images[0].1.clone(), photo(3, 37, 53, 9)])?;
    c.inputs.insert("batch_u8".into(), batch.clone());
    c.inputs.insert("batch_f32".into(), to_tensor(&batch)?);

    let names: Vec<String> = c.inputs.keys().cloned().collect();
    for input in &names {
        let x = c.inputs[input].clone();
        let dims = x.dims().to_vec();
        let (h, w) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        // Resize: shorter side down and up, exact sizes, one axis only, max_size.
        let resizes: Vec<(Value, ResizeTo)> = vec![
            (json!({"size": [24]}), ResizeTo::shorter(24)),
            (json!({"size": [100]}), ResizeTo::shorter(100)),
            (
                json!({"size": [17, 90]}),
                ResizeTo::Exact {
                    height: 17,
                    width: 90,
                },
            ),
            (
                json!({"size": [h, 20]}),
                ResizeTo::Exact {
                    height: h,
                    width: 20,
                },
            ),
            (
                json!({"size": [5, w]}),
                ResizeTo::Exact {
                    height: 5,
                    width: w,
                },
            ),
            (
                json!({"size": [224, 224]}),
                ResizeTo::Exact {
                    height: 224,
                    width: 224,
                },
            ),
            (
                json!({"size": [30], "max_size": 40}),
                ResizeTo::Shorter {
                    size: 30,
                    max_size: Some(40),
                },
            ),
        ];
        for (i, (args, to)) in resizes.into_iter().enumerate() {
            c.add(
                format!("{input}-resize{i}"),
                input,
                "resize",
                args,
                resize(&x, to)?,
            );
        }
        for (i, (ch, cw)) in [(20, 30), (70, 80), (h, w), (h + 3, w - 4), (1, 1)]
            .into_iter()
            .enumerate()
        {
            c.add(
                format!("{input}-center_crop{i}"),
                input,
                "center_crop",
                json!({"size": [ch, cw]}),
                center_crop(&x, ch, cw)?,
            );
        }
        for (i, (t, l, ch, cw)) in [
            (0i64, 0i64, 5, 7),
            (3, 4, 20, 11),
            (-2, -3, 12, 9),
            (20, 25, 40, 50),
        ]
        .into_iter()
        .enumerate()
        {
            let args = json!({"top": t, "left": l, "height": ch, "width": cw});
            c.add(
                format!("{input}-crop{i}"),
                input,
                "crop",
                args,
                crop(&x, t, l, ch, cw)?,
            );
        }
        c.add(
            format!("{input}-hflip"),
            input,
            "hflip",
            json!({}),
            hflip(&x)?,
        );
        for (i, (t, l, ch, cw, oh, ow)) in [(2i64, 3i64, 20, 25, 16, 16), (0, 0, 10, 12, 31, 40)]
            .into_iter()
            .enumerate()
        {
            let args = json!({"top": t, "left": l, "height": ch, "width": cw, "size": [oh, ow]});
            c.add(
                format!("{input}-resized_crop{i}"),
                input,
                "resized_crop",
                args,
                resized_crop(&x, t, l, ch, cw, oh, ow)?,
            );
        }
        let channels = dims[dims.len() - 3];
        let colour_ok = channels == 1 || channels == 3;
        if x.dtype() == DType::F32 {
            let (mean, std) = if channels == 3 {
                (vec![0.485, 0.456, 0.406], vec![0.229, 0.224, 0.225])
            } else {
                (vec![0.5], vec![0.25])
            };
            let n = Normalize {
                mean: mean.clone(),
                std: std.clone(),
            };
            let y = n.apply(x.clone(), &mut TransformRng::new(0))?;
            c.add(
                format!("{input}-normalize"),
                input,
                "normalize",
                json!({"mean": mean, "std": std}),
                y,
            );
        } else if !input.starts_with("batch") {
            let f = to_tensor(&x)?;
            c.add(
                format!("{input}-to_tensor_v1"),
                input,
                "to_tensor_v1",
                json!({}),
                f.clone(),
            );
            c.add(
                format!("{input}-to_dtype_scale"),
                input,
                "to_dtype_scale",
                json!({}),
                f,
            );
        }
        if colour_ok {
            for (k, factor) in [0.0, 0.5, 1.3, 2.0].into_iter().enumerate() {
                let args = json!({ "factor": factor });
                c.add(
                    format!("{input}-brightness{k}"),
                    input,
                    "brightness",
                    args.clone(),
                    adjust_brightness(&x, factor)?,
                );
                c.add(
                    format!("{input}-contrast{k}"),
                    input,
                    "contrast",
                    args.clone(),
                    adjust_contrast(&x, factor)?,
                );
                c.add(
                    format!("{input}-saturation{k}"),
                    input,
                    "saturation",
                    args,
                    adjust_saturation(&x, factor)?,
                );
            }
            for (k, factor) in [-0.5, -0.23, 0.0, 0.1, 0.37, 0.5].into_iter().enumerate() {
                let args = json!({ "factor": factor });
                c.add(
                    format!("{input}-hue{k}"),
                    input,
                    "hue",
                    args,
                    adjust_hue(&x, factor)?,
                );
            }
        }
    }

    // Random transforms: Kiln's draws replayed through torchvision's functionals.
    for input in ["a_u8", "a_f32", "c_u8", "c_f32"] {
        let x = c.inputs[input].clone();
        let (h, w) = (x.dims()[1], x.dims()[2]);
        let rrc = RandomResizedCrop::new(24, 32);
        for seed in 0..6u64 {
            let b = rrc.get_params(h, w, &mut TransformRng::new(seed));
            let y = rrc.apply(x.clone(), &mut TransformRng::new(seed))?;
            let args = json!({"top": b.top, "left": b.left, "height": b.height, "width": b.width, "size": [24, 32]});
            c.add(
                format!("{input}-rrc_seed{seed}"),
                input,
                "resized_crop",
                args,
                y,
            );
        }
        let jitter = ColorJitter::new(0.4, 0.4, 0.4, 0.1)?;
        for seed in 0..6u64 {
            let p = jitter.get_params(&mut TransformRng::new(seed));
            let y = jitter.apply(x.clone(), &mut TransformRng::new(seed))?;
            let steps: Vec<Value> = p
                .order
                .iter()
                .filter_map(|op| match op {
                    JitterOp::Brightness => p.brightness.map(|f| json!(["brightness", f])),
                    JitterOp::Contrast => p.contrast.map(|f| json!(["contrast", f])),
                    JitterOp::Saturation => p.saturation.map(|f| json!(["saturation", f])),
                    JitterOp::Hue => p.hue.map(|f| json!(["hue", f])),
                })
                .collect();
            c.add(
                format!("{input}-jitter_seed{seed}"),
                input,
                "jitter",
                json!({ "steps": steps }),
                y,
            );
        }
    }
    Ok(c)
}

#[test]
fn vision_transforms_match_torchvision() -> kiln_core::Result<()> {
    let Some(python) = kiln_testkit::python("vision_transforms_match_torchvision") else {
        return Ok(());
    };
    let cases = build_cases()?;
    let dir = kiln_testkit::TempDir::new("vision-parity");
    let inputs = write_inputs(dir.path(), &cases);
    let list: Vec<Value> = cases
        .cases
        .iter()
        .map(|(name, input, op, args, _)| json!({"name": name, "input": input, "op": op, "args": args}))
        .collect();
    let spec = json!({"inputs": inputs, "cases": list});
    std::fs::write(dir.path().join("cases.json"), spec.to_string()).expect("write cases");
    let dir_arg = dir.path().to_string_lossy().into_owned();
    let out = kiln_testkit::run_reference_script!(&python, "vision_parity.py", &[dir_arg]);
    assert!(
        out.contains(&format!("{} cases", cases.cases.len())),
        "{out}"
    );
    let results: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("results.json")).expect("results"),
    )
    .expect("results JSON");

    // (op, dtype) -> (cases, worst difference, worst case)
    let mut table: BTreeMap<(String, &str), (usize, f64, String)> = BTreeMap::new();
    let mut failures = Vec::new();
    for (name, input, op, _, kiln) in &cases.cases {
        let diff = compare(name, kiln, dir.path(), &results[name]);
        let dtype = dtype_name(&cases.inputs[input]);
        let key_op = if name.contains("rrc_seed") {
            "random_resized_crop".to_string()
        } else {
            op.clone()
        };
        let row = table
            .entry((key_op, dtype))
            .or_insert((0, 0.0, String::new()));
        row.0 += 1;
        if diff > row.1 || row.2.is_empty() {
            row.1 = diff;
            row.2 = name.clone();
        }
        let tol_op = if op == "jitter" {
            "jitter"
        } else {
            op.as_str()
        };
        if diff.is_nan() || diff > tolerance(tol_op, dtype) {
            failures.push(format!(
                "{name}: max |diff| {diff:e} > {:e}",
                tolerance(tol_op, dtype)
            ));
        }
    }
    eprintln!(
        "{:<22} {:<5} {:>6} {:>12}  worst case",
        "transform", "dtype", "cases", "max |diff|"
    );
    for ((op, dtype), (n, worst, case)) in &table {
        eprintln!("{op:<22} {dtype:<5} {n:>6} {worst:>12.3e}  {case}");
    }
    assert!(
        failures.is_empty(),
        "beyond tolerance:\n{}",
        failures.join("\n")
    );
    Ok(())
}
