//! The training tools through the `kiln` CLI: weight averaging (EMA, SWA),
//! the learning-rate finder (`kiln tune lr`), the model summary (`kiln inspect
//! CONFIG` and at the start of a run), the TensorBoard views of `[logging]`, and
//! the profiler (`kiln train --profile`).

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::Path;

use common::{config, digits_available, kiln_fails, kiln_stdout, losses, scratch, serial, train};
use kiln::core::state_dict::StateDict;
use kiln::train::Checkpoint;

mod common;

/// The column `name` of a run's `epochs.csv`, one value per epoch.
fn epoch_column(run: &Path, name: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(run.join("epochs.csv")).unwrap();
    let header: Vec<&str> = text.lines().next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == name).unwrap();
    text.lines()
        .skip(1)
        .map(|l| l.split(',').nth(col).unwrap().parse().unwrap())
        .collect()
}

/// `[training] ema`: the same training steps as without it (the losses are
/// equal), validation with the average (other validation losses), the
/// average checkpointed with its update count and written as the run's
/// `model.safetensors`, and a resumed run ending on the same average.
#[test]
fn ema_validates_checkpoints_resumes_and_writes_the_average() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("ema");
    let plain = config(&dir, 0);
    let text = std::fs::read_to_string(&plain).unwrap();
    let averaged = dir.join("ema.toml");
    std::fs::write(
        &averaged,
        text.replace(
            "[training]\n",
            "[training]\nema = { decay = 0.9, every_n_steps = 2, start_step = 4 }\n",
        ),
    )
    .unwrap();
    let (plain, averaged) = (plain.to_str().unwrap(), averaged.to_str().unwrap());
    let (a, b, c) = (dir.join("ema"), dir.join("plain"), dir.join("resumed"));
    train(averaged, &a, &["--epochs", "2"]);
    train(plain, &b, &["--epochs", "2"]);
    assert_eq!(
        losses(&a),
        losses(&b),
        "the average does not touch training"
    );
    let val_loss = |run: &Path| epoch_column(run, "val_loss");
    let (va, vb) = (val_loss(&a), val_loss(&b));
    assert!(va.iter().zip(&vb).all(|(x, y)| x != y), "{va:?} {vb:?}");

    let last = kiln::train::Checkpointer::last_path(&a.join("checkpoints"));
    let checkpoint = Checkpoint::load(&last).unwrap();
    let saved = checkpoint
        .averaged
        .as_ref()
        .expect("the checkpoint holds the average");
    let steps = losses(&a).len() as u64;
    assert_eq!(checkpoint.step, steps, "a checkpoint at the last step");
    assert_eq!(
        saved.updates,
        (4..=steps).filter(|s| s % 2 == 0).count() as u64
    );
    let (model, _) = StateDict::load_safetensors(a.join("model.safetensors")).unwrap();
    let (trained, _) = StateDict::load_safetensors(b.join("model.safetensors")).unwrap();
    for (name, t) in saved.tensors.iter() {
        assert_eq!(
            model.get(name),
            Some(t),
            "model.safetensors holds the average's {name}"
        );
        assert_ne!(trained.get(name), Some(t), "{name}");
    }
    // `kiln inspect` lists the average with its tensors.
    let printed = kiln_stdout(&["inspect", last.to_str().unwrap()]);
    assert!(
        printed.contains(&format!(
            "averaged    EMA of {} updates, {} tensors",
            saved.updates,
            saved.tensors.len()
        )),
        "{printed}"
    );
    for (name, t) in saved.tensors.iter() {
        let row = printed
            .lines()
            .find(|l| l.split_whitespace().next() == Some(&format!("averaged.{name}")))
            .unwrap_or_else(|| panic!("no averaged.{name} in\n{printed}"));
        assert!(row.ends_with(&t.numel().to_string()), "{row}");
    }
    assert!(
        printed.contains(&format!("{} averaged tensors", saved.tensors.len())),
        "{printed}"
    );

    // `buffers = false` keeps the model's running statistics; `validate = false`
    // validates the training weights, as a run without an average.
    let bn = text.replace(
        "  { type = \"relu\" },",
        "  { type = \"batch_norm1d\", num_features = 64 },\n  { type = \"relu\" },",
    );
    assert_ne!(bn, text);
    let (bn_plain, bn_ema) = (dir.join("bn.toml"), dir.join("bn-ema.toml"));
    std::fs::write(&bn_plain, &bn).unwrap();
    std::fs::write(
        &bn_ema,
        bn.replace(
            "[training]\n",
            "[training]\nema = { decay = 0.9, warmup = true, buffers = false, validate = false }\n",
        ),
    )
    .unwrap();
    let (d, e) = (dir.join("bn-ema"), dir.join("bn-plain"));
    train(bn_ema.to_str().unwrap(), &d, &["--epochs", "1"]);
    train(bn_plain.to_str().unwrap(), &e, &["--epochs", "1"]);
    assert_eq!(
        val_loss(&d)[..1],
        val_loss(&e)[..1],
        "validated with the training weights"
    );
    let (wd, _) = StateDict::load_safetensors(d.join("model.safetensors")).unwrap();
    let (we, _) = StateDict::load_safetensors(e.join("model.safetensors")).unwrap();
    assert_eq!(wd.get("1.running_mean"), we.get("1.running_mean"));
    assert_ne!(wd.get("1.weight"), we.get("1.weight"));
    let last = kiln::train::Checkpointer::last_path(&d.join("checkpoints"));
    let saved = Checkpoint::load(&last).unwrap().averaged.unwrap();
    assert!(saved.tensors.get("1.weight").is_some());
    assert!(saved.tensors.get("1.running_mean").is_none());

    train(averaged, &c, &["--epochs", "1"]);
    train(averaged, &c, &["--epochs", "2", "--resume", "auto"]);
    let (resumed, _) = StateDict::load_safetensors(c.join("model.safetensors")).unwrap();
    for (name, t) in model.iter() {
        assert!(
            resumed.get(name).unwrap().allclose(t, 1e-4, 1e-6),
            "the resumed run's average of {name}"
        );
    }
}

