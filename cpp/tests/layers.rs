//! Kiln's fused ops as layers of a model definition (`kiln_fused_ops::layer`): on
//! libtorch they equal the composition of built-in ops (forward and every
//! parameter gradient, 1e-5); TensorFlow agrees with libtorch on the same weights
//! (1e-5); `Trainer` trains them on both backends with the same losses epoch by
//! epoch (1e-4); misuse fails with errors that name what was wrong; under
//! `bf16-mixed` they run (in float32, their autocast kernels) within bf16 rounding.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln_core::backend::Trainable;
use kiln_core::{
    backend::{Backend, EagerBackend, TrainBackend},
    export::ExportOptions,
    loss::Loss,
    model::{CustomConfig, Init, Layer, LinearConfig},
    module::Module,
    optim::{OptimizerConfig, SgdConfig},
    state_dict::StateDict,
    Device, Error, HostTensor,
};
use kiln_data::{InMemoryDataset, SequentialLoader};
use kiln_testkit::noise;
use kiln_tf::{TfBackend, TfTensor};
use kiln_torch::{from_tch, TorchBackend, TorchModel};
use kiln_train::{Trainer, TrainerConfig, TrainingState};
use tch::{Kind, Tensor};

/// libtorch's generator is global: tests in this binary run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    kiln_fused_ops::register_layers().unwrap();
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// `Linear(6, 16, bias=False) -> bias_gelu(16) -> Linear(16, 4) -> swish(1.7)`.
fn spec() -> Layer {
    Layer::sequential([
        LinearConfig::new(6, 16).with_bias(false).into(),
        kiln_fused_ops::layer::bias_gelu(16),
        LinearConfig::new(16, 4).into(),
        kiln_fused_ops::layer::swish(1.7),
    ])
}

fn batch(rows: usize, seed: u64) -> (HostTensor, HostTensor) {
    let values = noise(rows * 6, seed);
    // Learnable labels: which of the first four features is largest.
    let labels: Vec<i64> = values
        .chunks(6)
        .map(|row| (0..4).fold(0, |best, i| if row[i] > row[best] { i } else { best }) as i64)
        .collect();
    (
        HostTensor::new(values, [rows, 6]).unwrap(),
        HostTensor::new(labels, [rows]).unwrap(),
    )
}

