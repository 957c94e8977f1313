//! `HostTensor` <-> `tensorflow::Tensor` for every supported dtype, with shape and
//! values preserved, and the conversions that cannot hold rejected with typed errors.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln_core::backend::Trainable;
use kiln_core::{DType, Error, HostTensor};
use kiln_tf::{from_tf, to_tf, TfTensor};
use tensorflow::{DataType, Graph, Session, SessionOptions, SessionRunArgs, Tensor};

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
    ]
}

#[test]
fn every_dtype_round_trips_with_shape_and_values() {
    for host in samples() {
        let tf = TfTensor::from_host(&host).unwrap();
        assert_eq!(tf.dtype(), host.dtype());
        assert_eq!(&tf.shape(), host.shape());
        assert_eq!(tf.to_host().unwrap(), host);
    }
}

#[test]
fn typed_conversion_keeps_row_major_order() {
    let host = HostTensor::new(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3]).unwrap();
    let tf: Tensor<f32> = to_tf(&host).unwrap();
    assert_eq!(tf.dims(), &[2, 3]);
    assert_eq!(tf.get(&[1, 2]), 6.0);
    assert_eq!(tf.get(&[0, 1]), 2.0);
    assert_eq!(from_tf(&tf).unwrap(), host);
}

#[test]
fn wrong_dtype_is_a_typed_error() {
    let host = HostTensor::new(vec![1i64, 2], [2]).unwrap();
    match to_tf::<f32>(&host).unwrap_err() {
        Error::DTypeMismatch {
            expected, actual, ..
        } => {
            assert_eq!((expected, actual), (DType::F32, DType::I64))
        }
        other => panic!("expected DTypeMismatch, got {other}"),
    }
}

#[test]
fn element_count_mismatch_is_a_typed_error() {
    let err = HostTensor::new(vec![1u8; 7], [2, 4]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ElementCount {
                expected: 8,
                actual: 7,
                ..
            }
        ),
        "{err}"
    );
}

/// A tensor converted from the host goes through a real session: `Square`, values by hand.
#[test]
fn converted_tensor_feeds_a_session() {
    let mut graph = Graph::new();
    let x = {
        let mut op = graph.new_operation("Placeholder", "x").unwrap();
        op.set_attr_type("dtype", DataType::Double).unwrap();
        op.finish().unwrap()
    };
    let sq = {
        let mut op = graph.new_operation("Square", "sq").unwrap();
        op.add_input(x.clone());
        op.finish().unwrap()
    };
    let session = Session::new(&SessionOptions::new(), &graph).unwrap();
    let host = HostTensor::new(vec![1.5f64, -2.0, 0.0, 3.0], [2, 2]).unwrap();
    let TfTensor::F64(input) = TfTensor::from_host(&host).unwrap() else {
        panic!("f64 host tensor must convert to an f64 TensorFlow tensor");
    };
    let mut args = SessionRunArgs::new();
    args.add_feed(&x, 0, &input);
    let fetch = args.request_fetch(&sq, 0);
    session.run(&mut args).unwrap();
    let out = from_tf(&args.fetch::<f64>(fetch).unwrap()).unwrap();
    assert_eq!(
        out,
        HostTensor::new(vec![2.25f64, 4.0, 0.0, 9.0], [2, 2]).unwrap()
    );
}

#[test]
fn tensorflow_errors_carry_the_native_message() {
    let mut graph = Graph::new();
    let err = graph
        .new_operation("NoSuchOpInTensorFlow", "bad")
        .unwrap()
        .finish()
        .map_err(|status| kiln_tf::tf_error("building a graph", status))
        .unwrap_err();
    // The status is the error's source: read the chain, as a user sees it.
    let text = err.display_chain().to_string();
    assert!(
        matches!(
            err,
            Error::Backend {
                backend: "tensorflow",
                ..
            }
        ),
        "{text}"
    );
    assert!(text.contains("NoSuchOpInTensorFlow"), "{text}");
}

#[test]
fn half_precision_is_unsupported_with_a_clear_error() {
    for dtype in [DType::BF16, DType::F16] {
        let host = HostTensor::new(vec![1.0f32, 2.0], [2])
            .unwrap()
            .to_dtype(dtype);
        let err = TfTensor::from_host(&host).unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err:?}");
        assert!(err.to_string().contains(dtype.name()), "{err}");
    }
}

#[test]
fn bf16_precisions_are_refused_naming_the_torch_backend() {
    use kiln_core::{
        backend::TrainBackend,
        model::{Layer, LinearConfig},
        precision::FloatPrecision,
    };
    let mut model = kiln_tf::TfBackend::build_model(
        &Layer::Linear(LinearConfig::new(3, 2)),
        kiln_core::Device::Cpu,
    )
    .unwrap();
    kiln_tf::TfBackend::set_precision(&mut model, FloatPrecision::F32).unwrap();
    for precision in [
        FloatPrecision::Bf16Mixed,
        FloatPrecision::Bf16True,
        FloatPrecision::F16Mixed,
        FloatPrecision::F16True,
    ] {
        let err = kiln_tf::TfBackend::set_precision(&mut model, precision).unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains(precision.name()) && text.contains("torch backend"),
            "{text}"
        );
    }
    assert_eq!(model.precision(), FloatPrecision::F32);
}
