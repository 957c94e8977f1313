//! A Rust op as a `Layer::Custom` layer of a `TfModel`: the model's output equals
//! the op computed from built-in TensorFlow ops on the same weights, the
//! `Trainer` trains it (the loss falls, the op's parameter moves), and a layer
//! that does not fit the op fails with an error naming what was wrong.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

mod common;

use common::*;
use kiln_core::backend::Trainable;
use kiln_core::{
    backend::{Backend, TrainBackend},
    loss::Loss,
    model::{CustomConfig, Init, Layer, LinearConfig},
    module::Module,
    optim::{OptimizerConfig, SgdConfig},
    Device, HostTensor,
};
use kiln_data::{InMemoryDataset, SequentialLoader};
use kiln_tf::{TfBackend, TfModel, TfTensor};
use kiln_train::{Trainer, TrainerConfig, TrainingState};
use tensorflow::DataType;

fn setup() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        kiln_tf_op::register_layer::<RmsNorm>().unwrap();
        kiln_tf_op::register::<RmsNormBackward>().unwrap();
        kiln_tf_op::register::<SquaredRelu>().unwrap();
        // register_layer after register (of the op itself) is fine.
        kiln_tf_op::register_layer::<SquaredRelu>().unwrap();
        kiln_tf_op::register::<SquaredReluBackward>().unwrap();
    });
}

/// `Linear(4, 8) -> rms_norm(weight [8], eps 1e-2) -> squared_relu -> Linear(8, 3)`.
fn spec() -> Layer {
    Layer::sequential([
        LinearConfig::new(4, 8).into(),
        CustomConfig::new("tft::rms_norm")
            .with_param("weight", [8], Init::Constant { value: 1.25 })
            .with_attr("eps", 1e-2)
            .into(),
        CustomConfig::new("tft::squared_relu").into(),
        LinearConfig::new(8, 3).into(),
    ])
}

fn batch(rows: usize, seed: u64) -> (HostTensor, HostTensor) {
    let x = values(rows * 4, seed);
    let labels = kiln_testkit::argmax_labels(&x, 4, 3);
    let x: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    (
        HostTensor::new(x, [rows, 4]).unwrap(),
        HostTensor::new(labels, [rows]).unwrap(),
    )
}

#[test]
fn the_layer_computes_the_op() {
    setup();
    TfBackend::manual_seed(3);
    let model = TfModel::new(&spec(), Device::Cpu).unwrap();
    let (x, _) = batch(6, 1);
    let out = model
        .forward(&TfTensor::from_host(&x).unwrap())
        .unwrap()
        .to_host()
        .unwrap();
    let state = model.state_dict().unwrap();
    let get = |k: &str| state.get(k).unwrap().to_f64_vec();
    let rms_weight = get("1.weight");
    assert_eq!(rms_weight, vec![1.25; 8]);

    // The same network from built-in ops, in float32.
    let mut net = Net::new(DataType::Float);
    let xp = net.placeholder(Some(&[6, 4]));
    let w0 = net.constant(&get("0.weight"), &[8, 4]);
    let b0 = net.constant(&get("0.bias"), &[8]);
    let w3 = net.constant(&get("3.weight"), &[3, 8]);
    let b3 = net.constant(&get("3.bias"), &[3]);
    let rw = net.constant(&rms_weight, &[8]);
    let linear = |net: &mut Net, x, w, b| {
        let mut nd = net
            .graph
            .new_operation(
                "MatMul",
                &format!("mm{}", net.graph.operation_iter().count()),
            )
            .unwrap();
        nd.add_input(x);
        nd.add_input(w);
        nd.set_attr_bool("transpose_b", true).unwrap();
        let mm: tensorflow::Output = nd.finish().unwrap().into();
        net.builtin("AddV2", &[mm, b])
    };
    let h = linear(&mut net, xp.clone(), w0, b0);
    let h = net.rms_norm_reference(&h, &rw, f64::from(1e-2_f32));
    let h = net.builtin("Relu", &[h]);
    let h = net.builtin("Square", &[h]);
    let y = linear(&mut net, h, w3, b3);
    let reference = net
        .run(&[(&xp, &x.to_f64_vec(), &[6, 4])], &[y])
        .unwrap()
        .remove(0);
    let d = max_abs_diff(&out.to_f64_vec(), &reference);
    eprintln!("TfModel with custom layers vs built-in composition: max |diff| {d:.2e}");
    assert!(d <= 1e-6, "{d}");
}

#[test]
fn the_trainer_trains_a_model_with_the_op_as_a_layer() {
    setup();
    TfBackend::manual_seed(7);
    let model = TfBackend::build_model(&spec(), Device::Cpu).unwrap();
    let before = model
        .state_dict()
        .unwrap()
        .get("1.weight")
        .unwrap()
        .to_f64_vec();
    let config = OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9));
    let optimizer = model.build_optimizer(&config, &[]).unwrap();
    let mut state = TrainingState::<TfBackend>::new(model, optimizer, None);
    let (x, y) = batch(96, 11);
    let loader = SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), 32).unwrap();
    let config = TrainerConfig {
        epochs: 8,
        ..TrainerConfig::default()
    };
    let history = Trainer::<TfBackend>::new(config, Loss::cross_entropy())
        .unwrap()
        .fit(&mut state, &loader, None)
        .unwrap();
    let losses: Vec<f64> = history.series("loss").into_iter().map(|(_, v)| v).collect();
    eprintln!("epoch losses {losses:.4?}");
    assert_eq!(losses.len(), 8);
    assert!(
        losses[7] < 0.8 * losses[0],
        "training reduces the loss: {losses:?}"
    );
    let after = state
        .model
        .state_dict()
        .unwrap()
        .get("1.weight")
        .unwrap()
        .to_f64_vec();
    let moved = max_abs_diff(&before, &after);
    eprintln!("the rms_norm weight moved by up to {moved:.3e}");
    assert!(moved > 1e-3, "the op's parameter is trained");
}

#[test]
fn layers_that_do_not_fit_the_op_are_refused() {
    setup();
    let (x, _) = batch(2, 5);
    let x = TfTensor::from_host(&x).unwrap();
    let run = |layer: Layer| -> String {
        let spec = Layer::sequential([LinearConfig::new(4, 8).into(), layer]);
        let result = TfModel::new(&spec, Device::Cpu).and_then(|m| m.forward(&x));
        result
            .err()
            .map(|e| e.display_chain().to_string())
            .unwrap_or_default()
    };
    let err = run(CustomConfig::new("tft::rms_norm").into());
    assert!(
        err.contains("tft::rms_norm.params") && err.contains("[\"weight\"]"),
        "{err}"
    );
    let err = run(CustomConfig::new("tft::rms_norm")
        .with_param("weight", [8], Init::Ones)
        .with_attr("epsilon", 0.1)
        .into());
    assert!(
        err.contains("tft::rms_norm.attrs.epsilon") && err.contains("no attribute"),
        "{err}"
    );
}
