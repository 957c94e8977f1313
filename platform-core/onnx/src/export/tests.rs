//! Unit tests of the exporter's pure pieces: checks, names, shapes, the model's
//! header. The numbers are checked against ONNX Runtime in the workspace's
//! `tests/onnx_export.rs`.

use kiln_core::model::{CustomConfig, Init, Layer, LinearConfig, TorchScriptConfig};
use kiln_core::state_dict::StateDict;
use kiln_core::{export::ExportOptions, DType, HostTensor};

use super::*;
use crate::proto::tensor_shape_proto::dimension::Value as DimValue;

fn linear_state(prefix: &str, inp: usize, out: usize, dtype: DType) -> StateDict {
    let mut s = StateDict::new();
    let w = HostTensor::new(vec![0.5f32; inp * out], [out, inp]).unwrap_or_else(|e| panic!("{e}"));
    let b = HostTensor::new(vec![0.1f32; out], [out]).unwrap_or_else(|e| panic!("{e}"));
    s.insert(join(prefix, "weight"), w.to_dtype(dtype));
    s.insert(join(prefix, "bias"), b.to_dtype(dtype));
    s
}

fn dims(info: &ValueInfoProto) -> Vec<Option<DimValue>> {
    match info.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => t
            .shape
            .as_ref()
            .map(|s| s.dim.iter().map(|d| d.value.clone()).collect())
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

#[test]
fn the_model_records_its_producer_versions_and_shapes() -> Result<()> {
    let net = Layer::sequential([LinearConfig::new(3, 2).into(), Layer::Relu]);
    let state = linear_state("0", 3, 2, DType::F32);
    let model = OnnxExport::new(&net, &state, &ExportOptions::new(&[4, 3])).to_model()?;
    assert_eq!(model.ir_version, Some(10));
    assert_eq!(model.producer_name.as_deref(), Some("kiln"));
    assert_eq!(model.opset_import[0].version, Some(21));
    assert_eq!(model.opset_import[0].domain.as_deref(), Some(""));
    let graph = model.graph.unwrap_or_default();
    let names: Vec<_> = graph.node.iter().filter_map(|n| n.name.clone()).collect();
    assert_eq!(names, ["0/Gemm", "1/Relu"]);
    assert_eq!(graph.node[1].output, ["output"]);
    let inits: Vec<_> = graph
        .initializer
        .iter()
        .filter_map(|t| t.name.clone())
        .collect();
    assert_eq!(inits, ["0.weight", "0.bias"]);
    let batch = Some(DimValue::DimParam("batch".to_owned()));
    assert_eq!(
        dims(&graph.input[0]),
        [batch.clone(), Some(DimValue::DimValue(3))]
    );
    assert_eq!(dims(&graph.output[0]), [batch, Some(DimValue::DimValue(2))]);
    let fixed = OnnxExport::new(
        &net,
        &state,
        &ExportOptions::new(&[4, 3]).with_dynamic_batch(false),
    )
    .to_model()?
    .graph
    .unwrap_or_default();
    assert_eq!(
        dims(&fixed.output[0]),
        [Some(DimValue::DimValue(4)), Some(DimValue::DimValue(2))]
    );
    Ok(())
}

#[test]
fn weights_keep_their_float_dtype() -> Result<()> {
    let net: Layer = LinearConfig::new(3, 2).into();
    let state = linear_state("", 3, 2, DType::F64);
    let model = OnnxExport::new(&net, &state, &ExportOptions::new(&[1, 3])).to_model()?;
    let graph = model.graph.unwrap_or_default();
    let double = proto::tensor_proto::DataType::Double as i32;
    assert!(graph
        .initializer
        .iter()
        .all(|t| t.data_type == Some(double)));
    match graph.input[0]
        .r#type
        .as_ref()
        .and_then(|t| t.value.as_ref())
    {
        Some(type_proto::Value::TensorType(t)) => assert_eq!(t.elem_type, Some(double)),
        other => panic!("input type {other:?}"),
    }
    Ok(())
}

#[test]
fn mixed_float_dtypes_and_wrong_shapes_are_typed_errors() {
    let net: Layer = LinearConfig::new(3, 2).into();
    let mut state = linear_state("", 3, 2, DType::F32);
    state.insert(
        "bias",
        HostTensor::zeros(DType::F64, [2]).unwrap_or_else(|e| panic!("{e}")),
    );
    let err = OnnxExport::new(&net, &state, &ExportOptions::new(&[1, 3]))
        .to_model()
        .unwrap_err();
    assert!(
        matches!(&err, Error::Weight { key, .. } if key == "bias"),
        "{err}"
    );
    state.insert(
        "bias",
        HostTensor::zeros(DType::F32, [3]).unwrap_or_else(|e| panic!("{e}")),
    );
    let err = OnnxExport::new(&net, &state, &ExportOptions::new(&[1, 3]))
        .to_model()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "<root> (Linear): state dict entry `bias` has shape [3], expected [2]"
    );
}

