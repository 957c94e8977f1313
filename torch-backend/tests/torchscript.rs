//! TorchScript models saved by Python: run (several inputs and outputs, dicts),
//! eval/train mode, typed errors, fine-tuning with Kiln's optimizers, and saving
//! back so that Python's `torch.jit.load` sees the new weights.
//! Fixtures and references: `tests/reference/torchscript_models.py`.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};

use kiln_core::{
    backend::Mode,
    loss::Loss,
    module::Module,
    optim::{Optimizer, OptimizerConfig, SgdConfig},
    state_dict::StateDict,
    Device, Error,
};
use kiln_torch::{compute_loss, from_tch, to_tch, ScriptModule, TorchOptimizer};
use tch::IValue;

/// Makes the fixtures once per test binary run.
fn fixtures(test: &str) -> Option<(PathBuf, PathBuf, StateDict)> {
    let python = common::python(test)?;
    let dir = common::scratch_dir(&format!("torchscript-{test}"));
    common::make_fixtures(&python, "torchscript_models.py", &dir);
    let reference = common::load(&dir.join("reference.safetensors"));
    Some((python, dir, reference))
}

fn tensor(reference: &StateDict, key: &str) -> tch::Tensor {
    to_tch(reference.get(key).unwrap(), Device::Cpu).unwrap()
}

#[test]
fn scripted_and_traced_models_match_python_in_both_modes() {
    let Some((_, dir, reference)) = fixtures("modes") else {
        return;
    };
    let x = tensor(&reference, "x");
    // A forward pass in training mode updates BatchNorm's running statistics, so
    // each mode starts from a freshly loaded model, as in the Python reference.
    let mlp = ScriptModule::load(dir.join("mlp_bn.pt"), Device::Cpu).unwrap();
    assert_eq!(mlp.mode(), Mode::Train);
    let train = from_tch(&mlp.forward(&x).unwrap()).unwrap();
    common::assert_close(
        "mlp train",
        &train,
        reference.get("mlp_train").unwrap(),
        1e-6,
    );
    let mut mlp = ScriptModule::load(dir.join("mlp_bn.pt"), Device::Cpu).unwrap();
    mlp.set_mode(Mode::Eval);
    let eval = from_tch(&mlp.forward(&x).unwrap()).unwrap();
    common::assert_close("mlp eval", &eval, reference.get("mlp_eval").unwrap(), 1e-6);
    assert!(
        !eval.allclose(&train, 1e-3, 1e-3),
        "BatchNorm must behave differently in eval mode"
    );
    let names: Vec<String> = mlp
        .named_parameters()
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        names,
        [
            "fc1.weight",
            "fc1.bias",
            "bn.weight",
            "bn.bias",
            "fc2.weight",
            "fc2.bias"
        ]
    );

    let cnn = ScriptModule::load(dir.join("traced_cnn.pt"), Device::Cpu).unwrap();
    let out = from_tch(&cnn.forward(&tensor(&reference, "img")).unwrap()).unwrap();
    common::assert_close("traced cnn", &out, reference.get("cnn").unwrap(), 1e-6);
}

#[test]
fn several_inputs_tuple_and_dict_outputs() {
    let Some((_, dir, reference)) = fixtures("io") else {
        return;
    };
    let multi = ScriptModule::load(dir.join("multi_io.pt"), Device::Cpu).unwrap();
    let outputs = multi
        .forward_many(&[tensor(&reference, "a"), tensor(&reference, "b")])
        .unwrap();
    assert_eq!(outputs.len(), 2);
    common::assert_close(
        "multi 0",
        &from_tch(&outputs[0]).unwrap(),
        reference.get("multi_0").unwrap(),
        1e-6,
    );
    common::assert_close(
        "multi 1",
        &from_tch(&outputs[1]).unwrap(),
        reference.get("multi_1").unwrap(),
        1e-6,
    );

    let dict = ScriptModule::load(dir.join("dict_out.pt"), Device::Cpu).unwrap();
    let x = tch::Tensor::from_slice(&[1.0f32, 2.0, 3.5]);
    let IValue::GenericDict(entries) = dict
        .forward_values(&[IValue::Tensor(x.shallow_clone())])
        .unwrap()
    else {
        panic!("expected a dict");
    };
    for (key, value) in entries {
        let (IValue::String(key), IValue::Tensor(value)) = (key, value) else {
            panic!("str -> tensor")
        };
        let values = from_tch(&value).unwrap().to_f64_vec();
        match key.as_str() {
            "double" => assert_eq!(values, [2.0, 4.0, 7.0]),
            "total" => assert_eq!(values, [6.5]),
            other => panic!("unexpected key {other}"),
        }
    }
    let err = dict.forward(&x).unwrap_err();
    assert!(
        matches!(err, Error::Unsupported { .. }) && err.to_string().contains("dict"),
        "{err}"
    );
}

