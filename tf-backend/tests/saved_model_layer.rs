#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

//! `Layer::SavedModel` on the TensorFlow backend: a Keras 3 export's `features`
//! signature (`tests/reference/saved_models.py features`) imported into a
//! [`TfModel`]'s graph as a frozen feature extractor under a trained `Linear`
//! head: its forward against the SavedModel's own signature, training that moves
//! only the head, and the typed errors.

mod common;

use kiln_core::backend::Trainable;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kiln_core::{
    backend::{Backend, StepPlan},
    loss::Loss,
    model::{Layer, LinearConfig, SavedModelLayerConfig},
    module::Module,
    optim::{AdamConfig, Optimizer, OptimizerConfig},
    DType, Device, Error, HostTensor,
};
use kiln_tf::{resolve_saved_model_shapes, SavedModel, TfBackend, TfModel, TfTensor};

const SCRIPT: &str = "saved_models.py";
/// Width of the `features` signature's output (the MLP's hidden layer).
const HIDDEN: usize = 16;

/// The exported SavedModels, made once per test binary.
fn fixture(test: &str) -> Option<&'static PathBuf> {
    static FIXTURE: OnceLock<Option<PathBuf>> = OnceLock::new();
    let fixture = FIXTURE.get_or_init(|| {
        let python = common::python("saved_model_layer tests")?;
        let dir = common::scratch_dir("saved-model-layer-fixtures");
        common::run_reference(&python, SCRIPT, &[Path::new("features"), &dir]);
        Some(dir)
    });
    if fixture.is_none() {
        kiln_testkit::skip(
            test,
            "no project virtualenv to export the SavedModel fixtures",
        );
    }
    fixture.as_ref()
}

fn features(dir: &Path) -> SavedModelLayerConfig {
    SavedModelLayerConfig::new(dir.join("features")).with_signature("features")
}

/// `[saved_model features, Linear(16, 2)]`.
fn spec(dir: &Path) -> Layer {
    Layer::sequential([features(dir).into(), LinearConfig::new(HIDDEN, 2).into()])
}

fn probe(rows: usize, shift: f32) -> HostTensor {
    let x: Vec<f32> = (0..rows * 8)
        .map(|i| ((i * 37 % 23) as f32 / 11.0 - 1.0) + shift)
        .collect();
    HostTensor::new(x, [rows, 8]).unwrap()
}

fn forward(model: &TfModel, x: &HostTensor) -> HostTensor {
    let x = TfTensor::from_host(x).unwrap();
    Module::<TfBackend>::forward(model, &x)
        .unwrap()
        .to_host()
        .unwrap()
}

/// What the SavedModel's own `features` signature computes on `x`.
fn signature_features(dir: &Path, x: &HostTensor) -> HostTensor {
    let model = SavedModel::load(dir.join("features")).unwrap();
    let mut out = model.run("features", &[("x", x)]).unwrap();
    out.remove("output_0").unwrap()
}

/// `features @ weight.T + bias`, by hand, in f64.
fn linear(features: &HostTensor, weight: &HostTensor, bias: &HostTensor) -> Vec<f64> {
    let (f, w, b) = (
        features.to_f64_vec(),
        weight.to_f64_vec(),
        bias.to_f64_vec(),
    );
    let (rows, inner, outs) = (features.dims()[0], features.dims()[1], bias.dims()[0]);
    let mut y = Vec::with_capacity(rows * outs);
    for r in 0..rows {
        for o in 0..outs {
            let dot: f64 = (0..inner)
                .map(|k| f[r * inner + k] * w[o * inner + k])
                .sum();
            y.push(dot + b[o]);
        }
    }
    y
}

fn keys(model: &TfModel) -> Vec<String> {
    Module::<TfBackend>::state_dict(model)
        .unwrap()
        .keys()
        .cloned()
        .collect()
}

/// The forward pass equals the SavedModel's `features` signature followed by the
/// head computed by hand from the model's state dict; the state dict holds only
/// the head, and the output shape was read from the signature.
#[test]
fn forward_is_the_signature_then_the_head() {
    let Some(dir) = fixture("forward_is_the_signature_then_the_head") else {
        return;
    };
    let model = TfModel::new(&spec(dir), Device::Cpu).unwrap();
    assert_eq!(keys(&model), ["1.bias", "1.weight"]);
    let Layer::Sequential { layers } = model.spec() else {
        panic!("a sequential spec");
    };
    let Layer::SavedModel(config) = &layers[0] else {
        panic!("the saved_model layer first");
    };
    assert_eq!(config.output_shape.as_deref(), Some(&[HIDDEN][..]));

    let state = Module::<TfBackend>::state_dict(&model).unwrap();
    for rows in [4, 7] {
        let x = probe(rows, 0.0);
        let y = forward(&model, &x);
        assert_eq!(y.dims(), &[rows, 2]);
        let expected = linear(
            &signature_features(dir, &x),
            state.get("1.weight").unwrap(),
            state.get("1.bias").unwrap(),
        );
        kiln_testkit::assert_close(
            &format!("forward, batch {rows}"),
            &y.to_f64_vec(),
            &expected,
            1e-5,
            "the SavedModel's signature and a hand-computed Linear",
        );
    }
}

