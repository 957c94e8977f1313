//! The fine-tuning example and its config, as a user runs them: Python makes the
//! backbone (`examples/finetune/backbone.py`); the example's code (included
//! here, so the test runs exactly what a user copies) trains a head on it,
//! resumes and saves; `kiln train` trains `examples/configs/finetune.toml`.
//! Checked: validation accuracy, the frozen backbone (batch-norm statistics
//! included) bit for bit as in its file, and the exported backbone loading in
//! Python's `torch.jit.load` with those values.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::{Path, PathBuf};
use std::process::Command;

use kiln::prelude::*;
use kiln::torch::ScriptModule;

mod common;

#[allow(dead_code)] // its `main`
#[path = "../examples/finetune.rs"]
mod finetune;

/// Runs `examples/finetune/backbone.py` into `dir`, returning the backbone's
/// path, or `None` after a skip (no Python or no digits).
fn backbone(test: &str, dir: &Path) -> Option<(PathBuf, PathBuf)> {
    let digits = kiln_testkit::digits(test)?;
    let python = kiln_testkit::python(test)?;
    let path = dir.join("backbone.pt");
    let script = kiln_testkit::workspace_root().join("examples/finetune/backbone.py");
    let printed = kiln_testkit::run_reference(
        &python,
        &script,
        &[path.as_os_str(), "--data".as_ref(), digits.as_os_str()],
    );
    assert!(printed.contains("-> [N, 128]"), "{printed}");
    Some((python, path))
}

/// The backbone file's parameters and buffers, as libtorch loads them.
fn original(backbone: &Path) -> StateDict {
    ScriptModule::load(backbone, Device::Cpu)
        .unwrap()
        .state_dict()
        .unwrap()
}

/// Asserts that `model` holds every entry of `backbone` under `prefix`, with the
/// same dtype, shape and bytes.
fn assert_bitwise(what: &str, model: &StateDict, prefix: &str, backbone: &StateDict) {
    assert_eq!(
        backbone.len(),
        14,
        "conv, bn: weights, biases and statistics"
    );
    for (name, expected) in backbone.iter() {
        let key = format!("{prefix}{name}");
        let ours = model
            .get(&key)
            .unwrap_or_else(|| panic!("{what}: no {key}"));
        assert_eq!(
            (ours.dtype(), ours.dims(), ours.as_bytes()),
            (expected.dtype(), expected.dims(), expected.as_bytes()),
            "{what}: {key} differs from the backbone file"
        );
    }
}

#[test]
fn the_example_fine_tunes_a_frozen_backbone_resumes_and_exports_it() {
    let _serial = common::serial();
    let test = "the_finetune_example";
    let dir = common::scratch("finetune-example");
    let Some((python, pt)) = backbone(test, &dir) else {
        return;
    };
    let digits = kiln_testkit::digits(test).unwrap();
    let run = dir.join("run");
    let accuracy = finetune::run(&pt, &run, &digits).unwrap();
    eprintln!("example: validation accuracy {accuracy:.4}");
    assert!(accuracy > 0.9, "a linear head on the features: {accuracy}");

    let expected = original(&pt);
    let (weights, _) = StateDict::load_safetensors(run.join("model.safetensors")).unwrap();
    assert_eq!(
        weights.len(),
        14 + 2,
        "the backbone's entries and the head's"
    );
    assert_bitwise("model.safetensors", &weights, "0.", &expected);
    let last = kiln::train::Checkpoint::load(&run.join("checkpoints/last.safetensors")).unwrap();
    assert_eq!(last.epoch, 6, "resumed after 3 epochs, trained to 6");
    assert_bitwise("the last checkpoint", &last.model, "0.", &expected);
    for name in ["1.weight", "1.bias"] {
        assert_eq!(last.model.get(name), weights.get(name), "{name}");
    }
    let exported = run.join("backbone.pt");
    assert_bitwise("backbone.pt", &original(&exported), "", &expected);

    // Python loads the exported backbone, in eval mode, with the file's values,
    // and it computes the same features as the original.
    let check = r#"
import sys, torch
original, exported = torch.jit.load(sys.argv[1]), torch.jit.load(sys.argv[2])
assert not exported.training, "exported in eval mode"
a, b = original.state_dict(), exported.state_dict()
assert a.keys() == b.keys(), (a.keys(), b.keys())
for k in a:
    assert torch.equal(a[k], b[k]), k
original.eval()
x = torch.rand(4, 1, 8, 8)
assert torch.equal(original(x), exported(x))
print("ok", len(b))
"#;
    let out = Command::new(&python)
        .args(["-c", check])
        .args([&pt, &exported])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "torch.jit.load of {}: {}",
        exported.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok 14");
}

#[test]
fn the_finetune_config_trains_a_frozen_backbone_through_the_cli() {
    let _serial = common::serial();
    let test = "the_finetune_config";
    let dir = common::scratch("finetune-config");
    let Some((_, pt)) = backbone(test, &dir) else {
        return;
    };
    // The config as shipped, its backbone path (relative to the working
    // directory) made absolute.
    let shipped = std::fs::read_to_string(
        kiln_testkit::workspace_root().join("examples/configs/finetune.toml"),
    )
    .unwrap();
    let layer = r#"path = "backbone.pt""#;
    assert_eq!(shipped.matches(layer).count(), 1, "{shipped}");
    let config = dir.join("finetune.toml");
    std::fs::write(
        &config,
        shipped.replace(layer, &format!("path = {:?}", pt.to_str().unwrap())),
    )
    .unwrap();
    let run = dir.join("run");
    let printed = common::train(config.to_str().unwrap(), &run, &["--no-progress"]);
    // "kiln: done in 1.2s, 138 steps; validation loss 0.0981, accuracy 97.50%"
    let accuracy: f64 = printed
        .lines()
        .find(|line| line.starts_with("kiln: done"))
        .and_then(|line| line.split("accuracy ").nth(1))
        .and_then(|rest| rest.split('%').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no validation accuracy in\n{printed}"));
    eprintln!("kiln train: validation accuracy {accuracy}%");
    assert!(accuracy > 90.0, "{printed}");
    let (weights, _) = StateDict::load_safetensors(run.join("model.safetensors")).unwrap();
    assert_bitwise("model.safetensors", &weights, "0.", &original(&pt));
}
