//! The hand-written training loop example (`examples/manual_loop.rs`, included
//! here, so the test runs what a user copies): the one generic function trains
//! the digits on both backends, writes the weights it refuses to write over,
//! and PyTorch, given those weights, classifies the held-out rows as the
//! example reported.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::process::Command;

use kiln::prelude::*;

mod common;

#[allow(dead_code)] // its `main`
#[path = "../examples/manual_loop.rs"]
mod manual_loop;

const EPOCHS: u64 = 5;

#[test]
fn the_manual_loop_trains_on_both_backends_and_pytorch_agrees_with_its_accuracy() {
    let _serial = common::serial();
    let test = "the_manual_loop_example";
    let Some(data) = kiln_testkit::digits(test) else {
        return;
    };
    let dir = common::scratch("manual-loop-example");
    let options = |backend: &str| manual_loop::Options {
        data: data.clone(),
        epochs: EPOCHS,
        seed: 0,
        device: Device::Cpu,
        save: Some(dir.join(format!("{backend}.safetensors"))),
    };

    let torch = manual_loop::train::<TorchBackend>(&options("torch")).unwrap();
    let tf = manual_loop::train::<TfBackend>(&options("tensorflow")).unwrap();
    // The two engines draw different initial weights and dropout masks: both
    // must learn, not agree.
    for (name, report) in [("torch", &torch), ("tensorflow", &tf)] {
        eprintln!(
            "{name}: train losses {:?}, validation accuracy {:.4}",
            report.train_losses, report.val_accuracy
        );
        assert_eq!(report.train_losses.len(), EPOCHS as usize, "{name}");
        assert!(
            report.train_losses[EPOCHS as usize - 1] < 0.5 * report.train_losses[0],
            "{name}: the training loss does not fall: {:?}",
            report.train_losses
        );
        assert!(
            report.val_accuracy > 0.9,
            "{name}: validation accuracy {}",
            report.val_accuracy
        );
    }

    // An existing --save path is refused, before training, and left as it was.
    let saved = options("torch").save.unwrap();
    let bytes = std::fs::read(&saved).unwrap();
    let err = manual_loop::train::<TorchBackend>(&options("torch")).unwrap_err();
    assert!(err.to_string().contains("exists"), "{err:#}");
    assert_eq!(std::fs::read(&saved).unwrap(), bytes, "{}", saved.display());

    // PyTorch loads each file into the same network and classifies the
    // held-out rows: the accuracy the example counted by hand.
    let Some(python) = kiln_testkit::python(test) else {
        return;
    };
    let (_, (val_x, val_y)) = manual_loop::digits(&data, 0).unwrap();
    let rows = val_y.numel();
    let mut held_out = StateDict::new();
    held_out.insert("x", val_x);
    held_out.insert("y", val_y);
    let held_out_path = dir.join("held_out.safetensors");
    held_out
        .save_safetensors(&held_out_path, &Default::default())
        .unwrap();
    let check = r#"
import sys, torch
from torch import nn
from safetensors.torch import load_file
rows = load_file(sys.argv[1])
for path in sys.argv[2:]:
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))
    model.load_state_dict(load_file(path))  # strict: the same names and shapes
    model.eval()
    with torch.no_grad():
        correct = (model(rows["x"]).argmax(1) == rows["y"]).sum().item()
    print(correct)
"#;
    let out = Command::new(&python)
        .args(["-c", check])
        .arg(&held_out_path)
        .args(["torch", "tensorflow"].map(|b| dir.join(format!("{b}.safetensors"))))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "PyTorch on the saved weights: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let correct: Vec<usize> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| line.trim().parse().unwrap())
        .collect();
    assert_eq!(correct.len(), 2, "{correct:?}");
    for ((name, report), correct) in [("torch", &torch), ("tensorflow", &tf)]
        .into_iter()
        .zip(correct)
    {
        let pytorch = correct as f64 / rows as f64;
        eprintln!("{name}: PyTorch's accuracy on the saved weights {pytorch:.4}");
        // Argmax over the same weights, rounded differently: one row may tip.
        assert!(
            (pytorch - report.val_accuracy).abs() <= 1.0 / rows as f64 + 1e-12,
            "{name}: PyTorch counts {correct}/{rows} correct, the example {}",
            report.val_accuracy
        );
    }
}
