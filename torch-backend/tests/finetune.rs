//! Fine-tuning models Kiln did not define, through the `Trainer`: a scripted
//! backbone with batch norm as a frozen `torchscript` layer under a new head,
//! compared step by step with the same fine-tuning in Python PyTorch
//! (`tests/reference/finetune.py`); the same backbone in a `Chain` with a
//! `TchModule` head; and a `TchModule` alone (and boxed), against a
//! hand-written loop.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kiln_core::{
    backend::{Backend, TrainBackend, Trainable},
    loss::Loss,
    model::{Layer, LinearConfig, TorchScriptConfig},
    module::Module,
    optim::{Optimizer, OptimizerConfig, SgdConfig},
    state_dict::StateDict,
    Device, HostTensor, Result,
};
use kiln_data::{InMemoryDataset, SequentialLoader};
use kiln_torch::{Chain, Freeze, ScriptModule, TchModule, TorchBackend};
use kiln_train::{
    Callback, CheckpointPolicy, Checkpointer, Context, Flow, Trainer, TrainerConfig, TrainingState,
};

/// libtorch's generator is global and the trainer reseeds it every step.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Records every step's loss.
struct Losses(Arc<Mutex<Vec<f64>>>);

impl<B: TrainBackend, M: Trainable<B>> Callback<B, M> for Losses {
    fn on_step_end(&mut self, _cx: &mut Context<'_, B, M>, loss: f64) -> Result<Flow> {
        self.0.lock().unwrap().push(loss);
        Ok(Flow::Continue)
    }
}

fn fixtures(test: &str) -> Option<(PathBuf, PathBuf, StateDict)> {
    let python = common::python(test)?;
    let dir = common::scratch_dir(&format!("finetune-{test}"));
    common::run_reference(&python, "finetune.py", &[Path::new("make"), &dir]);
    let data = common::load(&dir.join("data.safetensors"));
    Some((python, dir, data))
}

fn loader(data: &StateDict) -> SequentialLoader {
    let dataset = InMemoryDataset::new(
        data.get("x").unwrap().clone(),
        data.get("y").unwrap().clone(),
    )
    .unwrap();
    SequentialLoader::new(dataset, 16).unwrap()
}

fn sgd() -> OptimizerConfig {
    OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9))
}

/// Trains `model` two epochs with the Trainer; returns the per-step losses.
fn fit<M: Trainable<TorchBackend>>(
    model: M,
    data: &StateDict,
) -> (TrainingState<TorchBackend, M>, Vec<f64>) {
    let optimizer = model.build_optimizer(&sgd(), &[]).unwrap();
    let mut state = TrainingState::<TorchBackend, M>::new(model, optimizer, None);
    let losses = Arc::new(Mutex::new(Vec::new()));
    let config = TrainerConfig {
        epochs: 2,
        ..TrainerConfig::default()
    };
    Trainer::<TorchBackend, M>::new(config, Loss::cross_entropy())
        .unwrap()
        .with_callback(Losses(losses.clone()))
        .fit(&mut state, &loader(data), None)
        .unwrap();
    let losses = losses.lock().unwrap().clone();
    (state, losses)
}

/// Python's run with `bn_mode` on Kiln's initial head `head`.
fn python_run(python: &Path, dir: &Path, head: StateDict, bn_mode: &str) -> StateDict {
    head.save_safetensors(dir.join("head.safetensors"), &Default::default())
        .unwrap();
    common::run_reference(
        python,
        "finetune.py",
        &[Path::new("train"), dir, Path::new(bn_mode)],
    );
    common::load(&dir.join(format!("python_{bn_mode}.safetensors")))
}

fn compare_losses(ours: &[f64], python: &StateDict) {
    let expected = python.get("losses").unwrap().to_f64_vec();
    assert_eq!(ours.len(), 6, "3 batches x 2 epochs");
    let worst = ours
        .iter()
        .zip(&expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f64, f64::max);
    eprintln!("max per-step loss difference from PyTorch: {worst:.2e}");
    let actual = HostTensor::new(ours.to_vec(), [ours.len()]).unwrap();
    common::assert_close(
        "per-step losses",
        &actual,
        &HostTensor::new(expected.clone(), [expected.len()]).unwrap(),
        1e-5,
    );
}

