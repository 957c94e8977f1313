//! `HostTensor` <-> `tch::Tensor` for every supported dtype, with shape and values
//! preserved, and the conversions that cannot hold rejected with typed errors.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln_core::{
    backend::{Backend, EagerBackend},
    DType, Device, Error, HostTensor,
};
use kiln_torch::{from_tch, to_tch, TorchBackend};

fn samples() -> Vec<HostTensor> {
    vec![
        HostTensor::new(vec![0u8, 1, 127, 255, 42, 7], [2, 3]).unwrap(),
        HostTensor::new(vec![i32::MIN, -1, 0, 1, i32::MAX, 12345], [3, 2]).unwrap(),
        HostTensor::new(vec![i64::MIN, -7, 0, 9, i64::MAX, 1 << 40], [1, 2, 3]).unwrap(),
        HostTensor::new(
            vec![-1.5f32, 0.0, f32::MIN_POSITIVE, 3.25, f32::MAX, -0.0],
            [6],
        )
        .unwrap(),
        HostTensor::new(
            vec![std::f64::consts::PI, -2.0, 1e-300, 1e300, 0.5, -0.25],
            [2, 1, 3],
        )
        .unwrap(),
        HostTensor::scalar(3.5f64),
        HostTensor::new(Vec::<f32>::new(), [0, 4]).unwrap(),
        HostTensor::new(vec![-1.5f32, 0.0, 1e-20, 3.25, 1e30, -0.0], [2, 3])
            .unwrap()
            .to_dtype(DType::BF16),
        HostTensor::new(vec![-1.5f32, 0.0, 6e-5, 3.25, 65504.0, -0.0], [3, 2])
            .unwrap()
            .to_dtype(DType::F16),
    ]
}

#[test]
fn half_precision_bits_mean_the_same_to_libtorch() {
    // libtorch's own conversion of Kiln's bf16/f16 bits gives back the values
    // Kiln rounded them to (checked against f32s that both types hold exactly).
    let values = vec![-1.5f32, 0.25, 3.0, 1024.0, -0.0, 96.0];
    let host = HostTensor::new(values.clone(), [6]).unwrap();
    for dtype in [DType::BF16, DType::F16] {
        let tensor = to_tch(&host.to_dtype(dtype), Device::Cpu).unwrap();
        let floats = from_tch(&tensor.to_kind(tch::Kind::Float)).unwrap();
        assert_eq!(
            floats.as_slice::<f32>().unwrap(),
            values.as_slice(),
            "{dtype}"
        );
        let from_libtorch = from_tch(
            &to_tch(&host, Device::Cpu)
                .unwrap()
                .to_kind(kiln_torch::kind_from_dtype(dtype).unwrap()),
        )
        .unwrap();
        assert_eq!(from_libtorch, host.to_dtype(dtype), "{dtype}");
    }
}

#[test]
fn every_dtype_round_trips_with_shape_and_values() {
    for host in samples() {
        let tensor = to_tch(&host, Device::Cpu).unwrap();
        let dims: Vec<i64> = host.dims().iter().map(|&d| d as i64).collect();
        assert_eq!(tensor.size(), dims, "{host:?}");
        assert_eq!(TorchBackend::dtype(&tensor).unwrap(), host.dtype());
        let back = from_tch(&tensor).unwrap();
        assert_eq!(back, host);
    }
}

#[test]
fn values_land_where_libtorch_expects_them() {
    // Row-major: element [1, 2] of a [2, 3] tensor is the sixth value.
    let host = HostTensor::new(vec![1i64, 2, 3, 4, 5, 6], [2, 3]).unwrap();
    let tensor = to_tch(&host, Device::Cpu).unwrap();
    assert_eq!(tensor.int64_value(&[1, 2]), 6);
    assert_eq!(tensor.int64_value(&[0, 1]), 2);
    // A libtorch-made tensor comes back with libtorch's values.
    let made = tch::Tensor::arange(6, (tch::Kind::Float, tch::Device::Cpu)).view([3, 2]);
    let back = from_tch(&made).unwrap();
    assert_eq!(back.dims(), &[3, 2]);
    assert_eq!(
        back.as_slice::<f32>().unwrap(),
        &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    );
}

#[test]
fn non_contiguous_tensors_come_back_in_logical_order() {
    let made = tch::Tensor::arange(6, (tch::Kind::Int64, tch::Device::Cpu))
        .view([2, 3])
        .transpose(0, 1);
    let back = from_tch(&made).unwrap();
    assert_eq!(back.dims(), &[3, 2]);
    assert_eq!(back.as_slice::<i64>().unwrap(), &[0, 3, 1, 4, 2, 5]);
}