#[test]
fn bad_files_and_bad_inputs_are_typed_errors() {
    let Some((_, dir, _)) = fixtures("errors") else {
        return;
    };
    let err = ScriptModule::load(dir.join("missing.pt"), Device::Cpu).unwrap_err();
    assert!(
        matches!(err, Error::Io { .. }) && err.to_string().contains("missing.pt"),
        "{err}"
    );

    let err = ScriptModule::load(dir.join("not_script.pt"), Device::Cpu).unwrap_err();
    assert!(matches!(err, Error::Data { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("not a loadable TorchScript archive"),
        "{err}"
    );

    let garbage = dir.join("garbage.pt");
    std::fs::write(&garbage, b"definitely not a zip archive").unwrap();
    assert!(matches!(
        ScriptModule::load(&garbage, Device::Cpu).unwrap_err(),
        Error::Data { .. }
    ));

    let multi = ScriptModule::load(dir.join("multi_io.pt"), Device::Cpu).unwrap();
    let a = tch::Tensor::ones([2, 3], (tch::Kind::Float, tch::Device::Cpu));
    let err = multi.forward(&a).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{text}");
    assert!(
        text.contains("got 1 input(s)") && text.contains("Tensor b"),
        "{text}"
    );

    let double = tch::Tensor::ones([2, 3], (tch::Kind::Double, tch::Device::Cpu));
    let err = multi.forward_many(&[double, a]).unwrap_err();
    match err {
        Error::DTypeMismatch {
            expected, actual, ..
        } => {
            assert_eq!(
                (expected, actual),
                (kiln_core::DType::F32, kiln_core::DType::F64)
            )
        }
        other => panic!("expected DTypeMismatch, got {other}"),
    }
}

#[test]
fn fine_tune_save_and_reload_in_python() {
    let Some((python, dir, reference)) = fixtures("finetune") else {
        return;
    };
    let mut model = ScriptModule::load(dir.join("mlp_bn.pt"), Device::Cpu).unwrap();
    let before = model.state_dict().unwrap();
    let mut opt = TorchOptimizer::new(
        OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9)),
        model.named_parameters().unwrap(),
        &[],
    )
    .unwrap();
    <kiln_torch::TorchBackend as kiln_core::backend::Backend>::manual_seed(0);
    let x = tch::Tensor::randn([32, 4], (tch::Kind::Float, tch::Device::Cpu));
    let target = tch::Tensor::randn([32, 3], (tch::Kind::Float, tch::Device::Cpu));
    let mut losses = Vec::new();
    for _ in 0..30 {
        opt.zero_grad().unwrap();
        let loss = compute_loss(&Loss::mse(), &model.forward(&x).unwrap(), &target).unwrap();
        loss.backward();
        opt.step().unwrap();
        losses.push(loss.double_value(&[]));
    }
    assert!(
        losses[29] < 0.9 * losses[0],
        "fine-tuning must lower the loss: {losses:?}"
    );
    let after = model.state_dict().unwrap();
    assert_ne!(before.get("fc1.weight"), after.get("fc1.weight"));

    let saved = dir.join("fine_tuned.pt");
    model.save(&saved).unwrap();
    model.set_mode(Mode::Eval);
    let probe = reference.get("x").unwrap();
    let ours = from_tch(&model.forward(&to_tch(probe, Device::Cpu).unwrap()).unwrap()).unwrap();

    let input = dir.join("probe.safetensors");
    StateDict::from_iter([("x".to_owned(), probe.clone())])
        .save_safetensors(&input, &Default::default())
        .unwrap();
    let out = dir.join("python_out.safetensors");
    common::run_reference(
        &python,
        "torchscript_models.py",
        &[Path::new("run"), &saved, &input, &out],
    );
    let python_out = common::load(&out);
    common::assert_close("reloaded output", &ours, python_out.get("y").unwrap(), 1e-6);
    for (name, value) in after.iter() {
        common::assert_close(
            name,
            python_out.get(&format!("state.{name}")).unwrap(),
            value,
            0.0,
        );
    }

    // And Kiln reads its own save back.
    let reloaded = ScriptModule::load(&saved, Device::Cpu).unwrap();
    assert_eq!(reloaded.state_dict().unwrap(), after);
}

/// 64 rows of 4 features and 3 regression targets, fixed.
fn regression_data() -> (kiln_core::HostTensor, kiln_core::HostTensor) {
    let x: Vec<f32> = (0..64 * 4)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let y: Vec<f32> = (0..64 * 3)
        .map(|i| ((i * 53 % 89) as f32 / 44.0) - 1.0)
        .collect();
    (
        kiln_core::HostTensor::new(x, [64, 4]).unwrap(),
        kiln_core::HostTensor::new(y, [64, 3]).unwrap(),
    )
}

