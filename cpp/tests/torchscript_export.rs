//! Kiln's fused ops leave through `kiln_torch::export_torchscript` as their
//! composition of standard ops: the model of
//! `examples/configs/digits-mlp-fused.toml` (`kiln::bias_gelu`, `kiln::swish`),
//! exported, gives the fused kernels' outputs (1e-6) and parameter gradients
//! (1e-5) when Kiln loads it back as a `ScriptModule`, and Python PyTorch, which
//! has no Kiln op library, loads, runs and trains it
//! (kiln-torch's `tests/reference/torchscript_export_check.py`).

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln_testkit::noise;
use std::path::Path;

use kiln_core::{
    backend::{Backend, Mode},
    export::ExportOptions,
    model::Layer,
    module::Module,
    state_dict::StateDict,
    Device, HostTensor,
};
use kiln_torch::{export_torchscript, from_tch, to_tch, ScriptModule, TorchBackend, TorchModel};

fn max_diff(a: &HostTensor, b: &HostTensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    a.to_f64_vec()
        .iter()
        .zip(b.to_f64_vec())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// The output and every parameter's gradient of `loss = sum(out * projection)`.
fn output_and_gradients(
    model: &impl Module<TorchBackend>,
    x: &tch::Tensor,
) -> (HostTensor, Vec<(String, HostTensor)>) {
    let params = model.named_parameters().unwrap();
    for (_, p) in &params {
        let mut grad = p.grad();
        if grad.defined() {
            let _ = grad.zero_();
        }
    }
    let out = model.forward(x).unwrap();
    let projection = tch::Tensor::from_slice(&noise(out.numel(), 99)).reshape(out.size());
    (out.shallow_clone() * projection).sum(None).backward();
    let grads = params
        .iter()
        .map(|(name, p)| (name.clone(), from_tch(&p.grad()).unwrap()))
        .collect();
    (from_tch(&out.detach()).unwrap(), grads)
}

#[test]
fn the_fused_mlp_exports_as_standard_ops_that_python_runs() {
    kiln_fused_ops::register_layers().unwrap();
    let config =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/configs/digits-mlp-fused.toml");
    let table: toml::Table = toml::from_str(&std::fs::read_to_string(config).unwrap()).unwrap();
    let spec: Layer = table["model"].clone().try_into().unwrap();
    let ops: Vec<String> = spec
        .layers()
        .iter()
        .filter_map(|(_, l)| match l {
            Layer::Custom(c) => Some(c.op.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(ops, ["kiln::bias_gelu", "kiln::swish"]);

    TorchBackend::manual_seed(5);
    let mut model = TorchModel::new(&spec, Device::Cpu).unwrap();
    // Away from their initial values (zeros and 1), so both parameters matter.
    let mut state = model.state_dict().unwrap();
    state.insert("1.bias", HostTensor::new(noise(128, 3), [128]).unwrap());
    state.insert("3.beta", HostTensor::new(vec![1.3f32], [1]).unwrap());
    model.load_state_dict(&state).unwrap();

    let dir = kiln_testkit::scratch_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "fused-export");
    let file = dir.join("digits-mlp-fused.pt");
    model.set_mode(Mode::Eval);
    export_torchscript(&model, &file, &ExportOptions::default()).unwrap();

    let x_host = HostTensor::new(noise(16 * 64, 11), [16, 64]).unwrap();
    let x = to_tch(&x_host, Device::Cpu).unwrap();
    let script = ScriptModule::load(&file, Device::Cpu).unwrap();
    assert_eq!(script.state_dict().unwrap(), state);
    let (ours, our_grads) = output_and_gradients(&model, &x);
    let (theirs, their_grads) = output_and_gradients(&script, &x);
    let out_diff = max_diff(&ours, &theirs);
    assert!(out_diff <= 1e-6, "output differs by {out_diff:e}");
    let mut grad_diff = 0.0f64;
    for ((name, a), (other, b)) in our_grads.iter().zip(&their_grads) {
        assert_eq!(name, other);
        grad_diff = grad_diff.max(max_diff(a, b));
    }
    assert!(grad_diff <= 1e-5, "gradients differ by {grad_diff:e}");
    eprintln!("fused export: output {out_diff:e}, gradients {grad_diff:e} from the fused kernels");

    // Python, without Kiln's op library.
    let Some(python) =
        kiln_testkit::python("the_fused_mlp_exports_as_standard_ops_that_python_runs")
    else {
        return;
    };
    let mut io = StateDict::new();
    io.insert("x", x_host);
    io.insert("y_eval", ours.clone());
    io.insert("y_train", ours);
    for (key, value) in state.iter() {
        io.insert(format!("state.{key}"), value.clone());
        io.insert(format!("after.{key}"), value.clone());
    }
    let io_path = dir.join("io.safetensors");
    io.save_safetensors(&io_path, &Default::default()).unwrap();
    let keys: Vec<String> = spec
        .parameter_specs("")
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    let manifest = serde_json::json!([{
        "name": "digits_mlp_fused",
        "file": file,
        "io": io_path,
        "training": false,
        "keys": keys,
        "trainable": keys,
    }]);
    let manifest_path = dir.join("manifest.json");
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let results_path = dir.join("results.json");
    kiln_testkit::run_reference(
        &python,
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../torch-backend/tests/reference/torchscript_export_check.py"),
        &[manifest_path.as_path(), results_path.as_path()],
    );
    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&results_path).unwrap()).unwrap();
    let case = &results["digits_mlp_fused"];
    for measure in ["eval_output", "train_output"] {
        let diff = case[measure].as_f64().unwrap();
        assert!(diff <= 1e-6, "Python's {measure} differs by {diff:e}");
    }
    assert_eq!(case["state"].as_f64(), Some(0.0));
    assert_eq!(case["sgd_changed"].as_u64(), Some(keys.len() as u64));
}

#[test]
fn a_fused_op_with_other_parameters_is_refused_before_anything_is_written() {
    use kiln_core::export::ExportError;
    use kiln_core::model::{CustomConfig, Init};

    kiln_fused_ops::register_layers().unwrap();
    // The layer builds (its op checks its parameters when it runs); the export
    // asks the op's lowering, which refuses them.
    let spec = Layer::from(CustomConfig::new("kiln::swish").with_param("gamma", [1], Init::Ones));
    let model = TorchModel::new(&spec, Device::Cpu).unwrap();
    let dir = kiln_testkit::TempDir::new("fused-export-refused");
    let file = dir.path().join("swish.pt");
    let err = export_torchscript(&model, &file, &ExportOptions::default()).unwrap_err();
    assert!(matches!(err, ExportError::Unsupported { .. }), "{err}");
    assert!(err.to_string().contains("[\"beta\"]"), "{err}");
    assert!(!file.exists());
}
