//! Losses against `torch.nn.functional` (value and input gradient within 1e-5),
//! state dicts exchanged with Python through safetensors both ways, strict
//! loading errors, device handling and seeded reproducibility.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use kiln_core::{
    backend::{Backend, EagerBackend, Mode},
    loss::{CrossEntropyConfig, Loss, Reduction, SmoothL1Config},
    model::{BatchNormConfig, Conv2dConfig, Layer, LinearConfig, Pool2dConfig},
    module::Module,
    optim::{Optimizer, OptimizerConfig, SgdConfig},
    Device, Error, HostTensor,
};
use kiln_torch::{
    compute_loss, from_tch, kind_from_dtype, to_tch, Chain, TchModule, TorchBackend, TorchModel,
    TorchOptimizer,
};

fn cnn() -> Layer {
    Layer::sequential([
        Conv2dConfig::new(1, 4, [3, 3]).with_padding([1, 1]).into(),
        Layer::BatchNorm2d(BatchNormConfig::new(4)),
        Layer::Relu,
        Layer::MaxPool2d(Pool2dConfig::new([2, 2])),
        Layer::Flatten {
            start_dim: 1,
            end_dim: -1,
        },
        LinearConfig::new(100, 10).into(),
    ])
}

#[test]
fn every_loss_matches_pytorch() {
    let Some(python) = common::python("every_loss_matches_pytorch") else {
        return;
    };
    // (name, loss, input shape, kind of target, ignored class)
    type LossCase = (&'static str, Loss, Vec<usize>, &'static str, Option<i64>);
    let cases: Vec<LossCase> = vec![
        ("ce", Loss::cross_entropy(), vec![6, 5], "class", None),
        (
            "ce_sum",
            Loss::cross_entropy().with_reduction(Reduction::Sum),
            vec![6, 5],
            "class",
            None,
        ),
        (
            "ce_none_spatial",
            Loss::cross_entropy().with_reduction(Reduction::None),
            vec![3, 4, 2, 2],
            "class",
            None,
        ),
        (
            "ce_weight_smoothing_ignore",
            Loss::CrossEntropy(
                CrossEntropyConfig::new()
                    .with_weight(vec![1.0, 2.0, 0.5, 1.5, 1.0])
                    .with_label_smoothing(0.1)
                    .with_ignore_index(2),
            ),
            vec![7, 5],
            "class",
            Some(2),
        ),
        (
            "ce_probabilities",
            Loss::cross_entropy(),
            vec![6, 5],
            "probs",
            None,
        ),
        ("nll", Loss::nll(), vec![6, 5], "class", None),
        ("mse", Loss::mse(), vec![4, 3], "same", None),
        (
            "mse_none",
            Loss::mse().with_reduction(Reduction::None),
            vec![4, 3],
            "same",
            None,
        ),
        (
            "l1_sum",
            Loss::l1().with_reduction(Reduction::Sum),
            vec![4, 3],
            "same",
            None,
        ),
        (
            "smooth_l1",
            Loss::SmoothL1(SmoothL1Config::new().with_beta(0.5)),
            vec![4, 3],
            "same",
            None,
        ),
        (
            "bce_with_logits",
            Loss::bce_with_logits(),
            vec![4, 3],
            "binary",
            None,
        ),
    ];
    let dir = common::scratch_dir("losses");
    let request: Vec<serde_json::Value> = cases
        .iter()
        .enumerate()
        .map(|(i, (name, loss, input, target, ignore))| {
            serde_json::json!({"name": name, "loss": loss, "input": input, "target": target,
                               "classes": input[1], "seed": 40 + i, "ignore": ignore})
        })
        .collect();
    let request_path = common::write_json(&dir, "cases.json", &request);
    let out = dir.join("losses.safetensors");
    common::run_reference(
        &python,
        "state_and_losses.py",
        &[Path::new("losses"), &request_path, &out],
    );
    let reference = common::load(&out);
    for (name, loss, ..) in &cases {
        let get = |k: &str| reference.get(&format!("{name}.{k}")).unwrap();
        let x = to_tch(get("input"), Device::Cpu)
            .unwrap()
            .set_requires_grad(true);
        let t = to_tch(get("target"), Device::Cpu).unwrap();
        let value = compute_loss(loss, &x, &t).unwrap_or_else(|e| panic!("{name}: {e}"));
        common::assert_close(
            &format!("{name} loss"),
            &from_tch(&value).unwrap(),
            get("loss"),
            1e-5,
        );
        value.sum(tch::Kind::Float).backward();
        common::assert_close(
            &format!("{name} grad"),
            &from_tch(&x.grad()).unwrap(),
            get("grad"),
            1e-5,
        );
    }
}