/// `kiln tune lr`: the range test on the config's data, model and optimizer,
/// its table and plot in a directory of its own, the suggestion printed and
/// written into a new copy of the config (never over a file, the config
/// included); the same on TensorFlow.
#[test]
fn tune_lr_suggests_a_rate_and_writes_only_new_files() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("tune-lr");
    let cfg = config(&dir, 0);
    let original = std::fs::read(&cfg).unwrap();
    let (out, tuned) = (dir.join("lr"), dir.join("tuned.toml"));
    let args = [
        "tune",
        "lr",
        "--config",
        cfg.to_str().unwrap(),
        "--min-lr",
        "1e-5",
        "--max-lr",
        "10",
        "--num-training",
        "60",
        "--mode",
        "exponential",
        "--early-stop-threshold",
        "4",
        "--output",
        out.to_str().unwrap(),
        "--suggestion",
        "log",
        "--save-config",
        tuned.to_str().unwrap(),
    ];
    let stdout = kiln_stdout(&args);
    let suggested: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("kiln: suggested learning rate "))
        .unwrap_or_else(|| panic!("{stdout}"))
        .parse()
        .unwrap();
    let csv = std::fs::read_to_string(out.join("lr_find.csv")).unwrap();
    let rows: Vec<(f64, f64)> = csv
        .lines()
        .skip(1)
        .map(|l| {
            let cells: Vec<&str> = l.split(',').collect();
            (cells[1].parse().unwrap(), cells[2].parse().unwrap())
        })
        .collect();
    assert!(rows.len() > 12 && rows.len() <= 60, "{csv}");
    assert_eq!(rows[0].0, 1e-5);
    let at = rows
        .iter()
        .position(|r| r.0 == suggested)
        .expect("a rate of the sweep");
    assert!((10..rows.len() - 1).contains(&at), "{at} of {}", rows.len());
    let recorded = kiln::train::LrFinderResult {
        lrs: rows.iter().map(|r| r.0).collect(),
        losses: rows.iter().map(|r| r.1).collect(),
        stopped_early: rows.len() < 60,
    };
    assert_eq!(
        recorded.suggestion_log(),
        Some(suggested),
        "--suggestion log"
    );
    assert!(std::fs::metadata(out.join("lr_find.png")).unwrap().len() > 1000);
    assert_eq!(
        std::fs::read(&cfg).unwrap(),
        original,
        "the config is untouched"
    );
    let text = std::fs::read_to_string(&tuned).unwrap();
    let value: toml::Value = toml::from_str(&text).unwrap();
    assert_eq!(value["optimizer"]["lr"].as_float(), Some(suggested));
    assert_eq!(value["optimizer"]["type"].as_str(), Some("adam"));

    // Again: the copy exists, so nothing runs and nothing is written.
    let err = kiln_fails(&args);
    assert!(
        err.contains("--save-config") && err.contains("exists"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&tuned).unwrap(), text);
    // An output directory that holds other files is refused too.
    let err = kiln_fails(&args[..18]);
    assert!(err.contains(out.to_str().unwrap()), "{err}");

    // On TensorFlow, through its executable.
    let tf = dir.join("lr-tf");
    let stdout = kiln_stdout(&[
        "tune",
        "lr",
        "--config",
        cfg.to_str().unwrap(),
        "--backend",
        "tensorflow",
        "--min-lr",
        "1e-4",
        "--max-lr",
        "1",
        "--num-training",
        "20",
        "--mode",
        "linear",
        "--early-stop-threshold",
        "0",
        "--output",
        tf.to_str().unwrap(),
    ]);
    assert!(stdout.contains("20 steps from 1e-4 to 1e0"), "{stdout}");
    assert_eq!(
        std::fs::read_to_string(tf.join("lr_find.csv"))
            .unwrap()
            .lines()
            .count(),
        21
    );
}