/// Five Adam steps change the head and nothing else: the state dict keeps only the
/// head's keys, the loss falls, and the features reaching the head (read back
/// through the model's output and the head's new weights) are the signature's,
/// bit for bit, before and after.
#[test]
fn training_moves_only_the_head() {
    let Some(dir) = fixture("training_moves_only_the_head") else {
        return;
    };
    TfBackend::manual_seed(3);
    let mut model = TfModel::new(&spec(dir), Device::Cpu).unwrap();
    let before = Module::<TfBackend>::state_dict(&model).unwrap();
    let mut opt = model
        .build_optimizer(&OptimizerConfig::Adam(AdamConfig::new(5e-2)), &[])
        .unwrap();
    let loss = Loss::cross_entropy();
    let plan = StepPlan {
        loss: &loss,
        scale: 1.0,
        apply: true,
        clip: None,
    };
    let x = probe(8, 0.25);
    let y = HostTensor::new((0..8).map(|i| i % 2).collect::<Vec<i64>>(), [8]).unwrap();
    let (tx, ty) = (
        TfTensor::from_host(&x).unwrap(),
        TfTensor::from_host(&y).unwrap(),
    );
    let mut losses = Vec::new();
    for _ in 0..5 {
        opt.zero_grad().unwrap();
        losses.push(model.train_step(&mut opt, &tx, &ty, &plan).unwrap());
    }
    assert!(
        losses.last().unwrap() < losses.first().unwrap(),
        "the loss falls: {losses:?}"
    );

    assert_eq!(keys(&model), ["1.bias", "1.weight"]);
    let after = Module::<TfBackend>::state_dict(&model).unwrap();
    for key in ["1.weight", "1.bias"] {
        assert_ne!(before.get(key), after.get(key), "{key} trained");
    }

    // The extractor is untouched: on a probe, the model's output is exactly
    // the head applied to the untrained signature's features (the SavedModel
    // loaded afresh from its files) ...
    let probe_x = probe(5, -0.5);
    let expected = linear(
        &signature_features(dir, &probe_x),
        after.get("1.weight").unwrap(),
        after.get("1.bias").unwrap(),
    );
    kiln_testkit::assert_close(
        "forward after training",
        &forward(&model, &probe_x).to_f64_vec(),
        &expected,
        1e-5,
        "the untrained signature and the trained head",
    );
    // ... and a model built now on the same files, given the trained head,
    // computes the same output bit for bit.
    let mut fresh = TfModel::new(&spec(dir), Device::Cpu).unwrap();
    Module::<TfBackend>::load_state_dict(&mut fresh, &after).unwrap();
    assert_eq!(forward(&model, &probe_x), forward(&fresh, &probe_x));
}

/// A layer before the extractor gets no gradient through it (frozen: the
/// `StopGradient` after the signature's output), so training leaves it as it is.
#[test]
fn layers_before_the_extractor_get_no_gradient() {
    let Some(dir) = fixture("layers_before_the_extractor_get_no_gradient") else {
        return;
    };
    let spec = Layer::sequential([
        LinearConfig::new(8, 8).into(),
        features(dir).into(),
        LinearConfig::new(HIDDEN, 2).into(),
    ]);
    let mut model = TfModel::new(&spec, Device::Cpu).unwrap();
    assert_eq!(keys(&model), ["0.bias", "0.weight", "2.bias", "2.weight"]);
    let before = Module::<TfBackend>::state_dict(&model).unwrap();
    let mut opt = model
        .build_optimizer(&OptimizerConfig::Adam(AdamConfig::new(5e-2)), &[])
        .unwrap();
    let loss = Loss::cross_entropy();
    let plan = StepPlan {
        loss: &loss,
        scale: 1.0,
        apply: true,
        clip: None,
    };
    let x = TfTensor::from_host(&probe(4, 0.0)).unwrap();
    let y = TfTensor::from_host(&HostTensor::new(vec![0i64, 1, 0, 1], [4]).unwrap()).unwrap();
    for _ in 0..2 {
        opt.zero_grad().unwrap();
        model.train_step(&mut opt, &x, &y, &plan).unwrap();
    }
    let after = Module::<TfBackend>::state_dict(&model).unwrap();
    assert_eq!(before.get("0.weight"), after.get("0.weight"));
    assert_eq!(before.get("0.bias"), after.get("0.bias"));
    assert_ne!(before.get("2.weight"), after.get("2.weight"));
}