/// The backbone as a frozen torchscript layer of a Kiln model: frozen batch
/// norm in eval mode (recipes' choice) and in train mode (PyTorch's default).
#[test]
fn a_frozen_scripted_backbone_with_a_new_head_fine_tunes_as_in_pytorch() {
    let _serial = serial();
    let Some((python, dir, data)) = fixtures("layer") else {
        return;
    };
    let backbone = dir.join("backbone.pt");
    let original = ScriptModule::load(&backbone, Device::Cpu)
        .unwrap()
        .state_dict()
        .unwrap();
    let spec = Layer::sequential([
        TorchScriptConfig::new(&backbone).frozen().into(),
        LinearConfig::new(8, 3).into(),
    ]);
    let resolved =
        kiln_torch::resolve_torchscript_shapes(&spec, &[6], kiln_core::DType::F32, Device::Cpu)
            .unwrap();
    assert_eq!(resolved.output_shape(&[5, 6]).unwrap(), vec![5, 3]);

    for bn_mode in ["eval", "train"] {
        TorchBackend::manual_seed(3);
        let mut model = TorchBackend::build_model(&resolved, Device::Cpu).unwrap();
        if bn_mode == "eval" {
            assert_eq!(model.keep_frozen_batch_norm_in_eval().unwrap(), ["0.bn"]);
        }
        let head = common::strip(&model.state_dict().unwrap(), "1.");
        let names: Vec<String> = model
            .named_parameters()
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(
            names,
            [
                "0.fc.weight",
                "0.fc.bias",
                "0.bn.weight",
                "0.bn.bias",
                "1.weight",
                "1.bias"
            ]
        );
        let (state, losses) = fit(model, &data);
        // Only the head is in the optimizer.
        let opt_keys: Vec<String> = state
            .optimizer
            .state_dict()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        assert!(
            opt_keys.iter().all(|k| !k.starts_with("state.0.")),
            "{opt_keys:?}"
        );

        let reference = python_run(&python, &dir, head, bn_mode);
        compare_losses(&losses, &reference);
        let trained = state.model.state_dict().unwrap();
        for name in ["weight", "bias"] {
            common::assert_close(
                &format!("head {name}"),
                trained.get(&format!("1.{name}")).unwrap(),
                reference.get(&format!("head.{name}")).unwrap(),
                1e-5,
            );
        }
        // The backbone goes back out as TorchScript, with its current state.
        let saved = dir.join(format!("backbone-{bn_mode}.pt"));
        state.model.save_torchscript_layer("0", &saved).unwrap();
        let reloaded = ScriptModule::load(&saved, Device::Cpu)
            .unwrap()
            .state_dict()
            .unwrap();
        assert_eq!(reloaded, common::strip(&trained, "0."));
        let err = state.model.save_torchscript_layer("1", &saved).unwrap_err();
        assert!(
            err.to_string().contains("`1` is not a torchscript layer"),
            "{err}"
        );
        for (name, value) in original.iter() {
            let ours = trained.get(&format!("0.{name}")).unwrap();
            let theirs = reference.get(&format!("backbone.{name}")).unwrap();
            let buffer = name.starts_with("bn.running") || name.ends_with("num_batches_tracked");
            if bn_mode == "train" && buffer {
                // The running statistics move with every batch, as in PyTorch.
                assert_ne!(ours, value, "{name} must move in train mode");
                common::assert_close(name, ours, theirs, 1e-6);
            } else {
                assert_eq!(ours, value, "{name}: frozen, bit for bit ({bn_mode})");
            }
        }
    }
}

/// The same fine-tuning with the backbone as a `ScriptModule` in a `Chain`
/// and a `TchModule` head.
#[test]
fn a_chain_of_a_frozen_script_module_and_a_tch_head_trains_as_in_pytorch() {
    let _serial = serial();
    let Some((python, dir, data)) = fixtures("chain") else {
        return;
    };
    let mut backbone = ScriptModule::load(dir.join("backbone.pt"), Device::Cpu).unwrap();
    let original = backbone.state_dict().unwrap();
    assert_eq!(backbone.freeze(&["*"]).unwrap().len(), 4);
    TorchBackend::manual_seed(5);
    let head = TchModule::new(Device::Cpu, |p| {
        let linear = tch::nn::linear(p / "proj", 8, 3, Default::default());
        move |x: &tch::Tensor, _train: bool| Ok(tch::nn::Module::forward(&linear, x))
    })
    .unwrap();
    let head_state = common::strip(&head.state_dict().unwrap(), "proj.");
    let mut chain = Chain::new()
        .push("backbone", backbone)
        .unwrap()
        .push("head", head)
        .unwrap();
    assert_eq!(
        chain.keep_frozen_batch_norm_in_eval().unwrap(),
        ["backbone.bn"]
    );

    let (state, losses) = fit(chain, &data);
    let reference = python_run(&python, &dir, head_state, "eval");
    compare_losses(&losses, &reference);
    let trained = state.model.state_dict().unwrap();
    for (name, value) in original.iter() {
        assert_eq!(
            trained.get(&format!("backbone.{name}")).unwrap(),
            value,
            "{name}"
        );
    }
    common::assert_close(
        "head weight",
        trained.get("head.proj.weight").unwrap(),
        reference.get("head.weight").unwrap(),
        1e-5,
    );
}