#[test]
fn buffers_have_pytorch_names_and_a_trainer_checkpoint_resumes_bitwise() {
    use kiln_data::{InMemoryDataset, SequentialLoader};
    use kiln_torch::TorchBackend;
    use kiln_train::{CheckpointPolicy, Checkpointer, Trainer, TrainerConfig, TrainingState};

    let Some((_, dir, reference)) = fixtures("buffers") else {
        return;
    };
    let path = dir.join("mlp_bn.pt");
    let model = ScriptModule::load(&path, Device::Cpu).unwrap();

    // The state dict is Python's: parameters and buffers, same names and values.
    let ours = model.state_dict().unwrap();
    let python: Vec<String> = reference
        .keys()
        .filter_map(|k| k.strip_prefix("mlp_state."))
        .map(str::to_owned)
        .collect();
    let mut keys: Vec<String> = ours.keys().cloned().collect();
    keys.sort();
    let mut expected = python.clone();
    expected.sort();
    assert_eq!(keys, expected);
    assert!(keys.contains(&"bn.running_mean".to_owned()), "{keys:?}");
    for name in &python {
        assert_eq!(
            ours.get(name).unwrap(),
            reference.get(&format!("mlp_state.{name}")).unwrap(),
            "{name}"
        );
    }
    let buffers: Vec<String> = model
        .named_buffers()
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        buffers,
        [
            "bn.running_mean",
            "bn.running_var",
            "bn.num_batches_tracked"
        ]
    );

    // Train in train mode through the Trainer (batch norm updates its statistics),
    // checkpointing every 3 steps; resume a fresh load from step 3.
    let (x, y) = regression_data();
    let loader =
        || SequentialLoader::new(InMemoryDataset::new(x.clone(), y.clone()).unwrap(), 16).unwrap();
    let config = TrainerConfig {
        epochs: 2,
        ..TrainerConfig::default()
    };
    let sgd = OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9));
    let state = |model: ScriptModule| {
        let opt = kiln_core::backend::Trainable::<TorchBackend>::build_optimizer(&model, &sgd, &[])
            .unwrap();
        TrainingState::<TorchBackend, ScriptModule>::new(model, opt, None)
    };
    let run_dir = dir.join("checkpoints");
    let policy = CheckpointPolicy {
        every_n_steps: Some(3),
        every_n_epochs: None,
        keep_last: 5,
        ..CheckpointPolicy::default()
    };
    let mut full = state(ScriptModule::load(&path, Device::Cpu).unwrap());
    Trainer::<TorchBackend, ScriptModule>::new(config.clone(), Loss::mse())
        .unwrap()
        .with_checkpointer(Checkpointer::new(&run_dir, policy).unwrap(), None)
        .fit(&mut full, &loader(), None)
        .unwrap();
    assert_eq!(full.step, 8);
    let trained = full.model.state_dict().unwrap();
    assert_ne!(
        trained.get("bn.running_mean"),
        ours.get("bn.running_mean"),
        "training in train mode must move the running statistics"
    );

    let mut resumed = state(ScriptModule::load(&path, Device::Cpu).unwrap());
    let checkpoint = Trainer::<TorchBackend, ScriptModule>::resume(
        &mut resumed,
        &run_dir.join("step-00000003.safetensors"),
    )
    .unwrap();
    assert!(checkpoint.model.get("bn.num_batches_tracked").is_some());
    Trainer::<TorchBackend, ScriptModule>::new(config, Loss::mse())
        .unwrap()
        .fit(&mut resumed, &loader(), None)
        .unwrap();
    assert_eq!(
        resumed.model.state_dict().unwrap(),
        trained,
        "bitwise, buffers included"
    );
    assert_eq!(
        resumed.optimizer.state_dict().unwrap(),
        full.optimizer.state_dict().unwrap()
    );

    // Saving after a resume writes the same file as saving without one.
    let (a, b) = (dir.join("full"), dir.join("resumed"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    full.model.save(a.join("model.pt")).unwrap();
    resumed.model.save(b.join("model.pt")).unwrap();
    let (a, b) = (
        std::fs::read(a.join("model.pt")).unwrap(),
        std::fs::read(b.join("model.pt")).unwrap(),
    );
    assert!(
        a == b,
        "the two saves differ ({} and {} bytes)",
        a.len(),
        b.len()
    );

    // A state dict missing a buffer is refused, and changes nothing.
    let mut partial = trained.clone();
    partial.remove("bn.running_var");
    let err = resumed.model.load_state_dict(&partial).unwrap_err();
    assert!(matches!(err, Error::MissingKey { .. }), "{err}");
    assert_eq!(resumed.model.state_dict().unwrap(), trained);
}