fn max_diff(a: &HostTensor, b: &HostTensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    a.to_f64_vec()
        .iter()
        .zip(b.to_f64_vec())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn torch_model(seed: i64) -> TorchModel {
    TorchBackend::manual_seed(seed as u64);
    TorchBackend::build_model(&spec(), Device::Cpu).unwrap()
}

/// Forward output and the gradients of `cross_entropy(output, y)`, by name.
fn torch_forward_and_grads(
    model: &TorchModel,
    x: &HostTensor,
    y: &HostTensor,
) -> (HostTensor, StateDict) {
    for (_, mut p) in Module::<TorchBackend>::named_parameters(model).unwrap() {
        p.zero_grad();
    }
    let out = model
        .forward(&TorchBackend::from_host(x, Device::Cpu).unwrap())
        .unwrap();
    let target = TorchBackend::from_host(y, Device::Cpu).unwrap();
    let loss = TorchBackend::loss(&Loss::cross_entropy(), &out, &target).unwrap();
    TorchBackend::backward(&loss).unwrap();
    let mut grads = StateDict::new();
    for (name, p) in Module::<TorchBackend>::named_parameters(model).unwrap() {
        grads.insert(name, from_tch(&p.grad()).unwrap());
    }
    (from_tch(&out.detach()).unwrap(), grads)
}

#[test]
fn fused_layers_equal_the_built_in_composition_on_libtorch() {
    let _serial = serial();
    let model = torch_model(3);
    let (x, y) = batch(10, 1);
    let (out, grads) = torch_forward_and_grads(&model, &x, &y);

    // The same computation from libtorch's built-in ops, on copies of the weights.
    let state = model.state_dict().unwrap();
    let leaf = |name: &str| {
        TorchBackend::from_host(state.get(name).unwrap(), Device::Cpu)
            .unwrap()
            .set_requires_grad(true)
    };
    let (w0, b1, w2, b2, beta) = (
        leaf("0.weight"),
        leaf("1.bias"),
        leaf("2.weight"),
        leaf("2.bias"),
        leaf("3.beta"),
    );
    let xt = TorchBackend::from_host(&x, Device::Cpu).unwrap();
    let h = (xt.matmul(&w0.tr()) + &b1).gelu("none");
    let z = h.matmul(&w2.tr()) + &b2;
    let reference = &z * (&z * &beta).sigmoid();
    let yt = TorchBackend::from_host(&y, Device::Cpu).unwrap();
    reference.cross_entropy_for_logits(&yt).backward();

    let d = max_diff(&out, &from_tch(&reference.detach()).unwrap());
    assert!(d < 1e-5, "forward differs by {d}");
    for (name, t) in [
        ("0.weight", &w0),
        ("1.bias", &b1),
        ("2.weight", &w2),
        ("2.bias", &b2),
        ("3.beta", &beta),
    ] {
        let d = max_diff(grads.get(name).unwrap(), &from_tch(&t.grad()).unwrap());
        assert!(d < 1e-5, "gradient of {name} differs by {d}");
    }
    assert!(
        grads.get("3.beta").unwrap().to_f64_vec()[0].abs() > 1e-6,
        "beta is learned: its gradient is not zero"
    );
}

#[test]
fn tensorflow_agrees_with_libtorch_on_the_same_weights() {
    let _serial = serial();
    let torch = torch_model(5);
    let mut tf = TfBackend::build_model(&spec(), Device::Cpu).unwrap();
    tf.load_state_dict(&torch.state_dict().unwrap()).unwrap();
    let (x, y) = batch(12, 2);
    let (t_out, t_grads) = torch_forward_and_grads(&torch, &x, &y);
    let f_out = tf
        .forward(&TfTensor::from_host(&x).unwrap())
        .unwrap()
        .to_host()
        .unwrap();
    let d = max_diff(&t_out, &f_out);
    assert!(d < 1e-5, "forward differs by {d}");
    let (_, f_grads) = tf
        .gradients(
            &Loss::cross_entropy(),
            &TfTensor::from_host(&x).unwrap(),
            &TfTensor::from_host(&y).unwrap(),
        )
        .unwrap();
    assert_eq!(f_grads.len(), 5, "every parameter has a gradient");
    for (name, g) in t_grads.iter() {
        let d = max_diff(g, f_grads.get(name).unwrap());
        assert!(d < 1e-5, "gradient of {name} differs by {d}");
    }
}

fn state<B: TrainBackend>(initial: &StateDict) -> TrainingState<B> {
    let mut model = B::build_model(&spec(), Device::Cpu).unwrap();
    model.load_state_dict(initial).unwrap();
    let config = OptimizerConfig::Sgd(SgdConfig::new(0.2).with_momentum(0.9));
    let optimizer = model.build_optimizer(&config, &[]).unwrap();
    TrainingState::new(model, optimizer, None)
}

fn fit<B: TrainBackend>(state: &mut TrainingState<B>) -> Vec<f64> {
    let (x, y) = batch(128, 7);
    let loader = SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), 32).unwrap();
    let config = TrainerConfig {
        epochs: 15,
        ..TrainerConfig::default()
    };
    let history = Trainer::<B>::new(config, Loss::cross_entropy())
        .unwrap()
        .fit(state, &loader, None)
        .unwrap();
    history.series("loss").into_iter().map(|(_, v)| v).collect()
}

#[test]
fn the_trainer_trains_fused_layers_on_both_backends_alike() {
    let _serial = serial();
    let initial = torch_model(11).state_dict().unwrap();
    let mut on_torch = state::<TorchBackend>(&initial);
    let mut on_tf = state::<TfBackend>(&initial);
    let t = fit(&mut on_torch);
    let f = fit(&mut on_tf);
    eprintln!("torch losses {t:.4?}\ntensorflow losses {f:.4?}");
    assert_eq!(t.len(), 15);
    assert!(t[14] < 0.7 * t[0], "training reduces the loss: {t:?}");
    let worst = t
        .iter()
        .zip(&f)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-4, "epoch losses differ by {worst}");
    let d = on_torch
        .model
        .state_dict()
        .unwrap()
        .iter()
        .map(|(name, v)| max_diff(v, on_tf.model.state_dict().unwrap().get(name).unwrap()))
        .fold(0.0, f64::max);
    assert!(d < 1e-4, "trained weights differ by {d}");
}