#[test]
fn loss_inputs_that_cannot_work_are_typed_errors() {
    let logits = tch::Tensor::zeros([4, 3], (tch::Kind::Float, tch::Device::Cpu));
    let float_targets = tch::Tensor::zeros([4, 2], (tch::Kind::Float, tch::Device::Cpu));
    let err = compute_loss(&Loss::cross_entropy(), &logits, &float_targets).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    let int32 = tch::Tensor::zeros([4], (tch::Kind::Int, tch::Device::Cpu));
    let err = compute_loss(&Loss::cross_entropy(), &logits, &int32).unwrap_err();
    assert!(matches!(err, Error::DTypeMismatch { .. }), "{err}");
    let short = tch::Tensor::zeros([3], (tch::Kind::Int64, tch::Device::Cpu));
    assert!(matches!(
        compute_loss(&Loss::nll(), &logits, &short).unwrap_err(),
        Error::ShapeMismatch { .. }
    ));
    let err = compute_loss(&Loss::mse(), &logits, &float_targets).unwrap_err();
    assert!(err.to_string().contains("[4, 3]"), "{err}");
}

#[test]
fn state_dicts_cross_between_python_and_kiln_through_safetensors() {
    let Some(python) = common::python("state_dicts_cross") else {
        return;
    };
    let dir = common::scratch_dir("state-interop");
    let layer_path = common::write_json(&dir, "layer.json", &cnn());
    common::run_reference(
        &python,
        "state_and_losses.py",
        &[Path::new("export"), &layer_path, &dir],
    );

    // Python -> Kiln: same outputs.
    let mut model = TorchModel::new(&cnn(), Device::Cpu).unwrap();
    model.load(dir.join("python_state.safetensors")).unwrap();
    model.set_mode(Mode::Eval);
    let io = common::load(&dir.join("python_io.safetensors"));
    let x = to_tch(io.get("x").unwrap(), Device::Cpu).unwrap();
    let y = from_tch(&model.forward(&x).unwrap()).unwrap();
    common::assert_close("python weights in kiln", &y, io.get("y").unwrap(), 1e-6);

    // Kiln -> Python: a freshly initialised Kiln model, saved, loads strictly in Python.
    TorchBackend::manual_seed(11);
    let mut ours = TorchModel::new(&cnn(), Device::Cpu).unwrap();
    let _ = ours.forward(&x).unwrap(); // updates the running statistics
    ours.set_mode(Mode::Eval);
    let ours_y = from_tch(&ours.forward(&x).unwrap()).unwrap();
    let saved = dir.join("kiln_state.safetensors");
    ours.save(&saved).unwrap();
    let out = dir.join("python_out.safetensors");
    common::run_reference(
        &python,
        "state_and_losses.py",
        &[
            Path::new("import"),
            &layer_path,
            &saved,
            &dir.join("python_io.safetensors"),
            &out,
        ],
    );
    common::assert_close(
        "kiln weights in python",
        &ours_y,
        common::load(&out).get("y").unwrap(),
        1e-6,
    );
}

