//! The `kiln` CLI end to end: train from a config, get killed by a real signal
//! mid-run, resume from the last checkpoint, and reproduce the per-step losses
//! of an uninterrupted run bitwise. Also: inspect, eval and predict, a
//! config error that names the key, and NumPy arrays as a data source.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    config, digits_available, kiln, kiln_fails, kiln_stdout, losses, scratch, serial, train, KILN,
};
use kiln::core::state_dict::StateDict;
use kiln::train::Checkpoint;

mod common;

/// Per-step losses of two runs agree. Exactly, as a rule; but across processes
/// libtorch's CPU kernels were seen to differ in the last bit now and then (two
/// uninterrupted runs of one config included) while other processes loaded the two
/// cores, and a last-bit difference then grows slowly over the following steps.
/// So the check allows 1e-4 relative: any real resume fault (a wrong data
/// position, optimizer or schedule state) changes the losses far more than that.
/// The in-process trainer test (`tests/trainer.rs`) checks resume bitwise.
fn assert_same_run(actual: &[(String, String)], expected: &[(String, String)], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: number of steps");
    let mut exact = 0;
    for ((step, a), (_, e)) in actual.iter().zip(expected) {
        let (a, e): (f64, f64) = (a.parse().unwrap(), e.parse().unwrap());
        exact += usize::from(a == e);
        assert!(
            (a - e).abs() <= 1e-4 * e.abs(),
            "{what}: step {step} loss {a} vs {e}"
        );
    }
    eprintln!(
        "{what}: {exact} of {} step losses bitwise equal",
        expected.len()
    );
}