/// `resolve_saved_model_shapes` reads the output shape from the signature and
/// checks the shape reaching the layer.
#[test]
fn shapes_are_resolved_from_the_signature() {
    let Some(dir) = fixture("shapes_are_resolved_from_the_signature") else {
        return;
    };
    let unresolved = spec(dir);
    assert!(matches!(
        unresolved.output_shape(&[4, 8]),
        Err(Error::Unsupported { .. })
    ));
    let resolved = resolve_saved_model_shapes(&unresolved, &[8], DType::F32).unwrap();
    assert_eq!(resolved.output_shape(&[4, 8]).unwrap(), vec![4, 2]);

    let err = resolve_saved_model_shapes(&unresolved, &[5], DType::F32).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
    let err = resolve_saved_model_shapes(&unresolved, &[8], DType::F64).unwrap_err();
    assert!(matches!(err, Error::DTypeMismatch { .. }), "{err:?}");
}

/// A signature whose output TensorFlow cannot size statically: `TfModel::new`
/// leaves its shape unknown (forward is `Unsupported`, naming the resolver);
/// `resolve_saved_model_shapes` runs it once and records the width, after which
/// the model computes what the sized `features` signature does.
#[test]
fn an_unsized_output_is_found_by_running_it_once() {
    let Some(dir) = fixture("an_unsized_output_is_found_by_running_it_once") else {
        return;
    };
    let unsized_spec = Layer::sequential([
        SavedModelLayerConfig::new(dir.join("features"))
            .with_signature("unsized")
            .into(),
        LinearConfig::new(HIDDEN, 2).into(),
    ]);
    let model = TfModel::new(&unsized_spec, Device::Cpu).unwrap();
    let x = TfTensor::from_host(&probe(3, 0.0)).unwrap();
    let err = Module::<TfBackend>::forward(&model, &x).unwrap_err();
    let Error::Unsupported { what } = &err else {
        panic!("{err:?}");
    };
    assert!(what.contains("resolve_saved_model_shapes"), "{what}");

    let resolved = resolve_saved_model_shapes(&unsized_spec, &[8], DType::F32).unwrap();
    assert_eq!(resolved.output_shape(&[3, 8]).unwrap(), vec![3, 2]);
    let mut model = TfModel::new(&resolved, Device::Cpu).unwrap();
    let sized = TfModel::new(&spec(dir), Device::Cpu).unwrap();
    let head = Module::<TfBackend>::state_dict(&sized).unwrap();
    Module::<TfBackend>::load_state_dict(&mut model, &head).unwrap();
    let x = probe(3, 0.0);
    assert_eq!(forward(&model, &x), forward(&sized, &x));
}

/// Typed errors: a missing directory, an unknown signature or output, an input
/// of the wrong width or dtype, an `output_shape` the signature contradicts, and two
/// SavedModels whose variables share names.
#[test]
fn errors_are_typed() {
    let Some(dir) = fixture("errors_are_typed") else {
        return;
    };
    let build = |layer: SavedModelLayerConfig| {
        TfModel::new(
            &Layer::sequential([layer.into(), LinearConfig::new(HIDDEN, 2).into()]),
            Device::Cpu,
        )
    };

    let err = build(SavedModelLayerConfig::new(dir.join("missing"))).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");

    let err = build(features(dir).with_signature("nope")).unwrap_err();
    let Error::InvalidArgument {
        reason: message, ..
    } = &err
    else {
        panic!("{err:?}");
    };
    assert!(
        message.contains("features") && message.contains("serve"),
        "{message}"
    );

    let err = build(features(dir).with_output("nope")).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");

    let err = build(features(dir).with_output_shape([3])).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");

    let model = build(features(dir)).unwrap();
    let wrong = TfTensor::from_host(&HostTensor::new(vec![0f32; 10], [2, 5]).unwrap()).unwrap();
    let err = Module::<TfBackend>::forward(&model, &wrong).unwrap_err();
    let Error::ShapeMismatch { context, .. } = &err else {
        panic!("{err:?}");
    };
    assert!(context.contains("signature `features`"), "{context}");
    let doubles = TfTensor::from_host(&HostTensor::new(vec![0f64; 16], [2, 8]).unwrap()).unwrap();
    let err = Module::<TfBackend>::forward(&model, &doubles).unwrap_err();
    assert!(matches!(err, Error::DTypeMismatch { .. }), "{err:?}");
    // The model still works after the refused inputs.
    assert_eq!(forward(&model, &probe(2, 0.0)).dims(), &[2, 2]);

    let two = Layer::sequential([
        features(dir).into(),
        LinearConfig::new(HIDDEN, 8).into(),
        SavedModelLayerConfig::new(dir.join("features_reseeded"))
            .with_signature("features")
            .into(),
        LinearConfig::new(HIDDEN, 2).into(),
    ]);
    let err = TfModel::new(&two, Device::Cpu).unwrap_err();
    let Error::Unsupported { what } = &err else {
        panic!("{err:?}");
    };
    assert!(what.contains("names a variable"), "{what}");
}