#[test]
fn misuse_fails_with_errors_that_name_the_problem() {
    let _serial = serial();
    // An op nobody registered: both backends name it and say how to register.
    let unknown = Layer::sequential([Layer::Relu, CustomConfig::new("nowhere::op").into()]);
    for message in [
        TorchModel::new(&unknown, Device::Cpu)
            .unwrap_err()
            .to_string(),
        kiln_tf::TfModel::new(&unknown, Device::Cpu)
            .unwrap_err()
            .to_string(),
    ] {
        assert!(
            message
                .starts_with("invalid argument `1.op`: custom op `nowhere::op` is not registered"),
            "{message}"
        );
        assert!(
            message.contains("kiln::swish"),
            "lists the registered ops: {message}"
        );
    }

    // kiln::swish declared without its parameter.
    let bare: Layer = CustomConfig::new(kiln_fused_ops::layer::SWISH).into();
    let torch = TorchModel::new(&bare, Device::Cpu).unwrap();
    let x = Tensor::ones([2, 3], (Kind::Float, tch::Device::Cpu));
    let message = torch.forward(&x).unwrap_err().to_string();
    assert_eq!(
        message,
        "invalid argument `kiln::swish.params`: expected the parameters [\"beta\"], got []"
    );
    let message = kiln_tf::TfModel::new(&bare, Device::Cpu)
        .unwrap()
        .forward(&TfTensor::from_host(&HostTensor::new(vec![1.0f32; 6], [2, 3]).unwrap()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("expected the parameters [\"beta\"]"),
        "{message}"
    );

    // A bias of the wrong length: the C++ kernel's check comes back as a backend error.
    let wrong: Layer = CustomConfig::new(kiln_fused_ops::layer::BIAS_GELU)
        .with_param("bias", [5], Init::Zeros)
        .into();
    let err = TorchModel::new(&wrong, Device::Cpu)
        .unwrap()
        .forward(&x)
        .unwrap_err();
    // The native message is the error's source: read the chain, as a user sees it.
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    assert!(err.display_chain().to_string().contains("bias"), "{err}");
    let err = kiln_tf::TfModel::new(&wrong, Device::Cpu)
        .unwrap()
        .forward(&TfTensor::from_host(&HostTensor::new(vec![1.0f32; 6], [2, 3]).unwrap()).unwrap())
        .unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    assert!(err.display_chain().to_string().contains("bias"), "{err}");
}

/// Under `bf16-mixed` the fused layers get bf16 activations from the linear layers
/// before them (and float32 parameters): their autocast kernels run them in
/// float32 (before those, `bias_gelu` refused bfloat16), and the model's output and
/// gradients stay float32 and within bf16 rounding of the float32 model's.
#[test]
fn fused_layers_train_under_bf16_mixed_precision() {
    use kiln_core::precision::FloatPrecision;
    let _serial = serial();
    let (x, y) = batch(32, 11);
    let mut model = torch_model(5);
    let (out32, grads32) = torch_forward_and_grads(&model, &x, &y);
    model.set_precision(FloatPrecision::Bf16Mixed).unwrap();
    let (out, grads) = torch_forward_and_grads(&model, &x, &y);
    assert_eq!(out.dtype(), kiln_core::DType::F32);
    let diff = max_diff(&out, &out32);
    assert!(diff > 0.0 && diff < 5e-2, "output: {diff}");
    for (name, g32) in grads32.iter() {
        let g = grads.get(name).unwrap();
        assert_eq!(g.dtype(), kiln_core::DType::F32, "{name}");
        let d = max_diff(g, g32);
        // Not 0: the gradient went through the bf16 activations (and backward).
        assert!(d > 0.0 && d < 5e-2, "grad {name}: {d}");
    }
}

/// The model of `examples/configs/digits-mlp-fused.toml`.
fn digits_mlp_fused() -> Layer {
    let text = std::fs::read_to_string(
        kiln_testkit::workspace_root().join("examples/configs/digits-mlp-fused.toml"),
    )
    .unwrap();
    let config: toml::Table = toml::from_str(&text).unwrap();
    config["model"].clone().try_into().unwrap()
}

/// A TfModel of `spec` whose fused layers' parameters are moved off their
/// initial values (zero biases, beta 1), so the export must carry them.
fn tf_model_with_learned_params(spec: &Layer, seed: u64) -> kiln_tf::TfModel {
    TfBackend::manual_seed(seed);
    let mut model = kiln_tf::TfModel::new(spec, Device::Cpu).unwrap();
    let mut state = model.state_dict().unwrap();
    let names: Vec<String> = state.iter().map(|(n, _)| n.clone()).collect();
    for (i, name) in names.iter().enumerate() {
        let t = state.get(name).unwrap().clone();
        if name.ends_with(".bias") && t.dims().len() == 1 && !name.starts_with('0') {
            let n = t.dims()[0];
            let values: Vec<f32> = noise(n, 40 + i as u64).iter().map(|v| v * 0.5).collect();
            state.insert(name.clone(), HostTensor::new(values, [n]).unwrap());
        } else if name.ends_with(".beta") {
            state.insert(
                name.clone(),
                HostTensor::new(vec![0.6f32 + i as f32 * 0.1], [1]).unwrap(),
            );
        }
    }
    model.load_state_dict(&state).unwrap();
    model
}

/// A model with Kiln's fused ops exports as a SavedModel of standard
/// TensorFlow ops (their portable builders: gelu(x + bias) with `Erf`,
/// `x * Sigmoid(beta * x)`): the digits MLP of
/// `examples/configs/digits-mlp-fused.toml` and a model with swish (and bias
/// GELU) inside residual blocks. Python's `tf.saved_model.load`, which cannot
/// load Kiln's op library, runs the `serving_default` signature
/// (`tf-backend/tests/reference/saved_model_export_check.py`) as the TfModel's
/// eval forward (fused kernels) computes it (<= 1e-5), at another batch size,
/// and its checkpoint holds exactly the model's state dict.
#[test]
fn fused_layers_export_as_standard_ops_that_python_serves() {
    let _serial = serial();
    let root = kiln_testkit::TempDir::new("export-fused");
    let residual = Layer::sequential([
        LinearConfig::new(6, 8).with_bias(false).into(),
        Layer::residual(kiln_fused_ops::layer::bias_gelu(8)),
        Layer::residual(kiln_fused_ops::layer::swish(1.0)),
        LinearConfig::new(8, 4).into(),
        Layer::residual(Layer::sequential([
            kiln_fused_ops::layer::swish(1.5),
            LinearConfig::new(4, 4).into(),
        ])),
    ]);
    let cases = [
        ("digits_mlp_fused", digits_mlp_fused(), 64usize),
        ("swish_in_residual", residual, 6usize),
    ];
    let mut manifest = Vec::new();
    let mut expected_variables = Vec::new();
    for (i, (name, spec, features)) in cases.iter().enumerate() {
        let mut model = tf_model_with_learned_params(spec, 21 + i as u64);
        let dir = root.path().join(name);
        kiln_tf::export_saved_model(&model, &dir, &ExportOptions::new(&[4, *features]))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let pb = std::fs::read(dir.join("saved_model.pb")).unwrap();
        for op in kiln_fused_ops::tf::OP_TYPES {
            assert!(
                !pb.windows(op.len()).any(|w| w == op.as_bytes()),
                "{name}: the exported graph names Kiln's op {op}"
            );
        }
        let x = HostTensor::new(noise(7 * features, 50 + i as u64), [7, *features]).unwrap();
        model.set_mode(kiln_core::backend::Mode::Eval);
        let expected = model
            .forward(&TfTensor::from_host(&x).unwrap())
            .unwrap()
            .to_host()
            .unwrap();
        let served = kiln_tf::SavedModel::load(&dir)
            .unwrap()
            .run("serving_default", &[("input", &x)])
            .unwrap();
        let d = max_diff(&served["output"], &expected);
        eprintln!("{name}: Kiln's SavedModel loader vs the TfModel, max |diff| {d:.1e}");
        assert!(d <= 1e-5, "{name}: Kiln's loader differs by {d:.2e}");

        let state = model.state_dict().unwrap();
        let data = root.path().join(format!("{name}.safetensors"));
        let state_file = root.path().join(format!("{name}-state.safetensors"));
        let mut tensors = StateDict::new();
        tensors.insert("input", x);
        tensors.insert("expected", expected);
        tensors
            .save_safetensors(&data, &Default::default())
            .unwrap();
        state
            .save_safetensors(&state_file, &Default::default())
            .unwrap();
        manifest.push(serde_json::json!({
            "name": name,
            "dir": dir,
            "data": data,
            "input_name": "input",
            "output_name": "output",
            "state": state_file,
        }));
        expected_variables.push((
            state.len() as u64,
            model.named_parameters().unwrap().len() as u64,
        ));
    }

    let Some(python) =
        kiln_testkit::python("fused_layers_export_as_standard_ops_that_python_serves")
    else {
        return;
    };
    let manifest_file = root.path().join("manifest.json");
    std::fs::write(&manifest_file, serde_json::to_string(&manifest).unwrap()).unwrap();
    let stdout = kiln_testkit::run_reference(
        &python,
        &kiln_testkit::workspace_root()
            .join("tf-backend/tests/reference/saved_model_export_check.py"),
        &[manifest_file.as_os_str()],
    );
    let results: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    for ((name, _, _), (variables, trainable)) in cases.iter().zip(expected_variables) {
        let r = &results[*name];
        let output = r["output"].as_f64().unwrap();
        eprintln!("{name}: Python's tf.saved_model.load vs the TfModel, max |diff| {output:.1e}");
        assert!(
            output <= 1e-5,
            "{name}: Python differs by {output:.2e}: {r}"
        );
        assert_eq!(r["state"].as_f64(), Some(0.0), "{name}: checkpoint {r}");
        assert!(r["batch_dim"].is_null(), "{name}: batch dim not open: {r}");
        assert_eq!(
            (r["variables"].as_u64(), r["trainable"].as_u64()),
            (Some(variables), Some(trainable)),
            "{name}: {r}"
        );
    }
}

/// A user's custom layer built from a Kiln op library kernel, with no portable
/// builder, is still refused: `NonStandardOp` names the layer, its op and the
/// op type, says how to fix it, and nothing is written.
#[test]
fn saved_model_export_refuses_a_custom_layer_without_a_portable_builder() {
    let _serial = serial();
    kiln_tf::register_custom_layer("user::fused_swish", |graph, name, x, params, _config| {
        kiln_fused_ops::tf::swish(graph, name, x, params[0].clone()).map(tensorflow::Output::from)
    });
    assert!(!kiln_tf::portable_custom_layer_registered(
        "user::fused_swish"
    ));
    assert!(kiln_tf::portable_custom_layer_registered(
        kiln_fused_ops::layer::SWISH
    ));
    let spec = Layer::sequential([
        LinearConfig::new(6, 4).into(),
        kiln_fused_ops::layer::swish(1.0),
        Layer::residual(
            CustomConfig::new("user::fused_swish")
                .with_param("beta", [1], Init::Constant { value: 1.0 })
                .into(),
        ),
    ]);
    let model = kiln_tf::TfModel::new(&spec, Device::Cpu).unwrap();
    let root = kiln_testkit::TempDir::new("export-user-op");
    let dir = root.path().join("refused");
    let err = kiln_tf::export_saved_model(&model, &dir, &ExportOptions::new(&[2, 6])).unwrap_err();
    match &err {
        kiln_core::export::ExportError::NonStandardOp {
            path, layer, op, ..
        } => assert_eq!(
            (path.as_str(), layer.as_str(), op.as_str()),
            ("2.block", "Custom user::fused_swish", "KilnSwish")
        ),
        other => panic!("{other:?}"),
    }
    let message = err.to_string();
    for part in [
        "2.block",
        "user::fused_swish",
        "register_portable_custom_layer",
    ] {
        assert!(message.contains(part), "`{part}` missing from: {message}");
    }
    assert!(!dir.exists());
    assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
}

/// A state dict made on libtorch (batch-norm running statistics updated by
/// training-mode passes there) loads into a `TfModel` of the same definition and
/// exports as a SavedModel that TensorFlow's C++ loader (Kiln's `SavedModel`)
/// serves as libtorch computes in eval mode (1e-5), at another batch size.
#[test]
fn a_torch_state_dict_exports_as_a_saved_model() {
    let _serial = serial();
    let spec = Layer::sequential([
        LinearConfig::new(6, 16).into(),
        Layer::BatchNorm1d(kiln_core::model::BatchNormConfig::new(16)),
        Layer::Relu,
        LinearConfig::new(16, 4).into(),
    ]);
    TorchBackend::manual_seed(9);
    let mut torch = TorchBackend::build_model(&spec, Device::Cpu).unwrap();
    for seed in 0..3 {
        let (x, _) = batch(8, 20 + seed);
        let _ = torch
            .forward(&TorchBackend::from_host(&x, Device::Cpu).unwrap())
            .unwrap();
    }
    torch.set_mode(kiln_core::backend::Mode::Eval);
    let state = torch.state_dict().unwrap();
    let mean = state.get("1.running_mean").unwrap().to_f64_vec();
    assert!(
        mean.iter().any(|m| m.abs() > 1e-3),
        "training-mode passes moved the statistics"
    );

    let mut tf = kiln_tf::TfModel::new(&spec, Device::Cpu).unwrap();
    tf.load_state_dict(&state).unwrap();
    let dir = std::env::temp_dir().join(format!("kiln-export-torch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    kiln_tf::export_saved_model(&tf, &dir, &ExportOptions::new(&[2, 6])).unwrap();
    let (x, _) = batch(7, 30);
    let expected = from_tch(
        &torch
            .forward(&TorchBackend::from_host(&x, Device::Cpu).unwrap())
            .unwrap(),
    )
    .unwrap();
    let served = kiln_tf::SavedModel::load(&dir)
        .unwrap()
        .run("serving_default", &[("input", &x)])
        .unwrap();
    let d = max_diff(&served["output"], &expected);
    eprintln!("torch state dict -> SavedModel: max difference from libtorch {d:.1e}");
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(d <= 1e-5, "the export differs from libtorch by {d:.2e}");
}