/// `kiln eval` of `checkpoint` with `config`: the accuracy it prints, and all it printed.
fn eval_accuracy(config: &Path, checkpoint: &Path) -> (f64, String) {
    let metrics = String::from_utf8(
        kiln(&[
            "eval",
            "--config",
            config.to_str().unwrap(),
            "--checkpoint",
            checkpoint.to_str().unwrap(),
        ])
        .stdout,
    )
    .unwrap();
    let accuracy = metrics
        .lines()
        .find_map(|l| l.strip_prefix("accuracy"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (accuracy, metrics)
}

#[test]
fn killed_run_resumes_bitwise() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("resume");
    let cfg = config(&dir, 2);
    let cfg = cfg.to_str().unwrap();
    let (a, b) = (dir.join("uninterrupted"), dir.join("killed"));
    // Long enough that the kill at step 20 lands well before the end.
    train(cfg, &a, &["--epochs", "10"]);
    let reference = losses(&a);
    assert!(
        reference.len() > 50,
        "expected a few epochs of steps, got {}",
        reference.len()
    );

    // Start the same run, and SIGKILL it once a checkpoint past step 20 exists.
    let mut child = Command::new(KILN)
        .args([
            "train",
            "--config",
            cfg,
            "--output",
            b.to_str().unwrap(),
            "--epochs",
            "10",
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let target = b.join("checkpoints/step-00000020.safetensors");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !target.exists() {
        assert!(
            Instant::now() < deadline,
            "no checkpoint appeared at {}",
            target.display()
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status}) before it could be killed");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL: no chance to clean up
    child.wait().unwrap();
    let last = b.join("checkpoints/last.safetensors");
    let checkpoint = Checkpoint::load(&last).expect("the last checkpoint must load after a kill");
    // The kill may land between writing step 20 and pointing `last` at it.
    assert!(checkpoint.step >= 15 && checkpoint.step < reference.len() as u64);

    train(cfg, &b, &["--epochs", "10", "--resume", "auto"]);
    let resumed = losses(&b);
    assert_eq!(
        resumed.len(),
        reference.len(),
        "steps.csv rows after resume"
    );
    assert_same_run(&resumed, &reference, "resumed");
}

/// A copy of the checkpoint `from` at `to` without `kiln.data_order`, as a
/// Kiln from before the loaders took PyTorch's order wrote it.
fn unstamped(from: &Path, to: &Path) -> Checkpoint {
    let (tensors, mut meta) = StateDict::load_safetensors(from).unwrap();
    assert_eq!(
        meta.remove("kiln.data_order").as_deref(),
        Some(kiln::core::rng::EPOCH_ORDER),
        "the trainer stamps its checkpoints"
    );
    tensors.save_safetensors(to, &meta).unwrap();
    Checkpoint::load(to).unwrap()
}

/// A checkpoint of an older Kiln (no `kiln.data_order`, another shuffle):
/// written mid-epoch it is refused, naming the file and what to do; at an
/// epoch boundary it resumes.
#[test]
fn an_older_kiln_s_checkpoint_resumes_only_at_an_epoch_boundary() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("data-order");
    let cfg = config(&dir, 0);
    let cfg = cfg.to_str().unwrap();
    let run = dir.join("run");
    let out = run.to_str().unwrap();
    // 45 steps of one epoch; checkpoints at steps 35, 40 and 45 are kept.
    train(cfg, &run, &["--epochs", "1"]);
    let checkpoints = run.join("checkpoints");
    let (mid, boundary) = (
        dir.join("old-mid.safetensors"),
        dir.join("old-end.safetensors"),
    );
    let old_mid = unstamped(&checkpoints.join("step-00000040.safetensors"), &mid);
    let old_end = unstamped(&checkpoints.join("step-00000045.safetensors"), &boundary);
    assert_eq!((old_mid.epoch, old_mid.batch_in_epoch), (0, 40));
    assert_eq!((old_end.epoch, old_end.batch_in_epoch), (1, 0));
    assert_eq!(old_mid.data_order, None);
    let shown = kiln_stdout(&["inspect", mid.to_str().unwrap()]);
    assert!(shown.contains("data order  not recorded"), "{shown}");

    let steps = std::fs::read_to_string(run.join("steps.csv")).unwrap();
    let err = kiln_fails(&[
        "train",
        "--config",
        cfg,
        "--output",
        out,
        "--epochs",
        "2",
        "--resume",
        mid.to_str().unwrap(),
    ]);
    for part in [
        mid.to_str().unwrap(),
        "stands at batch 40 of epoch 0",
        "by an older Kiln, whose shuffled data order differs",
        "Resume from a checkpoint written at the end of an epoch",
        "start the run over",
    ] {
        assert!(err.contains(part), "no {part:?} in:\n{err}");
    }
    assert_eq!(
        std::fs::read_to_string(run.join("steps.csv")).unwrap(),
        steps,
        "nothing written"
    );

    train(
        cfg,
        &run,
        &["--epochs", "2", "--resume", boundary.to_str().unwrap()],
    );
    assert_eq!(losses(&run).len(), 2 * 45);
    let last = Checkpoint::load(&checkpoints.join("last.safetensors")).unwrap();
    assert_eq!(
        last.data_order.as_deref(),
        Some(kiln::core::rng::EPOCH_ORDER)
    );
}

#[test]
fn loader_order_does_not_depend_on_workers() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("workers");
    let cfg = config(&dir, 0);
    let (one, four) = (dir.join("w1"), dir.join("w4"));
    let cfg = cfg.to_str().unwrap();
    train(cfg, &one, &["--workers", "1", "--max-steps", "30"]);
    train(cfg, &four, &["--workers", "4", "--max-steps", "30"]);
    assert_same_run(&losses(&four), &losses(&one), "4 workers vs 1");
}

#[test]
fn inspect_eval_predict_and_config_errors() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("tools");
    let cfg = config(&dir, 0);
    let cfg = cfg.to_str().unwrap();
    let out = dir.join("run");
    train(cfg, &out, &["--epochs", "2"]);
    let last = out.join("checkpoints/last.safetensors");
    let table = String::from_utf8(kiln(&["inspect", last.to_str().unwrap()]).stdout).unwrap();
    assert!(
        table.contains("model.0.weight") && table.contains("[64, 64]"),
        "{table}"
    );
    assert!(
        table.contains("optimizer.state.0.weight.exp_avg"),
        "{table}"
    );

    let (accuracy, metrics) = eval_accuracy(Path::new(cfg), &last);
    assert!(accuracy > 0.8, "{metrics}");

    let predictions = dir.join("predictions.csv");
    kiln(&[
        "predict",
        "--config",
        cfg,
        "--checkpoint",
        last.to_str().unwrap(),
        "--output",
        predictions.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&predictions).unwrap();
    let rows: Vec<&str> = text.lines().skip(1).collect();
    assert_eq!(rows.len(), 360);
    let correct = rows
        .iter()
        .filter(|r| {
            let c: Vec<&str> = r.split(',').collect();
            c[1] == c[2]
        })
        .count() as f64
        / 360.0;
    assert!(
        (correct - accuracy).abs() < 1e-6, // eval prints six decimals
        "predict and eval agree: {correct} vs {accuracy}"
    );

    // A typo in the config names the key and the allowed values.
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        std::fs::read_to_string(cfg)
            .unwrap()
            .replace("type = \"adam\"", "type = \"adm\""),
    )
    .unwrap();
    let out = Command::new(KILN)
        .args(["train", "--config", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("adm") && err.contains("adamw") && err.contains("optimizer"),
        "{err}"
    );

    // A file that is not a checkpoint (a config is summarised instead: cli_tools.rs).
    let notes = dir.join("notes.txt");
    std::fs::write(&notes, "not a checkpoint\n").unwrap();
    let out = Command::new(KILN)
        .args(["inspect", notes.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("notes.txt"));
}

/// `--precision` (or `[training] precision`): bf16-mixed, bf16-true, 16-mixed
/// (with loss scaling: its scale is in the checkpoint) and 16-true train to the
/// accuracy float32 reaches here, `eval` of the run's checkpoint uses the run's
/// precision (its written config), and the weights are stored in the
/// precision's parameter dtype. The TensorFlow backend refuses them by name.
#[test]
fn half_precisions_train_and_evaluate() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("precision");
    let cfg = config(&dir, 0);
    let cfg = cfg.to_str().unwrap();
    for (precision, dtype) in [
        ("bf16-mixed", "float32"),
        ("bf16-true", "bfloat16"),
        ("16-mixed", "float32"),
        ("16-true", "float16"),
    ] {
        let out = dir.join(precision);
        // Adam's default eps (1e-8) is below float16's range, where 16-true keeps
        // Adam's state: such a run needs a larger one, as in PyTorch (see below).
        let eps_cfg = dir.join("config-eps.toml");
        std::fs::write(
            &eps_cfg,
            std::fs::read_to_string(cfg)
                .unwrap()
                .replace("lr = 0.003", "lr = 0.003\neps = 1e-4"),
        )
        .unwrap();
        let cfg = if precision == "16-true" {
            eps_cfg.to_str().unwrap()
        } else {
            cfg
        };
        let stdout = train(cfg, &out, &["--epochs", "2", "--precision", precision]);
        assert!(
            stdout.contains(&format!("on cpu in {precision}")),
            "{stdout}"
        );
        let run_config = out.join("config.toml");
        assert!(
            std::fs::read_to_string(&run_config)
                .unwrap()
                .contains(&format!("precision = \"{precision}\"")),
            "the run's config records its precision"
        );
        let last = out.join("checkpoints/last.safetensors");
        let table = String::from_utf8(kiln(&["inspect", last.to_str().unwrap()]).stdout).unwrap();
        let row = table
            .lines()
            .find(|l| l.contains("model.0.weight"))
            .unwrap_or_else(|| panic!("{table}"));
        assert!(row.contains(dtype), "{precision}: {row}");
        assert_eq!(
            table.contains("grad_scaler.scale"),
            precision == "16-mixed",
            "{precision}: only 16-mixed checkpoints hold a loss scale: {table}"
        );

        let (accuracy, metrics) = eval_accuracy(&run_config, &last);
        assert!(accuracy > 0.8, "{precision}: {metrics}");
    }

    // 16-true with Adam's default eps: Kiln warns before training, and the run
    // stops on the NaN loss that follows, as the warning says it would.
    let out = Command::new(KILN)
        .args([
            "train",
            "--config",
            cfg,
            "--epochs",
            "2",
            "--precision",
            "16-true",
        ])
        .arg("--output")
        .arg(dir.join("16-true-default-eps"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("eps 1e-8 is below float16's range") && err.contains("eps = 1e-4"),
        "{err}"
    );
    assert!(!out.status.success() && err.contains("NaN"), "{err}");

    for precision in ["bf16-mixed", "16-mixed", "16-true"] {
        let out = Command::new(KILN)
            .args([
                "train",
                "--config",
                cfg,
                "--backend",
                "tensorflow",
                "--precision",
                precision,
                "--output",
                dir.join(format!("tf-{precision}")).to_str().unwrap(),
            ])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(precision) && err.contains("torch backend"),
            "{err}"
        );
    }

    let out = Command::new(KILN)
        .args(["train", "--config", cfg, "--precision", "fp8"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("fp8") && err.contains("bf16-mixed"), "{err}");
}

/// The shipped config runs as the README's first command runs it (fewer epochs),
/// and leaves every output a user expects.
#[test]
fn the_shipped_config_trains_and_writes_every_output() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("shipped");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/configs/digits-cnn.toml");
    let out = kiln(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--output",
        dir.to_str().unwrap(),
        "--epochs",
        "3",
        "--no-progress",
    ]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    let accuracy: f64 = stdout
        .split("accuracy ")
        .nth(1)
        .and_then(|rest| rest.split('%').next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(accuracy > 90.0, "{stdout}");
    for file in [
        "steps.csv",
        "epochs.csv",
        "curves.png",
        "model.safetensors",
        "config.toml",
        "checkpoints/last.safetensors",
    ] {
        assert!(dir.join(file).is_file(), "{file} missing");
    }
    let events = std::fs::read_dir(dir.join("tensorboard")).unwrap().count();
    assert_eq!(events, 1, "one TensorBoard event file");
    let epochs = std::fs::read_to_string(dir.join("epochs.csv")).unwrap();
    assert_eq!(
        epochs.lines().count(),
        4,
        "a header and three epochs:\n{epochs}"
    );
}

/// `dataset = "npy"`: scikit-learn's digits saved by `numpy.save` train
/// exactly as `dataset = "digits"` (the same losses, bit for bit), and the
/// arrays a run cannot use are refused before training, naming the key.
#[test]
fn npy_arrays_train_as_the_digits_they_hold() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let Some(python) = kiln_testkit::python("npy_arrays_train_as_the_digits_they_hold") else {
        return;
    };
    let dir = scratch("npy");
    kiln_testkit::run_reference_script!(&python, "digits_npy.py", &[dir.as_os_str()]);
    let plain = config(&dir, 0);
    let text = std::fs::read_to_string(&plain).unwrap();
    let with = |name: &str, keys: &str| {
        let path = dir.join(name);
        let source = format!("dataset = \"npy\"\n{keys}");
        std::fs::write(&path, text.replace("dataset = \"digits\"\n", &source)).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let at = |file: &str| dir.join(file).display().to_string();
    let npy = with(
        "npy.toml",
        &format!("path = \"{}\"\nlabels = \"{}\"\n", at("x.npy"), at("y.npy")),
    );
    let (a, b) = (dir.join("digits"), dir.join("npy"));
    train(plain.to_str().unwrap(), &a, &["--epochs", "1"]);
    train(&npy, &b, &["--epochs", "1"]);
    assert!(!losses(&a).is_empty());
    assert_eq!(
        losses(&a),
        losses(&b),
        "the same examples, in the same order"
    );

    let refused = |config: &str| {
        let out = dir.join("refused");
        let err = kiln_fails(&[
            "train",
            "--config",
            config,
            "--output",
            out.to_str().unwrap(),
        ]);
        assert!(!out.exists(), "nothing written for a refused run");
        err
    };
    let no_labels = with("no-labels.toml", &format!("path = \"{}\"\n", at("x.npy")));
    let err = refused(&no_labels);
    assert!(
        err.contains("data.labels is required for dataset = \"npy\""),
        "{err}"
    );
    let column = with(
        "column.toml",
        &format!(
            "path = \"{}\"\nlabels = \"{}\"\n",
            at("x.npy"),
            at("y_column.npy")
        ),
    );
    let err = refused(&column);
    assert!(
        err.contains("holds an array of shape [1797, 1]; expected [1797], one label for each"),
        "{err}"
    );
    let csv_key = with(
        "csv-key.toml",
        &format!("path = \"{}\"\nlabel_column = \"y\"\n", at("x.npy")),
    );
    let err = refused(&csv_key);
    assert!(
        err.contains("label_column")
            && err.contains("applies to csv and text data, not dataset = \"npy\""),
        "{err}"
    );
}