/// A checkpoint written from the model's and optimizer's own tensors (the trainer's
/// way: libtorch memory read in place) is byte for byte the file of their host copies,
/// for float32 and bfloat16 models, parameters, buffers and Adam moments.
#[test]
fn checkpoints_read_libtorch_memory_in_place_and_write_what_host_copies_would() {
    let dir = common::scratch_dir("state-in-place");
    let x = tch::Tensor::randn([8, 1, 10, 10], (tch::Kind::Float, tch::Device::Cpu));
    let y = tch::Tensor::randint(10, [8], (tch::Kind::Int64, tch::Device::Cpu));
    for dtype in [kiln_core::DType::F32, kiln_core::DType::BF16] {
        TorchBackend::manual_seed(5);
        let mut model = TorchModel::new(&cnn(), Device::Cpu).unwrap();
        model.to_dtype(dtype).unwrap();
        let mut opt = TorchOptimizer::new(
            OptimizerConfig::Adam(kiln_core::optim::AdamConfig::new(1e-2)),
            model.named_parameters().unwrap(),
            &[],
        )
        .unwrap();
        for _ in 0..2 {
            let out = model
                .forward(&x.to_kind(kind_from_dtype(dtype).unwrap()))
                .unwrap();
            let loss =
                compute_loss(&Loss::CrossEntropy(CrossEntropyConfig::default()), &out, &y).unwrap();
            opt.zero_grad().unwrap();
            TorchBackend::backward(&loss).unwrap();
            opt.step().unwrap();
        }
        fn checkpoint<S>(model: S, optimizer: S) -> kiln_train::Checkpoint<S> {
            kiln_train::Checkpoint {
                model,
                optimizer,
                step: 2,
                epoch: 0,
                batch_in_epoch: 2,
                seed: 5,
                world_size: 1,
                backend: "torch".into(),
                optimizer_kind: None,
                model_definition: Some(cnn()),
                lora: None,
                data: None,
                data_order: None,
                scheduler: None,
                metrics: Default::default(),
                epoch_loss: None,
                epoch_metrics: Default::default(),
                averaged: None,
                callbacks: Default::default(),
            }
        }
        let (live, copies) = (dir.join("live.ckpt"), dir.join("copies.ckpt"));
        checkpoint(model.state_tensors().unwrap(), opt.state_tensors().unwrap())
            .save(&live)
            .unwrap();
        checkpoint(model.state_dict().unwrap(), opt.state_dict().unwrap())
            .save(&copies)
            .unwrap();
        let live_bytes = std::fs::read(&live).unwrap();
        assert_eq!(live_bytes, std::fs::read(&copies).unwrap(), "{dtype}");
        let loaded = kiln_train::Checkpoint::load(&live).unwrap();
        assert_eq!(loaded.model, model.state_dict().unwrap());
        assert!(loaded.optimizer.keys().any(|k| k.ends_with("exp_avg_sq")));
    }

    // In place: the bytes handed over are the tensor's own memory, storage offset
    // included; a strided view is copied into row-major order instead.
    let base = tch::Tensor::arange(24, (tch::Kind::Float, tch::Device::Cpu)).view([4, 6]);
    let rows = base.narrow(0, 1, 2);
    let at = TorchBackend::with_host_bytes(&rows, |b| b.as_ptr() as usize).unwrap();
    assert_eq!(at, rows.data_ptr() as usize);
    assert_ne!(at, base.data_ptr() as usize);
    for view in [rows, base.tr(), base.narrow(1, 2, 3)] {
        let expected = from_tch(&view).unwrap();
        let bytes = TorchBackend::with_host_bytes(&view, <[u8]>::to_vec).unwrap();
        assert_eq!(bytes, expected.as_bytes(), "{:?}", view.stride());
    }
}

#[test]
fn strict_loading_names_the_key_and_both_shapes_and_changes_nothing() {
    let mut model = TorchModel::new(&cnn(), Device::Cpu).unwrap();
    let good = model.state_dict().unwrap();
    let mut missing = good.clone();
    missing.remove("0.weight");
    let err = model.load_state_dict(&missing).unwrap_err();
    assert!(
        matches!(&err, Error::MissingKey { key, .. } if key == "0.weight"),
        "{err}"
    );

    let mut misshaped = good.clone();
    misshaped.insert(
        "5.weight".to_owned(),
        HostTensor::zeros(kiln_core::DType::F32, [10, 99]).unwrap(),
    );
    misshaped.insert(
        "0.bias".to_owned(),
        HostTensor::zeros(kiln_core::DType::F32, [4]).unwrap(),
    );
    let err = model.load_state_dict(&misshaped).unwrap_err().to_string();
    assert!(
        err.contains("5.weight") && err.contains("[10, 100]") && err.contains("[10, 99]"),
        "{err}"
    );
    assert_eq!(
        model.state_dict().unwrap(),
        good,
        "a failed load must change nothing"
    );

    let mut extra = good.clone();
    extra.insert("head.weight".to_owned(), HostTensor::scalar(1.0f32));
    assert!(model
        .load_state_dict(&extra)
        .unwrap_err()
        .to_string()
        .contains("head.weight"));

    let dir = common::scratch_dir("state-errors");
    let err = model.load(dir.join("absent.safetensors")).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
}

