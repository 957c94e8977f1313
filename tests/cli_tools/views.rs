//! `[logging]`'s TensorBoard views through the CLI: rates, gradient norms,
//! histograms and misclassified images, read back by TensorBoard.

use std::path::Path;

use super::common::{config, digits_available, kiln_fails, losses, scratch, serial, train};
use super::epoch_column;
use kiln::train::Checkpoint;

/// `[logging]`'s TensorBoard views, read back by TensorBoard's own
/// `EventAccumulator`: each group's rate and the gradient norms at every
/// logged step, and weight and gradient histograms whose statistics are those
/// of the checkpoint written at the same step. TensorFlow refuses
/// `grad_norms` before writing anything.
#[test]
fn tensorboard_views_read_back_in_tensorboard() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let Some(python) = kiln_testkit::python("TensorBoard views through the CLI") else {
        return;
    };
    let dir = scratch("views");
    let logging = std::fs::read_to_string(config(&dir, 0)).unwrap().replace(
        "[logging]\ntensorboard = false\n",
        "[logging]\ntensorboard = true\nlr_per_group = true\ngrad_norms = true\n\
         histograms_every_n_steps = 5\n",
    );
    let text = logging.replace(
        "[training]\n",
        "[[param_groups]]\nname = \"head\"\nparams = { prefix = \"3.\" }\nlr = 0.001\n\n\
             [training]\n",
    );
    let cfg = dir.join("views.toml");
    std::fs::write(&cfg, &text).unwrap();
    let run = dir.join("run");
    train(cfg.to_str().unwrap(), &run, &["--epochs", "1"]);
    let stdout = kiln_testkit::run_reference_script!(
        &python,
        "tensorboard_views.py",
        &[run.join("tensorboard").as_os_str()]
    );
    let read: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let steps = losses(&run).len();
    let scalar = |tag: &str| {
        read["scalars"][tag]
            .as_array()
            .unwrap_or_else(|| panic!("no scalar {tag}: {stdout}"))
            .clone()
    };
    for tag in ["grad_norm/total", "grad_norm/group_0", "grad_norm/group_1"] {
        let values = scalar(tag);
        assert_eq!(values.len(), steps, "{tag} at every step");
        assert!(values.iter().all(|v| v[1].as_f64().unwrap() > 0.0), "{tag}");
    }
    // Adam at 0.003 and the head's 0.001, with StepLR (0.7) after the epoch.
    let rates = |tag: &str| {
        scalar(tag)
            .iter()
            .map(|v| v[1].as_f64().unwrap())
            .collect::<Vec<_>>()
    };
    assert!(rates("lr/group_0").iter().all(|r| (r - 0.001).abs() < 1e-9));
    assert!(rates("lr/group_1").iter().all(|r| (r - 0.003).abs() < 1e-9));

    // Histograms at steps 5, 10, ...: those of the checkpoint of that step.
    let histogram = &read["histograms"]["weights/0.weight"];
    let rows = histogram.as_array().unwrap_or_else(|| panic!("{stdout}"));
    assert_eq!(rows.len(), steps / 5);
    assert!(
        read["histograms"]["gradients/3.bias"].is_array(),
        "{stdout}"
    );
    // The last multiple of 5: its checkpoint is among the 3 kept.
    let step = steps / 5 * 5;
    let checkpoint =
        Checkpoint::load(&run.join(format!("checkpoints/step-{step:08}.safetensors"))).unwrap();
    let weights = checkpoint.model.get("0.weight").unwrap().to_f64_vec();
    let row = rows.iter().find(|r| r[0] == step as u64).unwrap();
    let at = |i: usize| row[i].as_f64().unwrap();
    let min = weights.iter().copied().fold(f64::INFINITY, f64::min);
    let max = weights.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = weights.iter().sum();
    let squares: f64 = weights.iter().map(|w| w * w).sum();
    assert_eq!((at(1), at(2), at(3)), (min, max, weights.len() as f64));
    assert!((at(4) - sum).abs() < 1e-9 && (at(5) - squares).abs() < 1e-9);
    let counts: f64 = row[7]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_f64().unwrap())
        .sum();
    assert_eq!(counts, weights.len() as f64);

    // On TensorFlow, gradient norms are refused before the run starts.
    let tf = dir.join("tf.toml");
    std::fs::write(&tf, format!("backend = \"tensorflow\"\n{logging}")).unwrap();
    let out = dir.join("tf-run");
    let err = kiln_fails(&[
        "train",
        "--config",
        tf.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(err.contains("logging.grad_norms"), "{err}");
    assert!(!out.exists(), "nothing written");

    // The model graph: TensorFlow's, read back by TensorBoard; libtorch has none.
    let graphed = logging.replace("grad_norms = true", "graph = true");
    std::fs::write(&tf, format!("backend = \"tensorflow\"\n{graphed}")).unwrap();
    train(tf.to_str().unwrap(), &out, &["--epochs", "1"]);
    let stdout = kiln_testkit::run_reference_script!(
        &python,
        "tensorboard_views.py",
        &[out.join("tensorboard").as_os_str()]
    );
    let read: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let ops: Vec<&str> = read["graph"]["ops"]
        .as_array()
        .unwrap_or_else(|| panic!("no graph: {stdout}"))
        .iter()
        .map(|o| o.as_str().unwrap())
        .collect();
    // The two linear layers' products, forward and backward, and Adam's update.
    for op in ["MatMul", "VarHandleOp", "ResourceApplyAdam"] {
        assert!(ops.contains(&op), "{op} not in {ops:?}");
    }
    let torch = dir.join("graph.toml");
    std::fs::write(&torch, &graphed).unwrap();
    let refused = dir.join("torch-graph");
    let err = kiln_fails(&[
        "train",
        "--config",
        torch.to_str().unwrap(),
        "--output",
        refused.to_str().unwrap(),
    ]);
    assert!(
        err.contains("logging.graph") && err.contains("keeps no dataflow graph"),
        "{err}"
    );
    assert!(!refused.exists(), "nothing written");
}

/// A small CNN on the digits as `[1, 8, 8]` images, logging misclassified
/// validation images (`extra` goes at the top of the config).
fn misclassified_config(dir: &Path, name: &str, extra: &str, logging: &str) -> String {
    let text = format!(
        r#"seed = 4
output_dir = "{out}"
{extra}
[data]
dataset = "digits"
batch_size = 64
workers = 1
scale = 16.0
val_fraction = 0.2
input_shape = [1, 8, 8]

[model]
type = "sequential"
layers = [
  {{ type = "conv2d", in_channels = 1, out_channels = 8, kernel_size = 3, padding = 1 }},
  {{ type = "relu" }},
  {{ type = "max_pool2d", kernel_size = 2 }},
  {{ type = "flatten" }},
  {{ type = "linear", in_features = 128, out_features = 10 }},
]

[loss]
type = "cross_entropy"

[optimizer]
type = "adam"
lr = 0.01

[training]
epochs = 2

[logging]
plots = false
progress = false
{logging}
"#,
        out = dir.join("default-out").display()
    );
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

/// `[logging] misclassified_images`, on both engines: after each validation
/// TensorBoard's `EventAccumulator` reads a grid and a table whose count of
/// misclassified samples is `val_accuracy`'s; each sample's class is the
/// split's label, and the grid is, pixel for pixel, what torchvision's
/// `make_grid(normalize=True, scale_each=True)` and `SummaryWriter.add_image`
/// make of those samples. PyTorch, running the final weights over the split,
/// finds the same first misclassified samples, predictions and probabilities
/// as the last epoch's table. Data or settings that cannot give images are
/// refused before anything is written.
#[test]
fn misclassified_images_read_back_in_tensorboard() {
    let _serial = serial();
    let Some(digits) = kiln_testkit::digits("misclassified images through the CLI") else {
        return;
    };
    let Some(python) = kiln_testkit::python("misclassified images through the CLI") else {
        return;
    };
    let dir = scratch("misclassified");
    let (_, val) = kiln::data::split_indices(1797, 0.2, 4).unwrap();
    let indices = dir.join("val.json");
    std::fs::write(&indices, serde_json::to_string(&val).unwrap()).unwrap();
    for (backend, epochs) in [("torch", 2), ("tensorflow", 1)] {
        let cfg = misclassified_config(
            &dir,
            &format!("{backend}.toml"),
            &format!("backend = \"{backend}\""),
            "misclassified_images = 12",
        );
        let run = dir.join(backend);
        train(&cfg, &run, &["--epochs", &epochs.to_string()]);
        let stdout = kiln_testkit::run_reference_script!(
            &python,
            "misclassified_images.py",
            &[
                run.join("tensorboard").as_os_str(),
                digits.as_os_str(),
                indices.as_os_str(),
                run.join("model.safetensors").as_os_str(),
                "12".as_ref(),
            ]
        );
        let read: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let logged = read["epochs"].as_array().unwrap();
        let accuracy = epoch_column(&run, "val_accuracy");
        assert_eq!(
            logged.len(),
            epochs,
            "{backend}: one per validation: {stdout}"
        );
        for (epoch, entry) in logged.iter().enumerate() {
            let number = |key: &str| {
                entry[key]
                    .as_u64()
                    .unwrap_or_else(|| panic!("{key}: {entry}"))
            };
            assert_eq!(number("step"), epoch as u64);
            assert_eq!(number("seen"), val.len() as u64);
            let wrong = number("wrong");
            let expected = ((1.0 - accuracy[epoch]) * val.len() as f64).round() as u64;
            assert_eq!(
                wrong, expected,
                "{backend}: val_accuracy {}",
                accuracy[epoch]
            );
            let rows = entry["rows"].as_array().unwrap();
            let shown = wrong.min(12) as usize;
            assert_eq!(rows.len(), shown, "{entry}");
            assert!(entry["labels_match"].as_bool().unwrap(), "{entry}");
            for row in rows {
                assert_ne!(row[1], row[2], "{row}: class and prediction differ");
                let p = row[3].as_f64().unwrap();
                assert!(
                    p > 0.1 && p <= 1.0,
                    "{row}: the predicted class's probability"
                );
            }
            if shown > 0 {
                // make_grid: 8 to a row, 2 pixels between and around.
                let (across, down) = (shown.min(8), shown.div_ceil(8));
                let size = |n: usize| if shown == 1 { 8 } else { n * 10 + 2 };
                assert_eq!(number("width"), size(across) as u64);
                assert_eq!(number("height"), size(down) as u64);
                assert_eq!(number("png_width"), number("width"));
                assert_eq!(number("png_height"), number("height"));
                assert_eq!(number("pixels_max_diff"), 0, "{backend}: the grid's pixels");
            }
        }
        // PyTorch on the final weights: the last table's samples.
        let last = logged.last().unwrap();
        let torch = &read["torch"];
        assert_eq!(torch["wrong"], last["wrong"], "{backend}: {stdout}");
        let (ours, theirs) = (
            last["rows"].as_array().unwrap(),
            torch["rows"].as_array().unwrap(),
        );
        assert_eq!(ours.len(), theirs.len());
        for (a, b) in ours.iter().zip(theirs) {
            let first3 = |v: &serde_json::Value| v.as_array().unwrap()[..3].to_vec();
            assert_eq!(first3(a), first3(b), "{backend}: sample, class, prediction");
            let (pa, pb) = (a[3].as_f64().unwrap(), b[3].as_f64().unwrap());
            assert!(
                (pa - pb).abs() < 6e-4,
                "{backend}: probability {pa} vs {pb}"
            );
        }
    }

    // Refused before anything is written: flat inputs, TensorBoard off, no
    // validation split.
    let cnn = "{ type = \"conv2d\", in_channels = 1, out_channels = 8, kernel_size = 3, \
               padding = 1 },\n  { type = \"relu\" },\n  { type = \"max_pool2d\", kernel_size = 2 \
               },\n  { type = \"flatten\" },\n  { type = \"linear\", in_features = 128";
    // (name, edits of the config, what the error says)
    type Refusal<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str);
    let refusals: [Refusal<'_>; 3] = [
        (
            "flat",
            &[
                ("input_shape = [1, 8, 8]\n", ""),
                (cnn, "{ type = \"linear\", in_features = 64"),
            ],
            "is [64]",
        ),
        (
            "no-tensorboard",
            &[(
                "misclassified_images",
                "tensorboard = false\nmisclassified_images",
            )],
            "logging.tensorboard = false",
        ),
        (
            "no-validation",
            &[("val_fraction = 0.2", "val_fraction = 0.0")],
            "has none",
        ),
    ];
    for (name, edits, expected) in refusals {
        let cfg = misclassified_config(
            &dir,
            &format!("{name}.toml"),
            "",
            "misclassified_images = 4",
        );
        let mut text = std::fs::read_to_string(&cfg).unwrap();
        for (from, to) in edits {
            assert!(text.contains(from), "{name}: {from}");
            text = text.replace(from, to);
        }
        std::fs::write(&cfg, text).unwrap();
        let out = dir.join(name);
        let err = kiln_fails(&["train", "--config", &cfg, "--output", out.to_str().unwrap()]);
        assert!(
            err.contains("logging.misclassified_images") && err.contains(expected),
            "{name}: {err}"
        );
        assert!(!out.exists(), "{name}: nothing written");
    }
}