/// `[training] swa` through the CLI: the schedule anneals from the StepLR rate
/// in effect when averaging begins, the checkpoint holds the equal-weight
/// average, and `model.safetensors` is that average with batch norm's
/// statistics recomputed over the training data; a run resumed mid-average
/// ends with the same model.
#[test]
fn swa_anneals_averages_and_writes_the_average_with_its_statistics() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("swa");
    let text = std::fs::read_to_string(config(&dir, 0)).unwrap();
    let swa = text
        .replace(
            "  { type = \"relu\" },",
            "  { type = \"batch_norm1d\", num_features = 64 },\n  { type = \"relu\" },",
        )
        .replace(
            "[training]\n",
            "[training]\nswa = { lrs = 0.001, epoch_start = 1, annealing_epochs = 2, \
             annealing_strategy = \"linear\" }\n",
        );
    let cfg = dir.join("swa.toml");
    std::fs::write(&cfg, swa).unwrap();
    let cfg = cfg.to_str().unwrap();
    let (a, b) = (dir.join("swa"), dir.join("resumed"));
    train(cfg, &a, &["--epochs", "3"]);

    // Adam at 0.003, StepLR 0.7 after epoch 0, then SWALR from 0.0021 to 0.001
    // over two epochs, linearly: 0.0021, 0.00155.
    let lrs = epoch_column(&a, "lr");
    for (got, want) in lrs.iter().zip([0.003, 0.0021, 0.00155]) {
        assert!((got - want).abs() < 1e-12, "{lrs:?}");
    }
    assert_eq!(lrs.len(), 3);

    let checkpoint = Checkpoint::load(&kiln::train::Checkpointer::last_path(
        &a.join("checkpoints"),
    ))
    .unwrap();
    let saved = checkpoint.averaged.as_ref().expect("the average is saved");
    assert_eq!(saved.method, kiln::train::AveragingMethod::Swa);
    assert_eq!(saved.updates, 2, "after epochs 1 and 2");
    assert!((saved.swa_lrs_from.as_ref().unwrap()[0] - 0.0021).abs() < 1e-15);
    assert!(
        saved.tensors.get("1.running_mean").is_none(),
        "parameters only"
    );
    let (model, _) = StateDict::load_safetensors(a.join("model.safetensors")).unwrap();
    for (name, t) in saved.tensors.iter() {
        assert_eq!(
            model.get(name),
            Some(t),
            "model.safetensors holds the average's {name}"
        );
        assert_ne!(checkpoint.model.get(name), Some(t), "{name} is averaged");
    }
    let steps_per_epoch = losses(&a).len() as f64 / 3.0;
    assert_eq!(
        model.get("1.num_batches_tracked").unwrap().to_f64_vec(),
        [steps_per_epoch],
        "one pass over the training batches"
    );
    assert_ne!(
        model.get("1.running_var"),
        checkpoint.model.get("1.running_var"),
        "statistics recomputed for the average"
    );

    // `validate = true` validates the average once it holds two epochs (one
    // is the weights themselves); `update_bn = false` keeps the training
    // weights' statistics; int(0.34 * 3) = 1 starts at the same epoch.
    let v_cfg = dir.join("swa-validate.toml");
    std::fs::write(
        &v_cfg,
        std::fs::read_to_string(cfg).unwrap().replace(
            "epoch_start = 1,",
            "epoch_start = 0.34, validate = true, update_bn = false,",
        ),
    )
    .unwrap();
    let v = dir.join("validated");
    train(v_cfg.to_str().unwrap(), &v, &["--epochs", "3"]);
    assert_eq!(losses(&v), losses(&a), "the same training");
    let val_loss = |run: &Path| epoch_column(run, "val_loss");
    let (va, vv) = (val_loss(&a), val_loss(&v));
    assert_eq!(va[..2], vv[..2], "{va:?} {vv:?}");
    assert_ne!(va[2], vv[2], "{va:?} {vv:?}");
    let v_last = Checkpoint::load(&kiln::train::Checkpointer::last_path(
        &v.join("checkpoints"),
    ))
    .unwrap();
    let (v_model, _) = StateDict::load_safetensors(v.join("model.safetensors")).unwrap();
    assert_eq!(
        v_model.get("1.running_var"),
        v_last.model.get("1.running_var"),
        "update_bn = false keeps the training statistics"
    );
    assert_eq!(
        v_model.get("0.weight"),
        model.get("0.weight"),
        "the same average"
    );

    train(cfg, &b, &["--epochs", "2"]);
    train(cfg, &b, &["--epochs", "3", "--resume", "auto"]);
    let (resumed, _) = StateDict::load_safetensors(b.join("model.safetensors")).unwrap();
    for (name, t) in model.iter() {
        assert!(
            resumed.get(name).unwrap().allclose(t, 1e-4, 1e-6),
            "the resumed run's {name}"
        );
    }
}

