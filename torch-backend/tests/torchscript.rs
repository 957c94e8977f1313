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
    common::run_reference(&python, "torchscript_models.py", &[Path::new("make"), &dir]);
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
            python_out.get(&format!("param.{name}")).unwrap(),
            value,
            0.0,
        );
    }

    // And Kiln reads its own save back.
    let reloaded = ScriptModule::load(&saved, Device::Cpu).unwrap();
    assert_eq!(reloaded.state_dict().unwrap(), after);
}