#[test]
fn unsupported_dtype_is_a_typed_error() {
    let complex = tch::Tensor::ones([2], (tch::Kind::ComplexFloat, tch::Device::Cpu));
    let err = from_tch(&complex).unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    assert!(err.to_string().contains("ComplexFloat"), "{err}");
}

#[test]
fn element_count_mismatch_is_a_typed_error() {
    let err = HostTensor::new(vec![1.0f32; 5], [2, 3]).unwrap_err();
    match err {
        Error::ElementCount {
            expected, actual, ..
        } => assert_eq!((expected, actual), (6, 5)),
        other => panic!("expected ElementCount, got {other}"),
    }
}

#[test]
fn wrong_dtype_access_is_a_typed_error() {
    let tensor = to_tch(&HostTensor::new(vec![1i32, 2], [2]).unwrap(), Device::Cpu).unwrap();
    let host = from_tch(&tensor).unwrap();
    match host.as_slice::<f32>().unwrap_err() {
        Error::DTypeMismatch {
            expected, actual, ..
        } => {
            assert_eq!((expected, actual), (DType::F32, DType::I32))
        }
        other => panic!("expected DTypeMismatch, got {other}"),
    }
}

#[test]
fn missing_cuda_device_is_a_typed_error() {
    let host = HostTensor::new(vec![1.0f32], [1]).unwrap();
    let count = TorchBackend::cuda_device_count();
    let err = TorchBackend::from_host(&host, Device::Cuda(count + 3)).unwrap_err();
    assert!(matches!(err, Error::DeviceUnavailable { .. }), "{err}");
    assert!(
        err.to_string().contains(&format!("cuda:{}", count + 3)),
        "{err}"
    );
}

/// `error: cause: cause`, as `anyhow`'s `{:#}` (and the CLI) prints it.
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    kiln_core::error::ErrorChain::new(error).to_string()
}

#[test]
fn libtorch_errors_show_no_cpp_stack_trace_through_the_chain() {
    let a = tch::Tensor::ones([2, 3], (tch::Kind::Float, tch::Device::Cpu));
    let b = tch::Tensor::ones([4, 5], (tch::Kind::Float, tch::Device::Cpu));
    let native = a.f_matmul(&b).unwrap_err();
    // libtorch appends its C++ stack trace to the message; the test needs one.
    assert!(
        native.to_string().contains("Exception raised from"),
        "{native}"
    );
    let err = kiln_torch::torch_error("matmul", native);
    let text = chain(&err);
    assert!(text.contains("cannot be multiplied"), "{text}");
    assert_eq!(text.matches("cannot be multiplied").count(), 1, "{text}");
    assert!(!text.contains("Exception raised from"), "{text}");
    assert!(!text.contains("frame #"), "{text}");
    assert_eq!(text.lines().count(), 1, "{text}");
}

#[test]
fn libtorch_errors_carry_the_native_message() {
    let a = tch::Tensor::ones([2, 3], (tch::Kind::Float, tch::Device::Cpu));
    let b = tch::Tensor::ones([4, 5], (tch::Kind::Float, tch::Device::Cpu));
    let err = a
        .f_matmul(&b)
        .map_err(|e| kiln_torch::torch_error("matmul", e))
        .unwrap_err();
    // libtorch's message is the error's source: read the chain, as a user sees it.
    let text = chain(&err);
    assert!(
        matches!(
            err,
            Error::Backend {
                backend: "torch",
                ..
            }
        ),
        "{text}"
    );
    assert!(
        text.contains("matmul") && text.contains("2x3") && text.contains("4x5"),
        "{text}"
    );
}

#[test]
fn backward_computes_hand_derived_gradients() {
    // d/dx sum(x^2) = 2x
    let x = to_tch(
        &HostTensor::new(vec![1.0f64, -2.0, 0.5], [3]).unwrap(),
        Device::Cpu,
    )
    .unwrap()
    .set_requires_grad(true);
    let loss = (&x * &x).sum(tch::Kind::Double);
    TorchBackend::backward(&loss).unwrap();
    let grad = from_tch(&x.grad()).unwrap();
    assert_eq!(grad.as_slice::<f64>().unwrap(), &[2.0, -4.0, 1.0]);
    let not_scalar = &x * 2.0;
    let err = TorchBackend::backward(&not_scalar).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
}