#[test]
fn devices_are_checked_not_silently_mixed() {
    let mut model = TorchModel::new(&cnn(), Device::Cpu).unwrap();
    let count = TorchBackend::cuda_device_count();
    let err = model.to(Device::Cuda(count)).unwrap_err();
    assert!(matches!(err, Error::DeviceUnavailable { .. }), "{err}");
    assert_eq!(model.device(), Device::Cpu, "a failed move changes nothing");
    if count == 0 {
        println!("skipping the cross-device checks: no CUDA device");
        return;
    }
    let x = tch::Tensor::randn([2, 1, 10, 10], (tch::Kind::Float, tch::Device::Cpu));
    let cpu_out = from_tch(&{
        model.set_mode(Mode::Eval);
        model.forward(&x).unwrap()
    })
    .unwrap();
    model.to(Device::Cuda(0)).unwrap();
    let err = model.forward(&x).unwrap_err();
    match err {
        Error::DeviceMismatch {
            expected, actual, ..
        } => {
            assert_eq!((expected, actual), (Device::Cuda(0), Device::Cpu))
        }
        other => panic!("expected DeviceMismatch, got {other}"),
    }
    let pinned = kiln_torch::to_tch_pinned(&from_tch(&x).unwrap(), Device::Cuda(0)).unwrap();
    let gpu_out = from_tch(&model.forward(&pinned).unwrap()).unwrap();
    common::assert_close("cuda forward", &gpu_out, &cpu_out, 1e-5);
}

/// The escape hatch: hand-written tch code in a chain with built layers, trained
/// together, parameters under prefixed names.
#[test]
fn tch_closures_mix_with_built_layers() {
    TorchBackend::manual_seed(1);
    let gate = TchModule::new(Device::Cpu, |p| {
        let scale = p.var("scale", &[8], tch::nn::Init::Const(0.5));
        move |x: &tch::Tensor, _train: bool| Ok(x * scale.sigmoid())
    })
    .unwrap();
    let mut chain = Chain::new()
        .push(
            "encoder",
            TorchModel::new(&Layer::from(LinearConfig::new(4, 8)), Device::Cpu).unwrap(),
        )
        .unwrap()
        .push("gate", gate)
        .unwrap()
        .push(
            "head",
            TorchModel::new(&Layer::from(LinearConfig::new(8, 1)), Device::Cpu).unwrap(),
        )
        .unwrap();
    let names: Vec<String> = chain
        .named_parameters()
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        names,
        [
            "encoder.weight",
            "encoder.bias",
            "gate.scale",
            "head.weight",
            "head.bias"
        ]
    );
    let before = chain.state_dict().unwrap();
    let mut opt = TorchOptimizer::new(
        OptimizerConfig::Sgd(SgdConfig::new(0.1)),
        chain.named_parameters().unwrap(),
        &[],
    )
    .unwrap();
    let x = tch::Tensor::randn([16, 4], (tch::Kind::Float, tch::Device::Cpu));
    let y = x.sum_dim_intlist(1, true, tch::Kind::Float);
    let mut first = None;
    for _ in 0..50 {
        opt.zero_grad().unwrap();
        let loss = compute_loss(&Loss::mse(), &chain.forward(&x).unwrap(), &y).unwrap();
        loss.backward();
        opt.step().unwrap();
        first.get_or_insert(loss.double_value(&[]));
    }
    let last = compute_loss(&Loss::mse(), &chain.forward(&x).unwrap(), &y)
        .unwrap()
        .double_value(&[]);
    assert!(last < 0.2 * first.unwrap(), "{last} vs {first:?}");
    assert_ne!(
        chain.state_dict().unwrap().get("gate.scale"),
        before.get("gate.scale")
    );
    chain.load_state_dict(&before).unwrap();
    assert_eq!(chain.state_dict().unwrap(), before);
}

#[test]
fn a_wrong_input_shape_names_the_layer_and_both_shapes() {
    let model = TorchModel::new(&cnn(), Device::Cpu).unwrap();
    // 12x12 images flatten to 144 per channel-pooled map, not the 100 the head expects.
    let x = tch::Tensor::zeros([2, 1, 12, 12], (tch::Kind::Float, tch::Device::Cpu));
    let err = model.forward(&x).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{text}");
    assert!(
        text.contains("5") && text.contains("Linear") && text.contains("144"),
        "{text}"
    );
}