/// A `TchModule` through the Trainer equals the loop a tch user writes, and
/// its checkpoint resumes bitwise.
#[test]
fn a_tch_module_through_the_trainer_equals_a_hand_written_loop_and_resumes() {
    let _serial = serial();
    let make = || {
        TorchBackend::manual_seed(11);
        TchModule::new(Device::Cpu, |p| {
            let a = tch::nn::linear(p / "a", 4, 16, Default::default());
            let b = tch::nn::linear(p / "b", 16, 2, Default::default());
            move |x: &tch::Tensor, _train: bool| {
                Ok(tch::nn::Module::forward(
                    &b,
                    &tch::nn::Module::forward(&a, x).tanh(),
                ))
            }
        })
        .unwrap()
    };
    let x: Vec<f32> = (0..64 * 4)
        .map(|i| ((i * 29 % 31) as f32 / 15.0) - 1.0)
        .collect();
    let y: Vec<f32> = (0..64 * 2)
        .map(|i| ((i * 17 % 23) as f32 / 11.0) - 1.0)
        .collect();
    let (x, y) = (
        HostTensor::new(x, [64, 4]).unwrap(),
        HostTensor::new(y, [64, 2]).unwrap(),
    );
    let data: StateDict = [("x".to_owned(), x.clone()), ("y".to_owned(), y.clone())]
        .into_iter()
        .collect();
    let run_dir = common::scratch_dir("finetune-tch-module");
    let policy = CheckpointPolicy {
        every_n_steps: Some(3),
        every_n_epochs: None,
        keep_last: 10,
        ..CheckpointPolicy::default()
    };
    let config = TrainerConfig {
        epochs: 2,
        ..TrainerConfig::default()
    };

    // Through the Trainer, checkpointing.
    let model = make();
    let optimizer = model.build_optimizer(&sgd(), &[]).unwrap();
    let mut state = TrainingState::<TorchBackend, TchModule>::new(model, optimizer, None);
    Trainer::<TorchBackend, TchModule>::new(config.clone(), Loss::mse())
        .unwrap()
        .with_checkpointer(Checkpointer::new(&run_dir, policy).unwrap(), None)
        .fit(&mut state, &loader(&data), None)
        .unwrap();
    assert_eq!(state.step, 8);

    // By hand: zero_grad, forward, loss, backward, step.
    let model = make();
    let mut opt =
        kiln_torch::TorchOptimizer::new(sgd(), model.named_parameters().unwrap(), &[]).unwrap();
    for _epoch in 0..2 {
        for start in (0..64).step_by(16) {
            let xb = kiln_torch::to_tch(&x, Device::Cpu)
                .unwrap()
                .narrow(0, start, 16);
            let yb = kiln_torch::to_tch(&y, Device::Cpu)
                .unwrap()
                .narrow(0, start, 16);
            opt.zero_grad().unwrap();
            let loss =
                kiln_torch::compute_loss(&Loss::mse(), &model.forward(&xb).unwrap(), &yb).unwrap();
            loss.backward();
            opt.step().unwrap();
        }
    }
    assert_eq!(
        state.model.state_dict().unwrap(),
        model.state_dict().unwrap()
    );

    // Any torch module, boxed, trains the same way.
    let boxed: Box<dyn Module<TorchBackend> + Send> = Box::new(make());
    let optimizer = boxed.build_optimizer(&sgd(), &[]).unwrap();
    let mut boxed_state = TrainingState::<TorchBackend, Box<dyn Module<TorchBackend> + Send>>::new(
        boxed, optimizer, None,
    );
    Trainer::<TorchBackend, Box<dyn Module<TorchBackend> + Send>>::new(config.clone(), Loss::mse())
        .unwrap()
        .fit(&mut boxed_state, &loader(&data), None)
        .unwrap();
    assert_eq!(
        boxed_state.model.state_dict().unwrap(),
        state.model.state_dict().unwrap()
    );

    // Resumed from step 3 in a fresh module: the same weights and optimizer state.
    let fresh = make();
    let optimizer = fresh.build_optimizer(&sgd(), &[]).unwrap();
    let mut resumed = TrainingState::<TorchBackend, TchModule>::new(fresh, optimizer, None);
    Trainer::<TorchBackend, TchModule>::resume(
        &mut resumed,
        &run_dir.join("step-00000003.safetensors"),
    )
    .unwrap();
    Trainer::<TorchBackend, TchModule>::new(config, Loss::mse())
        .unwrap()
        .fit(&mut resumed, &loader(&data), None)
        .unwrap();
    assert_eq!(
        resumed.model.state_dict().unwrap(),
        state.model.state_dict().unwrap()
    );
    assert_eq!(
        resumed.optimizer.state_dict().unwrap(),
        state.optimizer.state_dict().unwrap()
    );
}