/// `kiln inspect CONFIG`: the model summary of the config's model for one
/// sample of its data (hand-counted: Linear(64, 64), ReLU, Dropout,
/// Linear(64, 10)), with frozen parameters, to a depth, writing nothing; and
/// `kiln train` prints it at the start unless `summary_depth = 0`.
#[test]
fn inspect_config_prints_the_model_summary() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("summary");
    let cfg = config(&dir, 0);
    let text = std::fs::read_to_string(&cfg).unwrap();
    let shown = kiln_stdout(&["inspect", cfg.to_str().unwrap()]);
    let rows: Vec<Vec<&str>> = shown
        .lines()
        .map(|l| l.split_whitespace().collect())
        .filter(|r: &Vec<&str>| r.len() >= 6)
        .collect();
    let expected = [
        ["Sequential", "[1,", "10]", "4,810", "4,810", "4,736"].as_slice(),
        &["0", "(Linear)", "[1,", "64]", "4,160", "4,160", "4,096"],
        &["1", "(Relu)", "[1,", "64]", "0", "0", "0"],
        &["2", "(Dropout)", "[1,", "64]", "0", "0", "0"],
        &["3", "(Linear)", "[1,", "10]", "650", "650", "640"],
    ];
    for want in expected {
        assert!(
            rows.iter().any(|r| r == want),
            "no row {want:?} in\n{shown}"
        );
    }
    assert!(
        shown.contains("params: 4,810 (4,810 trainable, 0 frozen)"),
        "{shown}"
    );
    assert!(
        shown.contains("mult-adds for one sample of [1, 64]: 4,736"),
        "{shown}"
    );
    assert!(!dir.join("default-out").exists(), "inspect writes nothing");

    let frozen = dir.join("frozen.toml");
    std::fs::write(&frozen, format!("freeze = [\"0.*\"]\n{text}")).unwrap();
    let shown = kiln_stdout(&["inspect", frozen.to_str().unwrap(), "--depth", "0"]);
    assert!(
        shown.contains("params: 4,810 (650 trainable, 4,160 frozen)"),
        "{shown}"
    );
    assert!(
        !shown.contains("(Linear)"),
        "depth 0: the model's row only\n{shown}"
    );
    let other = dir.join("model.safetensors");
    let err = kiln_fails(&["inspect", other.to_str().unwrap(), "--depth", "1"]);
    assert!(
        err.contains("--depth applies to a config's model summary"),
        "{err}"
    );

    let run = dir.join("run");
    let printed = train(cfg.to_str().unwrap(), &run, &["--epochs", "1"]);
    assert!(printed.contains("3 (Linear)"), "{printed}");
    let quiet = dir.join("quiet.toml");
    std::fs::write(
        &quiet,
        text.replace("[logging]\n", "[logging]\nsummary_depth = 0\n"),
    )
    .unwrap();
    let printed = train(
        quiet.to_str().unwrap(),
        &dir.join("quiet"),
        &["--epochs", "1"],
    );
    assert!(!printed.contains("(Linear)"), "{printed}");
}

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

