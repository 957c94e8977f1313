//! `StateDict` safetensors files against Python's `safetensors.torch`, both
//! ways, and the errors for files Kiln cannot read.

use std::collections::BTreeMap;

use kiln_core::{state_dict::StateDict, DType, Error, HostTensor};
use serde_json::Value;

/// Rebuilds a tensor from the script's `{"dtype", "shape", "values"}` description.
fn tensor_from_description(name: &str, desc: &Value) -> HostTensor {
    let dtype: DType = desc["dtype"]
        .as_str()
        .and_then(|d| d.parse().ok())
        .unwrap_or_else(|| panic!("{name}: dtype {}", desc["dtype"]));
    let shape: Vec<usize> = serde_json::from_value(desc["shape"].clone()).expect("shape");
    let values = desc["values"].as_array().expect("values");
    let floats = || values.iter().map(|v| v.as_f64().expect("float"));
    let ints = || values.iter().map(|v| v.as_i64().expect("integer"));
    let tensor = match dtype {
        DType::F32 => HostTensor::new(floats().map(|v| v as f32).collect::<Vec<_>>(), shape),
        DType::F64 => HostTensor::new(floats().collect::<Vec<_>>(), shape),
        // The values are exactly representable (the script prints the 16-bit
        // floats' own values), so the rounding cast is exact.
        DType::BF16 | DType::F16 => {
            HostTensor::new(floats().collect::<Vec<_>>(), shape).map(|t| t.to_dtype(dtype))
        }
        DType::I64 => HostTensor::new(ints().collect::<Vec<_>>(), shape),
        DType::I32 => HostTensor::new(
            ints()
                .map(|v| i32::try_from(v).expect("i32"))
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::U8 => HostTensor::new(
            ints()
                .map(|v| u8::try_from(v).expect("u8"))
                .collect::<Vec<_>>(),
            shape,
        ),
        other => panic!("{name}: unexpected dtype {other}"),
    };
    tensor.unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn described_state(reply: &Value) -> (StateDict, BTreeMap<String, String>) {
    let tensors = reply["tensors"].as_object().expect("tensors");
    let state = tensors
        .iter()
        .map(|(name, desc)| (name.clone(), tensor_from_description(name, desc)))
        .collect();
    let metadata = serde_json::from_value(reply["metadata"].clone()).expect("metadata");
    (state, metadata)
}

fn rust_state() -> StateDict {
    let mut sd = StateDict::new();
    let entries = [
        (
            "conv.weight",
            HostTensor::new(
                vec![0.5f32, -1.25, 1e-40, f32::MAX, -0.0, 3.0, 7.5, -8.0],
                [2, 1, 2, 2],
            ),
        ),
        (
            "conv.bias",
            HostTensor::new(vec![1.0f64 / 3.0, -2.0e-310], [2]),
        ),
        (
            "bn.num_batches_tracked",
            Ok(HostTensor::scalar(123_456_789_012i64)),
        ),
        ("labels", HostTensor::new(vec![i32::MIN, 0, i32::MAX], [3])),
        ("bytes", HostTensor::new(vec![0u8, 17, 255, 128], [2, 2])),
        ("nothing", HostTensor::zeros(DType::F64, [3, 0])),
        (
            "half.bf16",
            HostTensor::new(vec![1.0f32, -0.3125, 3.0e38, 1e-30], [2, 2])
                .map(|t| t.to_dtype(DType::BF16)),
        ),
        (
            "half.f16",
            HostTensor::new(vec![1.0f32, -0.3125, 65504.0, 6e-8], [4])
                .map(|t| t.to_dtype(DType::F16)),
        ),
    ];
    for (name, tensor) in entries {
        sd.insert(name, tensor.expect("valid tensor"));
    }
    sd
}

#[test]
fn python_written_file_loads() {
    let Some(python) = kiln_testkit::python("python_written_file_loads") else {
        return;
    };
    let dir = kiln_testkit::TempDir::new("st-python");
    let path = dir.path().join("from_python.safetensors");
    let stdout = kiln_testkit::run_reference_script!(
        &python,
        "safetensors_io.py",
        &["write".as_ref(), path.as_os_str()],
    );
    let reply: Value = serde_json::from_str(&stdout).expect("JSON");
    let (expected, expected_meta) = described_state(&reply);
    assert_eq!(expected.len(), 10);

    let (loaded, metadata) = StateDict::load_safetensors(&path).expect("load");
    assert_eq!(metadata, expected_meta);
    assert_eq!(
        loaded.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>()
    );
    for (name, tensor) in &expected {
        let got = loaded.get(name).expect("present");
        assert_eq!(got.dtype(), tensor.dtype(), "{name}");
        assert_eq!(got.dims(), tensor.dims(), "{name}");
        assert_eq!(got, tensor, "{name}");
    }
    assert_eq!(
        loaded.get("step").map(|t| t.item::<i64>().expect("i64")),
        Some(42)
    );

    // The same file, cut short, is a checkpoint error naming it.
    let bytes = std::fs::read(&path).expect("read");
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 16]).expect("write");
    let err = StateDict::load_safetensors(&cut).expect_err("truncated");
    match &err {
        Error::Checkpoint { path, reason, .. } => {
            assert_eq!(path, &cut);
            assert!(reason.starts_with("header claims"), "{reason}");
            assert!(reason.contains("(the file is truncated)"), "{reason}");
        }
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
    assert!(err.to_string().contains("cut.safetensors"), "{err}");
}

#[test]
fn rust_written_file_reads_in_python() {
    let Some(python) = kiln_testkit::python("rust_written_file_reads_in_python") else {
        return;
    };
    let dir = kiln_testkit::TempDir::new("st-rust");
    let path = dir.path().join("from_rust.safetensors");
    let state = rust_state();
    let metadata = BTreeMap::from([
        ("format".to_owned(), "pt".to_owned()),
        ("kiln.step".to_owned(), "1000".to_owned()),
        ("unicode".to_owned(), "größe ✓".to_owned()),
    ]);
    state.save_safetensors(&path, &metadata).expect("save");

    let stdout = kiln_testkit::run_reference_script!(
        &python,
        "safetensors_io.py",
        &["read".as_ref(), path.as_os_str()],
    );
    let reply: Value = serde_json::from_str(&stdout).expect("JSON");
    let (read_back, read_meta) = described_state(&reply);
    assert_eq!(read_meta, metadata);
    assert_eq!(read_back, state);
}

#[test]
fn unsupported_dtype_and_garbage_are_named() {
    let Some(python) = kiln_testkit::python("unsupported_dtype_and_garbage_are_named") else {
        return;
    };
    let dir = kiln_testkit::TempDir::new("st-errors");
    let path = dir.path().join("f8.safetensors");
    kiln_testkit::run_reference_script!(
        &python,
        "safetensors_io.py",
        &["write-f8".as_ref(), path.as_os_str()],
    );
    let err = StateDict::load_safetensors(&path).expect_err("float8");
    assert_eq!(
        err.to_string(),
        format!(
            "checkpoint {}: dtype F8_E4M3 of tensor `weights` is not supported (U8, I32, I64, F32, F64, BF16, F16)",
            path.display()
        )
    );

    let garbage = dir.path().join("garbage.safetensors");
    let noise: Vec<u8> = (0u32..300)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&garbage, noise).expect("write");
    let err = StateDict::load_safetensors(&garbage).expect_err("garbage");
    match &err {
        Error::Checkpoint { path, reason, .. } => {
            assert_eq!(path, &garbage);
            assert!(reason.contains("not a safetensors file"), "{reason}");
        }
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}