#[test]
fn unmapped_layers_are_unsupported_with_their_path() {
    let user = CustomConfig::new("me::wobble").with_param("k", [1], Init::Ones);
    let net = Layer::sequential([Layer::residual(Layer::sequential([
        Layer::Relu,
        user.into(),
    ]))]);
    let mut state = StateDict::new();
    state.insert(
        "0.block.1.k",
        HostTensor::new(vec![1.0f32], [1]).unwrap_or_else(|e| panic!("{e}")),
    );
    let err = OnnxExport::new(&net, &state, &ExportOptions::new(&[2, 3]))
        .to_model()
        .unwrap_err();
    match &err {
        Error::Unsupported {
            path,
            layer,
            reason,
            ..
        } => {
            assert_eq!(
                (path.as_str(), layer.as_str()),
                ("0.block.1", "Custom(me::wobble)")
            );
            assert!(
                reason.contains("kiln_onnx::register_onnx_lowering"),
                "{reason}"
            );
        }
        other => panic!("{other}"),
    }
    // A registered mapping makes it exportable.
    let model = OnnxExport::new(&net, &state, &ExportOptions::new(&[2, 3]))
        .custom_op("me::wobble", |op| {
            let k = op.param("k")?;
            let x = op.input().to_owned();
            Ok(op.node("Mul", &[&x, &k], vec![]))
        })
        .to_model();
    assert!(model.is_ok(), "{model:?}");

    let ts: Layer = TorchScriptConfig::new("backbone.pt").into();
    let net = Layer::sequential([Layer::Relu, ts]);
    let err = OnnxExport::new(&net, &state, &ExportOptions::new(&[2, 3]))
        .to_model()
        .unwrap_err();
    assert!(
        matches!(&err, Error::Unsupported { path, layer, .. } if path == "1" && layer == "TorchScript"),
        "{err}"
    );
}

#[test]
fn settings_that_cannot_work_are_refused() {
    let net: Layer = LinearConfig::new(3, 2).into();
    let state = linear_state("", 3, 2, DType::F32);
    let same = OnnxExport::new(
        &net,
        &state,
        &ExportOptions::new(&[1, 3]).with_output_name("input"),
    );
    assert!(matches!(same.to_model(), Err(Error::Invalid { .. })));
    let clash = OnnxExport::new(
        &net,
        &state,
        &ExportOptions::new(&[1, 3]).with_input_name("weight"),
    );
    assert!(matches!(clash.to_model(), Err(Error::Invalid { .. })));
    let ints = OnnxExport::new(
        &net,
        &state,
        &ExportOptions::new(&[1, 3]).with_input_dtype(DType::I64),
    );
    let err = ints.to_model().unwrap_err();
    assert_eq!(
        err.to_string(),
        "<root> (Linear): receives int64 data; it takes float32 features (the weights' dtype)"
    );
    let bad_shape = OnnxExport::new(&net, &state, &ExportOptions::new(&[1, 4]))
        .to_model()
        .unwrap_err();
    assert!(matches!(bad_shape, Error::Core(_)), "{bad_shape}");
}

#[test]
fn flatten_from_the_batch_leaves_the_first_dimension_unknown() -> Result<()> {
    let net = Layer::Flatten {
        start_dim: 0,
        end_dim: -1,
    };
    let state = StateDict::new();
    let graph = OnnxExport::new(&net, &state, &ExportOptions::new(&[2, 3, 4]))
        .to_model()?
        .graph
        .unwrap_or_default();
    assert_eq!(dims(&graph.output[0]), [None]);
    assert_eq!(graph.node[0].op_type.as_deref(), Some("Reshape"));
    Ok(())
}