/// A profile's table, `ops.csv`: name -> (calls, self µs, total µs).
fn profile_rows(dir: &Path) -> std::collections::BTreeMap<String, (u64, f64, f64)> {
    let text = std::fs::read_to_string(dir.join("ops.csv")).unwrap();
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some("name,calls,self_cpu_us,cpu_total_us,self_device_us")
    );
    lines
        .map(|l| {
            // Operator names hold no comma here (a quoted one would).
            let cells: Vec<&str> = l.split(',').collect();
            let number = |i: usize| cells[i].parse::<f64>().unwrap();
            (
                cells[0].to_owned(),
                (cells[1].parse().unwrap(), number(2), number(3)),
            )
        })
        .collect()
}

/// What every profile holds, on either engine: `steps` steps, each waiting once
/// for its batch; rows by self time, which never exceeds the total; and the
/// same sums from the trace file, read by an independent script.
fn check_profile(python: &Path, profile: &Path, steps: u64) {
    let rows = profile_rows(profile);
    let calls = |name: &str| rows.get(name).map_or(0, |r| r.0);
    assert_eq!(calls("ProfilerStep*"), steps, "{rows:?}");
    assert_eq!(calls("kiln::data_loader_wait"), steps);
    let table = std::fs::read_to_string(profile.join("ops.txt")).unwrap();
    assert!(table.starts_with(&format!("{steps} steps, ")), "{table}");
    assert!(table.contains("Self CPU %") && table.contains("Self CPU time total"));
    let csv = std::fs::read_to_string(profile.join("ops.csv")).unwrap();
    let selfs: Vec<f64> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(2).unwrap().parse().unwrap())
        .collect();
    assert!(selfs.windows(2).all(|w| w[0] >= w[1]), "{csv}");
    assert!(rows.values().all(|r| r.1 <= r.2 + 1e-9));

    let stdout = kiln_testkit::run_reference_script!(
        python,
        "profile_trace.py",
        &[profile.join("trace.json").as_os_str()]
    );
    let reference: std::collections::BTreeMap<String, (u64, f64, f64)> =
        serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        reference.keys().collect::<Vec<_>>(),
        rows.keys().collect::<Vec<_>>()
    );
    for (name, (calls, self_us, total_us)) in &reference {
        let row = rows[name];
        // The trace's times are whole nanoseconds, as the events', but a self
        // time is a total less its children's, each rounded in the trace: a
        // row with many children (ProfilerStep*) gathers their roundings.
        let tolerance = 0.002 * *calls as f64 + 1e-3 + 1e-6 * self_us.abs().max(*total_us);
        assert_eq!(row.0, *calls, "{name}");
        assert!(
            (row.1 - self_us).abs() <= tolerance,
            "{name}: {row:?} vs {self_us}"
        );
        assert!(
            (row.2 - total_us).abs() <= tolerance,
            "{name}: {row:?} vs {total_us}"
        );
    }
}

