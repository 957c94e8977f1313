//! The SavedModel fine-tuning example, as a user runs it: Python exports a Keras
//! model with `serve` and `train` signatures (`examples/savedmodel/export.py`);
//! the example's code (included here, so the test runs what a user copies)
//! fine-tunes it with the Trainer and writes a fine-tuned copy. Checked: the
//! original export untouched, the copy holding the last checkpoint's weights,
//! and Python's `tf.saved_model.load` of both models counting the accuracies the
//! example reported (the fine-tuned one higher) and serving the copy as Kiln does.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use kiln::prelude::*;
use kiln::tf::{SavedModel, SavedModelModule};

mod common;

#[allow(dead_code)] // its `main`
#[path = "../examples/savedmodel_finetune.rs"]
mod savedmodel_finetune;

/// Every file under `dir`, by path relative to it, with its bytes.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(at) = todo.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else {
                let bytes = std::fs::read(&path).unwrap();
                out.insert(path.strip_prefix(dir).unwrap().to_path_buf(), bytes);
            }
        }
    }
    out
}

#[test]
fn the_example_fine_tunes_a_keras_savedmodel_that_python_then_serves() {
    let _serial = common::serial();
    let test = "the_savedmodel_example";
    let Some(data) = kiln_testkit::digits(test) else {
        return;
    };
    let Some(python) = kiln_testkit::python(test) else {
        return;
    };
    let dir = common::scratch("savedmodel-example");
    let exported = dir.join("exported");
    let script = kiln_testkit::workspace_root().join("examples/savedmodel/export.py");
    let printed = kiln_testkit::run_reference(
        &python,
        &script,
        &[exported.as_os_str(), "--data".as_ref(), data.as_os_str()],
    );
    assert!(printed.contains("exported to"), "{printed}");
    let original = files(&exported);

    let run = dir.join("run");
    let outcome = savedmodel_finetune::run(&exported, &run, &data).unwrap();
    eprintln!(
        "example: validation accuracy {:.4} before, {:.4} after",
        outcome.before, outcome.after
    );
    assert!(outcome.after > 0.9, "{outcome:?}");
    assert_eq!(outcome.finetuned, run.join("finetuned"));
    assert_eq!(
        files(&exported),
        original,
        "the exported SavedModel was modified"
    );

    // The copy holds the fine-tuned weights: the last checkpoint's model state.
    let last = kiln::train::Checkpoint::load(&run.join("checkpoints/last.safetensors")).unwrap();
    let copy = SavedModelModule::load(&outcome.finetuned).unwrap();
    let copied = copy.state_dict().unwrap();
    assert_eq!(copied.len(), 4, "two kernels, two biases");
    assert_eq!(copied, last.model, "the copy against the last checkpoint");
    let start = SavedModelModule::load(&exported)
        .unwrap()
        .state_dict()
        .unwrap();
    assert_ne!(copied, start, "fine-tuning changed nothing");

    // Python serves both models on the held-out rows.
    let (_, (val_x, val_y)) = savedmodel_finetune::digits(&data).unwrap();
    let rows = val_y.numel();
    let few =
        HostTensor::new(val_x.as_slice::<f32>().unwrap()[..5 * 64].to_vec(), [5, 64]).unwrap();
    let mut held_out = StateDict::new();
    held_out.insert("x", val_x);
    held_out.insert("y", val_y);
    let held_out_path = dir.join("held_out.safetensors");
    held_out
        .save_safetensors(&held_out_path, &Default::default())
        .unwrap();
    let check = r#"
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, tensorflow as tf
from safetensors.numpy import load_file
rows = load_file(sys.argv[1])
out = {}
for key, path in (("before", sys.argv[2]), ("after", sys.argv[3])):
    model = tf.saved_model.load(path)  # kept alive while its functions run
    logits = model.serve(tf.constant(rows["x"])).numpy()
    out[key] = int((logits.argmax(1) == rows["y"]).sum())
    out[key + "_logits"] = logits[:5].reshape(-1).tolist()
print(json.dumps(out))
"#;
    let out = Command::new(&python)
        .args(["-c", check])
        .args([&held_out_path, &exported, &outcome.finetuned])
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tf.saved_model.load: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let python_says: serde_json::Value = serde_json::from_slice(out.stdout.trim_ascii())
        .unwrap_or_else(|e| {
            panic!("{e}: {}", String::from_utf8_lossy(&out.stdout));
        });
    let counted = |key: &str| python_says[key].as_u64().unwrap() as f64 / rows as f64;
    let (before, after) = (counted("before"), counted("after"));
    eprintln!("Python: validation accuracy {before:.4} before, {after:.4} after");
    // Argmax over the same weights, computed in another process: one row may tip.
    let tip = 1.0 / rows as f64 + 1e-12;
    assert!(
        (before - outcome.before).abs() <= tip,
        "before: {before} vs {outcome:?}"
    );
    assert!(
        (after - outcome.after).abs() <= tip,
        "after: {after} vs {outcome:?}"
    );
    assert!(
        after > before + 0.2,
        "fine-tuning on all ten digits should lift a model trained on 0-4: {before} -> {after}"
    );

    // Kiln's `serve` on the copy gives Python's logits.
    let ours = SavedModel::load(&outcome.finetuned)
        .unwrap()
        .run("serve", &[("x", &few)])
        .unwrap();
    let logits = ours.values().next().unwrap();
    assert_eq!(logits.dims(), &[5, 10]);
    let python_logits: Vec<f64> = python_says["after_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    kiln_testkit::assert_close(
        "serve logits of the fine-tuned copy",
        &logits.to_f64_vec(),
        &python_logits,
        1e-5,
        "TensorFlow (Python)",
    );
}