/// `kiln train --profile steps=3..7`: libtorch's profiler records steps 3 to 6;
/// the trace, read back by an independent script, sums to the table's numbers;
/// the operators' counts are the model's; windows the run cannot record and
/// files in the way are refused before anything is written.
#[test]
fn profile_writes_the_trace_and_the_operators_by_self_time() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let Some(python) = kiln_testkit::python("the profiler's trace") else {
        return;
    };
    let dir = scratch("profile");
    let cfg = config(&dir, 0);
    let cfg = cfg.to_str().unwrap();
    let run = dir.join("run");
    let out = run.to_str().unwrap();
    let args = |profile: &'static str| {
        vec![
            "train",
            "--config",
            cfg,
            "--output",
            out,
            "--epochs",
            "1",
            "--profile",
            profile,
        ]
    };
    // 1,438 training examples in batches of 32: 45 steps.
    let err = kiln_fails(&args("steps=40..47"));
    assert!(err.contains("ends after step 45, the run's last"), "{err}");
    assert!(!run.exists(), "nothing written");
    let err = kiln_fails(&args("steps=7..3"));
    assert!(err.contains("START < END"), "{err}");

    let stdout = kiln_stdout(&args("steps=3..7"));
    assert!(!stdout.is_empty());
    let profile = run.join("profile");
    check_profile(&python, &profile, 4);
    let rows = profile_rows(&profile);
    let calls = |name: &str| rows.get(name).map_or(0, |r| r.0);
    // Per step: two linear layers, a dropout and Adam's (fused) update.
    assert_eq!(calls("aten::linear"), 8, "{rows:?}");
    assert_eq!(calls("aten::dropout"), 4);
    assert_eq!(calls("aten::_fused_adam_"), 4);
    // A resumed run profiling into the same directory: refused, the profile kept.
    let trace = std::fs::read(profile.join("trace.json")).unwrap();
    let err = kiln_fails(&[
        "train",
        "--config",
        cfg,
        "--output",
        out,
        "--epochs",
        "2",
        "--resume",
        "auto",
        "--profile",
        "steps=50..52",
    ]);
    assert!(err.contains("trace.json exists"), "{err}");
    assert_eq!(std::fs::read(profile.join("trace.json")).unwrap(), trace);
    assert_eq!(losses(&run).len(), 45, "the run was not resumed");

    // On TensorFlow: the session runs' step stats, TensorFlow's op types.
    let tf = dir.join("tf");
    kiln_stdout(&[
        "train",
        "--config",
        cfg,
        "--output",
        tf.to_str().unwrap(),
        "--epochs",
        "1",
        "--backend",
        "tensorflow",
        "--profile",
        "steps=3..7",
    ]);
    check_profile(&python, &tf.join("profile"), 4);
    let rows = profile_rows(&tf.join("profile"));
    assert!(rows.keys().any(|name| name.contains("MatMul")), "{rows:?}");
}
